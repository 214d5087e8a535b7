"""This API process's ear for job changes: one PostgreSQL connection of its own, LISTENing on
db.notify's channel on a thread, waking the live-stream feeds of each job named (api/streams.py).

While it listens, a row reaches a stream within one query of its commit, and a feed polls only as a
fallback (slowly); while it does not (SQLite, or the connection lost and not yet back), the feeds
poll at their usual pace. A reconnect wakes every feed: what was notified in between is read then.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from sqlalchemy.engine import make_url

from megatrain.db.notify import CHANNEL

log = logging.getLogger("megatrain.api.notifications")

RECONNECT_S = (0.5, 1.0, 2.0, 5.0)
WAIT_S = 1.0
"""How long one wait for notifications lasts before the thread looks whether it should stop."""


class JobListener:
    """LISTEN on `database_url` (PostgreSQL) on a daemon thread; `on_job(job_id)` for each
    notification and `on_job(None)` after a (re)connect, both called from that thread."""

    def __init__(self, database_url: str, on_job: Callable[[str | None], None]):
        url = make_url(database_url)
        self.conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.on_job = on_job
        self.connected = False
        self._stop = threading.Event()
        # This listener's own channel: stop() notifies it so that the wait ends at once (else an
        # API's shutdown, and every test's, waits out WAIT_S).
        self._wake = f"megatrain_stop_{uuid.uuid4().hex}"
        self._thread = threading.Thread(target=self._run, daemon=True, name="job-listener")

    @staticmethod
    def supported(database_url: str) -> bool:
        return make_url(database_url).get_backend_name() == "postgresql"

    def start(self) -> JobListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.connected:
            try:
                import psycopg

                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=2) as conn:
                    conn.execute(f"NOTIFY {self._wake}")
            except Exception:  # the thread still stops within WAIT_S
                pass
        self._thread.join(timeout=WAIT_S + 2)

    def _run(self) -> None:
        import psycopg

        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    conn.execute(f"LISTEN {self._wake}")
                    self.connected, failures = True, 0
                    self.on_job(None)  # anything notified while not listening is read now
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=WAIT_S):
                            if note.channel == self._wake:
                                break
                            self.on_job(note.payload)
            except Exception as exc:  # a lost connection: poll meanwhile, listen again soon
                if self._stop.is_set():
                    break
                self.connected = False
                delay = RECONNECT_S[min(failures, len(RECONNECT_S) - 1)]
                failures += 1
                log.warning("job notifications lost (%s); feeds poll until they are back in %ss", exc, delay)
                self._stop.wait(delay)
        self.connected = False
