"""`megatrain data preprocess`: a good run reads back equal to tokenizing each line directly; bad
input is one red line naming file:line (exit 1) and leaves nothing behind; the CLI stays torch-free."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from megatrain.cli import app

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["hello world", "a second document ✓", "tabs\tand\nnewlines", "x" * 300]


def _corpus(path: Path, texts: list[str], extra: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "".join(e + "\n" for e in extra))
    return path


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["data", "preprocess", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def _hf(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_hf_run_reads_back_as_the_lines_tokenized(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from megatrain.engine.data.indexed import IndexedDataset

    src, tok_path = _corpus(tmp_path / "c.jsonl", TEXTS), _hf(tmp_path)
    code, out = _run(
        "--input", str(src), "--json-key", "text", "--tokenizer", f"hf:{tok_path}",
        "--output-prefix", str(tmp_path / "ds" / "corpus"), "--workers", "0", "--append-eod",
    )  # fmt: skip
    assert code == 0, out
    hf = Tokenizer.from_file(str(tok_path))
    eod = hf.token_to_id("<|endoftext|>")
    ds = IndexedDataset(tmp_path / "ds" / "corpus")
    assert [ds.document(i).tolist() for i in range(ds.num_documents)] == [
        hf.encode(t, add_special_tokens=False).ids + [eod] for t in TEXTS
    ]
    assert f"{len(TEXTS)} documents, {ds.num_tokens} tokens (uint16" in out
    assert "docs/s" in out and "tokens/s" in out and "MB/s" in out


def test_without_append_eod_no_eod_and_a_note(tmp_path: Path) -> None:
    from megatrain.engine.data.indexed import IndexedDataset

    code, out = _run(
        "--input", str(_corpus(tmp_path / "c.jsonl", TEXTS)), "--output-prefix", str(tmp_path / "o")
    )
    assert code == 0, out
    ds = IndexedDataset(tmp_path / "o")
    assert ds.document(0).tolist() == list(b"hello world")
    assert "no end-of-document token appended" in out


def test_bad_line_is_one_red_line_with_file_and_line(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "c.jsonl", TEXTS[:2], ('{"text": 1}',))
    code, out = _run("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--workers", "0")
    assert code == 1
    assert out.strip() == f"error: {src}:3: no string field 'text': it is a JSON number"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_skip_lists_the_bad_lines(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "c.jsonl", TEXTS[:2], ("{oops", '{"text": ""}'))
    code, out = _run("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--on-error", "skip")
    assert code == 0, out
    assert "2 documents" in out and "skipped 2 lines" in out
    assert "line 3: not valid JSON" in out and "line 4: empty document" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokenizer", "wordpiece"], "error: --tokenizer: tokenizer 'wordpiece' must be byte, hf:PATH"),
        (["--tokenizer", "hf:missing.json"], "error: cannot read the tokenizer file"),
        (["--tokenizer", "tiktoken:nope"], "error: unknown tiktoken encoding 'nope'"),
        (["--tiktoken-ranks", "r.tiktoken"], "error: --tiktoken-ranks is only for --tokenizer tiktoken:NAME"),
        (["--on-error", "ignore"], "error: --on-error must be skip or fail, not 'ignore'"),
        (["--workers", "-2"], "error: --workers must be 0 or more, not -2"),
        (["--json-key", "body"], "c.jsonl:1: no string field 'body' (the keys: 'text')"),
    ],
)
def test_user_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    src = _corpus(tmp_path / "c.jsonl", TEXTS)
    code, out = _run("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--workers", "0", *args)
    assert code == 1 and message in out and len(out.strip().splitlines()) == 1, out


def test_missing_input_and_url_output(tmp_path: Path) -> None:
    code, out = _run("--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o"))
    assert code == 1 and f"error: {tmp_path / 'nope.jsonl'} does not exist" in out
    code, out = _run("--input", "x.jsonl", "--output-prefix", "s3://b/o")
    assert code == 1 and "--output-prefix must be a local path" in out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def test_the_command_line_stays_torch_free() -> None:
    code = (
        "import sys, megatrain.cli; "
        "heavy = [m for m in ('torch', 'numpy', 'tokenizers', 'megatrain.engine.data.preprocess') "
        "if m in sys.modules]; assert not heavy, heavy"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_worker_processes_from_the_real_command(tmp_path: Path) -> None:
    # Spawned workers re-import the parent's main module: `python -m megatrain.cli` must survive it.
    src = _corpus(tmp_path / "c.jsonl", TEXTS * 50)
    proc = subprocess.run(
        [sys.executable, "-m", "megatrain.cli", "data", "preprocess", "--input", str(src),
         "--output-prefix", str(tmp_path / "o"), "--workers", "2", "--append-eod"],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(TEXTS) * 50} documents" in proc.stdout
    from megatrain.engine.data.indexed import IndexedDataset

    ds = IndexedDataset(tmp_path / "o")
    assert ds.num_documents == len(TEXTS) * 50
    assert ds.document(ds.num_documents - 1).tolist() == list(TEXTS[-1].encode()) + [256]


def test_sigterm_mid_run_leaves_nothing_behind(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    src.write_text(('{"text": "' + "word " * 400 + '"}\n') * 20000)  # 40 MB: seconds of work
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatrain.cli", "data", "preprocess", "--input", str(src),
         "--output-prefix", str(tmp_path / "o"), "--workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # Until the workers' first tokens reach the temporary .bin: the pool is up and working.
        while not any(p.name.startswith("o.bin.tmp-") and p.stat().st_size for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert out.strip() == "error: interrupted; nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
