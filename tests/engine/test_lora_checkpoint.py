"""A LoRA run's checkpoints: the adapters and their optimizer state only, a resume that continues
exactly, and readers (generation, exports, downloads) that get the base back from where it came
from, with the adapters folded in where a plain model is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain.engine.checkpoint.sharded import CheckpointReader, load_checkpoint
from megatrain.engine.interop.hf import export_model_hf
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.train import run
from megatrain.spec import parse_spec

from .helpers import tiny_spec, write_corpus

TOKENS = torch.arange(24).reshape(2, 12) % 200


def _spec(tmp: Path, iters: int, **model: Any) -> Any:
    raw = tiny_spec(tmp / "c.jsonl", train_iters=iters, checkpoint_interval=3, eval_interval=0, lr=2e-2)
    raw["training"].update(method="lora", lora={"rank": 4, "alpha": 8.0}, async_checkpoint=False)
    raw["training"]["lr_schedule"] = "constant"  # the same schedule whatever train_iters says
    raw["model"].update(model)
    return parse_spec(raw)


def _probe(train: Any) -> dict[str, Any]:
    model = train.model.module
    with torch.no_grad():
        logits = model(TOKENS)
    return {"state": {n: p.detach().clone() for n, p in model.named_parameters()}, "logits": logits}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lora-ckpt")
    write_corpus(tmp / "c.jsonl")
    whole = run(_spec(tmp, 6), tmp / "whole", probe=_probe)
    run(_spec(tmp, 3), tmp / "cut")  # stops at 3 with its checkpoint ...
    resumed = run(_spec(tmp, 6), tmp / "cut", probe=_probe)  # ... and carries on to 6
    full_raw = tiny_spec(tmp / "c.jsonl", train_iters=3, checkpoint_interval=3, eval_interval=0)
    run(parse_spec(full_raw), tmp / "full")
    return {"tmp": tmp, "whole": whole, "resumed": resumed}


def test_a_resumed_lora_run_continues_exactly(runs: dict[str, Any]) -> None:
    whole, resumed = runs["whole"]["probe"], runs["resumed"]["probe"]
    assert whole["state"].keys() == resumed["state"].keys()
    for name, t in whole["state"].items():
        torch.testing.assert_close(resumed["state"][name], t, atol=0, rtol=0, msg=name)


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs: dict[str, Any]) -> None:
    tmp = runs["tmp"]
    reader = CheckpointReader(tmp / "whole" / "checkpoints")
    saved = {k for k in reader._metadata.state_dict_metadata if not k.startswith("rng/")}
    assert saved and all(".lora." in k for k in saved), sorted(saved)[:5]
    assert {k.split("/")[0] for k in saved} == {"model", "optim"}
    assert reader.adapters_only and reader.folder.trainer_state["base_init_from"] is None

    def size(root: Path) -> int:
        return sum(f.stat().st_size for f in (root / "checkpoints" / "iter_0000003").iterdir())

    assert size(tmp / "whole") < size(tmp / "full") / 2


def test_readers_get_the_base_back_and_fold_the_adapters_in(runs: dict[str, Any]) -> None:
    tmp, trained = runs["tmp"], runs["whole"]["probe"]
    reader = CheckpointReader(tmp / "whole" / "checkpoints")
    for name, t in trained["state"].items():  # the seeded base, bit for bit, and the adapters
        torch.testing.assert_close(reader.tensor(name), t, atol=0, rtol=0, msg=name)
    merged = reader.model_state()
    assert not any(".lora." in n for n in merged)
    assert not torch.equal(merged["layers.0.attn.qkv.weight"], trained["state"]["layers.0.attn.qkv.weight"])
    model, spec = load_checkpoint(tmp / "whole" / "checkpoints")
    assert spec.training.method == "lora"
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), trained["logits"], atol=1e-5, rtol=0)


def test_a_base_from_a_hugging_face_folder_is_read_back_from_it(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c.jsonl")
    spec = _spec(tmp_path, 3)
    from megatrain.engine.config import transformer_config
    from megatrain.engine.data import ByteTokenizer

    torch.manual_seed(0)
    base = GPTModel(transformer_config(spec, ByteTokenizer().vocab_size))
    with torch.no_grad():  # an import pads the vocabulary with zero rows: start from those
        for name in ("embed.weight", "lm_head.weight"):
            base.get_parameter(name)[base.config.real_vocab_size :] = 0
    export_model_hf(base, tmp_path / "hf", dtype=torch.float32)
    raw = spec.model_dump(mode="json")
    raw["model"]["init_from"] = f"hf:{(tmp_path / 'hf').as_uri()}"
    out = run(parse_spec(raw), tmp_path / "out", probe=_probe)
    reader = CheckpointReader(tmp_path / "out" / "checkpoints")
    assert reader.folder.trainer_state["base_init_from"] == raw["model"]["init_from"]
    for name, t in base.state_dict().items():
        torch.testing.assert_close(reader.tensor(name), t, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(out["probe"]["state"][name], t, atol=0, rtol=0, msg=name)  # frozen
    model, _ = load_checkpoint(tmp_path / "out" / "checkpoints")
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), out["probe"]["logits"], atol=1e-5, rtol=0)
