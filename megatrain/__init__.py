"""megatrain: a Megatron-LM-class parallel transformer trainer and the control plane around it.

Importing the package must stay cheap and torch-free: the API, scheduler, SDK and CLI import it.
"""

import sys
import sysconfig
from pathlib import Path

__version__ = "0.1.0"

# The repository root: migrations/ and web/ live beside the package (DESIGN.md's layout).
REPO_ROOT = Path(__file__).resolve().parent.parent


def resource_dir(name: str) -> Path:
    """`web` or `migrations`: beside the package in a checkout (and an editable install), else
    where a wheel's data files put them ({prefix}/share/megatrain/NAME); the checkout's path when
    neither exists (callers report it)."""
    local = REPO_ROOT / name
    if local.is_dir():
        return local
    for prefix in (sys.prefix, sysconfig.get_path("data"), sysconfig.get_config_var("userbase") or ""):
        candidate = Path(prefix) / "share" / "megatrain" / name
        if candidate.is_dir():
            return candidate
    return local
