"""What every section of a spec shares: strict models (unknown fields are errors), a rule's error
shape, and the name pattern of jobs, pools, datasets and tenants."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from megatrain.spec_errors import Problem

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
"""Job, pool and dataset names: what a URL path, a file name and a Slurm job name all accept."""


class Strict(BaseModel):
    """A spec section: an unknown field is an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def rule(field: str, message: str) -> Problem:
    """A broken cross-field rule, as spec_errors reports it."""
    return {"field": field, "message": message}
