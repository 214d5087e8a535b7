"""EngineLM over a model at a layout (evaluation.scorer.LayoutScorer) answers lm-eval as one process
does: the same per-item log-likelihoods (fp32, 1e-4), greedy flags and greedy generations at tp=2
with sequence parallelism, pp=2, cp=2 and dp=2, and the same accuracy on a shipped task. The one
process is EngineLM over the single-device GPTModel, which tests/engine/test_eval_lm.py holds
against lm-eval's own HFLM; every layout starts from the same weights (build_model draws them from
the seed whatever the layout)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"
PAIRS = [
    ("The capital of France is", " Paris"),
    ("def add(a, b):\n    return", " a + b"),
    ("Q: 2 + 2 = ?\nA:", " 4"),
    ("x", "yz and more text after it"),
    ("long " * 30, " end"),  # left-truncated to max_length
]
PROMPTS = ["def f(", "The cat", "abc"]


def _rank(rank: int, world: int, workdir: str, parallelism: dict[str, Any], task: bool) -> dict[str, Any]:
    from lm_eval.api.instance import Instance

    from megatrain.engine.build import build_model
    from megatrain.engine.config import transformer_config
    from megatrain.engine.data.tokenizers import ByteTokenizer
    from megatrain.engine.evaluation.lm import EngineLM
    from megatrain.engine.evaluation.scorer import LayoutScorer
    from megatrain.engine.evaluation.tasks import load_task, run_tasks
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.plan.layout import resolve_layout

    from .eval_helpers import tiny_spec

    # Each rank's datasets cache of its own: lm-eval's loader writes one.
    os.environ["HF_DATASETS_CACHE"] = str(Path(workdir) / f"hf-{world}-{rank}")
    spec = tiny_spec().model_copy(deep=True)
    raw = spec.model_dump(mode="json", exclude_unset=True)
    raw["parallelism"] = {"distributed_optimizer": False, **parallelism}
    raw["resources"] = {"devices": world}
    spec = type(spec).model_validate(raw)
    layout = resolve_layout(spec, world)
    tokenizer = ByteTokenizer()
    mcfg = transformer_config(spec, tokenizer.vocab_size)
    state = ParallelState.build(layout) if world > 1 else ParallelState.single()
    model = build_model(mcfg, state, spec.training.seed, "cpu")
    if world == 1:
        lm = EngineLM(model.module, tokenizer, batch_size=2)  # the single-device path
    else:
        scorer = LayoutScorer(model, mcfg.seq_length, mcfg.real_vocab_size, rows_per_forward=2)
        lm = EngineLM(scorer, tokenizer, batch_size=3)

    def requests(kind: str, args: list[tuple[Any, ...]]) -> list[Instance]:
        return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]

    until = {"until": ["\n\n"], "max_gen_toks": 6}
    out: dict[str, Any] = {
        "loglikelihood": lm.loglikelihood(requests("loglikelihood", PAIRS)),
        "generations": lm.generate_until(requests("generate_until", [(p, until) for p in PROMPTS])),
    }
    if task:
        out["task"] = run_tasks(lm, [load_task(EXAMPLES / "corpus_mc.yaml")], limit=12)
    return out


def _check(got: dict[str, Any], ref: dict[str, Any], what: Any) -> None:
    for (lp, greedy), (want, want_greedy), pair in zip(
        got["loglikelihood"], ref["loglikelihood"], PAIRS, strict=True
    ):
        assert lp == pytest.approx(want, abs=1e-4), (what, pair)
        assert greedy == want_greedy, (what, pair)
    assert got["generations"] == ref["generations"], what


@pytest.mark.distributed
def test_every_layout_scores_and_generates_as_one_process(tmp_path: Path) -> None:
    from .parallel._launch import run_distributed

    ref = run_distributed(_rank, 1, str(tmp_path), {}, True)[0]
    assert len({round(lp, 3) for lp, _ in ref["loglikelihood"]}) == len(PAIRS)  # real, distinct
    assert any(g for g in ref["generations"])
    layouts: list[dict[str, Any]] = [
        {"tp": 2, "dp": 1, "sequence_parallel": True},
        {"pp": 2, "dp": 1},
        {"cp": 2, "dp": 1},
        {"dp": 2},
    ]
    for layout in layouts:
        ranks = run_distributed(_rank, 2, str(tmp_path), layout, "pp" in layout)
        for rank in ranks:  # every rank holds the whole answer
            _check(rank, ref, layout)
        if "pp" in layout:
            task = ranks[0]["task"]["corpus_mc"]
            want = ref["task"]["corpus_mc"]
            assert task["acc"]["n"] == want["acc"]["n"] == 12
            for metric in ("acc", "acc_norm"):
                assert task[metric]["value"] == pytest.approx(want[metric]["value"]), metric


def _eval_spec(folder: Path, world: int, parallelism: dict[str, Any]) -> Any:
    from megatrain.spec import parse_spec

    from .eval_helpers import tiny_spec

    raw = tiny_spec().model_dump(mode="json", exclude_unset=True)
    tasks = [(EXAMPLES / "corpus_mc.yaml").as_uri()]
    raw.update(kind="eval", eval={"tasks": tasks, "limit": 12, "batch_size": 4, "perplexity": ["valid"]})
    raw["model"]["init_from"] = f"hf:{folder.as_uri()}"
    corpus = folder.parent / "corpus.jsonl"  # (written by the test)
    raw["data"] = {"train": [{"path": corpus.as_uri()}], "split": "80,20,0", "tokenizer": {"type": "byte"}}
    raw["parallelism"] = {"distributed_optimizer": False, **parallelism}
    raw["resources"] = {"devices": world}
    return parse_spec(raw)


def _eval_rank(rank: int, world: int, workdir: str, parallelism: dict[str, Any]) -> None:
    import torch.distributed as dist

    from megatrain.engine.evaluation.job import evaluate_at_layout
    from megatrain.engine.runtime import Dist
    from megatrain.failures import Activity
    from megatrain.plan.layout import resolve_layout

    os.environ["HF_DATASETS_CACHE"] = str(Path(workdir) / f"hf-job-{rank}")
    spec = _eval_spec(Path(workdir) / "hf", world, parallelism)
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    out = Path(workdir) / f"job-{'-'.join(parallelism)}"
    evaluate_at_layout(spec, resolve_layout(spec, world), out, ctx, Activity())


@pytest.mark.distributed
def test_an_eval_job_at_a_layout_reads_its_shards_and_scores_as_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kind eval on two ranks: each builds its shards of the Hugging Face folder (read by slice),
    rank 0 alone writes the results, equal to the one-process eval job's."""
    import json

    from megatrain.engine.evaluation.job import evaluate_job
    from megatrain.settings import reset_settings_cache

    from .eval_helpers import both_sides
    from .helpers import read_jsonl, write_corpus
    from .parallel._launch import run_distributed

    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(tmp_path / "cache"))  # (the ranks inherit it)
    reset_settings_cache()
    both_sides(tmp_path / "hf")  # the seeded tiny Llama exported with its tokenizer
    write_corpus(tmp_path / "corpus.jsonl", num_docs=30)  # eval.perplexity's data
    evaluate_job(_eval_spec(tmp_path / "hf", 1, {}), tmp_path / "one")
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    want, ppl = one["corpus_mc"], one["perplexity:valid"]
    for parallelism in ({"tp": 2, "dp": 1}, {"pp": 2, "dp": 1}):
        run_distributed(_eval_rank, 2, str(tmp_path), parallelism)
        out = tmp_path / f"job-{'-'.join(parallelism)}"
        results = json.loads((out / "results.json").read_text())
        got = results["corpus_mc"]
        assert results["perplexity:valid"]["loss"]["value"] == pytest.approx(ppl["loss"]["value"], rel=1e-5)
        assert results["perplexity:valid"]["loss"]["n"] == ppl["loss"]["n"] > 1
        for metric in ("acc", "acc_norm"):
            assert got[metric]["value"] == pytest.approx(want[metric]["value"]), (parallelism, metric)
            assert got[metric]["n"] == want[metric]["n"] == 12
        assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0]  # written once
        started = next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "started")
        layout = started["layout"]
        assert started["world_size"] == 2
        assert (layout["tp"], layout["pp"]) == (parallelism.get("tp", 1), parallelism.get("pp", 1))
