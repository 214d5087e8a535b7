"""What every config.json family reader shares (megatrain.hf_config and its BERT / T5 modules): the
error naming a config key, and reading a key that must be there or must hold a value we compute."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class HFConfigError(ValueError):
    """A config.json our model cannot reproduce; `key` names the offending config key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config.json {key}: {message}")


def require(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None:
        raise HFConfigError(key, "is missing")
    return value


def refuse(config: Mapping[str, Any], key: str, ok: Any, why: str) -> None:
    """A config value we cannot compute: `ok` is the one accepted value (or a tuple of them)."""
    value = config.get(key)
    accepted = ok if isinstance(ok, tuple) else (ok,)
    if value is not None and value not in accepted:
        raise HFConfigError(key, f"{value!r} is not supported ({why})")
