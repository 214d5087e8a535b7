"""/v1/models with a PEFT LoRA adapter folder (written by peft itself) over a registered base:
recorded with its base and settings, refused with the field to blame, and resolved at submission
into the base (model.init_from), the adapter (model.adapter_from) and training.lora."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from api_handle import Api
from test_models import _error, hf_folder, register

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def adapter_folder(base: Path, path: Path, **config: Any) -> Path:
    """peft's own save_pretrained of a LoRA adapter on the model at `base`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    lora = peft.LoraConfig(**({"r": 4, "lora_alpha": 8.0, "target_modules": TARGETS} | config))
    peft.get_peft_model(model, lora).save_pretrained(path)
    return path


def _register_adapter(api: Api, name: str, url: str, base: str | None) -> Any:
    body = {"name": name, "url": url} | ({"base": base} if base else {})
    return api.client.post("/v1/models", json=body, headers=api.headers)


@pytest.fixture
def base(api: Api) -> Path:
    folder = hf_folder(api.data_root / "llama")
    assert register(api, "tiny-llama", folder.as_uri()).status_code == 201
    return folder


def test_an_adapter_is_registered_over_its_base(api: Api, base: Path) -> None:
    folder = adapter_folder(base, api.data_root / "adapter", use_rslora=True)
    resp = _register_adapter(api, "tiny-lora", folder.as_uri(), "tiny-llama")
    assert resp.status_code == 201, resp.text
    m = resp.json()
    assert (m["kind"], m["base_url"], m["url"]) == ("adapter", base.as_uri(), folder.as_uri())
    assert m["adapter"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["qkv", "proj"],
                            "use_rslora": True}  # fmt: skip
    assert m["model_type"] == "llama" and m["num_layers"] == 2  # the base's
    listed = {x["name"]: x["kind"] for x in api.client.get("/v1/models", headers=api.headers).json()["items"]}
    assert listed == {"tiny-llama": "model", "tiny-lora": "adapter"}


def test_adapter_registrations_name_what_is_wrong(api: Api, base: Path) -> None:
    folder = adapter_folder(base, api.data_root / "adapter")
    field, message = _error(_register_adapter(api, "a", folder.as_uri(), None))
    assert field == "base" and "LoRA adapter" in message
    field, message = _error(_register_adapter(api, "a", folder.as_uri(), "nothing"))
    assert field == "base" and "not a registered model" in message
    assert _register_adapter(api, "tiny-lora", folder.as_uri(), "tiny-llama").status_code == 201
    field, message = _error(_register_adapter(api, "b", folder.as_uri(), "tiny-lora"))
    assert field == "base" and "not a whole model" in message
    field, _ = _error(_register_adapter(api, "c", base.as_uri(), "tiny-llama"))
    assert field == "base"  # a whole model takes no base
    (folder / "adapter_model.safetensors").unlink()
    field, message = _error(_register_adapter(api, "d", folder.as_uri(), "tiny-llama"))
    assert field == "url" and "adapter_model.safetensors" in message


def test_a_job_from_a_registered_adapter_trains_on_from_it(api: Api, base: Path) -> None:
    folder = adapter_folder(base, api.data_root / "adapter")
    assert _register_adapter(api, "tiny-lora", folder.as_uri(), "tiny-llama").status_code == 201
    spec = api.spec("from-adapter", model=None)
    spec["model"] = {"init_from": "hf:tiny-lora"}
    job = api.submit(spec)
    stored = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()["spec"]
    assert stored["model"]["init_from"] == f"hf:{base.as_uri()}"
    assert stored["model"]["adapter_from"] == f"hf:{folder.as_uri()}"
    assert stored["training"]["method"] == "lora"
    assert (stored["training"]["lora"]["rank"], stored["training"]["lora"]["targets"]) == (4, ["qkv", "proj"])
    spec["training"] = {**spec.get("training", {}), "method": "full"}
    field, message = _error(api.client.post("/v1/jobs", json=spec, headers=api.headers))
    assert field == "training.method" and "LoRA adapter" in message
    # Naming it as the adapter of a run over the base works too.
    spec["model"] = {"init_from": "hf:tiny-llama", "adapter_from": "hf:tiny-lora"}
    spec["training"]["method"] = "lora"
    spec["training"]["lora"] = {"rank": 4, "alpha": 8.0, "targets": ["qkv", "proj"]}
    stored = api.client.get(f"/v1/jobs/{api.submit(spec)['id']}", headers=api.headers).json()["spec"]
    assert stored["model"]["adapter_from"] == f"hf:{folder.as_uri()}"
    spec["model"]["adapter_from"] = "hf:tiny-llama"
    field, message = _error(api.client.post("/v1/jobs", json=spec, headers=api.headers))
    assert field == "model.adapter_from" and "not an adapter" in message
