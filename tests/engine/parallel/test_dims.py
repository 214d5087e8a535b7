"""ParallelDims: Megatron's rank order and the layout rules, as pure functions."""

from __future__ import annotations

import pytest

from megatrain.engine.parallel.dims import LayoutError, ParallelDims, validate_dims
from megatrain.engine.parallel.state import ParallelState


def test_rank_order_is_tp_fastest_then_cp_dp_pp() -> None:
    d = ParallelDims(tp=2, cp=1, dp=2, pp=2)
    assert d.world_size == 8
    assert [tuple(vars(d.coords(r)).values()) for r in range(4)] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0)
    ]  # fmt: skip
    assert d.coords(5).pp == 1 and d.coords(5).tp == 1 and d.coords(5).dp == 0
    for r in range(8):
        c = d.coords(r)
        assert d.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == r


def test_groups_partition_the_world() -> None:
    d = ParallelDims(tp=2, cp=2, dp=2, pp=2)
    assert d.group_ranks("tp")[0] == [0, 1]
    assert d.group_ranks("cp")[0] == [0, 2]
    assert d.group_ranks("dp")[0] == [0, 4]
    assert d.group_ranks("pp")[0] == [0, 8]
    assert d.group_ranks("tp", "pp")[0] == [0, 1, 8, 9]
    for dims in (("tp",), ("cp",), ("dp",), ("pp",), ("tp", "pp")):
        groups = d.group_ranks(*dims)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(16)), dims
        size = 1
        for name in dims:
            size *= d.size(name)
        assert {len(g) for g in groups} == {size}
    with pytest.raises(LayoutError, match="unknown dimensions"):
        d.group_ranks("ep")


def test_validation_names_every_broken_rule() -> None:
    with pytest.raises(LayoutError) as ei:
        validate_dims(
            ParallelDims(tp=4, dp=2), 6, num_attention_heads=6, num_query_groups=2, vocab_size=258
        )
    msg = str(ei.value)
    assert "tp×cp×dp×pp = 4×1×2×1 = 8 but the world has 6 processes" in msg
    assert "num_attention_heads=6 is not divisible by tp=4" in msg
    assert "num_query_groups=2 is not divisible by tp=4" in msg
    assert "vocab_size=258 is not divisible by tp=4" in msg
    with pytest.raises(LayoutError, match="seq_length=30 is not divisible by tp=4"):
        validate_dims(ParallelDims(tp=4, sequence_parallel=True), 4, seq_length=30)
    with pytest.raises(LayoutError, match="num_layers=6 is not divisible by pp×virtual_stages=4×1"):
        validate_dims(ParallelDims(pp=4), 4, num_layers=6)
    validate_dims(ParallelDims(tp=2, dp=2), 4, num_attention_heads=4, num_query_groups=2, vocab_size=256)


def test_bad_degrees_and_single_process_state() -> None:
    with pytest.raises(LayoutError, match="tp=0"):
        ParallelDims(tp=0)
    assert ParallelDims(tp=1, sequence_parallel=True).sequence_parallel is False
    s = ParallelState.single()
    assert s.tp_size == s.dp_size == s.pp_size == 1 and s.tp_group is None and s.group("mp") is None
    assert ParallelState.build(ParallelDims()).rank == 0
    with pytest.raises(LayoutError, match="needs 2 processes"):
        ParallelState.build(ParallelDims(dp=2))
