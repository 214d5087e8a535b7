"""Each data-parallel rank's slice of every global batch, read one step ahead in a background thread.

Training position is one integer, `consumed_samples`: the global batch of a step is the sample ids
[consumed, consumed + global_batch_size), rank r takes the r-th contiguous slice of
global/dp samples, cut into micro-batches. A resumed run therefore continues on exactly the batches an
uninterrupted run would have seen. `prefetch(consumed)` starts reading a step's micro-batches in a
worker thread (numpy copies out of the memory maps release the GIL), and `batch(ids)` hands out a
prefetched micro-batch, or reads it on the spot when nothing was prefetched for those ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.gpt_dataset import SampleDataset


def microbatch_sample_ids(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """The sample ids this data-parallel rank trains on in one iteration, per micro-batch."""
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    return [
        list(range(first + m, first + m + micro_batch_size)) for m in range(0, per_rank, micro_batch_size)
    ]


class Loader:
    """A rank's view of a dataset: micro-batches by sample ids, the next step's read ahead."""

    def __init__(
        self,
        dataset: SampleDataset,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        background: bool = True,
    ):
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loader") if background else None
        self._ahead: dict[tuple[int, ...], Future[Batch]] = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def microbatch_ids(self, consumed: int) -> list[list[int]]:
        return microbatch_sample_ids(
            consumed, self.global_batch_size, self.micro_batch_size, self.dp_rank, self.dp_size
        )

    def prefetch(self, consumed: int) -> None:
        """Start reading this rank's micro-batches of the step at `consumed` (if not already)."""
        if self._pool is None:
            return
        for ids in self.microbatch_ids(consumed):
            key = tuple(ids)
            if key not in self._ahead:
                self._ahead[key] = self._pool.submit(self.dataset.batch, ids)
        # Whatever was read ahead but never asked for (an evaluation in between) is dropped after two
        # steps, so the table stays small.
        while len(self._ahead) > 4 * max(1, self.global_batch_size // self.dp_size // self.micro_batch_size):
            self._ahead.pop(next(iter(self._ahead)))

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        future = self._ahead.pop(tuple(int(i) for i in sample_ids), None)
        if future is not None:
            self.hits += 1
            return future.result()
        self.misses += 1
        return self.dataset.batch(sample_ids)

    def step(self, consumed: int) -> list[Batch]:
        """This rank's micro-batches of the step at `consumed`."""
        return [self.batch(ids) for ids in self.microbatch_ids(consumed)]

    def trained_tokens(self, consumed: int, seq_length: int) -> int:
        """Tokens trained on in samples [0, consumed): a fine-tuning dataset counts its records'
        tokens (padding excluded); pretraining windows are seq_length tokens each."""
        count = getattr(self.dataset, "tokens_through", None)
        return int(count(consumed)) if count is not None else consumed * seq_length

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead.clear()
