"""Preprocessing throughput and memory: `preprocess()` against a plain single-process loop.

    python benchmarks/preprocess.py                          # 200 MB and 50 MB corpora, byte + BPE
    python benchmarks/preprocess.py --size-mb 400 --small-mb 100 --workers 1 2 4
    python benchmarks/preprocess.py --rounds 3               # median of 3 runs of each, rotating order
    python benchmarks/preprocess.py --tiny --json out.json   # seconds; what tests/benchmarks runs

A deterministic JSONL corpus (seeded word salad with some non-ASCII words, documents of lognormal
length) is generated in a temporary folder at two sizes, and a byte-level BPE tokenizers JSON is
trained on its first megabytes. For each tokenizer (byte, BPE) and corpus, every variant runs in a
fresh child process:

  plain      json.loads + the tokenizer's `encode` per line + IndexedDatasetWriter.add_document,
             one process: what a straightforward script does
  workers=0  preprocess() in one process (batch encoding, chunked writes, no parallelism)
  workers=N  preprocess() with N tokenizing processes while the parent reads and writes

and reports documents, tokens, seconds (tokenizer load and worker start included, interpreter start
excluded), tokens/s, MB/s of JSONL read, the speed-up over `plain`, and peak RSS: the child's own
(the parent of the workers) and its largest worker's, from getrusage. Every variant's .bin/.idx must
be byte-identical to `plain`'s; the script exits 1 when one is not. A last section prints
benchmarks/_loader.py's loader samples/s against what a training step consumes.

Every child runs with TOKENIZERS_PARALLELISM=false and RAYON_NUM_THREADS=1, so the HF tokenizer's
own Rust threads never add parallelism to one variant and not another: only processes do. On a
machine whose cores are shared (the figures in BENCHMARKS.md name theirs), N workers plus the
reading/writing parent compete with everything else running there.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_loader.py

# Identical for every variant: processes are the only parallelism measured.
CHILD_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
# A small fixed vocabulary (some of it non-ASCII), one string split once: the corpus's word salad.
WORDS = tuple(
    " ".join(
        [
            "the of and to in a is that for it as was with be by on not he this are or his from at",
            "which but have an they you were her she there been one all we their has would when if",
            "model train data token layer gradient parallel pipeline tensor sequence attention",
            "über café naïve 東京 データ модель обучение 2026 3.14 (x) [y] {z} def return import",
        ]
    ).split(" ")
)


# -- the corpus and the BPE tokenizer ------------------------------------------------------------


def generate_corpus(path: Path, size_bytes: int, seed: int = 0) -> Path:
    """JSONL of about `size_bytes`, the same bytes for the same seed and size."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(WORDS, dtype=object)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        doc_id = 0
        while written < size_bytes:
            # A batch of documents at a time: numpy picks the words, Python only joins them.
            lengths = np.clip(rng.lognormal(mean=5.0, sigma=0.8, size=256), 5, 4000).astype(int)
            picks = rng.integers(0, len(words), size=int(lengths.sum()))
            start = 0
            lines = []
            for n in lengths:
                text = " ".join(words[picks[start : start + n]])
                start += n
                lines.append(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
                doc_id += 1
            block = "".join(lines)
            f.write(block)
            written += len(block.encode("utf-8"))
    return path


def train_bpe(corpus: Path, path: Path, vocab_size: int = 8000, sample_bytes: int = 4 << 20) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    with open(corpus, "rb") as f:
        for line in f.read(sample_bytes).splitlines()[:-1]:  # whole lines only
            texts.append(json.loads(line)["text"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


# -- one variant, in a child process ------------------------------------------------------------


def library_tokenizer(spec: Any) -> Any:
    """The tokenizer as the baselines use it: for an HF file, `tokenizers` itself (`encode` per
    text), not our tiktoken twin of it (bpe_fast.py), which is part of what is measured."""
    from megatrain.engine.data.tokenizers import HFTokenizer, build_tokenizer

    return HFTokenizer(spec.path, twin=False) if spec.type == "hf" else build_tokenizer(spec)


def plain_loop(corpus: str, prefix: str, spec: Any) -> tuple[int, int]:
    """The baseline: one process, one line at a time, the tokenizer library's own `encode`."""
    from megatrain.engine.data.indexed import IndexedDatasetWriter, token_dtype

    tok = library_tokenizer(spec)
    docs = tokens = 0
    with IndexedDatasetWriter(prefix, token_dtype(tok.vocab_size)) as writer, open(corpus, "rb") as f:
        for line in f:
            ids = tok.encode(json.loads(line)["text"])
            ids.append(tok.eod)
            writer.add_document(ids)
            docs += 1
            tokens += len(ids)
    return docs, tokens


class _MegatronEncoder:
    """Megatron-LM's tools/preprocess_data.py `Encoder`, one key, no sentence splitting: the
    tokenizer built once per worker (the pool's initializer), then per line json.loads, the
    tokenizer's `encode`, EOD appended, and the line's length for the progress count."""

    tokenizer: Any = None

    def __init__(self, spec: Any):
        self.spec = spec

    def initializer(self) -> None:
        _MegatronEncoder.tokenizer = library_tokenizer(self.spec)

    def encode(self, line: str) -> tuple[list[int], list[int], int]:
        ids = _MegatronEncoder.tokenizer.encode(json.loads(line)["text"])
        if ids:
            ids.append(_MegatronEncoder.tokenizer.eod)
        return ids, [len(ids)] if ids else [], len(line)


def megatron_loop(corpus: str, prefix: str, spec: Any, workers: int) -> tuple[int, int]:
    """Megatron-LM's tools/preprocess_data.py as it runs (one partition): a multiprocessing.Pool
    of `workers` processes fed `pool.imap(encode, lines, 32)` from the text file, the parent adding
    each document to megatron.core's IndexedDatasetBuilder (which makes a numpy array of each
    document's list of ids), then finalizing the index. The HF tokenizer is called directly,
    without Megatron's transformers wrapper, which only adds work to Megatron's side."""
    import multiprocessing

    from megatrain.engine.data.tokenizers import build_tokenizer

    try:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    except ImportError:  # megatron-core absent: our writer, which writes the same bytes
        DType, IndexedDatasetBuilder = None, None
    vocab = build_tokenizer(spec).vocab_size
    encoder = _MegatronEncoder(spec)
    docs = tokens = 0
    with open(corpus, encoding="utf-8") as fin, multiprocessing.Pool(workers, encoder.initializer) as pool:
        if IndexedDatasetBuilder is not None:
            builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab))
            add, finalize = builder.add_document, lambda: builder.finalize(prefix + ".idx")
        else:
            from megatrain.engine.data.indexed import IndexedDatasetWriter, token_dtype

            writer = IndexedDatasetWriter(prefix, token_dtype(vocab)).__enter__()
            add, finalize = (
                (lambda ids, lens: writer.add_document(ids)),
                lambda: writer.__exit__(None, None, None),
            )
        for ids, lens, _ in pool.imap(encoder.encode, fin, 32):
            add(ids, lens)
            docs += 1
            tokens += len(ids)
        finalize()
    return docs, tokens


def run_child(args: dict[str, Any]) -> dict[str, Any]:
    from megatrain.engine.data.preprocess import preprocess
    from megatrain.spec import TokenizerSpec

    spec = TokenizerSpec.model_validate(args["tokenizer"])
    if args["variant"] == "megatron":
        # Imported before the clock starts, as Megatron's script imports it at its top.
        with contextlib.suppress(ImportError):
            import megatron.core.datasets.indexed_dataset  # noqa: F401
    start = time.perf_counter()
    if args["variant"] == "plain":
        docs, tokens = plain_loop(args["corpus"], args["prefix"], spec)
    elif args["variant"] == "megatron":
        docs, tokens = megatron_loop(args["corpus"], args["prefix"], spec, args["workers"])
    else:
        stats = preprocess(args["corpus"], args["prefix"], spec, workers=args["workers"], append_eod=True)
        docs, tokens = stats.documents, stats.tokens
    seconds = time.perf_counter() - start
    # Peaks read before hashing the output (whose reads would count otherwise). ru_maxrss is in KiB
    # on Linux; RUSAGE_CHILDREN is the largest of the finished (joined) worker processes.
    rss_parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_worker = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    digest = hashlib.sha256()
    for suffix in (".bin", ".idx"):
        with open(args["prefix"] + suffix, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        os.unlink(args["prefix"] + suffix)  # keep the temporary folder small
    return {
        "documents": docs,
        "tokens": tokens,
        "seconds": seconds,
        "sha256": digest.hexdigest(),
        "rss_parent_mb": rss_parent,
        "rss_worker_mb": rss_worker,
    }


@dataclass
class Row:
    tokenizer: str
    corpus_mb: float
    variant: str
    workers: int
    documents: int
    tokens: int
    seconds: float
    tokens_per_s: float
    mb_per_s: float
    speedup: float
    vs_megatron: float
    """Megatron's median seconds at the same worker count over ours (0: no such Megatron run)."""
    load: float
    """The host's 1-minute load average before each round's run: the largest."""
    rss_parent_mb: float
    rss_worker_mb: float
    identical: bool
    round_seconds: list[float]


def measure(
    tokenizer: dict[str, str], name: str, corpus: Path, variant: str, workers: int, tmp: Path
) -> dict:
    args = {"tokenizer": tokenizer, "corpus": str(corpus), "prefix": str(tmp / f"out-{variant}-{workers}"),
            "variant": variant, "workers": workers}  # fmt: skip
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {variant} workers={workers} failed:\n{proc.stdout}{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- sections -----------------------------------------------------------------------------------


def preprocess_section(args: argparse.Namespace, tmp: Path) -> tuple[list[Row], dict[str, Any]]:
    sizes = {"large": args.size_mb, "small": args.small_mb}
    corpora = {
        k: generate_corpus(tmp / f"corpus-{k}.jsonl", int(mb * 1e6), seed=0) for k, mb in sizes.items()
    }
    bpe = train_bpe(corpora["small"], tmp / "bpe.json", vocab_size=args.bpe_vocab)
    tokenizers = {"byte": {"type": "byte"}, "bpe": {"type": "hf", "path": str(bpe)}}
    variants = [
        ("plain", 0),
        *(("megatron", w) for w in args.workers if w > 0),  # Megatron's pool needs a worker
        *(("preprocess", w) for w in args.workers),
    ]
    rows: list[Row] = []
    for name in args.tokenizers:
        for size in ("small", "large"):
            corpus = corpora[size]
            mb = corpus.stat().st_size / 1e6
            runs: dict[tuple[str, int], list[dict]] = {v: [] for v in variants}
            for round_ in range(args.rounds):
                # A rotating order, so a slow spell on a shared machine hits a different variant
                # each round; the median over rounds is the figure.
                k = round_ % len(variants)
                for variant, workers in variants[k:] + variants[:k]:
                    load = os.getloadavg()[0]
                    result = measure(tokenizers[name], name, corpus, variant, workers, tmp)
                    runs[(variant, workers)].append({**result, "load": load})
            plain = statistics.median(r["seconds"] for r in runs[("plain", 0)])
            megatron = {
                w: statistics.median(r["seconds"] for r in rs)
                for (v, w), rs in runs.items()
                if v == "megatron"
            }
            digest = runs[("plain", 0)][0]["sha256"]
            for (variant, workers), results in runs.items():
                r, seconds = results[0], statistics.median(x["seconds"] for x in results)
                rows.append(
                    Row(name, mb, variant, workers, r["documents"], r["tokens"], seconds,
                        r["tokens"] / seconds, mb / seconds, plain / seconds,
                        megatron.get(workers, 0.0) / seconds if variant == "preprocess" else 0.0,
                        max(x["load"] for x in results),
                        max(x["rss_parent_mb"] for x in results), max(x["rss_worker_mb"] for x in results),
                        all(x["sha256"] == digest for x in results), [x["seconds"] for x in results])
                )  # fmt: skip
                print(_format_row(rows[-1]), flush=True)
    return rows, {
        "corpus_mb": {k: c.stat().st_size / 1e6 for k, c in corpora.items()},
        "bpe_vocab": args.bpe_vocab,
    }


def loader_section(args: argparse.Namespace, tmp: Path) -> dict[str, Any] | None:
    """Loader samples/s against what a training step consumes (issue 13, the loader half): the table
    of benchmarks/_loader.py, which owns the measurement, on a memory-mapped dataset in `tmp`."""
    from _loader import engine_data_share
    from _loader import loader_section as loader_table

    tokens, seconds, steps = (1_000_000, 0.3, 3) if args.tiny else (50_000_000, 3.0, 30)
    engine = engine_data_share(tmp, steps)
    print(
        f"\nEngine (demo Llama shape, seq 256, global batch 16, fp32 CPU): {engine['iter_time_s'] * 1e3:.0f} "
        f"ms/step, waiting for data {engine['data_time_s'] * 1e3:.2f} ms "
        f"({engine['data_time_s'] / engine['iter_time_s']:.2%} of the step); it consumes "
        f"{engine['samples_per_s']:.0f} samples/s ({engine['tokens_per_s']:.0f} tokens/s)",
        flush=True,
    )
    table = loader_table(tmp, tokens, seconds, cpu_step_tokens_per_s=engine["tokens_per_s"])
    print(table, flush=True)
    return {"tokens": tokens, "table": table, "engine": engine}


SECTIONS = {"preprocess": preprocess_section, "loader": loader_section}


# -- output -------------------------------------------------------------------------------------

HEADER = (
    f"{'tokenizer':9s} {'corpus':>8s} {'variant':>12s} {'docs':>9s} {'tokens':>12s} {'s':>7s} "
    f"{'tokens/s':>11s} {'MB/s':>7s} {'vs plain':>8s} {'vs meg':>7s} {'load':>5s} {'RSS MB':>7s} "
    f"{'worker':>7s} {'same':>4s}"
)


def _format_row(r: Row) -> str:
    variant = {"plain": "plain", "megatron": f"megatron={r.workers}"}.get(r.variant, f"workers={r.workers}")
    meg = f"{r.vs_megatron:6.2f}x" if r.vs_megatron else f"{'':7s}"
    same = "yes" if r.identical else "NO"
    return (
        f"{r.tokenizer:9s} {r.corpus_mb:6.0f}MB {variant:>12s} {r.documents:9,d} {r.tokens:12,d} "
        f"{r.seconds:7.1f} {r.tokens_per_s:11,.0f} {r.mb_per_s:7.1f} {r.speedup:7.2f}x {meg} {r.load:5.1f} "
        f"{r.rss_parent_mb:7.0f} {r.rss_worker_mb if r.workers else 0:7.0f} {same:>4s}"
    )


def _verdicts(rows: list[Row], large_mb: float) -> list[str]:
    out = []
    for name in dict.fromkeys(r.tokenizer for r in rows):
        two = [
            r
            for r in rows
            if r.tokenizer == name
            and r.variant == "preprocess"
            and r.workers == 2
            and r.corpus_mb >= large_mb * 0.99
        ]
        if two:
            s = two[0].speedup
            verdict = "met" if s >= 1.8 else "missed"
            out.append(f"{name}: 2 workers {s:.2f}x the plain loop (target >= 1.8x): {verdict}")
        for r in rows:
            if r.tokenizer == name and r.vs_megatron and r.corpus_mb >= large_mb * 0.99:
                verdict = "met" if r.vs_megatron >= 2.0 else "missed"
                out.append(
                    f"{name}: workers={r.workers} {r.vs_megatron:.2f}x Megatron's preprocess_data.py at "
                    f"{r.workers} workers (target >= 2x): {verdict} (load average up to {r.load:.1f})"
                )
        for w in sorted({r.workers for r in rows if r.variant == "preprocess"}):
            runs = [r for r in rows if r.tokenizer == name and r.workers == w and r.variant == "preprocess"]
            pair = sorted(runs, key=lambda r: r.corpus_mb)
            if len(pair) == 2:
                small, large = pair
                out.append(
                    f"{name}: workers={w} peak RSS {small.rss_parent_mb:.0f}+{small.rss_worker_mb:.0f} MB at "
                    f"{small.corpus_mb:.0f} MB, {large.rss_parent_mb:.0f}+{large.rss_worker_mb:.0f} MB at "
                    f"{large.corpus_mb:.0f} MB (parent+largest worker)"
                )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--size-mb", type=float, default=200.0, help="the large corpus (at least 200 for the target)"
    )
    p.add_argument(
        "--small-mb", type=float, default=50.0, help="the small corpus (RSS must not grow with size)"
    )
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tokenizers", nargs="+", choices=["byte", "bpe"], default=["byte", "bpe"])
    p.add_argument("--bpe-vocab", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=1, help="runs of every variant; the median is reported")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--tiny", action="store_true", help="2 MB and 0.5 MB corpora: a smoke run in seconds")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return 0
    if args.tiny:
        args.size_mb, args.small_mb, args.bpe_vocab = 2.0, 0.5, 1000
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPU cores (os.cpu_count), load average {load:.1f}; child env {CHILD_ENV}")
    results: dict[str, Any] = {"cpu_count": os.cpu_count()}
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        if "preprocess" in args.sections:
            print(HEADER, flush=True)
            rows, info = preprocess_section(args, Path(tmp))
            for line in _verdicts(rows, args.size_mb):
                print(line)
            ok = all(r.identical for r in rows)
            if not ok:
                print("ERROR: a variant's output differs from the plain loop's")
            results["preprocess"] = {"rows": [asdict(r) for r in rows], **info}
        if "loader" in args.sections:
            results["loader"] = loader_section(args, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
