"""Tenant secrets at rest and in a job's output: Fernet encryption under the operator's key(s), and
the redaction of secret values from whatever a job writes that others read (log lines, events,
failure reasons).

A secret is stored encrypted (db.secrets.TenantSecret) and decrypted only when an attempt of a job
that names it (spec `secrets`) is claimed, into that attempt's engine environment; it never enters a
spec, an event, an API answer or a log line (the runner redacts its value from every line and event
before they are stored).
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterable
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from megatrain.secret_names import name_problem
from megatrain.settings import Settings

__all__ = ["Redactor", "SecretBox", "SecretsUnavailable", "name_problem"]

MIN_REDACTED = 4
"""Shorter values are not redacted (they would blank ordinary text)."""


class SecretsUnavailable(Exception):
    """No operator key: secrets cannot be stored or read here."""


def _key_file_key(settings: Settings) -> str:
    """The embedded default's key, made once (mode 0600; processes starting at once agree)."""
    path = settings.home / "secrets.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path.read_text().strip()
        key = Fernet.generate_key().decode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key


class SecretBox:
    """Encrypts with the first of the operator's keys, decrypts with any."""

    def __init__(self, keys: Iterable[str]):
        try:
            self._fernet = MultiFernet([Fernet(k.strip().encode()) for k in keys if k.strip()])
        except (ValueError, TypeError) as exc:
            raise SecretsUnavailable(f"MEGATRAIN_SECRETS_KEY is not a Fernet key: {exc}") from None

    @classmethod
    def from_settings(cls, settings: Settings) -> SecretBox:
        if settings.secrets_key:
            return cls(settings.secrets_key.split(","))
        if settings.resolved_database_url.startswith("sqlite"):
            return cls([_key_file_key(settings)])
        raise SecretsUnavailable("tenant secrets need the operator's key: set MEGATRAIN_SECRETS_KEY")

    def encrypt(self, value: str) -> str:
        return self._fernet.encrypt(value.encode()).decode()

    def decrypt(self, token: str) -> str:
        try:
            return self._fernet.decrypt(token.encode()).decode()
        except InvalidToken:
            raise SecretsUnavailable(
                "a stored secret does not decrypt under MEGATRAIN_SECRETS_KEY (was its key removed?)"
            ) from None


class Redactor:
    """Replaces each secret's value with [secret:NAME] in text and in JSON-like values."""

    def __init__(self, secrets: dict[str, str]):
        pairs = sorted(
            ((v, k) for k, v in secrets.items() if len(v) >= MIN_REDACTED), key=lambda p: -len(p[0])
        )
        self._pairs = pairs
        self._pattern = re.compile("|".join(re.escape(v) for v, _ in pairs)) if pairs else None
        self._names = dict(pairs)

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, text: str) -> str:
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(lambda m: f"[secret:{self._names[m.group(0)]}]", text)

    def value(self, obj: Any) -> Any:
        """`obj` (str, list, dict, other) with every string redacted."""
        if self._pattern is None:
            return obj
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, list):
            return [self.value(v) for v in obj]
        if isinstance(obj, dict):
            return {k: self.value(v) for k, v in obj.items()}
        return obj
