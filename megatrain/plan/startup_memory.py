"""The most a rank holds while it starts, before its first step (megatrain.plan.memory's startup_bytes).

Pure arithmetic on what engine.train.run does, in order (measured by megatrain.engine.dryrun):

1. build_model materialises the rank's shards in the training dtype, one parameter at a time, each
   filled from one fp32 block of initial values (or a checkpoint's slice: a few MiB, not counted);
2. make_trainable's cast is then a no-op; DataParallel, with the distributed optimizer, copies the
   weights into one flat parameter buffer (each original freed as it moves, but the buffer is
   allocated whole first: two copies at the peak), and then allocates the fp32 gradient buffer;
3. the optimizer copies the 16-bit parameters it owns into fp32 mains (its whole share, or its
   1/dp·cp with the distributed optimizer); Adam's moments come only with the first step, which the
   step's estimate covers.

A LoRA run's DataParallel and optimizer see only the trainable adapters: its flat parameter buffer,
gradient buffer and fp32 mains are the adapters' size, the frozen weights stay as built.

The start-up peak is the largest of these; it exceeds the step's model state only where that state
is sharded finely (the distributed optimizer over a large dp) and the activations are small.
"""

from __future__ import annotations


def startup_phases(
    n_params: float,
    *,
    param_bytes: float,
    owned_params: float,
    distributed_optimizer: bool,
    trainable: float | None = None,
    weight_bytes: float | None = None,
) -> dict[str, float]:
    """Bytes held at the peak of each start-up phase (module docstring) of a rank holding n_params,
    `trainable` of them trained (default: all), whose optimizer owns owned_params of those (all, or
    its dp·cp shard), in a dtype of param_bytes; weight_bytes: what the built weights take when it
    is not n_params·param_bytes (QLoRA's NF4 weights, quantised as each is built)."""
    trainable = n_params if trainable is None else trainable
    weights = param_bytes * n_params if weight_bytes is None else weight_bytes
    grads = 4.0 * trainable
    mains = 4.0 * owned_params if param_bytes != 4 else 0.0  # fp32 mains alias fp32 parameters
    return {
        "build": weights,
        "param_buffer": weights + param_bytes * trainable if distributed_optimizer else weights,
        "grad_buffer": weights + grads,
        "optimizer": weights + grads + mains,
    }


__all__ = ["startup_phases"]
