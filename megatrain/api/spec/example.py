"""A ready-to-submit example spec whose data exists: the Submit page's template.

The data is the tenant's newest ready dataset, else a shared one, else the demo corpus if this
server's storage holds it (`megatrain demo` builds it there); otherwise there is no example, and
the answer says how to get data. Never a placeholder path that fails at submission.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.api.registry import visible
from megatrain.db.models import READY, Dataset, Tenant
from megatrain.demo import CORPUS_NAME
from megatrain.settings import Settings
from megatrain.storage import StorageError, open_store

DEMO_CORPUS_KEY = f"datasets/python-stdlib/{CORPUS_NAME}"
"""Where `megatrain demo` stores its corpus in the server's storage (megatrain.cli.demo)."""

NO_DATA_HINT = (
    "No training data yet: register a dataset (Datasets page, or `megatrain datasets create`), "
    "or run `megatrain demo` once to build the demo corpus."
)


def _spec(name: str, source: dict[str, Any], tokenizer: dict[str, Any]) -> dict[str, Any]:
    """A small Llama that trains in minutes on a CPU; precision and layout left to auto."""
    return {
        "name": name,
        "model": {
            "arch": "llama",
            "num_layers": 4,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "seq_length": 128,
        },
        "data": {"tokenizer": tokenizer, "train": [source], "split": "98,2,0"},
        "training": {
            "train_iters": 200,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "warmup_iters": 20,
        },
        "resources": {"devices": 1, "pool": "default", "priority": 0},
    }


def example_spec(session: Session, settings: Settings, tenant: Tenant) -> dict[str, Any]:
    """{"spec": a spec or None, "source": "dataset" | "demo" | None, "hint": text}."""
    rows = session.scalars(
        select(Dataset)
        .where(visible(Dataset, tenant), Dataset.state == READY)
        .order_by(Dataset.created_at.desc())
    ).all()
    own = [d for d in rows if d.tenant_id == tenant.id]
    if rows:
        ds = (own or rows)[0]
        return {
            "spec": _spec(f"{ds.name}-llama", {"dataset": ds.name}, ds.tokenizer),
            "source": "dataset",
            "hint": f"Trains on the dataset {ds.name!r}{' (shared)' if ds.tenant_id is None else ''}.",
        }
    store = open_store(settings.resolved_storage_url, settings.s3_endpoint_url)
    try:
        built = store.exists(DEMO_CORPUS_KEY)
    except (OSError, StorageError):  # storage unreachable: no example rather than a failed page
        built = False
    if built:
        url = f"{store.url}/{DEMO_CORPUS_KEY}"
        return {
            "spec": _spec("stdlib-llama", {"path": url}, {"type": "byte"}),
            "source": "demo",
            "hint": "Trains on the demo corpus (Python standard library sources) `megatrain demo` built.",
        }
    return {"spec": None, "source": None, "hint": NO_DATA_HINT}
