"""JSONL documents ({"text": ...} per line), plain, .gz or .zst, from file:// or s3:// URLs, read
into a list of strings: the in-memory path of small corpora. Large ones go through `preprocess`."""

from __future__ import annotations

from collections.abc import Iterator

from megatrain.engine.data.corpus import document_text, open_corpus, split_lines


def iter_jsonl_texts(url: str, text_key: str = "text") -> Iterator[str]:
    """Every line's `text_key` string, in file order, streamed; blank lines are skipped. A bad line
    is a ValueError reading "URL:LINE: problem"."""
    with open_corpus(url) as reader:
        for chunk in reader.chunks():
            for lineno, line in split_lines(chunk):
                if not line.strip():
                    continue
                try:
                    yield document_text(line, text_key)
                except ValueError as exc:
                    raise ValueError(f"{url}:{lineno}: {exc}") from None


def read_jsonl_texts(url: str, text_key: str = "text") -> list[str]:
    """Every line's `text_key` string, in file order; blank lines are skipped."""
    return list(iter_jsonl_texts(url, text_key))
