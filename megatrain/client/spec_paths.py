"""Data paths written relative to a spec file, made absolute `file:///` URLs before submission.

The API takes only absolute URLs (file:///abs/path, s3://bucket/key): it runs elsewhere and has
no notion of the submitter's working directory. A spec *file*, though, has a folder, so
`path: data/chat.jsonl` in examples/finetune_hf_chat.yaml can mean "beside this file" whatever
directory `megatrain submit` runs from. Only paths without a scheme are touched; URLs, registered
dataset names and built-in chat-template names pass through unchanged.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Tokenizer shorthands whose rest is a file (`hf:tokenizer.json`); tiktoken:NAME names an encoding.
_TOKENIZER_FILE_KINDS = ("hf", "sentencepiece")


def _file_url(path: str, base: Path) -> str:
    """`path` as file:///abs (joined to `base` when relative, `..` folded), or a URL as it is."""
    if _SCHEME.match(path):
        return path
    # normpath, not resolve(): the server resolves symlinks itself when it checks data access.
    return Path(os.path.normpath(base / os.path.expanduser(path))).as_uri()


def _tokenizer(value: Any, base: Path) -> Any:
    if isinstance(value, dict) and isinstance(value.get("path"), str) and value["path"]:
        return {**value, "path": _file_url(value["path"], base)}
    if isinstance(value, str):
        kind, sep, rest = value.partition(":")
        if sep and kind in _TOKENIZER_FILE_KINDS and rest:
            return f"{kind}:{_file_url(rest, base)}"
    return value


def resolve_spec_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of the raw spec `data` with `data.train[].path` (and data.valid's),
    `data.tokenizer(.path)`, a `data.chat_template` file (*.json) and the task files of `eval.tasks`
    and `training.eval_tasks` that have no scheme resolved against `base` (the spec file's folder)
    into file:///abs URLs. Anything malformed is left for the server to name."""
    for block, key in (("eval", "tasks"), ("training", "eval_tasks")):
        part = data.get(block)
        if isinstance(part, dict) and isinstance(part.get(key), list):
            tasks = [_file_url(t, base) if isinstance(t, str) and t else t for t in part[key]]
            data = {**data, block: {**part, key: tasks}}
    section = data.get("data")
    if not isinstance(section, dict):
        return data
    section = dict(section)
    for part in ("train", "valid"):
        sources = section.get(part)
        if isinstance(sources, list):
            section[part] = [
                {**src, "path": _file_url(src["path"], base)}
                if isinstance(src, dict) and isinstance(src.get("path"), str) and src["path"]
                else src
                for src in sources
            ]
    if "tokenizer" in section:
        section["tokenizer"] = _tokenizer(section["tokenizer"], base)
    template = section.get("chat_template")
    if isinstance(template, str) and template.endswith(".json"):
        section["chat_template"] = _file_url(template, base)
    return {**data, "data": section}
