"""Checking an uploaded JSONL corpus while it streams in, on its way to storage (never to local disk).

What is cheap is checked here, line by line, so a bad upload is refused before anything is stored
or registered: every line (blank ones aside) a JSON object with a non-empty string under the key
(text) or a record of its format (api/datasets/records.py, each also written, in the engine's
shape, to a second object), valid UTF-8, no line longer than the cap, at least one document.
Tokenizing is the workers' job.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from megatrain.api.datasets.records import TEXT, RecordProblem, detect_format, engine_record
from megatrain.api.errors import FieldError

MAX_LINE_BYTES = 64 << 20
"""The longest document line an upload may hold (its text is parsed whole)."""
FIELD = "file"
"""The field upload errors name: the request's body, the JSONL file."""


def _problem(line: int, message: str) -> FieldError:
    return FieldError(FIELD, f"line {line}: {message}")


class JsonlCheck:
    """`feed` chunks of the body as they arrive, `finish` at its end; each complete line is checked
    and only then written on to `sink` (a storage writer), so what reaches it is checked lines."""

    def __init__(
        self, json_key: str, sink: BinaryIO, record_format: str | None = TEXT, records: BinaryIO | None = None
    ):
        """`record_format` None: the first record's keys decide (chat, prompt_completion or
        preference). A record format needs `records`, the sink of the engine-shaped records."""
        self.json_key = json_key
        self.record_format = record_format
        self.lines = 0
        self.documents = 0
        self.size = 0
        self._rest = b""  # the unfinished last line of what arrived so far
        self._sink = sink
        self._records = records

    def _check(self, raw: bytes) -> None:
        self.lines += 1
        n = self.lines
        if not raw.strip():
            return  # blank lines are skipped, as the workers' preprocessing skips them
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _problem(n, f"not valid UTF-8 at byte {exc.start}") from None
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise _problem(n, f"not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(obj, dict):
            raise _problem(n, f"expected a JSON object, got {type(obj).__name__}")
        if self.record_format != TEXT:
            self._record(n, obj)
            return
        if self.json_key not in obj:
            raise _problem(n, f"no field {self.json_key!r} (json_key)")
        value = obj[self.json_key]
        if not isinstance(value, str):
            raise _problem(n, f"field {self.json_key!r} must be a string, got {type(value).__name__}")
        if not value:
            raise _problem(n, f"field {self.json_key!r} is empty")
        self.documents += 1

    def _record(self, n: int, obj: dict[str, Any]) -> None:
        """Check a record of the file's format and write it on in the engine's shape."""
        assert self._records is not None, "a record format needs a sink for its records"
        try:
            if self.record_format is None:
                self.record_format = detect_format(obj)
            record = engine_record(self.record_format, obj)
        except RecordProblem as exc:
            where = f"{self.record_format} record: " if self.record_format else ""
            raise _problem(n, f"{where}{exc}") from None
        self._records.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        self.documents += 1

    def feed(self, chunk: bytes) -> None:
        """Check the complete lines in `chunk` (with what came before) and pass them on."""
        data = self._rest + chunk
        lines = data.split(b"\n")
        self._rest = lines.pop()
        if len(self._rest) > MAX_LINE_BYTES:
            raise _problem(self.lines + 1, f"longer than {MAX_LINE_BYTES} bytes")
        for raw in lines:
            if len(raw) > MAX_LINE_BYTES:
                raise _problem(self.lines + 1, f"longer than {MAX_LINE_BYTES} bytes")
            self._check(raw)
        written = len(data) - len(self._rest)
        self._sink.write(memoryview(data)[:written])
        self.size += written

    def finish(self) -> None:
        """The body has ended: check its last line (one without a final newline) and that it held
        a document; everything has then been written to the sink."""
        if self._rest.strip():
            self._check(self._rest)
            self._sink.write(self._rest + b"\n")
            self.size += len(self._rest) + 1
        self._rest = b""
        if self.documents == 0:
            raise FieldError(FIELD, "the file is empty: it holds no JSON lines")
