"""The Cluster page in a real headless Chromium: a pool's described hardware (accelerator, memory
per device, peak TFLOP/s, bandwidths) and a lost node shown as lost, its slots not offered.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from fixtures.live import LiveApi
from sqlalchemy import select
from web_helpers import signed_in_page

from megatrain.db.models import Node, NodePool, utcnow
from megatrain.db.session import session_scope
from megatrain.plan.pool import PoolSpec
from megatrain.scheduler.placement import rule_items, rule_summary
from megatrain.scheduler.pools import apply_pool

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def test_cluster_page_shows_pool_hardware_and_lost_nodes(
    live_api: LiveApi, browser_context: Any, page_errors: list[str]
) -> None:
    spec = PoolSpec(
        name="h100",
        accelerator="NVIDIA H100 80GB HBM3",
        device_memory_bytes=80 << 30,
        peak_tflops={"bf16": 989.4, "fp8": 1979.0},
        devices_per_node=8,
        nodes=2,
        intra_node_bandwidth_gbps=450,
        inter_node_bandwidth_gbps=50,
    )
    with session_scope(live_api.settings.resolved_database_url) as s:
        apply_pool(s, spec)
        pool_id = s.scalar(select(NodePool.id).where(NodePool.name == "h100"))
        s.add(Node(pool_id=pool_id, hostname="gpu-1", slots_total=8))
        gone = utcnow() - timedelta(minutes=3)
        s.add(Node(pool_id=pool_id, hostname="gpu-2", slots_total=8, status="lost", last_seen_at=gone))

    page = signed_in_page(browser_context, page_errors, live_api.url, live_api.key, "/cluster")
    card = page.locator("section[data-pool='h100']")
    card.locator("dl.hardware").wait_for()
    facts = card.locator("dl.hardware").inner_text()
    for text in ("NVIDIA H100 80GB HBM3", "80.0 GiB", "bf16 989.4, fp8 1979", "8 per node × 2 nodes"):
        assert text in facts, facts
    assert "450 GB/s" in facts and "50 GB/s" in facts and "the operator" in facts
    assert "0 busy · 8 free · 8 GPUs" in card.inner_text()  # the lost node's 8 are not offered
    assert "1 node lost" in card.inner_text()
    lost = card.locator("[data-node='gpu-2']")
    assert lost.get_attribute("data-status") == "lost"
    assert lost.locator(".badge.failed").inner_text().lower() == "lost"
    assert "no heartbeat since" in lost.inner_text() and lost.locator(".slots").count() == 0
    assert card.locator("[data-node='gpu-1'] .slots .slot").count() == 8
    assert page_errors == []


def test_cluster_page_states_the_placement_rule_in_the_schedulers_words(
    live_api: LiveApi, browser_context: Any, page_errors: list[str]
) -> None:
    page = signed_in_page(browser_context, page_errors, live_api.url, live_api.key, "/cluster")
    page.wait_for_selector("#scheduling-order:not(:empty)")
    sub = page.locator(".page-head .sub").inner_text()
    # Fair share and backfill, as megatrain/scheduler/placement.py's docstring says: not "no backfill".
    assert f"scheduling order: {rule_summary()}." in sub, sub
    assert "fair share" in sub and "backfill" in sub and "no backfill" not in sub
    rules = page.locator("#scheduling-rules")
    rules.locator("summary").click()
    items = rules.locator("li").all_inner_texts()
    assert [i.split(".")[0] + "." for i in items] == [r.title.split(".")[0] + "." for r in rule_items()]
    assert "never delays the head" in items[-1]
    assert page_errors == []
