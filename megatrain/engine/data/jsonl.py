"""JSONL documents ({"text": ...} per line), plain or .gz, from file:// or s3:// URLs."""

from __future__ import annotations

import gzip
import io
import json

from megatrain.storage import read_url


def read_jsonl_texts(url: str, text_key: str = "text") -> list[str]:
    """Every line's `text_key` string, in file order; blank lines are skipped."""
    texts: list[str] = []
    with read_url(url) as raw:
        stream = gzip.GzipFile(fileobj=raw) if url.endswith(".gz") else raw
        lines = io.TextIOWrapper(stream, encoding="utf-8")
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{url}:{lineno}: not valid JSON ({exc.msg})") from None
            text = obj.get(text_key) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{url}:{lineno}: no string field {text_key!r}")
            texts.append(text)
        lines.close()  # closes the stream (and raw) too; unclosed, the wrapper warns when collected
    return texts
