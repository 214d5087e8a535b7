"""EngineLM (megatrain.engine.evaluation.lm) against lm-evaluation-harness's own HFLM on the same
weights: a seeded tiny Llama loaded as a serve job loads its base (engine.serving.loader), exported
with its byte tokenizer to a transformers folder (interop.hf), HFLM on that folder. Every request
type lm-eval tasks are made of gives the same answers: per-item log-likelihoods within 1e-4 (fp32)
and the same greedy flags, rolling log-likelihoods over several windows, and the same greedy
generations cut at the same stop strings."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from megatrain.engine.evaluation.lm import EngineLM  # noqa: E402
from megatrain.engine.serving.loader import Served  # noqa: E402

from .eval_helpers import SEQ, both_sides  # noqa: E402

CONTEXTS = ["The capital of France is", "def add(a, b):\n    return", "Q: 2 + 2 = ?\nA:", "x"]
CONTINUATIONS = [" Paris", " a + b", " 4", "yz and more text after it"]


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[EngineLM, HFLM, Served]:
    return both_sides(tmp_path_factory.mktemp("hf"))


def _requests(kind: str, args: list[tuple[Any, ...]]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihoods_equal_hflms(both: tuple[EngineLM, HFLM, Served]) -> None:
    ours, hf, _ = both
    pairs = [*zip(CONTEXTS, CONTINUATIONS, strict=True), ("", "an empty context"), ("trailing  ", "space")]
    # A context longer than max_length is left-truncated the same way on both sides.
    pairs.append(("long " * 30, " end"))
    mine = ours.loglikelihood(_requests("loglikelihood", pairs))
    theirs = hf.loglikelihood(_requests("loglikelihood", pairs))
    for (lp, greedy), (hf_lp, hf_greedy), pair in zip(mine, theirs, pairs, strict=True):
        assert lp == pytest.approx(hf_lp, abs=1e-4), pair
        assert greedy == hf_greedy, pair
    assert len({round(lp, 3) for lp, _ in mine}) == len(pairs)  # real, different scores
    # A continuation the model would write itself is greedy: its own next token after a context,
    # and the one after that.
    context = list(b"abc")
    first = int(ours.model(torch.tensor([context]))[0, -1, : ours.vocab_limit].argmax())
    second = int(ours.model(torch.tensor([[*context, first]]))[0, -1, : ours.vocab_limit].argmax())
    ((_, is_greedy), (_, not_greedy)) = ours._loglikelihood_tokens(
        [(None, context, [first, second]), (None, context, [first, (second + 1) % 256])]
    )
    assert is_greedy and not not_greedy


def test_rolling_loglikelihoods_equal_hflms_over_several_windows(both: tuple[EngineLM, HFLM, Served]) -> None:
    ours, hf, _ = both
    texts = [("short text",), ("a longer document that spans windows; " * 6,)]  # ~230 bytes: 4 windows
    mine = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    theirs = hf.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    assert mine == pytest.approx(theirs, abs=1e-3)
    assert mine[1] < mine[0] < 0


def test_greedy_generations_equal_hflms(both: tuple[EngineLM, HFLM, Served]) -> None:
    ours, hf, served = both
    args = [(c, {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}) for c in CONTEXTS]
    args.append((CONTEXTS[0], {"until": "e", "max_gen_toks": 20}))  # a stop string cuts early
    # The stop strings after the first cut too.
    args += [(c, {"until": ["QQQ", stop], "max_gen_toks": 20}) for c in CONTEXTS for stop in "eat "]
    mine = ours.generate_until(_requests("generate_until", args))
    theirs = hf.generate_until(_requests("generate_until", args))
    assert mine == theirs
    assert any(len(text) > 3 for text in mine) and "e" not in mine[len(CONTEXTS)]
    full = ours.generate_until(_requests("generate_until", [(c, {"max_gen_toks": 20}) for c in CONTEXTS]))
    assert any(stop in text for text in full for stop in "eat "), full  # (so the cuts above cut)


def test_bad_arguments_are_named(both: tuple[EngineLM, HFLM, Served]) -> None:
    ours, _, served = both
    with pytest.raises(ValueError, match="max_length"):
        EngineLM(served.model, served.tokenizer, max_length=SEQ + 1)
    with pytest.raises(ValueError, match="until"):
        ours.generate_until(_requests("generate_until", [("x", {"until": 3})]))
    with pytest.raises(ValueError, match="no room"):
        ours.generate_until(_requests("generate_until", [("x", {"max_gen_toks": SEQ})]))
