"""What a node reports it can import (megatrain.spec_packages.installed_packages), read without
importing torch, and stored on its row when it registers."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from megatrain.db.models import Node
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.spec_packages import installed_packages
from megatrain.worker.nodes import ensure_local_pool


def test_installed_packages_name_versions_and_torchs_cuda() -> None:
    found = installed_packages()
    assert found["torch"] == importlib.metadata.version("torch")
    assert found.get("cuda") == torch.version.cuda  # absent for a CPU build
    assert "flash_attn" not in found or importlib.metadata.version("flash-attn") == found["flash_attn"]


def test_reading_them_does_not_import_torch() -> None:
    code = "import sys; from megatrain.spec_packages import installed_packages as f; f(); "
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_registering_node_stores_them(settings: Settings) -> None:
    with session_scope(settings.resolved_database_url) as s:
        node = ensure_local_pool(s, settings)
        s.commit()
        stored = s.get(Node, node.id)
        assert stored is not None and stored.packages == installed_packages()
