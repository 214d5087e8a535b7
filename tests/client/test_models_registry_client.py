"""The SDK's registered-model calls against the real API (uvicorn on a free port): register a folder
transformers wrote, list/get/delete, errors as ApiError naming `url`, and a job submitted with
`model.init_from: hf:NAME` whose stored model comes from the folder's config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.live import LiveApi

from megatrain.client import ApiError, Client

transformers = pytest.importorskip("transformers")


def _folder(path: Path) -> Path:
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=260, max_position_embeddings=32,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_register_list_get_submit_delete(live_api: LiveApi) -> None:
    folder = _folder(live_api.data_path.parent / "llama")
    with Client() as c:
        m = c.register_model("tiny", folder.as_uri())
        assert (m.name, m.url, m.model_type, m.num_layers, m.hidden_size, m.vocab_size) == (
            "tiny", folder.as_uri(), "llama", 1, 32, 260,
        )  # fmt: skip
        assert [x.name for x in c.models()] == ["tiny"] and c.get_model("tiny").id == m.id
        spec = live_api.spec("from-name")
        spec["model"] = {"init_from": "hf:tiny"}
        job = c.submit(spec)
        stored = c.get_job(job.id).spec
        assert stored is not None
        assert stored["model"]["init_from"] == f"hf:{folder.as_uri()}"
        assert stored["model"]["num_query_groups"] == 1 and stored["model"]["ffn_hidden_size"] == 64
        with pytest.raises(ApiError) as exc:
            c.register_model("tiny", folder.as_uri())
        assert exc.value.status == 409
        with pytest.raises(ApiError) as exc:
            c.register_model("empty", (live_api.data_path.parent / "nothing").as_uri())
        assert exc.value.status == 422 and exc.value.fields == ["url"]
        c.delete_model("tiny")
        assert c.models() == []
        with pytest.raises(ApiError) as exc:
            c.get_model("tiny")
        assert exc.value.status == 404
