"""GPT sample indices: the anchor's golden vector, every token of the epochs served exactly once,
determinism, the separate final epoch, and equality with Megatron-LM's own builders."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatrain.engine.data.gpt_indices import (
    GPTIndices,
    build_gpt_indices,
    cached_gpt_indices,
    num_epochs,
    sample_index,
    separate_final_epoch,
)


def test_the_anchor_s_golden_sample_index() -> None:
    # ../shared/anchors/megatron-indexed-dataset.md §6: sizes [4,3,2,4], L=4, one epoch, x=1.
    out = sample_index(np.array([4, 3, 2, 4]), np.array([0, 1, 2, 3], dtype=np.int32), 4, 13, 1)
    assert out.dtype == np.int32 and out.tolist() == [[0, 0], [1, 0], [2, 1], [3, 3]]


def _samples(
    sizes: np.ndarray, tokens: list[np.ndarray], ix, seq_length: int, extra: int
) -> list[np.ndarray]:
    """Each sample's L + x tokens, read as Megatron's GPTDataset reads them."""
    out = []
    for row in range(len(ix.sample_index) - 1):
        (d0, o0), (d1, o1) = ix.sample_index[row], ix.sample_index[row + 1]
        parts = [tokens[ix.document_index[d]] for d in range(d0, d1 + 1)]
        parts[-1] = parts[-1][: o1 + extra]
        parts[0] = parts[0][o0:] if d0 != d1 else tokens[ix.document_index[d0]][o0 : o1 + extra]
        out.append(np.concatenate(parts))
    return out


@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("requested", [None, 40, 95])
def test_every_token_of_the_epochs_is_served_once(extra: int, requested: int | None) -> None:
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 30, size=25)  # empty sequences included
    tokens = [np.arange(n) + 1000 * i for i, n in enumerate(sizes)]
    seq_length = 8
    ix = build_gpt_indices(
        sizes, np.arange(25, dtype=np.int32), seq_length, requested, seed=5, add_extra_token=bool(extra)
    )
    samples = _samples(sizes, tokens, ix, seq_length, extra)
    assert all(len(s) == seq_length + extra for s in samples)
    stream = np.concatenate([tokens[d] for d in ix.document_index])
    inputs = np.concatenate([s[:seq_length] for s in samples])
    assert np.array_equal(inputs, stream[: len(inputs)])  # in order, no token twice, none skipped
    assert len(stream) - len(inputs) < seq_length + extra  # only a partial last sample is dropped
    if requested is not None:
        assert len(ix) >= requested
    assert sorted(ix.shuffle_index.tolist()) == list(range(len(samples)))


def test_indices_are_deterministic_per_seed() -> None:
    sizes = np.random.default_rng(0).integers(1, 50, size=40)
    args = (sizes, np.arange(40, dtype=np.int32), 16, 300)
    a, b, c = (
        build_gpt_indices(*args, seed=1),
        build_gpt_indices(*args, seed=1),
        build_gpt_indices(*args, seed=2),
    )
    assert all(np.array_equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(), strict=True))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_epochs_and_the_separate_final_epoch() -> None:
    # 100 tokens per epoch, L=10, x=1: 9 samples per epoch.
    assert num_epochs(100, 10, None) == 1
    assert num_epochs(100, 10, 9) == 1 and num_epochs(100, 10, 10) == 2
    assert separate_final_epoch(2, 100, 10, 10)  # 1 of the second epoch's 9 samples: apart
    assert not separate_final_epoch(2, 100, 10, 17)  # 8 of 9 (>= 80%): shuffled with the rest
    assert not separate_final_epoch(1, 100, 10, 5)


# Megatron's side, in one process for every case (its package import sets global torch state and
# takes seconds).
_MEGATRON_SIDE = """
import json, sys
import numpy as np
from megatron.core.datasets import helpers
from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
results = []
for a in json.loads(sys.stdin.read()):
    rng = np.random.RandomState(a["seed"])
    docs = _build_document_index(np.array(a["sequences"], dtype=np.int32), a["epochs"], rng, a["separate"])
    sizes = np.array(a["sizes"], dtype=np.int32)
    samples = helpers.build_sample_idx(sizes, docs, a["L"], a["epochs"], a["T"], True, bool(a["x"]))
    total = samples.shape[0] - 1
    shuffle = _build_shuffle_index(a["before_final"] if a["separate"] else total, total, rng)
    results.append({"docs": docs.tolist(), "samples": samples.tolist(), "shuffle": shuffle.tolist(),
                    "dtypes": [str(samples.dtype), str(shuffle.dtype)]})
print(json.dumps(results))
"""
CASES = [(None, 1), (60, 1), (70, 0), (40, 1)]
SIZES = np.random.default_rng(11).integers(0, 40, size=30).astype(np.int32)
SEQUENCES = np.arange(3, 27, dtype=np.int32)  # a split: a contiguous run of sequence ids
SEQ_LENGTH, SEED = 16, 1234


def _payload(requested: int | None, extra: int) -> dict[str, object]:
    tokens = int(SIZES[SEQUENCES].sum())
    epochs = num_epochs(tokens, SEQ_LENGTH, requested, extra)
    return {
        "sizes": SIZES.tolist(), "sequences": SEQUENCES.tolist(), "L": SEQ_LENGTH, "epochs": epochs,
        "T": tokens, "x": extra, "seed": SEED,
        "separate": separate_final_epoch(epochs, tokens, SEQ_LENGTH, requested, extra),
        "before_final": ((epochs - 1) * tokens - extra) // SEQ_LENGTH,
    }  # fmt: skip


@pytest.fixture(scope="module")
def megatron_results() -> list[dict[str, object]]:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (the test extra brings it on Python 3.11)")
    payload = json.dumps([_payload(*case) for case in CASES])
    args = [sys.executable, "-c", _MEGATRON_SIDE]
    out = subprocess.run(args, input=payload, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-samples-x{x}" for n, x in CASES])
def test_equal_to_megatron_s_own_builders(megatron_results: list[dict[str, object]], case: int) -> None:
    requested, extra = CASES[case]
    ours = build_gpt_indices(SIZES, SEQUENCES, SEQ_LENGTH, requested, SEED, add_extra_token=bool(extra))
    theirs = megatron_results[case]
    assert ours.document_index.tolist() == theirs["docs"]
    assert ours.sample_index.tolist() == theirs["samples"]
    assert ours.shuffle_index.tolist() == theirs["shuffle"]
    assert [str(ours.sample_index.dtype), str(ours.shuffle_index.dtype)] == theirs["dtypes"]
    if requested == 40:
        assert _payload(requested, extra)["separate"]  # the final epoch shuffled apart is compared too


def _description(**overrides: object) -> dict[str, object]:
    base = {"dataset": "/data/corpus", "split": [0, 25], "seq_length": 8, "num_samples": 40, "seed": 5,
            "add_extra_token": True}  # fmt: skip
    return {**base, **overrides}


def _build(d: dict[str, object]) -> GPTIndices:
    sizes = np.random.default_rng(3).integers(0, 30, size=25)
    return build_gpt_indices(
        sizes, np.arange(25, dtype=np.int32), int(d["seq_length"]), int(d["num_samples"]), int(d["seed"]),
        add_extra_token=bool(d["add_extra_token"]),
    )  # fmt: skip


def test_cached_indices_are_built_once_and_mapped(tmp_path: Path) -> None:
    built = []

    def build(d: dict[str, object]) -> GPTIndices:
        built.append(d)
        return _build(d)

    d = _description()
    first = cached_gpt_indices(tmp_path, d, lambda: build(d))
    again = cached_gpt_indices(tmp_path, d, lambda: build(d))
    assert len(built) == 1
    assert isinstance(again.sample_index, np.memmap) and again.sample_index.dtype == np.int32
    fresh = _build(d)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(again, name), getattr(fresh, name))
        assert np.array_equal(getattr(first, name), getattr(fresh, name))
    # Every field counts: the extra label token (which Megatron's hash leaves out) is a new cache.
    other = _description(add_extra_token=False)
    cached_gpt_indices(tmp_path, other, lambda: build(other))
    assert len(built) == 2
    assert len(list(tmp_path.glob("*-GPTDataset-description.txt"))) == 2
    assert not list(tmp_path.glob("*.tmp-*"))


def _ask(cache: str, out: str) -> None:
    d = _description()

    def build() -> GPTIndices:
        with open(out, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough for the others to arrive while it builds
        return _build(d)

    ix = cached_gpt_indices(Path(cache), d, build)
    assert len(ix) >= 40


def test_processes_on_a_node_build_once_and_the_others_wait(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_ask, args=(str(tmp_path / "cache"), str(tmp_path / "log"))) for _ in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert (tmp_path / "log").read_text() == "built\n"
