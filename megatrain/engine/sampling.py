"""Samples from a job's checkpoint for the dashboard: the model and tokenizer loaded once per checkpoint
folder (the last few kept), then `generate` with a KV cache. Used by the workers' sample task
(megatrain.worker.samples), whose process keeps one sampler: the API never imports the engine."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from megatrain.engine.checkpoint import load_checkpoint
from megatrain.engine.data import build_tokenizer
from megatrain.engine.generate import generate


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    """The continuation alone, decoded."""
    elapsed_s: float


class CheckpointSampler:
    """Loaded checkpoints by folder URL (the `keep` most recently used); one generation at a time per
    process, so a burst of requests cannot load many models at once."""

    def __init__(self, keep: int = 2, device: str = "cpu"):
        self.keep, self.device = keep, device
        self._models: OrderedDict[str, tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def _load(self, url: str) -> tuple[Any, Any]:
        if url in self._models:
            self._models.move_to_end(url)
            return self._models[url]
        model, spec = load_checkpoint(url, self.device)
        tokenizer = build_tokenizer(spec.data.tokenizer)
        self._models[url] = (model, tokenizer)
        while len(self._models) > self.keep:
            self._models.popitem(last=False)
        return model, tokenizer

    def sample(
        self,
        url: str,
        prompt: str,
        max_new_tokens: int,
        *,
        temperature: float | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Sample:
        """Continue `prompt` from the checkpoint folder at `url`: greedy without sampling options,
        sampled (seeded) with any. ValueError for a prompt the model cannot take."""
        greedy = temperature is None and top_k == 0 and top_p == 1.0
        with self._lock:
            began = time.perf_counter()
            model, tokenizer = self._load(url)
            ids = tokenizer.encode(prompt)
            if not ids:
                raise ValueError("the prompt is empty after tokenization")
            limit = model.config.seq_length
            if len(ids) >= limit:
                raise ValueError(f"the prompt is {len(ids)} tokens; this model reads at most {limit - 1}")
            with torch.inference_mode():
                new = generate(
                    model,
                    ids,
                    max_new_tokens,
                    greedy=greedy,
                    temperature=temperature or 1.0,
                    top_k=top_k,
                    top_p=top_p,
                    seed=seed,
                    eos_id=tokenizer.eod,
                    vocab_limit=min(model.config.real_vocab_size, tokenizer.vocab_size),
                )
            return Sample(ids, new, tokenizer.decode(new), time.perf_counter() - began)
