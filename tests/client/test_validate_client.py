"""`Client.validate` (POST /v1/spec/validate): every error of a spec in one ApiError."""

from __future__ import annotations

import pytest
from fixtures.live import LiveApi

from megatrain.client import ApiError, Client


def test_validate_raises_one_error_carrying_all_of_them(live_api: LiveApi) -> None:
    spec = live_api.spec("checked")
    spec["training"].update(global_batch_size=3, warmup_iters=99)  # two rules of one section
    spec["parallelism"] = {"tp": 0}
    spec["data"]["tokenizer"] = {"type": "hf", "path": "file:///etc/tokenizer.json"}
    with Client() as c:
        assert c.validate(live_api.spec("fine"))["valid"] is True
        with pytest.raises(ApiError) as ei:
            c.validate(spec)
        assert list(c.list_jobs()) == []  # validating submits nothing
    err = ei.value
    assert err.status == 422
    assert err.fields == [
        "parallelism.tp",
        "training.global_batch_size",
        "training.warmup_iters",
        "data.tokenizer.path",
    ], err.field_errors
    assert all(f in str(err) for f in err.fields)
