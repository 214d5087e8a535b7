"""The shipped lm-eval tasks (examples/eval: a multiple-choice and a cloze task written for the demo
corpus) loaded by megatrain.engine.evaluation.tasks and run by lm-eval's own evaluator over EngineLM
and over HFLM on the same weights: the same accuracy and the same perplexity. A task file lm-eval
could not run here is refused naming the field and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from megatrain.engine.evaluation.tasks import TaskError, data_urls, load_task, run_tasks  # noqa: E402

from .eval_helpers import both_sides  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"
TASKS = [EXAMPLES / "corpus_mc.yaml", EXAMPLES / "corpus_cloze.yaml"]


def test_a_shipped_task_loads_with_its_items_resolved_beside_it() -> None:
    config = load_task(EXAMPLES / "corpus_mc.yaml")
    assert config["task"] == "corpus_mc" and config["output_type"] == "multiple_choice"
    assert config["dataset_kwargs"]["data_files"] == {"test": [str(EXAMPLES / "corpus_mc.jsonl")]}
    assert data_urls(config) == [(EXAMPLES / "corpus_mc.jsonl").as_uri()]
    # A file:// URL names the same file.
    assert load_task((EXAMPLES / "corpus_cloze.yaml").as_uri())["task"] == "corpus_cloze"


def test_the_shipped_tasks_score_as_hflm_scores_them(tmp_path: Path) -> None:
    ours, hf, _ = both_sides(tmp_path / "hf")
    configs = [load_task(t) for t in TASKS]
    mine = run_tasks(ours, configs, limit=40)
    theirs = run_tasks(hf, [load_task(t) for t in TASKS], limit=40)
    assert set(mine) == {"corpus_mc", "corpus_cloze"}
    assert set(mine["corpus_mc"]) == {"acc", "acc_norm"} and set(mine["corpus_cloze"]) == {
        "acc",
        "perplexity",
    }
    for task, metrics in mine.items():
        for metric, got in metrics.items():
            want = theirs[task][metric]
            assert got["n"] == want["n"] == 40, (task, metric)
            assert got["value"] == pytest.approx(want["value"], rel=1e-4), (task, metric)
            if want["stderr"] is not None:
                assert got["stderr"] == pytest.approx(want["stderr"], rel=1e-3), (task, metric)
    # Untrained weights: the right ending is one of four, perplexity far above 1.
    assert 0.0 <= mine["corpus_mc"]["acc"]["value"] <= 0.6
    assert mine["corpus_cloze"]["perplexity"]["value"] > 10


@pytest.mark.parametrize(
    ("text", "field", "rule"),
    [
        ("task: x\ndataset_path: hellaswag\ntest_split: test\n", "dataset_path", "must be `json`"),
        ("dataset_path: json\n", "task", "task name is required"),
        ("task: x\ndataset_path: json\ndataset_kwargs: {data_files: items.jsonl}\n", "test_split",
         "required"),
        ("task: x\ndataset_path: json\ntest_split: test\n", "dataset_kwargs.data_files", "JSON files"),
        ("task: x\ndataset_path: json\ntest_split: test\ndataset_kwargs: {data_files: {test: gone.jsonl}}\n",
         "data_files.test", "no such file"),
        ("task: x\ndataset_path: json\ntest_split: test\ndataset_kwargs: {data_files: {test: items.csv}}\n",
         "data_files.test", ".json or .jsonl"),
        ("task: x\ndataset_path: json\ntest_split: dev\ndataset_kwargs: {data_files: {test: items.jsonl}}\n",
         "test_split", "no data_files entry"),
        ("task: x\ndataset_path: json\noutput_type: ranking\ntest_split: test\n", "output_type", "one of"),
        ("task: [unclosed\n", "file", "not YAML"),
        ("- a\n- b\n", "file", "one task"),
    ],
)  # fmt: skip
def test_a_task_file_lm_eval_could_not_run_is_refused_naming_the_field(
    tmp_path: Path, text: str, field: str, rule: str
) -> None:
    (tmp_path / "items.jsonl").write_text('{"context": "a", "target": "b"}\n')
    (tmp_path / "items.csv").write_text("context,target\na,b\n")
    path = tmp_path / "task.yaml"
    path.write_text(text)
    with pytest.raises(TaskError) as info:
        load_task(path)
    assert info.value.field == field and rule in info.value.message, str(info.value)


def test_a_task_in_object_storage_is_read_there_and_its_items_cached_on_the_node(
    s3_bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An s3:// task YAML with its items beside it: the API's check keeps the items' URLs (for the
    data-access rule), the node's copy holds them in its verified cache; a missing item is refused
    naming the field."""
    from megatrain import eval_tasks
    from megatrain.settings import reset_settings_cache
    from megatrain.storage import open_store

    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(tmp_path / "cache"))
    reset_settings_cache()
    store = open_store(f"{s3_bucket_url}/tasks")
    store.put_file("corpus_mc.yaml", EXAMPLES / "corpus_mc.yaml")
    store.put_file("corpus_mc.jsonl", EXAMPLES / "corpus_mc.jsonl")
    url = f"{s3_bucket_url}/tasks/corpus_mc.yaml"

    checked = eval_tasks.load_task(url)  # the API's: no download
    assert checked["task"] == "corpus_mc"
    assert data_urls(checked) == [f"{s3_bucket_url}/tasks/corpus_mc.jsonl"]
    local = load_task(url)  # the node's
    (path,) = local["dataset_kwargs"]["data_files"]["test"]
    assert Path(path).is_relative_to(tmp_path / "cache")
    assert Path(path).read_bytes() == (EXAMPLES / "corpus_mc.jsonl").read_bytes()

    store.put_bytes(
        "broken.yaml", (EXAMPLES / "corpus_mc.yaml").read_bytes().replace(b"corpus_mc.jsonl", b"gone.jsonl")
    )
    with pytest.raises(TaskError) as info:
        eval_tasks.load_task(f"{s3_bucket_url}/tasks/broken.yaml")
    assert info.value.field == "data_files.test" and "no such object" in info.value.message, str(info.value)
    with pytest.raises(TaskError) as info:
        eval_tasks.load_task(f"{s3_bucket_url}/tasks/absent.yaml")
    assert info.value.field == "file" and "cannot read it" in info.value.message
