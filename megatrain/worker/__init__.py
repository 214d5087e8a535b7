"""Executors (local subprocesses, Celery on Redis), the shard runner, its heartbeats, and node
registration.

Only this package knows which executor runs a job; the scheduler calls `get_executor(settings)` and
the `Executor` interface. It imports nothing from the scheduler or the API.
"""
