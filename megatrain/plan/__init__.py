"""Pure, torch-free planning at the bottom of the import graph: the parallel layout type and its
rules (`layout`), and the analytical per-rank memory estimate (`memory`).

The API, the scheduler, the worker and the engine all import from here; nothing here imports any
of them (nor torch), so a laptop, an API server and a GPU rank agree on one layout.
"""
