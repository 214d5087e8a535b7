"""megatrain: a Megatron-LM-class parallel transformer trainer and the control plane around it.

Importing the package must stay cheap and torch-free: the API, scheduler, SDK and CLI import it.
"""

from pathlib import Path

__version__ = "0.1.0"

# The repository root: migrations/ and web/ live beside the package (DESIGN.md's layout).
REPO_ROOT = Path(__file__).resolve().parent.parent
