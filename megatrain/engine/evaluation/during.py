"""lm-eval tasks scored during training (`training.eval_tasks`): on the training ranks themselves,
between steps, through the very forward the training runs (evaluation.scorer.LayoutScorer over the
job's RankModel and its pipeline schedule): no second copy of the model, whatever the layout.

lm-eval's evaluator seeds Python's, NumPy's and torch's generators as it starts; the training's
states are put back afterwards, so a run with tasks draws the same dropout masks and samples as one
without them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from megatrain.engine.build import Trainable
from megatrain.engine.evaluation.lm import EngineLM
from megatrain.engine.evaluation.scorer import LayoutScorer
from megatrain.engine.evaluation.tasks import run_tasks


class TaskScoring:
    """The job's loaded task configs (megatrain.eval_tasks.load_task), scored on demand."""

    def __init__(
        self,
        configs: list[dict[str, Any]],
        tokenizer: Any,
        limit: int | None,
        seq_length: int,
        vocab_limit: int,
    ):
        self.configs, self.tokenizer, self.limit = configs, tokenizer, limit
        self.seq_length, self.vocab_limit = seq_length, vocab_limit

    @property
    def names(self) -> list[str]:
        return [c["task"] for c in self.configs]

    def __call__(self, train: Trainable, micro_batch_size: int) -> dict[str, dict[str, Any]]:
        """Per task, {metric: {value, stderr, n}}, with the model as it is now (collective: every
        rank of the job calls it at the same step)."""
        scorer = LayoutScorer(
            train.model,
            self.seq_length,
            self.vocab_limit,
            rows_per_forward=micro_batch_size,  # the pipeline's activations are this many rows
            pipeline=train.pipeline,
        )
        lm = EngineLM(scorer, self.tokenizer, batch_size=micro_batch_size * train.model.state.dp_size)
        with _generators_kept():
            return run_tasks(lm, self.configs, limit=self.limit)


@contextmanager
def _generators_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and every CUDA device's) generator states, as they were."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
