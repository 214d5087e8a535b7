"""Following a background task the API started (an export, a sample) until it is done."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from megatrain.client.errors import MegatrainError

T = TypeVar("T")


class TaskFailed(MegatrainError):
    """Background work on a checkpoint (an export, a sample) failed; `item.error` says why."""

    def __init__(self, item: Any, noun: str):
        self.item = item
        super().__init__(f"{noun} {item.id} of step {item.step} failed: {item.error}")


def poll_until_done(
    fetch: Callable[[], T],
    failed: Callable[[T], Exception],
    *,
    what: str,
    timeout_s: float | None,
    poll_interval_s: float,
) -> T:
    """`fetch()` until its `status` is ready (returned) or failed (`failed(it)` raised); TimeoutError
    past timeout_s (None: wait for ever). `what` names the task in the timeout's message."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        item: Any = fetch()
        if item.status == "ready":
            return item
        if item.status == "failed":
            raise failed(item)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{what} still {item.status} after {timeout_s:g} s")
        time.sleep(poll_interval_s)
