"""Zero-bubble pipeline schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): each
backward is split into B, the input gradient the previous stage waits for, and W, the weight
gradients nobody waits for, which fill the idle slots 1F1B leaves.

- `zb-h1`: one chunk per stage. 1F1B's warm-up forwards; in the steady state stage s leaves its
  first s W passes out (F B, then F B W), and runs them in the cool-down, where 1F1B idles. Every
  stage holds at most pp micro-batches' activations (1F1B's first stage's peak); the bubble is
  (p-1)(F+B-W) of a stage's time against 1F1B's (p-1)(F+B+W): a third of it when F = B = W.
- `zbv`: two chunks per stage in a V (stage s holds global chunks s and 2p-1-s: the first stage
  both embeds and computes the loss, the last turns the activations round itself), the order
  torch.distributed.pipelining's ScheduleZBVZeroBubble and the paper's ZB-V use. Each stage holds
  at most 2p chunks' activations (p micro-batches: 1F1B's first stage again); the only bubble left
  is the last stage's wait for its first input, (p-1) chunk forwards: (p-1)·F/2.

The orders are pure functions (every rank computes every stage's, as for 1F1B); weight-gradient
deferral itself is in megatrain.kernels.grad_accumulation (`deferring_weight_grads`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Action(NamedTuple):
    kind: Literal["F", "B", "W"]
    """F forward; B backward (the whole of it, or only the input gradient in a zero-bubble
    schedule); W the weight gradients a zero-bubble B left behind."""
    chunk: int
    """Local chunk index on this stage (0 .. virtual_stages-1)."""
    microbatch: int


SPLIT_SCHEDULES = ("zb-h1", "zbv")
"""Schedules whose backward is B then W."""


def zb_h1_actions(pp: int, stage: int, m: int) -> list[Action]:
    """Stage `stage`'s zb-h1 order over m micro-batches (one chunk)."""
    out: list[Action] = []
    f = b = w = 0
    for _ in range(min(pp - 1 - stage, m)):  # warm-up, as 1F1B
        out.append(Action("F", 0, f))
        f += 1
    steady = 0
    while f < m:
        out += [Action("F", 0, f), Action("B", 0, b)]
        f, b = f + 1, b + 1
        if steady >= stage:  # the first `stage` W passes wait for the cool-down
            out.append(Action("W", 0, w))
            w += 1
        steady += 1
    while b < m:
        out += [Action("B", 0, b), Action("W", 0, w)]
        b, w = b + 1, w + 1
    out += [Action("W", 0, k) for k in range(w, m)]
    return out


def zbv_chunk_ids(stage: int, pp: int) -> list[int]:
    """Global chunks of `stage` in the V: s on the way down, 2p-1-s on the way back."""
    return [stage, 2 * pp - 1 - stage]


def zbv_actions(pp: int, stage: int, m: int) -> list[Action]:
    """Stage `stage`'s zbv order over m micro-batches; local chunk 0 is the down leg, 1 the up leg.

    Written for at least 2p-1 micro-batches; with fewer, the actions of micro-batches that do not
    exist are dropped (as ScheduleZBVZeroBubble does), which keeps every dependency satisfiable."""
    n = max(m, 2 * pp - 1)
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - stage) - 1):
        out.append(Action("F", 0, f0))
        f0 += 1
    for _ in range(stage):
        out += [Action("F", 1, f1), Action("F", 0, f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(pp - stage):
        out += [Action("F", 1, f1), Action("B", 1, b1), Action("W", 1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(Action("F", 0, f0))
            f0 += 1
        out += [Action("B", 0, b0), Action("W", 0, b0), Action("F", 1, f1), Action("B", 1, b1)]
        out.append(Action("W", 1, b1))
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(stage):
        out += [Action("B", 0, b0), Action("B", 1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - stage):
        out += [Action("B", 0, b0), Action("W", 0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [Action("W", 1, k) for k in range(w1, b1)]
    out += [Action("W", 0, k) for k in range(w0, b0)]
    return [a for a in out if a.microbatch < m]


def split_bubble(schedule: str, pp: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """The exact idle share of the split schedules with stage times f, b, w per micro-batch (the
    simulation's; `tests/engine/parallel/test_zero_bubble.py` checks them against it)."""
    busy = m * (f + b + w)
    idle = (pp - 1) * (f + b - w) if schedule == "zb-h1" else (pp - 1) * f / 2
    return idle / (busy + idle)
