"""Pipeline schedules and stage partitioning as pure functions: orders, constraints, simulated bubbles."""

from __future__ import annotations

import pytest
import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.pipeline import build_stage_modules, stage_parameter_names
from megatrain.engine.parallel.schedules import (
    Action,
    ScheduleError,
    check_schedule,
    schedule_actions,
    simulate,
    theoretical_bubble,
)
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout, LayoutError
from megatrain.plan.memory import chunks_in_flight, estimate_memory, layers_on_stage


def test_chunk_layers_agree_with_the_estimate_and_stages_check_the_rules() -> None:
    assert Layout(pp=2).chunk_layers(8) == [(0, 4), (4, 8)]
    assert Layout(pp=2, pipeline_layers=(1, 4)).chunk_layers(5) == [(0, 1), (1, 5)]
    # The even split agrees with the memory estimate's model of the stages.
    assert [b - a for a, b in Layout(pp=4).chunk_layers(12)] == [layers_on_stage(12, 4, s) for s in range(4)]
    model = GPTModel(_cfg(tie=False))  # 4 layers cannot make 2×3 chunks
    with pytest.raises(
        LayoutError, match="num_layers=4 is not divisible by parallelism.pp×virtual_stages=2×3"
    ):
        build_stage_modules(model, _stage_state(2, 0, v=3))


def test_one_f_one_b_orders() -> None:
    # pp=4, M=6: stage 0 warms up with 3 forwards; the last stage alternates from the start.
    s0 = schedule_actions("1f1b", 4, 0, 6)
    assert "".join(a.kind for a in s0) == "FFF" + "FB" * 3 + "BBB"
    s3 = schedule_actions("1f1b", 4, 3, 6)
    assert [a.kind for a in s3] == list("FB" * 6)
    for stage in range(4):
        acts = schedule_actions("1f1b", 4, stage, 6)
        assert sorted(acts) == sorted(
            [Action("F", 0, m) for m in range(6)] + [Action("B", 0, m) for m in range(6)]
        )
        # Micro-batches go forward and backward in order.
        assert [a.microbatch for a in acts if a.kind == "F"] == list(range(6))
        assert [a.microbatch for a in acts if a.kind == "B"] == list(range(6))


def test_interleaved_order_covers_every_chunk_once() -> None:
    acts = schedule_actions("1f1b", 2, 0, 4, 2)
    fwd = [(a.chunk, a.microbatch) for a in acts if a.kind == "F"]
    # Groups of pp micro-batches per chunk: mb 0,1 on chunk 0, then on chunk 1, then mb 2,3 ...
    assert fwd == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    bwd = [(a.chunk, a.microbatch) for a in acts if a.kind == "B"]
    assert bwd == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("v", [1, 2])
def test_simulated_bubble_equals_theory(pp: int, m: int, v: int) -> None:
    """With equal stages and free communication the schedules reach the textbook bubble exactly."""
    sim = simulate("1f1b", pp, m, v, forward_time=1.0, backward_time=2.0)
    assert sim.bubble_fraction == pytest.approx(theoretical_bubble(pp, m, v), rel=1e-9)
    assert theoretical_bubble(pp, m, 1) == pytest.approx((pp - 1) / (m + pp - 1))
    gpipe = simulate("all_forward_all_backward", pp, m, v)
    assert gpipe.bubble_fraction == pytest.approx(sim.bubble_fraction)
    # 1F1B's point: the first stage holds at most pp micro-batches, GPipe all of them.
    assert gpipe.peak_in_flight[0] == m * v
    if v == 1:
        assert sim.peak_in_flight == tuple(min(pp - s, m) for s in range(pp))


def test_constraints_are_explained() -> None:
    with pytest.raises(ScheduleError, match=r"micro-batches per step \(6 = .*divisible by pp=4"):
        check_schedule("1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match="virtual_stages > 1 needs pp > 1"):
        check_schedule("1f1b", 1, 4, 2)
    with pytest.raises(ScheduleError, match="pipeline_schedule='zb' is not one of"):
        check_schedule("zb", 2, 4)
    check_schedule("1f1b", 4, 6)  # plain 1F1B takes any number of micro-batches


def _cfg(tie: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                             ffn_hidden_size=32, seq_length=8, vocab_size=32, tie_embeddings=tie,
                             position_embedding="learned" if tie else "rope")  # fmt: skip


def _stage_state(pp: int, stage: int, v: int = 1) -> ParallelState:
    dims = Layout(pp=pp, virtual_stages=v)
    return ParallelState(dims, dims.rank_of(pp=stage), torch.device("cpu"),
                         {d: None for d in ("tp", "cp", "dp", "pp", "mp")})  # fmt: skip


def test_stages_compose_to_the_full_model() -> None:
    """Chunks run one after another give the single model's logits; names stay single-device."""
    torch.manual_seed(0)
    model = GPTModel(_cfg(tie=True))
    tokens = torch.randint(0, 32, (2, 8))
    want = model(tokens)
    names = []
    x = tokens
    chunks = {}
    for stage in range(2):
        torch.manual_seed(0)
        chunks[stage] = build_stage_modules(GPTModel(_cfg(tie=True)), _stage_state(2, stage, 2))
    for c in range(4):  # chunk c on stage c % pp, local index c // pp
        x = chunks[c % 2][c // 2](x)
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    for stage in range(2):
        names += list(stage_parameter_names(chunks[stage]).values())
    assert chunks[0][0].embed.weight is not chunks[1][1].lm_head.weight  # untied copy on the last stage
    assert getattr(chunks[1][1].lm_head.weight, "shared", False)
    assert sorted(set(names)) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("schedule", ["1f1b", "all_forward_all_backward", "zb-h1", "zbv"])
@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 1), (4, 2, 1), (4, 8, 1), (2, 4, 2), (4, 4, 2), (4, 8, 2),
                                            (4, 3, 2), (8, 16, 2), (8, 5, 1)])  # fmt: skip
def test_memory_model_in_flight_matches_the_schedules(schedule: str, pp: int, m: int, v: int) -> None:
    """memory.py's closed form for activations held per stage is what the schedules really do."""
    if {"zb-h1": v != 1, "zbv": v != 2}.get(schedule, v > 1 and m % pp != 0):
        pytest.skip("zb-h1 runs one chunk per stage, zbv two; interleaving needs M divisible by pp")
    sim = simulate(schedule, pp, m, v)
    assert tuple(chunks_in_flight(schedule, pp, s, m, v) for s in range(pp)) == sim.peak_in_flight


def test_memory_estimate_follows_the_pipeline_split_and_schedule() -> None:
    cfg = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                            ffn_hidden_size=128, seq_length=32, vocab_size=256)  # fmt: skip
    one_f_one_b = estimate_memory(cfg, pp=4, num_microbatches=8, precision="fp32")
    gpipe = estimate_memory(cfg, pp=4, num_microbatches=8, precision="fp32",
                            pipeline_schedule="all_forward_all_backward")  # fmt: skip
    assert gpipe.activations_bytes > 1.5 * one_f_one_b.activations_bytes
    uneven = estimate_memory(cfg, pp=4, num_microbatches=8, precision="fp32", pipeline_layers=[1, 2, 2, 3])
    assert uneven.num_params > one_f_one_b.num_params or uneven.stage_totals != one_f_one_b.stage_totals


def test_receives_are_posted_one_ahead_in_order() -> None:
    """overlap_p2p_comm: after expect(), the first receive is in flight before the stage asks for
    it, and taking one posts the next at once; each arrives in the buffer posted for it."""
    from types import SimpleNamespace

    from megatrain.engine.parallel.schedules import StageTimes, _Receives

    posted: list[torch.Tensor] = []

    class Work:
        def __init__(self, buf: torch.Tensor) -> None:
            self.buf = buf

        def wait(self) -> None:  # the k-th message lands in the k-th posted buffer
            self.buf.fill_(next(i for i, b in enumerate(posted) if b is self.buf) + 1)

    def irecv(buf: torch.Tensor, peer: int, group: object) -> list[Work]:
        posted.append(buf)
        return [Work(buf)]

    p2p = SimpleNamespace(irecv=irecv, dtype=torch.float32, device=torch.device("cpu"), times=StageTimes())
    recv = _Receives(p2p, peer=1, group=None, shape=(2,))  # type: ignore[arg-type]
    recv.expect(3)
    assert len(posted) == 1  # the first is in flight before anyone asks
    got = [recv.take()]
    assert len(posted) == 2  # ... and the next one as soon as the first is taken
    got += [recv.take(), recv.take()]
    assert len(posted) == 3 and [int(t[0]) for t in got] == [1, 2, 3]
    recv.expect(0)
    assert int(recv.take()[0]) == 4 and len(posted) == 4  # unannounced: posted on demand
    recv.expect(2)
    with pytest.raises(RuntimeError, match="outstanding"):
        recv.expect(1)
