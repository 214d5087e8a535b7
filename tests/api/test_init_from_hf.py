"""`model.init_from: hf:URL` at submission: the model comes from the folder's config.json (written
here by transformers itself), mismatches and unreadable folders are 422s naming their fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from api_handle import Api

transformers = pytest.importorskip("transformers")


def _llama_folder(path: Path, **overrides: Any) -> Path:
    cfg = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaConfig(**(cfg | overrides)).save_pretrained(path)
    return path


def _post(api: Api, model: dict[str, Any]) -> Any:
    spec = api.spec("from-hf", model=None)
    spec["model"] = model
    return api.client.post("/v1/jobs", json=spec, headers=api.headers)


def _fields(resp: Any) -> list[str]:
    assert resp.status_code == 422, resp.text
    return sorted(e["field"] for e in resp.json()["detail"])


def test_model_fields_are_filled_from_config_json(api: Api) -> None:
    folder = _llama_folder(api.data_root / "llama")
    resp = _post(api, {"init_from": f"hf:{folder.as_uri()}", "seq_length": 32})
    assert resp.status_code == 201, resp.text
    model = api.client.get(f"/v1/jobs/{resp.json()['id']}", headers=api.headers).json()["spec"]["model"]
    expected = {
        "arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_query_groups": 2, "ffn_hidden_size": 128, "vocab_size": 300, "seq_length": 32,
        "norm_eps": 1e-6, "tie_embeddings": False, "qkv_bias": False,
    }  # fmt: skip
    assert {k: model[k] for k in expected} == expected
    # A bare absolute path is the same folder; the config's own length when the spec names none.
    resp = _post(api, {"init_from": f"hf:{folder}", "num_layers": 2})
    assert resp.status_code == 201, resp.text


def test_every_mismatching_model_field_is_named(api: Api) -> None:
    folder = _llama_folder(api.data_root / "llama")
    model = {"init_from": f"hf:{folder.as_uri()}", "num_layers": 3, "hidden_size": 32, "seq_length": 128,
             "num_attention_heads": 4}  # fmt: skip
    resp = _post(api, model)
    assert _fields(resp) == ["model.hidden_size", "model.num_layers", "model.seq_length"]
    assert "64" in {e["field"]: e["message"] for e in resp.json()["detail"]}["model.hidden_size"]


def test_moe_fields_are_filled_and_checked(api: Api) -> None:
    """A Qwen2-MoE folder fills model.moe; its experts must agree, its training coefficients are free."""
    folder = api.data_root / "qwen-moe"
    shape = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300, max_position_embeddings=64,
    )  # fmt: skip
    experts = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    )
    transformers.Qwen2MoeConfig(**shape, **experts).save_pretrained(folder)
    model = {"init_from": f"hf:{folder.as_uri()}", "seq_length": 32, "moe": {"capacity_factor": 2.0}}
    resp = _post(api, model)
    assert resp.status_code == 201, resp.text
    moe = api.client.get(f"/v1/jobs/{resp.json()['id']}", headers=api.headers).json()["spec"]["model"]["moe"]
    expected = {
        "num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32, "shared_expert_gate": True,
        "shared_expert_ffn_hidden_size": 64, "router_pre_softmax": True, "capacity_factor": 2.0,
    }  # fmt: skip
    assert {k: moe[k] for k in expected} == expected
    resp = _post(api, {**model, "moe": {"num_experts": 8, "router_topk": 2}})
    assert _fields(resp) == ["model.moe.num_experts"]


@pytest.mark.parametrize("case", ["missing", "outside", "not-json", "unsupported", "relative"])
def test_unusable_folders_are_init_from_errors(api: Api, tmp_path: Path, case: str) -> None:
    folder = api.data_root / "m"
    folder.mkdir()
    if case == "outside":
        folder = _llama_folder(tmp_path / "elsewhere")
    elif case == "not-json":
        (folder / "config.json").write_text("{not json")
    elif case == "unsupported":
        transformers.RobertaConfig(hidden_size=32, num_attention_heads=2).save_pretrained(folder)
    init_from = "hf:relative/folder" if case == "relative" else f"hf:{folder.as_uri()}"
    resp = _post(api, {"init_from": init_from})
    assert _fields(resp) == ["model.init_from"]
    expected = {"missing": "does not exist", "outside": "outside the data", "not-json": "not valid JSON",
                "unsupported": "model_type", "relative": "file:///"}[case]  # fmt: skip
    assert expected in resp.json()["detail"][0]["message"]


def test_the_stored_spec_trains_from_the_hf_weights(
    api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the API stores is what the engine loads: a transformers model saved here, a spec naming
    only init_from (and a shorter length), one training step from those weights. The engine refuses
    weights whose config disagrees with the spec's model in any field (norm_eps included)."""
    pytest.importorskip("torch")
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    folder = _llama_folder(api.data_root / "llama")
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder)
    ).save_pretrained(folder)
    (api.data_root / "corpus.jsonl").write_text(
        "".join(f'{{"text": "line {i} of the corpus"}}\n' for i in range(40))
    )
    training = {"train_iters": 1, "global_batch_size": 2, "micro_batch_size": 2}
    spec = api.spec("from-hf", model=None, training=training, resources={"devices": 1})
    spec["model"] = {"init_from": f"hf:{folder.as_uri()}", "seq_length": 16}
    resp = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert resp.status_code == 201, resp.text
    stored = api.client.get(f"/v1/jobs/{resp.json()['id']}", headers=api.headers).json()["spec"]
    summary = run(parse_spec(stored), tmp_path / "run", checkpoint_url=(tmp_path / "ckpt").as_uri())
    assert summary["step"] == 1
    assert f"initialised from the Hugging Face model at {folder.as_uri()}" in capsys.readouterr().out
