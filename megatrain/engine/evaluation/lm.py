"""lm-evaluation-harness's `LM` interface over our engine: the three request types every lm-eval task
is made of, answered by a GPTModel on one device (a job's checkpoint, a Hugging Face folder or a
fine-tune, as engine.serving.loader loads them) or by a model at any layout (evaluation.scorer).

- `loglikelihood(context, continuation)`: lm-eval's own TemplateLM splits each pair into tokens (the
  context's trailing spaces move to the continuation; an empty context is the prefix token), so
  the tokens scored are the ones lm-eval's HFLM would score; here they are right-padded into
  batches of similar length (causal attention: the padding after a row never reaches it), the
  log-softmax is taken over the real vocabulary (the embedding's padding rows left out) in fp32,
  and each answer is (sum of the continuation's log-probabilities, whether greedy decoding picks
  every one of its tokens).
- `loglikelihood_rolling(text)`: the text's whole log-likelihood over lm-eval's disjoint rolling
  windows of max_length tokens (perplexity tasks).
- `generate_until(context, {until, max_gen_toks, do_sample, temperature, ...})`: greedy (or
  sampled) decoding, on one device with continuous batching over a KV cache (serving.batcher:
  prompts of any lengths share each decode step, a row leaving at its first stop string), the
  prompt left-truncated to leave room for max_gen_toks, the text cut at the first stop string
  (the end-of-document token's text is one).

tests/engine/test_eval_lm.py holds this against HFLM on the same weights, exported with interop.hf.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM

from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.engine.evaluation.scorer import DeviceScorer, Generation, Scorer
from megatrain.engine.models.gpt import GPTModel

DEFAULT_MAX_GEN_TOKS = 256
"""lm-eval's default for a generate_until request that names no max_gen_toks."""
GENERATE_CHUNK = 4
"""Batches of prompts handed to the scorer at once: enough that rows ending early leave room for
the next ones, few enough that an eval job reports progress (its hang watch) often."""


class EngineLM(TemplateLM):
    """A model answering lm-eval's requests in batches of `batch_size` rows: one GPTModel on one
    device, or a Scorer (evaluation.scorer.LayoutScorer: a model at any layout, every rank of the
    job running the same requests).

    `max_length`: the longest sequence scored or generated (default and cap: the model's
    seq_length). `eot_token_id` is the tokenizer's end-of-document id; with no BOS in our
    tokenizers it is also the prefix an empty context is scored after (as HFLM does without one)."""

    def __init__(
        self,
        model: GPTModel | Scorer,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        seed: int = 1234,
        on_batch: Callable[[], None] | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        seq_length = model.config.seq_length if isinstance(model, GPTModel) else model.max_length
        if max_length is not None and not 1 < max_length <= seq_length:
            raise ValueError(f"max_length must be in [2, seq_length={seq_length}], got {max_length}")
        self.max_length = max_length or seq_length
        if isinstance(model, GPTModel):
            self.model: GPTModel | None = model
            self.scorer: Scorer = DeviceScorer(model, tokenizer, batch_size, self.max_length)
        else:
            self.model, self.scorer = None, model
        self.tokenizer = tokenizer
        self.batch_size_per_call = batch_size
        self.vocab_limit = self.scorer.vocab_limit
        self.seed = seed
        self.on_batch = on_batch
        """Called after every batch scored or generated (an eval job's progress, for its hang watch)."""

    # -- tokens ------------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eod)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # Our tokenizers add no special tokens: a document is its text's ids.
        return list(self.tokenizer.encode(string))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # -- scoring -----------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(
        self,
        requests: Sequence[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """(context tokens, continuation tokens) -> (log-probability of the continuation, greedy?).
        Longest first, so that each batch pads little; answers in the requests' order."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for start in range(0, len(order), self.batch_size_per_call):
            rows = order[start : start + self.batch_size_per_call]
            tokens, counts = [], []
            for i in rows:
                _, context, continuation = requests[i]
                if not context or not continuation:
                    raise ValueError("a loglikelihood request needs context and continuation tokens")
                if len(continuation) > self.max_length:
                    raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length")
                # The last max_length + 1 tokens; the final one is only predicted, never input.
                tokens.append((context + continuation)[-(self.max_length + 1) :])
                counts.append(len(continuation))
            for i, answer in zip(rows, self.scorer.loglikelihood(tokens, counts), strict=True):
                answers[i] = answer
            if self.on_batch is not None:
                self.on_batch()
        return answers

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, token by token, over lm-eval's disjoint windows."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, *window))
                owners.append(n)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    # -- generation --------------------------------------------------------------------------------

    @torch.no_grad()
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, cut at its first stop string. Requests with the same
        settings run together, whatever their prompts' lengths (each generation's rows share every
        decode step), GENERATE_CHUNK batches of them per call."""
        eot_text = self.tok_decode([self.eot_token_id])
        groups: dict[tuple[Any, ...], list[int]] = {}
        prepared = []
        for n, req in enumerate(requests):
            context, gen_kwargs = req.args
            options = _generation_options(gen_kwargs, eot_text)
            room = self.max_length - options["max_gen_toks"]
            if room < 1:
                raise ValueError(
                    f"max_gen_toks={options['max_gen_toks']} leaves no room for a prompt in max_length="
                    f"{self.max_length}"
                )
            ids = self.tok_encode(context)[-room:] or [self.prefix_token_id]
            prepared.append((ids, options))
            key = (options["max_gen_toks"], options["greedy"], options["temperature"], options["top_k"],
                   options["top_p"], tuple(options["until"]))  # fmt: skip
            groups.setdefault(key, []).append(n)
        out = [""] * len(requests)
        chunk = self.batch_size_per_call * GENERATE_CHUNK
        for members in groups.values():
            options = prepared[members[0]][1]
            generation = Generation(
                max_new_tokens=options["max_gen_toks"],
                greedy=options["greedy"],
                temperature=options["temperature"] or 1.0,
                top_k=options["top_k"],
                top_p=options["top_p"],
                seed=self.seed,
                eos_id=self.eot_token_id,
                until=tuple(options["until"]),
            )
            for start in range(0, len(members), chunk):
                rows = members[start : start + chunk]
                new = self.scorer.generate([prepared[i][0] for i in rows], generation)
                for i, ids in zip(rows, new, strict=True):
                    out[i] = _cut(self.tok_decode(ids), prepared[i][1]["until"])
                if self.on_batch is not None:
                    self.on_batch()
        return out


def _generation_options(gen_kwargs: dict[str, Any], eot_text: str) -> dict[str, Any]:
    """lm-eval's generation arguments, read as HFLM reads them: `until` (a string or a list; the
    end-of-document text added), `max_gen_toks`, and sampling only when do_sample is true and the
    temperature is not 0."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None) or []
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise ValueError(f"generate_until: `until` must be a string or a list of strings, got {until!r}")
    if eot_text and eot_text not in until:
        until = [*until, eot_text]
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    do_sample = bool(kwargs.pop("do_sample", False)) and temperature > 0.0
    return {
        "until": until,
        "max_gen_toks": int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS)),
        "greedy": not do_sample,
        "temperature": temperature if do_sample else 1.0,
        "top_k": int(kwargs.pop("top_k", 0) or 0) if do_sample else 0,
        "top_p": float(kwargs.pop("top_p", 1.0) or 1.0) if do_sample else 1.0,
    }


def _cut(text: str, until: Iterable[str]) -> str:
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
