"""JSONL corpus -> Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`), in parallel, streaming.

The calling thread reads the corpus in chunks of whole lines (`corpus.py`), hands each chunk to one
of `workers` threads (they parse the JSON, check the key, tokenize, append EOD) and writes their
results in chunk order through `IndexedDatasetWriter`. Threads, not processes: the tokenizers'
native batch encoders (HF `tokenizers`, tiktoken) release the GIL, so threads tokenize in
parallel without pickling lines out to worker processes and arrays back. At most `2 * workers`
chunks are in flight, so memory is flat in the input's size, and the chunking depends only on the
input, so the output is byte-identical for any number of workers. `workers=0` does the same in the
calling thread.

Semantics follow Megatron-LM's tools/preprocess_data.py with one key: one document per line, in
input order, the EOD id appended to each when `append_eod`. Without `split_sentences` a document is
one sequence. With it (Megatron's --split-sentences, for BERT and T5) each sentence is a sequence
and the document index groups them: sentences that tokenize to nothing are dropped and the EOD
belongs to the last sentence, as Megatron writes them. Megatron splits with NLTK's punkt English
model, data that cannot be fetched here (no network beyond package registries, and no PyPI package
we trust ships it), so `split_sentences` below is a documented rule-based splitter instead; a line
whose value is a list of strings is taken as its sentences as they are (Megatron does the same), so
a corpus split by punkt elsewhere gives Megatron's files byte for byte.
Unlike Megatron, a line that is not a JSON object, lacks a string under the key or yields no tokens
is an error (with its line number) instead of an empty document; blank lines are ignored.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from megatrain.engine.data.corpus import Chunk, CorpusError, document_text, open_corpus, split_lines
from megatrain.engine.data.indexed import IndexedDatasetWriter, token_dtype
from megatrain.engine.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer, describe
from megatrain.spec import TokenizerSpec

MAX_SKIPPED_LISTED = 1000
"""`PreprocessStats.skipped` lists at most this many bad lines; `skipped_count` counts them all."""
PROGRESS_INTERVAL_S = 0.5


# The splitter: a sentence ends at a token ending in . ! or ? (closing quotes and brackets after it
# allowed) that is followed by whitespace, unless a "." ends a known abbreviation, an initial or a
# dotted one ("e.g.", "U.S.", "a.k.a.").
_TOKEN = re.compile(r"\S+")
_DOTTED = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")
_CLOSERS = "\"')]}”’»"
_OPENERS = "\"'([{“‘«"
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "etc", "cf", "al", "inc", "ltd", "co",
     "corp", "fig", "figs", "vol", "pp", "ed", "eds", "dept", "est", "approx", "jan", "feb", "mar", "apr",
     "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "ph.d"}
)  # fmt: skip


def split_sentences(text: str) -> list[str]:
    """`text` cut into sentences, each stripped of the whitespace around it (rule-based, see above:
    "Dr. Jones met J. Smith. Then?" gives "Dr. Jones met J. Smith." and "Then?"). Newlines are
    whitespace, as in punkt."""
    sentences: list[str] = []
    start = end = None
    for m in _TOKEN.finditer(text):
        if start is None:
            start = m.start()
        end = m.end()
        core = m.group().rstrip(_CLOSERS)
        if not core or core[-1] not in ".!?":
            continue
        if core[-1] == "." and not core.endswith(".."):
            word = core[:-1].lstrip(_OPENERS).lower()
            if word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()) or _DOTTED.fullmatch(word):
                continue
        sentences.append(text[start:end])
        start = None
    if start is not None:
        sentences.append(text[start:end])
    return sentences


@dataclass
class BadLine:
    line: int
    reason: str


@dataclass
class ProgressInfo:
    documents: int
    tokens: int
    bytes_read: int
    """Bytes of JSONL text read so far (decompressed)."""
    seconds: float
    """Elapsed since the start."""
    raw_bytes_read: int = 0
    """Bytes of the file as stored (compressed) read so far: the position for a progress bar."""
    raw_bytes_total: int | None = None
    """The file's stored size, when known."""


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    input_bytes: int
    """Bytes of JSONL text read (decompressed)."""
    output_bytes: int
    """Size of PREFIX.bin plus PREFIX.idx."""
    skipped: list[BadLine]
    """The first MAX_SKIPPED_LISTED lines skipped (on_error="skip"), in file order."""
    seconds: float
    tokenizer: str
    vocab_size: int
    skipped_count: int = 0
    """Every line skipped, also beyond the listed ones."""
    dtype: str = field(default="")
    """The token dtype of PREFIX.bin (numpy's name)."""
    sequences: int = 0
    """Sequences written: sentences with split_sentences, else one per document."""


class PreprocessError(ValueError):
    """Bad input: the message reads "FILE:LINE: problem" when one line is to blame."""


@dataclass
class _ChunkResult:
    tokens: np.ndarray  # (tokens,) in the output dtype, documents concatenated
    lengths: np.ndarray  # (documents,) int64, EOD included
    bad: list[tuple[int, str]]  # the first MAX_SKIPPED_LISTED bad lines of the chunk
    bad_count: int
    sentences: np.ndarray | None = None  # split_sentences: (sequences,) int64 lengths, EOD included
    counts: np.ndarray | None = None  # split_sentences: (documents,) sequences of each document


class _Encoder:
    """Turns a chunk of lines into tokens; the worker threads share one (it keeps no state)."""

    def __init__(
        self, spec: TokenizerSpec, json_key: str, append_eod: bool, fail_fast: bool, split: bool = False
    ):
        self.tokenizer = build_tokenizer(spec)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.json_key = json_key
        self.append_eod = append_eod
        self.fail_fast = fail_fast
        self.split = split

    def _sentences(self, line: bytes) -> list[str]:
        """A line's sentences: its text split, or its list of strings as they are."""
        try:
            text = document_text(line, self.json_key)
        except ValueError:
            sentences = _string_list(line, self.json_key)
            if sentences is None:
                raise  # document_text's message names what is wrong
            return sentences
        return split_sentences(text)

    def __call__(self, chunk: Chunk) -> _ChunkResult:
        texts: list[Any] = []
        lines: list[int] = []
        bad: list[tuple[int, str]] = []
        bad_count = 0
        for number, line in split_lines(chunk):
            if not line.strip():
                continue
            try:
                texts.append(self._sentences(line) if self.split else document_text(line, self.json_key))
                lines.append(number)
            except ValueError as exc:
                bad_count += 1
                if len(bad) < MAX_SKIPPED_LISTED:
                    bad.append((number, str(exc)))
                if self.fail_fast:
                    break  # the parent raises on it; the rest of the chunk is never needed
        if self.split:
            return self._encode_sentences(texts, lines, bad, bad_count)
        tokens, lengths = self._encode(texts)
        empty = lengths == 0
        if empty.any():
            for number in np.asarray(lines)[empty].tolist():
                bad_count += 1
                if len(bad) < MAX_SKIPPED_LISTED:
                    bad.append((number, "empty document (no tokens)"))
            bad.sort()
            lengths = lengths[~empty]
        if self.append_eod and lengths.size:
            # Insert EOD after each document: at the running end offsets of the documents.
            ends = np.cumsum(lengths)
            tokens = np.insert(tokens, ends, self.tokenizer.eod)
            lengths = lengths + 1
        return _ChunkResult(tokens.astype(self.dtype, copy=False), lengths, bad, bad_count)

    def _encode_sentences(
        self, docs: list[list[str]], lines: list[int], bad: list[tuple[int, str]], bad_count: int
    ) -> _ChunkResult:
        counts = np.fromiter(map(len, docs), np.int64, len(docs))
        tokens, sizes = self._encode([s for doc in docs for s in doc])  # one batch for the chunk
        owner = np.repeat(np.arange(len(docs)), counts)  # (sentences,) the document of each
        lengths = np.bincount(owner, weights=sizes, minlength=len(docs)).astype(np.int64)
        kept = sizes > 0  # a sentence of no tokens is no sequence (Megatron drops it)
        sizes, counts = sizes[kept], np.bincount(owner[kept], minlength=len(docs))
        empty = lengths == 0  # no sentence left: a bad line, as without splitting
        for number in np.asarray(lines, dtype=np.int64)[empty].tolist():
            bad_count += 1
            if len(bad) < MAX_SKIPPED_LISTED:
                bad.append((number, "empty document (no tokens)"))
        bad.sort()
        lengths, counts = lengths[~empty], counts[~empty]
        if self.append_eod and lengths.size:
            tokens = np.insert(tokens, np.cumsum(lengths), self.tokenizer.eod)
            lengths = lengths + 1
            sizes[np.cumsum(counts) - 1] += 1  # the EOD ends each document's last sentence
        return _ChunkResult(tokens.astype(self.dtype, copy=False), lengths, bad, bad_count, sizes, counts)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(self.tokenizer, ByteTokenizer):
            # No per-token Python objects: the UTF-8 bytes are the ids.
            encoded = [t.encode("utf-8") for t in texts]
            tokens = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(self.dtype)
            return tokens, np.fromiter(map(len, encoded), np.int64, len(encoded))
        ids = self.tokenizer.encode_batch(texts) if texts else []
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
        return tokens, lengths


def _string_list(line: bytes, key: str) -> list[str] | None:
    try:
        obj = json.loads(line)
    except ValueError:  # not JSON, not UTF-8
        return None
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


@contextmanager
def _results(chunks: Iterator[Chunk], workers: int, encoder: _Encoder) -> Iterator[Iterator[_ChunkResult]]:
    """Every chunk's result, in order: from `workers` threads, or from this one when 0."""
    if workers == 0:
        yield map(encoder, chunks)
        return
    # The threads are the parallelism here; the HF batch encoder's own Rust threads would
    # oversubscribe the cores (it reads the variable at each call).
    set_here = "TOKENIZERS_PARALLELISM" not in os.environ
    if set_here:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pool = ThreadPoolExecutor(workers, thread_name_prefix="preprocess")
    try:
        # Two chunks per worker: one being tokenized, one waiting, so no worker idles on the reader.
        yield _in_order(pool, encoder, chunks, in_flight=2 * workers)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on an error: the running chunks end, no more
        if set_here:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


def _in_order(
    pool: ThreadPoolExecutor, encoder: _Encoder, chunks: Iterator[Chunk], in_flight: int
) -> Iterator[_ChunkResult]:
    pending: deque[Future[_ChunkResult]] = deque()
    for chunk in chunks:
        pending.append(pool.submit(encoder, chunk))
        if len(pending) >= in_flight:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def preprocess(
    input_url: str,
    output_prefix: str | Path,
    tokenizer: TokenizerSpec,
    *,
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = True,
    on_error: Literal["skip", "fail"] = "fail",
    progress: Callable[[ProgressInfo], None] | None = None,
    split_sentences: bool = False,
) -> PreprocessStats:
    """Tokenize a JSONL corpus into `output_prefix`.bin/.idx (nothing appears there on failure);
    `split_sentences`: one sequence per sentence (BERT and T5 data), documents in the index.

    Raises PreprocessError for bad input (with "FILE:LINE: problem" at the first bad line when
    on_error="fail", or when no document is left) and ValueError for a tokenizer that cannot load.
    """
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', not {on_error!r}")
    if workers < 0:
        raise ValueError(f"workers must be 0 (in this process) or more, not {workers}")
    start = time.perf_counter()
    fail_fast = on_error == "fail"
    encoder = _Encoder(tokenizer, json_key, append_eod, fail_fast, split_sentences)  # loads the tokenizer
    tok: Tokenizer = encoder.tokenizer
    skipped: list[BadLine] = []
    counts = {"documents": 0, "tokens": 0, "skipped": 0, "sequences": 0}
    last_report = start

    def write(result: _ChunkResult) -> None:
        if result.bad_count and fail_fast:
            line, reason = result.bad[0]
            raise PreprocessError(f"{input_url}:{line}: {reason}")
        counts["skipped"] += result.bad_count
        skipped.extend(BadLine(n, r) for n, r in result.bad[: MAX_SKIPPED_LISTED - len(skipped)])
        if result.sentences is None or result.counts is None:
            writer.add_documents(result.tokens, result.lengths)
            counts["sequences"] += result.lengths.size
        else:
            token_ends, sentence_ends = np.cumsum(result.lengths), np.cumsum(result.counts)
            for d in range(result.lengths.size):
                t1, s1 = int(token_ends[d]), int(sentence_ends[d])
                t0, s0 = t1 - int(result.lengths[d]), s1 - int(result.counts[d])
                writer.add_document(result.tokens[t0:t1], result.sentences[s0:s1].tolist())
            counts["sequences"] += result.sentences.size
        counts["documents"] += result.lengths.size
        counts["tokens"] += result.tokens.size

    def report(reader: Any, final: bool = False) -> None:
        nonlocal last_report
        now = time.perf_counter()
        if progress is None or (not final and now - last_report < PROGRESS_INTERVAL_S):
            return
        last_report = now
        progress(
            ProgressInfo(
                counts["documents"],
                counts["tokens"],
                reader.text_bytes,
                now - start,
                reader.raw_bytes,
                reader.size,
            )
        )

    try:
        with (
            open_corpus(input_url) as reader,
            IndexedDatasetWriter(output_prefix, encoder.dtype) as writer,
            _results(reader.chunks(), workers, encoder) as results,
        ):
            for result in results:
                write(result)
                report(reader)
            if counts["documents"] == 0:
                what = f"all {counts['skipped']} lines were skipped" if counts["skipped"] else "it is empty"
                raise PreprocessError(f"{input_url}: no documents to write: {what}")
            report(reader, final=True)
            input_bytes = reader.text_bytes
    except CorpusError as exc:
        raise PreprocessError(str(exc)) from None
    bin_path, idx_path = writer.bin_path, writer.idx_path
    return PreprocessStats(
        documents=counts["documents"],
        tokens=counts["tokens"],
        input_bytes=input_bytes,
        output_bytes=bin_path.stat().st_size + idx_path.stat().st_size,
        skipped=skipped,
        seconds=time.perf_counter() - start,
        tokenizer=describe(tokenizer),
        vocab_size=tok.vocab_size,
        skipped_count=counts["skipped"],
        dtype=encoder.dtype.name,
        sequences=counts["sequences"],
    )
