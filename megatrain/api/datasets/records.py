"""Record formats of an uploaded JSONL file: each line checked and turned into the record the
engine's readers take (engine/data/finetune.py and preference.py), or refused with the reason.

- chat: OpenAI's {"messages": [{"role", "content", "weight"?}, ...]} → {"messages": [{"role", "content"}]}
- prompt_completion: {"prompt", "completion"} → {"prompt", "response"}
- preference: OpenAI's {"input": {"messages"}, "preferred_output", "non_preferred_output"}
  → TRL's {"messages", "chosen", "rejected"}

The engine trains on every assistant turn of a chat, so a `weight` of 0 is honoured where it is
exact, on the trailing assistant turns (they and what follows them are dropped: nothing after the
last trained turn changes its loss), and refused before a trained turn. Tools are refused by name:
the engine trains on plain text chats.
"""

from __future__ import annotations

from typing import Any

TEXT = "text"
RECORD_FORMATS = (TEXT, "chat", "prompt_completion", "preference")
"""text: documents under json_key (preprocessed into an index); the rest: records jobs read."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""OpenAI's roles as the chat templates know them (developer is OpenAI's newer name for system)."""
TOOL_FIELDS = ("tools", "functions")
TOOL_MESSAGE_FIELDS = ("tool_calls", "function_call")


class RecordProblem(ValueError):
    """Why one record is refused (the caller adds its line)."""


def detect_format(obj: dict[str, Any]) -> str:
    """The format of a record by its keys (the first record of an OpenAI upload decides)."""
    if "messages" in obj:
        return "chat"
    if "input" in obj and "preferred_output" in obj:
        return "preference"
    if "prompt" in obj and "completion" in obj:
        return "prompt_completion"
    raise RecordProblem(
        "not a fine-tuning record: expected 'messages' (chat), 'prompt' and 'completion', or "
        "'input', 'preferred_output' and 'non_preferred_output' (preference)"
    )


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RecordProblem(f"{where}.content[{j}]: only text parts are supported, not {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise RecordProblem(f"{where}.content must be a string or a list of text parts")


def _message(m: Any, where: str) -> dict[str, str]:
    if not isinstance(m, dict):
        raise RecordProblem(f"{where} must be a JSON object")
    role = m.get("role")
    if role in ("tool", "function"):
        raise RecordProblem(f"{where}: role {role!r} is not supported (tool calls are not trained on)")
    if role not in ROLES:
        raise RecordProblem(f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}")
    for field in TOOL_MESSAGE_FIELDS:
        if m.get(field):
            raise RecordProblem(f"{where}.{field} is not supported (tool calls are not trained on)")
    return {"role": ROLES[role], "content": _text(m.get("content"), where)}


def _no_tools(obj: dict[str, Any], where: str = "") -> None:
    for field in TOOL_FIELDS:
        if obj.get(field):
            raise RecordProblem(f"{where}{field!r} is not supported: the engine trains on plain chats")


def _weight(m: dict[str, Any], where: str) -> int:
    if "weight" not in m:
        return 1
    if m.get("role") != "assistant":
        raise RecordProblem(f"{where}.weight is for assistant messages only")
    weight = m["weight"]
    if isinstance(weight, bool) or weight not in (0, 1):
        raise RecordProblem(f"{where}.weight must be 0 or 1, not {weight!r}")
    return int(weight)


def _chat(obj: dict[str, Any]) -> dict[str, Any]:
    _no_tools(obj)
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RecordProblem("'messages' must be a non-empty list")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    weights = [_weight(m, f"messages[{i}]") for i, m in enumerate(raw)]
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and weights[i] == 1]
    if not trained:
        none = all(m["role"] != "assistant" for m in messages)
        why = "no assistant message" if none else "every assistant message has weight 0"
        raise RecordProblem(f"nothing to train on: {why}")
    last = trained[-1]
    skipped = [i for i, m in enumerate(messages[:last]) if m["role"] == "assistant" and i not in trained]
    if skipped:
        raise RecordProblem(
            f"messages[{skipped[0]}].weight=0 before a trained assistant message is not supported "
            "(the engine trains every assistant turn of a chat): split the chat there"
        )
    return {"messages": messages[: last + 1]}


def _prompt_completion(obj: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise RecordProblem("'prompt' and 'completion' must be strings")
    if not completion:
        raise RecordProblem("'completion' is empty: nothing to train on")
    return {"prompt": prompt, "response": completion}


def _outputs(value: Any, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RecordProblem(f"{field!r} must be a non-empty list of assistant messages")
    out = [_message(m, f"{field}[{i}]") for i, m in enumerate(value)]
    if any(m["role"] != "assistant" for m in out):
        raise RecordProblem(f"{field!r} must hold assistant messages only")
    return out


def _preference(obj: dict[str, Any]) -> dict[str, Any]:
    given = obj.get("input")
    if not isinstance(given, dict):
        raise RecordProblem("'input' must be an object holding 'messages'")
    _no_tools(given, "input.")
    raw = given.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RecordProblem("'input.messages' must be a non-empty list")
    prompt = [_message(m, f"input.messages[{i}]") for i, m in enumerate(raw)]
    chosen = _outputs(obj.get("preferred_output"), "preferred_output")
    rejected = _outputs(obj.get("non_preferred_output"), "non_preferred_output")
    return {"messages": prompt, "chosen": chosen, "rejected": rejected}


_CONVERT = {"chat": _chat, "prompt_completion": _prompt_completion, "preference": _preference}


def engine_record(record_format: str, obj: dict[str, Any]) -> dict[str, Any]:
    """The record in the engine's shape; RecordProblem saying why it cannot be one."""
    return _CONVERT[record_format](obj)


def job_kinds(record_format: str) -> tuple[str, ...]:
    """The job kinds that read a dataset of this format (text: every kind, from its index)."""
    if record_format == "preference":
        return ("dpo",)
    if record_format == TEXT:
        return ("pretrain", "finetune", "dpo")
    return ("finetune",)
