"""The most a rank holds while it starts, before its first step (megatrain.plan.memory's startup_bytes).

Pure arithmetic on what engine.train.run does, in order (measured by megatrain.engine.dryrun):

1. build_model materialises the rank's shards in fp32 (train.run passes no dtype: BUILD_BYTES), one
   parameter at a time, filling each from one fp32 block of initial values (a few MiB, not counted);
2. make_trainable casts them to the training dtype, one parameter at a time: the fp32 copies plus
   the cast of the largest parameter;
3. DataParallel allocates the fp32 gradient buffer and, with the distributed optimizer, a flat
   parameter buffer the parameters are copied into (the old parameters are freed as each is
   re-pointed, so both copies exist at the peak);
4. the optimizer copies the 16-bit parameters it owns into fp32 mains (its whole share, or 1/dp·cp
   of it with the distributed optimizer); Adam's moments come only with the first step, which the
   step's estimate covers.

The start-up peak is the largest of these; it exceeds the step's model state when the distributed
optimizer shards that state finely (large dp) and the activations are small.
"""

from __future__ import annotations

BUILD_BYTES = 4
"""Bytes per parameter build_model materialises (fp32: engine.train.run calls it without a dtype)."""


def startup_phases(
    n_params: float,
    largest_param: float,
    *,
    param_bytes: float,
    owned_params: float,
    distributed_optimizer: bool,
) -> dict[str, float]:
    """Bytes held at the peak of each start-up phase (module docstring) of a rank holding n_params,
    whose optimizer owns owned_params of them (all, or its dp·cp shard), in a dtype of param_bytes."""
    cast = param_bytes * largest_param if param_bytes != BUILD_BYTES else 0.0
    grads = 4.0 * n_params
    flat = param_bytes * n_params if distributed_optimizer else 0.0
    mains = 4.0 * owned_params if param_bytes != 4 else 0.0  # fp32 mains alias fp32 parameters
    return {
        "build": BUILD_BYTES * n_params + cast,
        "data_parallel": param_bytes * n_params + grads + flat,
        "optimizer": param_bytes * n_params + grads + mains,
    }


__all__ = ["BUILD_BYTES", "startup_phases"]
