"""preprocess(): JSONL (plain, gzip, zstd; file or s3) -> indexed dataset, equal to tokenizing each
line directly, identical for any number of workers, bad lines named by number, nothing left behind
on failure or Ctrl-C."""

from __future__ import annotations

import gzip
import importlib.util
import io
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatrain.engine.data import corpus
from megatrain.engine.data import preprocess as pp
from megatrain.engine.data.corpus import Chunk, open_corpus
from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.data.ordered_pool import OrderedPool, WorkerDied, WorkerFailed
from megatrain.engine.data.preprocess import PreprocessError, ProgressInfo, preprocess
from megatrain.engine.data.tokenizers import build_tokenizer
from megatrain.spec import TokenizerSpec

BYTE = TokenizerSpec(type="byte")


def _texts(n: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "γάμμα", "delta", "世界", "x", "\n", '{"q": 1}', "tab\there"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(n)]


def _write(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def _corpus(path: Path, texts: list[str], key: str = "text") -> Path:
    return _write(path, [json.dumps({key: t, "id": i}) for i, t in enumerate(texts)])


def _documents(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    assert len(ds) == ds.num_documents  # one sequence per document
    return [ds.document(i).tolist() for i in range(ds.num_documents)]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith((".jsonl", ".gz", ".zst")))


def test_byte_output_is_each_line_tokenized_plus_eod(tmp_path: Path) -> None:
    texts = _texts()
    stats = preprocess(str(_corpus(tmp_path / "c.jsonl", texts)), tmp_path / "out", BYTE, workers=0)
    tok = build_tokenizer(BYTE)
    expected = [tok.encode(t) + [tok.eod] for t in texts]
    assert _documents(tmp_path / "out") == expected
    assert IndexedDataset(tmp_path / "out").dtype == np.uint16
    assert stats.documents == len(texts) and stats.tokens == sum(map(len, expected))
    assert stats.input_bytes == (tmp_path / "c.jsonl").stat().st_size
    assert stats.output_bytes == (tmp_path / "out.bin").stat().st_size + (tmp_path / "out.idx").stat().st_size
    assert stats.tokenizer == "byte" and stats.vocab_size == 257 and stats.skipped == []


def test_without_eod_and_another_key(tmp_path: Path) -> None:
    texts = _texts(20)
    src = _corpus(tmp_path / "c.jsonl", texts, key="body")
    preprocess(str(src), tmp_path / "out", BYTE, json_key="body", append_eod=False, workers=0)
    assert _documents(tmp_path / "out") == [list(t.encode()) for t in texts]


def test_output_is_identical_for_any_number_of_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 2048)  # many chunks, so workers really interleave
    src = str(_corpus(tmp_path / "c.jsonl", _texts(600)))
    outputs = []
    for workers in (0, 1, 2):
        preprocess(src, tmp_path / f"w{workers}", BYTE, workers=workers)
        outputs.append(
            ((tmp_path / f"w{workers}.bin").read_bytes(), (tmp_path / f"w{workers}.idx").read_bytes())
        )
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_compressed_input_reads_like_plain(tmp_path: Path, suffix: str) -> None:
    texts = _texts(50)
    preprocess(str(_corpus(tmp_path / "c.jsonl", texts)), tmp_path / "plain", BYTE, workers=0)
    stats = preprocess(_corpus(tmp_path / f"c{suffix}", texts).as_uri(), tmp_path / "packed", BYTE, workers=0)
    assert (tmp_path / "plain.bin").read_bytes() == (tmp_path / "packed.bin").read_bytes()
    assert (tmp_path / "plain.idx").read_bytes() == (tmp_path / "packed.idx").read_bytes()
    assert stats.input_bytes == (tmp_path / "c.jsonl").stat().st_size  # counted decompressed


BAD = [
    ('{"text": "ok one"}', None),
    ('{"text": "broken', "not valid JSON"),
    ('{"body": "no text key"}', "no string field 'text' (the keys: 'body')"),
    ('{"text": 7}', "no string field 'text': it is a JSON number"),
    ('{"text": ""}', "empty document (no tokens)"),
    ("[1, 2]", "a JSON list, not an object"),
    ("   ", None),  # blank lines are ignored, but counted in line numbers
    ('{"text": "ok two"}', None),
]


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_lines_fail_at_the_first_with_its_number(tmp_path: Path, workers: int) -> None:
    src = _write(tmp_path / "c.jsonl", [line for line, _ in BAD])
    with pytest.raises(PreprocessError, match=r"c\.jsonl:2: not valid JSON \(Unterminated string"):
        preprocess(str(src), tmp_path / "out", BYTE, workers=workers)
    assert _leftovers(tmp_path) == []  # no dataset, no temporary file


def test_an_empty_document_fails_before_a_later_malformed_line(tmp_path: Path) -> None:
    src = _write(tmp_path / "c.jsonl", ['{"text": "a"}', '{"text": ""}', "nope"])
    with pytest.raises(PreprocessError, match=r"c\.jsonl:2: empty document"):
        preprocess(str(src), tmp_path / "out", BYTE, workers=0)


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_lines_skipped_and_listed(tmp_path: Path, workers: int) -> None:
    src = _write(tmp_path / "c.jsonl", [line for line, _ in BAD])
    stats = preprocess(str(src), tmp_path / "out", BYTE, workers=workers, on_error="skip")
    expected = [(i, reason) for i, (line, reason) in enumerate(BAD, start=1) if reason]
    assert [b.line for b in stats.skipped] == [i for i, _ in expected]
    assert all(b.reason.startswith(reason) for b, (_, reason) in zip(stats.skipped, expected, strict=True))
    assert stats.skipped_count == 5 and stats.documents == 2
    assert _documents(tmp_path / "out") == [list(b"ok one") + [256], list(b"ok two") + [256]]


def test_skipped_list_is_capped_but_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pp, "MAX_SKIPPED_LISTED", 3)
    src = _write(tmp_path / "c.jsonl", ["x"] * 10 + ['{"text": "fine"}'])
    stats = preprocess(str(src), tmp_path / "out", BYTE, workers=0, on_error="skip")
    assert [b.line for b in stats.skipped] == [1, 2, 3] and stats.skipped_count == 10


def test_nothing_left_is_an_error(tmp_path: Path) -> None:
    src = _write(tmp_path / "c.jsonl", ["x", "y"])
    with pytest.raises(PreprocessError, match="no documents to write: all 2 lines were skipped"):
        preprocess(str(src), tmp_path / "out", BYTE, workers=0, on_error="skip")
    (tmp_path / "e.jsonl").write_bytes(b"")
    with pytest.raises(PreprocessError, match=r"e\.jsonl: no documents to write: it is empty"):
        preprocess(str(tmp_path / "e.jsonl"), tmp_path / "out", BYTE, workers=0)
    assert _leftovers(tmp_path) == []


def test_missing_and_corrupt_inputs(tmp_path: Path) -> None:
    with pytest.raises(PreprocessError, match="missing.jsonl does not exist"):
        preprocess(str(tmp_path / "missing.jsonl"), tmp_path / "out", BYTE)
    (tmp_path / "bad.jsonl.gz").write_bytes(b'{"text": "not gzip"}\n')
    with pytest.raises(PreprocessError, match=r"bad\.jsonl\.gz: cannot decompress"):
        preprocess(str(tmp_path / "bad.jsonl.gz"), tmp_path / "out", BYTE, workers=0)
    (tmp_path / "bad.jsonl.zst").write_bytes(b"\x00" * 64)
    with pytest.raises(PreprocessError, match=r"bad\.jsonl\.zst: cannot decompress"):
        preprocess(str(tmp_path / "bad.jsonl.zst"), tmp_path / "out", BYTE, workers=0)
    with pytest.raises(ValueError, match="workers must be 0"):
        preprocess(str(tmp_path / "bad.jsonl.gz"), tmp_path / "out", BYTE, workers=-1)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_ctrl_c_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(pp, "PROGRESS_INTERVAL_S", 0.0)
    src = _corpus(tmp_path / "c.jsonl", _texts(400))

    def interrupt(info: ProgressInfo) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        preprocess(str(src), tmp_path / "out", BYTE, workers=workers, progress=interrupt)
    assert _leftovers(tmp_path) == []


def test_progress_reports_grow_to_the_totals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(pp, "PROGRESS_INTERVAL_S", 0.0)
    src = _corpus(tmp_path / "c.jsonl", _texts(200))
    seen: list[ProgressInfo] = []
    stats = preprocess(str(src), tmp_path / "out", BYTE, workers=0, progress=seen.append)
    assert len(seen) > 3
    pairs = list(itertools.pairwise(seen))
    assert all(a.documents <= b.documents and a.bytes_read <= b.bytes_read for a, b in pairs)
    last = seen[-1]
    assert (last.documents, last.tokens, last.bytes_read) == (
        stats.documents,
        stats.tokens,
        stats.input_bytes,
    )
    assert last.raw_bytes_total == src.stat().st_size == last.raw_bytes_read


def _train_hf(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_texts(200), trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_in_workers_matches_direct_encoding(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    spec = TokenizerSpec(type="hf", path=str(_train_hf(tmp_path / "tok.json")))
    texts = _texts(100)
    stats = preprocess(str(_corpus(tmp_path / "c.jsonl", texts)), tmp_path / "out", spec, workers=2)
    hf = Tokenizer.from_file(str(tmp_path / "tok.json"))
    eod = hf.token_to_id("<|endoftext|>")
    assert _documents(tmp_path / "out") == [hf.encode(t, add_special_tokens=False).ids + [eod] for t in texts]
    assert stats.tokenizer == f"hf:{tmp_path / 'tok.json'}" and stats.vocab_size == hf.get_vocab_size()


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_threads_write_the_same_bytes_at_1_and_n_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # The worker threads run the tokenizers' GIL-free batch encoders at once, and a bad line near
    # the end sits in a chunk that finishes before earlier ones: order and the first bad line must
    # still be the input's, and no thread or environment change may outlive the call.
    import threading

    from .helpers import tiktoken_ranks_file

    monkeypatch.setattr(corpus, "CHUNK_BYTES", 1024)  # many chunks, so the threads really interleave
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    if kind == "hf":
        spec = TokenizerSpec(type="hf", path=str(_train_hf(tmp_path / "tok.json")))
    else:
        spec = TokenizerSpec(
            type="tiktoken", name="cl100k_base", path=str(tiktoken_ranks_file(tmp_path / "r.tiktoken"))
        )
    texts = [t for t in _texts(500) if t.strip()]
    src = str(_corpus(tmp_path / "c.jsonl", texts))
    threads = threading.active_count()
    outputs = []
    for workers in (0, 1, 4):
        preprocess(src, tmp_path / f"w{workers}", spec, workers=workers)
        outputs.append([(tmp_path / f"w{workers}{s}").read_bytes() for s in (".bin", ".idx")])
    assert outputs[0] == outputs[1] == outputs[2]
    tok = build_tokenizer(spec)
    assert _documents(tmp_path / "w4") == [tok.encode(t) + [tok.eod] for t in texts]

    lines = [json.dumps({"text": t}) for t in texts]
    lines[300], lines[-2] = '{"text": "broken', "[1]"
    bad = _write(tmp_path / "bad.jsonl", lines)
    (tmp_path / "failed").mkdir()
    with pytest.raises(PreprocessError, match=r"bad\.jsonl:301: not valid JSON"):
        preprocess(str(bad), tmp_path / "failed" / "out", spec, workers=4)
    assert _leftovers(tmp_path / "failed") == []
    assert threading.active_count() == threads and "TOKENIZERS_PARALLELISM" not in os.environ


def test_s3_input_is_streamed(tmp_path: Path, s3_bucket_url: str) -> None:
    from megatrain.storage import open_store

    texts = _texts(80)
    data = _corpus(tmp_path / "c.jsonl.gz", texts).read_bytes()
    open_store(s3_bucket_url).put_bytes("corpora/c.jsonl.gz", data)
    url = f"{s3_bucket_url}/corpora/c.jsonl.gz"
    with open_corpus(url) as reader:  # a stream from S3, not the object read into memory first
        assert not isinstance(reader._raw.raw, io.BytesIO) and reader.size == len(data)
    stats = preprocess(url, tmp_path / "out", BYTE, workers=1)
    assert stats.documents == len(texts)
    assert _documents(tmp_path / "out")[-1] == list(texts[-1].encode()) + [256]


def test_chunks_are_whole_lines_numbered_from_one(tmp_path: Path) -> None:
    lines = ["a" * 50, "b", "", "c" * 7, "d" * 3]
    src = tmp_path / "c.jsonl"
    src.write_bytes("\n".join(lines).encode())  # no newline at the end
    with open_corpus(str(src)) as reader:
        chunks: list[Chunk] = list(reader.chunks(8))  # smaller than the first line
    assert b"".join(c.data for c in chunks) == src.read_bytes()
    numbered = [pair for c in chunks for pair in corpus.split_lines(c)]
    assert numbered == [(i, line.encode()) for i, line in enumerate(lines, start=1)]


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece"])
def test_every_tokenizer_kind(tmp_path: Path, kind: str) -> None:
    from .helpers import tiktoken_ranks_file
    from .test_tokenizers import _train_sentencepiece

    if kind == "tiktoken":  # cl100k's special ids reach past 65,500: int32 tokens
        spec = TokenizerSpec(
            type="tiktoken", name="cl100k_base", path=str(tiktoken_ranks_file(tmp_path / "r.tiktoken"))
        )
        dtype = np.int32
    else:
        spec = TokenizerSpec(type="sentencepiece", path=str(_train_sentencepiece(tmp_path / "sp.model")))
        dtype = np.uint16
    texts = [t for t in _texts(60) if t.strip()]
    stats = preprocess(str(_corpus(tmp_path / "c.jsonl", texts)), tmp_path / "out", spec, workers=0)
    tok = build_tokenizer(spec)
    assert _documents(tmp_path / "out") == [tok.encode(t) + [tok.eod] for t in texts]
    assert IndexedDataset(tmp_path / "out").dtype == dtype and stats.dtype == np.dtype(dtype).name


# Megatron-LM's tools/preprocess_data.py with --append-eod, reduced to what reaches the files: per
# line, the ids plus EOD as one sentence, through Megatron's own IndexedDatasetBuilder.
_MEGATRON_BUILD = """
import json, sys
import numpy as np
from megatron.core.datasets import indexed_dataset as indexed
prefix, vocab, docs = json.loads(sys.stdin.read())
builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=indexed.DType.optimal_dtype(vocab))
for ids in docs:
    builder.add_document(np.array(ids, dtype=np.int64), [len(ids)])
builder.finalize(prefix + ".idx")
"""


def test_files_equal_megatron_s_builder_fed_the_same_documents(tmp_path: Path) -> None:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (the test extra brings it on Python 3.11)")
    spec = TokenizerSpec(type="hf", path=str(_train_hf(tmp_path / "tok.json")))
    texts = [t for t in _texts(120) if t]
    preprocess(str(_corpus(tmp_path / "c.jsonl", texts)), tmp_path / "ours", spec, workers=0)
    tok = build_tokenizer(spec)
    docs = [tok.encode(t) + [tok.eod] for t in texts]
    subprocess.run(
        [sys.executable, "-c", _MEGATRON_BUILD],
        input=json.dumps([str(tmp_path / "meg"), tok.vocab_size, docs]),
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"meg{suffix}").read_bytes(), suffix


# -- the ordered pool under the workers ---------------------------------------------------------


def _square_slowly(seed: int) -> Any:
    # The factory runs once per worker; the function it returns sleeps a little at random, so
    # workers finish out of order and the pool must restore it.
    import random
    import time

    rng = random.Random(seed)

    def square(x: int) -> int:
        time.sleep(rng.random() * 0.01)
        if x == -1:
            raise ArithmeticError("minus one is not allowed")
        if x == -9:
            os.kill(os.getpid(), signal.SIGKILL)
        return x * x

    return square


def _refuse() -> Any:
    raise ValueError("no tokenizer here")


def test_pool_keeps_order_and_bounds_what_is_in_flight() -> None:
    pulled = 0

    def items() -> Iterator[int]:
        nonlocal pulled
        for i in range(60):
            pulled += 1
            yield i

    got = []
    with OrderedPool(3, _square_slowly, (0,)) as pool:
        for i, value in enumerate(pool.map(items(), in_flight=4)):
            assert pulled <= i + 4  # never more than in_flight items handed out and not yet yielded
            got.append(value)
    assert got == [i * i for i in range(60)]


def test_pool_reports_errors_and_deaths_without_hanging() -> None:
    cases = [
        (_square_slowly, (1,), [1, 2, -1, 4], WorkerFailed, "ArithmeticError: minus one is not allowed"),
        (_square_slowly, (1,), [1, 2, 3, -9, 5, 6], WorkerDied, r"died \(killed by signal 9\)"),
        (_refuse, (), [1], WorkerFailed, "ValueError: no tokenizer here"),
    ]
    for factory, args, items, error, message in cases:
        with pytest.raises(error, match=message), OrderedPool(2, factory, args) as pool:
            list(pool.map(items, in_flight=4))


def test_pool_stops_its_workers_on_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt), OrderedPool(2, _square_slowly, (2,)) as pool:
        processes = list(pool._processes)
        for value in pool.map(range(100), in_flight=4):
            if value > 10:
                raise KeyboardInterrupt
    assert processes and not any(p.is_alive() for p in processes)


def test_crlf_bom_non_utf8_and_a_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "c.jsonl").write_bytes(
        b'\xef\xbb\xbf{"text": "one"}\r\n{"text": "tw\xff"}\r\n{"text": "two"}\r\n'
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PreprocessError, match=r"c\.jsonl:2: not UTF-8 text"):
        preprocess("c.jsonl", "out", BYTE, workers=0)
    stats = preprocess("c.jsonl", "out", BYTE, workers=0, on_error="skip", append_eod=False)
    assert stats.skipped_count == 1 and _documents(tmp_path / "out") == [list(b"one"), list(b"two")]
