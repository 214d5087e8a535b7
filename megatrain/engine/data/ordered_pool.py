"""An ordered, bounded process pool: `map` a function over items in N spawned processes and get the
results back in input order, with at most `in_flight` items between the two sides.

Why not concurrent.futures or multiprocessing.Pool: both read results through one pipe whose write
end the parent holds as well, so a worker that dies while sending a result (killed for memory, a
SIGTERM to the process group) leaves the reader waiting for the rest of the message forever, and
multiprocessing.Pool also loses the dead worker's task and waits for it. Here each worker has its
own two pipes and the parent keeps only its ends: a dead worker is an EOF, reported as WorkerDied.

Item i goes to worker i % N, which answers in order, so the parent reads result i from that worker's
pipe. A thread in each worker drains its task pipe, so the parent's sends never wait on a worker
that is itself blocked sending a result (which would deadlock the two once both pipes are full).
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class WorkerDied(RuntimeError):
    """A worker process exited before answering (killed, out of memory, crashed)."""


class WorkerFailed(RuntimeError):
    """The function raised in a worker; the message carries its traceback."""


def _worker_main(tasks: Connection, results: Connection, factory: Callable[..., Any], args: tuple) -> None:
    # Ctrl-C reaches the whole process group; the parent decides what happens, the workers stay quiet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def drain() -> None:
        try:
            while True:
                inbox.put(tasks.recv())
        except (EOFError, OSError):  # the parent closed its end or died
            inbox.put(None)

    threading.Thread(target=drain, daemon=True).start()
    try:
        fn = factory(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.send(("error", traceback.format_exc()))
        return
    while (item := inbox.get()) is not None:
        try:
            answer = ("ok", fn(item))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            answer = ("error", traceback.format_exc())
        try:
            results.send(answer)
        except OSError:  # the parent is gone
            return


class OrderedPool(Generic[T, R]):
    """`workers` spawned processes, each running `factory(*args)` once to build the function it
    applies to every item it gets. Use as a context manager: a clean exit stops the workers after
    their last item; an exception (Ctrl-C included) kills them at once."""

    def __init__(self, workers: int, factory: Callable[..., Callable[[T], R]], args: tuple = ()):
        if workers < 1:
            raise ValueError(f"an OrderedPool needs at least one worker, not {workers}")
        # spawn, not fork: a forked child would inherit locks held by the parent's other threads.
        ctx = multiprocessing.get_context("spawn")
        self._processes: list[Any] = []
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        try:
            for _ in range(workers):
                task_reader, task_writer = ctx.Pipe(duplex=False)
                result_reader, result_writer = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=_worker_main, args=(task_reader, result_writer, factory, args), daemon=True
                )
                process.start()
                # Only the worker may hold these ends: its death must read as EOF here.
                task_reader.close()
                result_writer.close()
                self._processes.append(process)
                self._tasks.append(task_writer)
                self._results.append(result_reader)
        except BaseException:
            self.kill()
            raise

    def map(self, items: Iterable[T], in_flight: int) -> Iterator[R]:
        """fn(item) for every item, in order; at most `in_flight` items sent but not yet yielded."""
        workers = len(self._processes)
        pending: deque[int] = deque()  # the worker holding each item in flight, oldest first
        for index, item in enumerate(items):
            worker = index % workers
            self._send(worker, item)
            pending.append(worker)
            if len(pending) >= max(in_flight, 1):
                yield self._receive(pending.popleft())
        while pending:
            yield self._receive(pending.popleft())

    def _send(self, worker: int, item: T) -> None:
        try:
            self._tasks[worker].send(item)
        except OSError:
            raise self._died(worker) from None

    def _receive(self, worker: int) -> R:
        try:
            status, value = self._results[worker].recv()
        except (EOFError, OSError):
            raise self._died(worker) from None
        if status == "error":
            raise WorkerFailed(f"in worker process {self._processes[worker].pid}:\n{value}")
        return value  # type: ignore[no-any-return]

    def _died(self, worker: int) -> WorkerDied:
        process = self._processes[worker]
        process.join(timeout=1.0)
        code = process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return WorkerDied(f"worker process {process.pid} died ({how}); out of memory?")

    def close(self) -> None:
        """Tell every worker to stop after its queue, then wait for it."""
        for conn in self._tasks:
            conn.close()  # the worker's drain thread reads EOF and ends its loop
        for process in self._processes:
            process.join(timeout=30)
        self.kill()

    def kill(self) -> None:
        """Stop every worker now (SIGKILL: safe here, see the module docstring)."""
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join()
        for conn in (*self._tasks, *self._results):
            conn.close()

    def __enter__(self) -> OrderedPool[T, R]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.kill()
