"""What may name a tenant secret: the environment variable it becomes in a job's processes, never one
the runtime sets or reads itself (shared by the spec's `secrets` and /v1/secrets)."""

from __future__ import annotations

import re

SECRET_NAME = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")
"""A secret's name is the environment variable it becomes in the job's processes."""
RESERVED = re.compile(
    r"^(MEGATRAIN_|CUDA_|NCCL_|TORCH|PYTHON|LD_|OMP_|MASTER_|SLURM_|CELERY_|AWS_|GLOO_)"
    r"|^(PATH|HOME|USER|SHELL|RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|HOSTNAME)$"
)
"""Names the runtime sets or reads itself: a secret may not replace them."""


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a secret's name, or None."""
    if not SECRET_NAME.match(name):
        return (
            "a secret's name is an environment variable: A-Z, 0-9 and _, starting with a letter, at most 64"
        )
    if RESERVED.match(name):
        return f"{name} is set by megatrain or the runtime itself and cannot be a secret"
    return None


def check_secret_names(names: list[str]) -> list[str]:
    """`names` (a spec's `secrets`), or ValueError for a bad or repeated one."""
    for name in names:
        problem = name_problem(name)
        if problem:
            raise ValueError(problem)
    if len(set(names)) != len(names):
        raise ValueError("each secret is named once")
    return names
