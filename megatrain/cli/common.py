"""What every `megatrain` command shares: the typer apps, the consoles, and the decorators that turn
errors into one red line (user errors) or one line naming the failure (server commands)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
import typer.core
from rich.console import Console
from rich.markup import escape

from megatrain.client import ApiError, ApiUnreachable, MegatrainError
from megatrain.settings import get_settings


def _flags_without_a_type() -> None:
    """Typer 0.29's rich help gives every flag a `<bool>` type column (`--help <bool>`), as if it
    took a value; a flag takes none, so show no type for it, as click's own help does."""
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if option is None or shown is None or getattr(shown, "_megatrain_flags", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich._megatrain_flags = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich


_flags_without_a_type()

app = typer.Typer(
    name="megatrain",
    help="Train transformers on the megatrain service: submit, follow, download.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="API keys (operator commands: they talk to the database directly).")
app.add_typer(keys_app, name="keys")
tenants_app = typer.Typer(help="Tenants (operator commands: they talk to the database directly).")
app.add_typer(tenants_app, name="tenants")

F = TypeVar("F", bound=Callable[..., Any])


def _out() -> Console:
    # Built per call: rich then writes to whatever sys.stdout is now (CliRunner swaps it).
    return Console(highlight=False, soft_wrap=True)


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(message: str, code: int = 1) -> typer.Exit:
    _err().print(f"[bold red]error:[/bold red] [red]{escape(message)}[/red]")
    return typer.Exit(code)


def _explain(exc: MegatrainError) -> str:
    """The error, plus what to do about it where that is not obvious."""
    if isinstance(exc, ApiUnreachable):
        return f"{exc}. Start the service with `megatrain up`, or point MEGATRAIN_API_URL at it."
    if isinstance(exc, ApiError) and exc.status == 401:
        return f"{exc}. {_key_advice(exc.sent_key or '')}"
    if isinstance(exc, ApiError) and exc.status == 422 and exc.field_errors:
        lines = "\n".join(f"  {e['field']}: {e['message']}" for e in exc.field_errors)
        return f"invalid job spec (HTTP 422):\n{lines}"
    return str(exc)


def _key_advice(sent_key: str) -> str:
    """What to do about a refused key, by where it came from (Client.sent_key)."""
    settings = get_settings()
    path, url = settings.credentials_path, settings.api_url
    if "from MEGATRAIN_API_KEY" in sent_key:
        return (
            f"The server at {url} does not know that key (revoked, or another server's): set "
            f"MEGATRAIN_API_KEY to one of its keys, or unset it to use the key in {path}."
        )
    if sent_key.startswith("sent the key"):
        return (
            f"The server at {url} does not know the key in {path}: it was started from another "
            "MEGATRAIN_HOME; set MEGATRAIN_API_KEY to one of its keys."
        )
    return f"Set MEGATRAIN_API_KEY, or start the embedded default (`megatrain up`), which writes {path}."


def _user_errors(fn: F) -> F:
    """Turn the SDK's errors into a red message and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MegatrainError as exc:
            raise _fail(_explain(exc)) from None
        except TimeoutError as exc:
            raise _fail(str(exc)) from None
        except KeyboardInterrupt:
            raise _fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]


def _still_running(job_id: str) -> typer.Exit:
    """Ctrl-C while following a job stops the following, not the job: say so, and how to go on."""
    _err().print(
        f"\nstopped following; job {job_id} keeps running. "
        f"Follow it again with `megatrain follow {job_id}` (or `megatrain logs {job_id} --follow`, "
        f"`megatrain metrics {job_id} --follow`); cancel it with `megatrain cancel {job_id}`.",
        markup=False,
    )
    return typer.Exit(130)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


STATUS_STYLE = {
    "queued": "yellow",
    "scheduled": "cyan",
    "running": "blue",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
}


def _status(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"


def _configure_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its per-plugin INFO lines are noise here


def _server_errors(fn: F) -> F:
    """Server commands: a missing component or a bad database URL is a message, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            return None
        except ImportError as exc:
            raise _fail(f"this installation lacks a component: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - operator commands report any failure in one line
            raise _fail(f"{type(exc).__name__}: {exc}") from None

    return wrapper  # type: ignore[return-value]
