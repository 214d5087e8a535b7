"""Executors (local subprocesses, Celery on Redis), the shard runner and its heartbeats.

Only this package knows which executor runs a job; the scheduler calls `get_executor(settings)`.
"""
