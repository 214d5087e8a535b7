"""`megatrain data preprocess`: a JSONL corpus into a Megatron indexed dataset on this machine.

The flags follow Megatron-LM's tools/preprocess_data.py (--input, --json-key, --output-prefix,
--workers, --append-eod, --split-sentences). The engine's data modules (numpy, the tokenizer
libraries) are imported only when the command runs, so `megatrain` starts as fast as before and
stays torch-free.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from megatrain.cli.common import _fail, _out, app

if TYPE_CHECKING:
    from megatrain.engine.data.preprocess import PreprocessStats, ProgressInfo
    from megatrain.spec import TokenizerSpec

data_app = typer.Typer(
    help="Datasets on this machine: preprocess JSONL into indexed datasets.", no_args_is_help=True
)
app.add_typer(data_app, name="data")

SKIPPED_SHOWN = 10
"""The summary names this many skipped lines; the rest are counted."""


def _url(value: str) -> str:
    """A URL as given, a local path made absolute (the readers take `/abs` or `scheme://`)."""
    return value if "://" in value else str(Path(value).expanduser().resolve())


def tokenizer_spec(text: str, tiktoken_ranks: str | None = None) -> TokenizerSpec:
    """`--tokenizer` (+ `--tiktoken-ranks`) as a TokenizerSpec; a ValueError naming the flag."""
    from pydantic import ValidationError

    from megatrain.spec import TokenizerSpec, parse_tokenizer

    try:
        fields = parse_tokenizer(text)
    except ValueError as exc:
        raise ValueError(f"--tokenizer: {exc}") from None
    if "path" in fields:
        fields["path"] = _url(fields["path"])
    if tiktoken_ranks is not None:
        if fields["type"] != "tiktoken":
            raise ValueError("--tiktoken-ranks is only for --tokenizer tiktoken:NAME")
        fields["path"] = _url(tiktoken_ranks)
    try:
        return TokenizerSpec.model_validate(fields)
    except ValidationError as exc:
        raise ValueError(f"--tokenizer {text!r}: {exc.errors()[0]['msg']}") from None


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def _progress_columns() -> tuple[object, ...]:
    return (
        TextColumn("preprocessing"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[docs]} docs/s"),
        TextColumn("{task.fields[tokens]} tokens/s"),
        TextColumn("{task.fields[mb]} MB/s"),
        TimeElapsedColumn(),
    )


def _summary(stats: PreprocessStats, prefix: str, append_eod: bool, split_sentences: bool = False) -> str:
    sentences = f" ({stats.sequences:,} sentences)" if split_sentences else ""
    lines = [
        f"wrote {escape(prefix)}.bin/.idx: {stats.documents:,} documents{sentences}, {stats.tokens:,} tokens "
        f"({stats.dtype}, vocabulary {stats.vocab_size:,}, {escape(stats.tokenizer)})",
        f"  {stats.input_bytes / 1e6:,.1f} MB read, {stats.output_bytes / 1e6:,.1f} MB written in "
        f"{stats.seconds:.1f} s: {_rate(stats.documents, stats.seconds):,.0f} docs/s, "
        f"{_rate(stats.tokens, stats.seconds):,.0f} tokens/s, "
        f"{_rate(stats.input_bytes / 1e6, stats.seconds):,.1f} MB/s",
    ]
    if not append_eod:
        lines.append("  no end-of-document token appended (--append-eod adds one per document)")
    if stats.skipped_count:
        noun = "line" if stats.skipped_count == 1 else "lines"
        lines.append(f"[yellow]  skipped {stats.skipped_count:,} {noun}:[/yellow]")
        lines += [f"    line {b.line}: {escape(b.reason)}" for b in stats.skipped[:SKIPPED_SHOWN]]
        if stats.skipped_count > SKIPPED_SHOWN:
            lines.append(f"    and {stats.skipped_count - SKIPPED_SHOWN:,} more")
    return "\n".join(lines)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so the half-written dataset is removed on the way out.
    raise KeyboardInterrupt


@data_app.command("preprocess")
def preprocess_command(
    input: Annotated[
        str, typer.Option("--input", help="JSONL file (.jsonl, .jsonl.gz, .jsonl.zst): path or URL.")
    ],
    output_prefix: Annotated[str, typer.Option("--output-prefix", help="Writes PREFIX.bin and PREFIX.idx.")],
    tokenizer: Annotated[
        str, typer.Option(help="byte | hf:PATH/tokenizer.json | tiktoken:NAME | sentencepiece:PATH.model")
    ] = "byte",
    tiktoken_ranks: Annotated[
        str | None, typer.Option(help="A .tiktoken ranks file for tiktoken:NAME (else tiktoken's cache).")
    ] = None,
    json_key: Annotated[str, typer.Option(help="The field holding each document's text.")] = "text",
    workers: Annotated[int, typer.Option(help="Tokenizing processes (0: in this process).")] = 1,
    append_eod: Annotated[bool, typer.Option("--append-eod", help="End every document with EOD.")] = False,
    split_sentences: Annotated[
        bool, typer.Option("--split-sentences", help="One sequence per sentence (BERT and T5 data).")
    ] = False,
    on_error: Annotated[
        str, typer.Option(help="A bad line (malformed, no key, empty): 'fail' stops, 'skip' goes on.")
    ] = "fail",
) -> None:
    """Tokenize a JSONL corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx)."""
    if on_error not in ("skip", "fail"):
        raise _fail(f"--on-error must be skip or fail, not {on_error!r}")
    if workers < 0:
        raise _fail(f"--workers must be 0 or more, not {workers}")
    if "://" in output_prefix:
        raise _fail(f"--output-prefix must be a local path, not {output_prefix!r}")
    console = _out()
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread: leave SIGTERM alone
        previous = None
    try:
        from megatrain.engine.data.preprocess import preprocess

        spec = tokenizer_spec(tokenizer, tiktoken_ranks)
        # No live bar when piped to a file or a CI log: only the summary is worth keeping there.
        live = Progress(
            *_progress_columns(), console=console, transient=True, disable=not console.is_terminal
        )
        with live as bar:
            task = bar.add_task("preprocess", total=None, docs="-", tokens="-", mb="-")

            def show(info: ProgressInfo) -> None:
                bar.update(
                    task,
                    completed=info.raw_bytes_read,
                    total=info.raw_bytes_total,
                    docs=f"{_rate(info.documents, info.seconds):,.0f}",
                    tokens=f"{_rate(info.tokens, info.seconds):,.0f}",
                    mb=f"{_rate(info.bytes_read / 1e6, info.seconds):,.1f}",
                )

            stats = preprocess(
                _url(input),
                Path(output_prefix).expanduser(),
                spec,
                json_key=json_key,
                workers=workers,
                append_eod=append_eod,
                on_error=on_error,  # type: ignore[arg-type]  # checked above
                progress=show,
                split_sentences=split_sentences,
            )
    except ValueError as exc:  # PreprocessError, CorpusError and tokenizer errors are ValueErrors
        raise _fail(str(exc)) from None
    except OSError as exc:  # the output folder cannot be written, the disk is full
        raise _fail(f"{exc.strerror or exc}: {exc.filename or output_prefix}") from None
    except KeyboardInterrupt:
        raise _fail("interrupted; nothing was written", 130) from None
    except Exception as exc:  # noqa: BLE001 - a worker killed, a connection lost: one line, no traceback
        raise _fail(f"preprocessing failed, nothing was written: {type(exc).__name__}: {exc}") from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    console.print(_summary(stats, output_prefix, append_eod, split_sentences))
