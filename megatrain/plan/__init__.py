"""Pure, torch-free planning at the bottom of the import graph: the parallel layout type and its
rules (`layout`), a pool's hardware facts (`pool`), the model's shapes and where its parameters sit
(`shapes`), the analytical per-rank memory estimate (`memory`, MoE layers' part in `moe_memory`), the
FLOPs formula (`flops`), collective times on the pool's links (`links`), the step-time model
(`cost`) and the layout planner that puts them together (`planner`: the fastest layout that fits,
pruned by the memory lower bounds in `bounds`).

The API, the scheduler, the worker and the engine all import from here; nothing here imports any
of them (nor torch), so a laptop, an API server and a GPU rank agree on one layout.
"""
