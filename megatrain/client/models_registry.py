"""The SDK's registered-model calls (mixed into `Client`): register a Hugging Face model folder
under a name (for `model.init_from: hf:NAME`), list, read, delete."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from megatrain.client.models import _pick


@dataclass
class RegisteredModel:
    """A Hugging Face model folder registered under `name`; `fields` are the model.* fields a job
    naming it (`model.init_from: hf:NAME`) gets from its config.json."""

    name: str
    id: str = ""
    shared: bool = False
    url: str = ""
    model_type: str = ""
    arch: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    seq_length: int = 0
    fields: dict[str, Any] = field(default_factory=dict)
    kind: str = "model"
    """model, or adapter: a PEFT LoRA folder over the registered model at base_url."""
    base_url: str | None = None
    adapter: dict[str, Any] | None = None
    """An adapter's settings as training.lora takes them."""
    created_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegisteredModel:
        return cls(**_pick(cls, data), raw=dict(data))


class ModelsMixin:
    if TYPE_CHECKING:  # provided by Client

        def _json(self, method: str, path: str, **kwargs: Any) -> Any: ...
        def _request(self, method: str, path: str, **kwargs: Any) -> Any: ...

    def register_model(self, name: str, url: str, base: str | None = None) -> RegisteredModel:
        """Register the folder at `url` (file:///…, s3://… or /abs/path; holding config.json and
        safetensors weights the tenant may read) as `name`; a PEFT LoRA adapter folder names the
        registered model it was trained on as `base`."""
        body = {"name": name, "url": url} | ({"base": base} if base else {})
        return RegisteredModel.from_dict(self._json("POST", "/v1/models", json=body))

    def models(self) -> list[RegisteredModel]:
        """The tenant's registered models and the shared ones, by name."""
        return [RegisteredModel.from_dict(m) for m in self._json("GET", "/v1/models")["items"]]

    def get_model(self, name: str) -> RegisteredModel:
        return RegisteredModel.from_dict(self._json("GET", f"/v1/models/{quote(name, safe='')}"))

    def delete_model(self, name: str) -> None:
        """Forget the name (the folder stays; jobs already submitted keep the URL they resolved)."""
        self._request("DELETE", f"/v1/models/{quote(name, safe='')}")
