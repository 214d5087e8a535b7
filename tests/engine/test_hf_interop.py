"""Hugging Face import and export against transformers' own models (tiny random configs, fp32, CPU).

Every check compares with what transformers computes or reads: its logits on the same tokens, its
from_pretrained of our exported folder, its rotary frequencies. Vocabularies of 1000 rows (not a
multiple of 128) exercise the padding on import and the cut on export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megatrain.engine.checkpoint import load_checkpoint
from megatrain.engine.config import TransformerConfig
from megatrain.engine.interop import (
    export_checkpoint_hf,
    export_hf,
    export_model_hf,
    load_hf_model,
    load_hf_state,
    read_hf_config,
)
from megatrain.engine.interop.hf_slices import hf_slices
from megatrain.engine.models.gpt import GPTModel, rope_inv_freq
from megatrain.engine.parallel.parallelize import load_full_state_dict, parallelize_model
from megatrain.engine.train import run
from megatrain.hf_config import HFConfigError, model_fields_from_hf
from megatrain.spec import parse_spec
from megatrain.storage import S3Store, open_store

from .helpers import tiny_spec
from .parallel._tp_common import fake_state

VOCAB = 1000
ATOL = 1e-5  # fp32 logits of the same weights; reduction orders differ by a few ulps
_LLAMA = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
          "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 64,
          "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
CASES: dict[str, Any] = {
    "gpt2": lambda: GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64,
                               bos_token_id=0, eos_token_id=0),
    "gpt2-untied": lambda: GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=False),
    # transformers 5's rope_parameters dialect; head_dim 8, theta 500: the llama3 rule divides three of
    # the four frequencies and interpolates one (wavelengths 6.3 | 30, 140, 660 against 4 and 16).
    "llama-gqa-llama3": lambda: LlamaConfig(**_LLAMA, rope_parameters={**LLAMA3, "rope_theta": 500.0}),
    "llama-linear-tied": lambda: LlamaConfig(**_LLAMA, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 20000.0}, tie_word_embeddings=True),
    "mistral-mqa": lambda: MistralConfig(**{**_LLAMA, "num_key_value_heads": 1}, sliding_window=4096),
    "qwen2-tied": lambda: Qwen2Config(**_LLAMA, tie_word_embeddings=True),
    "qwen2-untied": lambda: Qwen2Config(**_LLAMA, tie_word_embeddings=False),
}  # fmt: skip


def hf_model(config: Any) -> Any:
    """A transformers model whose every weight is random: biases off zero, norms off one."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def hf_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def our_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]  # padding rows beyond the real vocabulary


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_and_export_match_transformers(case: str, tmp_path: Path) -> None:
    ref = hf_model(CASES[case]())
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # sharded
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))

    ours, cfg = load_hf_model((tmp_path / "hf").as_uri())
    assert (cfg.vocab_size, cfg.vocab_size_unpadded) == (1024, VOCAB)
    assert not ours.embed.weight[VOCAB:].any() and not ours.lm_head.weight[VOCAB:].any()
    torch.testing.assert_close(our_logits(ours, tokens), hf_logits(ref, tokens), atol=ATOL, rtol=0)

    files = export_model_hf(ours, tmp_path / "out", dtype=torch.float32, max_shard_bytes=40_000)
    assert sum(f.endswith(".safetensors") for f in files) > 1 and files[-1] == "config.json"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.vocab_size == VOCAB and back.config.tie_word_embeddings == cfg.tie_embeddings
    # The family survives the round trip (a Mistral stays a Mistral, not the Llama its shape is).
    assert read_hf_config(tmp_path / "out")["model_type"] == ref.config.model_type
    assert type(back) is type(ref)
    torch.testing.assert_close(hf_logits(back, tokens), our_logits(ours, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [
        (128, 500000.0, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}),  # Llama 3.1
        (64, 10000.0, {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 256}),
        (64, 10000.0, {"type": "linear", "factor": 4.0}),
    ],
)  # fmt: skip
def test_rope_frequencies_equal_transformers(head_dim: int, theta: float, scaling: dict[str, Any]) -> None:
    params = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": scaling["type"]}
    config = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, rope_parameters={**params, "rope_theta": theta}
    )
    theirs, attention_scale = ROPE_INIT_FUNCTIONS[scaling["type"]](config, "cpu")
    assert attention_scale == 1.0  # cos/sin unscaled, as our tables are
    ours = rope_inv_freq(head_dim, theta, scaling)
    # transformers computes in fp32, we in fp64: equal to fp32 rounding.
    torch.testing.assert_close(ours.float(), theirs, rtol=2e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(head_dim, theta))  # the scaling changed something


def test_export_is_lazy_sharded_and_writes_tokenizer_files(tmp_path: Path) -> None:
    """bf16 shards of at most max_shard_bytes; a tensor is asked for only once its shard is next
    (each earlier shard already on storage), so one shard's tensors are held at a time."""
    ref = hf_model(CASES["qwen2-untied"]())
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = load_hf_model(tmp_path / "hf")
    state = model.state_dict()
    out = tmp_path / "out"
    files_before_call: dict[str, int] = {}

    def get_tensor(name: str) -> torch.Tensor:
        files_before_call.setdefault(name, len(list(out.glob("*.safetensors"))) if out.exists() else 0)
        return state[name]

    tokenizer_files = {"tokenizer.json": b'{"x": 1}', "special.txt": tmp_path / "hf" / "config.json"}
    special = {"bos_token_id": 1, "eos_token_id": 2}
    written = export_hf(
        get_tensor,
        cfg,
        out.as_uri(),
        max_shard_bytes=20_000,
        tokenizer_files=tokenizer_files,
        extra_config=special,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_of = {name: int(file.split("-")[1]) - 1 for name, file in index["weight_map"].items()}
    # The first HF tensor of each canonical tensor decides the shard that needs it first.
    first_needed = {
        "embed.weight": shard_of["model.embed_tokens.weight"],
        "lm_head.weight": shard_of["lm_head.weight"],
    }
    for name in files_before_call:
        if name.startswith("layers.0.attn.qkv"):
            first_needed[name] = shard_of["model.layers.0.self_attn.q_proj." + name.rsplit(".", 1)[1]]
    for name, shard in first_needed.items():
        assert files_before_call[name] == shard, name
    for file in set(index["weight_map"].values()):
        with safe_open(str(out / file), "pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118
        assert all(t.dtype == torch.bfloat16 for t in tensors)
        # At most the limit, unless one tensor alone exceeds it (the embedding: 1000 x 32 x 2 bytes).
        assert sum(t.numel() * 2 for t in tensors) <= 20_000 or len(tensors) == 1
    assert (out / "tokenizer.json").read_bytes() == b'{"x": 1}'
    assert (out / "special.txt").read_bytes() == (tmp_path / "hf" / "config.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (
        written[-1] == "config.json"
        and json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    )
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (1, 16))
    # bf16 weights: about 3 significant digits.
    torch.testing.assert_close(hf_logits(back, tokens), our_logits(model, tokens), atol=3e-2, rtol=0)


def test_mismatched_model_and_unsupported_configs_are_refused(tmp_path: Path) -> None:
    hf_model(CASES["llama-gqa-llama3"]()).save_pretrained(tmp_path / "hf")
    _, cfg = load_hf_model(tmp_path / "hf", seq_length=32)
    wrong = TransformerConfig.from_dict(
        {**cfg.to_dict(), "num_layers": 3, "rope_scaling": None, "norm_eps": 1e-5}
    )
    with pytest.raises(ValueError, match="num_layers: checkpoint 2, model 3.*rope_scaling.*norm_eps"):
        load_hf_state(tmp_path / "hf", wrong)
    small = TransformerConfig.from_dict({**cfg.to_dict(), "vocab_size": 512, "vocab_size_unpadded": None})
    with pytest.raises(ValueError, match="vocab_size: checkpoint 1000, model rows 512"):
        load_hf_state(tmp_path / "hf", small)
    # Llama's attention_bias puts a bias on o_proj too, which our model does not have.
    hf_model(LlamaConfig(**_LLAMA, attention_bias=True)).save_pretrained(tmp_path / "bias")
    with pytest.raises(HFConfigError, match="attention_bias"):
        load_hf_model(tmp_path / "bias")


def test_tensor_parallel_shards_whole_groups_of_qkv_bias(tmp_path: Path) -> None:
    """tp=2 over a Qwen2 import, both ways a rank gets its shards (slicing an imported model, and
    loading the imported weights into a sliced model, as init_from does): each rank's qkv bias, split
    by its own attention module, is transformers' q/k/v biases of that rank's heads and groups."""
    ref = hf_model(Qwen2Config(**{**_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 4}))
    ref.save_pretrained(tmp_path / "hf")
    theirs = [getattr(ref.model.layers[1].self_attn, f"{x}_proj").bias.detach() for x in "qkv"]
    _, cfg = load_hf_model(tmp_path / "hf")
    full = load_hf_state(tmp_path / "hf", cfg)
    for rank in range(2):
        sliced, _ = load_hf_model(tmp_path / "hf")
        parallelize_model(sliced, fake_state(2, rank))
        loaded = parallelize_model(GPTModel(cfg), fake_state(2, rank))
        load_full_state_dict(loaded, full, fake_state(2, rank))
        for model in (sliced, loaded):
            local = model.layers[1].attn
            ours = local.split_qkv(local.qkv.bias.detach().view(1, 1, -1))  # (1, heads, 1, hd) each
            for mine, full_bias in zip(ours, theirs, strict=True):
                half = full_bias.numel() // 2  # this rank's heads (q) or groups (k, v): a contiguous half
                torch.testing.assert_close(
                    mine.flatten(), full_bias[rank * half : (rank + 1) * half], atol=0, rtol=0
                )


def test_s3_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moto = pytest.importorskip("moto")
    import boto3

    monkeypatch.delenv("MEGATRAIN_S3_ENDPOINT_URL", raising=False)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    ref = hf_model(CASES["qwen2-tied"]())
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    tokens = torch.randint(0, VOCAB, (1, 16))
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="models")
        store = open_store("s3://models/qwen")
        for path in (tmp_path / "hf").iterdir():
            store.put_file(path.name, path)
        fetched: list[str] = []
        get_file = S3Store.get_file

        def counting(self: S3Store, key: str, path: str | Path) -> None:
            fetched.append(key)
            get_file(self, key, path)

        monkeypatch.setattr(S3Store, "get_file", counting)
        model, cfg = load_hf_model("s3://models/qwen")
        files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
        assert sorted(fetched) == files and len(files) > 1
        # Once per node: a rank reading slices afterwards finds every file in the cache.
        with hf_slices("s3://models/qwen", cfg) as weights:
            row = torch.empty(1, cfg.hidden_size)
            weights.fill("embed.weight", (cfg.vocab_size, cfg.hidden_size), (5, 0), row)
        assert sorted(fetched) == files
        torch.testing.assert_close(row[0], ref.model.embed_tokens.weight[5])
        export_model_hf(model, "s3://models/export", dtype=torch.float32, max_shard_bytes=40_000)
        out = open_store("s3://models/export")
        for obj in out.list():
            out.get_file(obj.key, tmp_path / "back" / obj.key)
    torch.testing.assert_close(our_logits(model, tokens), hf_logits(ref, tokens), atol=ATOL, rtol=0)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(hf_logits(back, tokens), our_logits(model, tokens), atol=ATOL, rtol=0)


def test_train_from_hf_then_export(tmp_path: Path, corpus: Path) -> None:
    """A spec with init_from hf:URL (model fields from the folder's config.json) trains 3 steps; the
    sharded checkpoint, exported tensor by tensor, is a Mistral again and gives transformers the
    logits our trained model (load_checkpoint) gives."""
    ref = hf_model(MistralConfig(**{**_LLAMA, "vocab_size": 300}))  # the byte tokenizer's 257 fit
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    raw = tiny_spec(corpus, train_iters=3, lr=1e-5, warmup_iters=0, eval_interval=0, checkpoint_interval=0)
    fields = model_fields_from_hf(read_hf_config(tmp_path / "hf"), seq_length=32)
    raw["model"] = {**fields, "init_from": "hf:" + (tmp_path / "hf").as_uri()}
    run(parse_spec(raw), tmp_path / "run")

    trained, _ = load_checkpoint(tmp_path / "run" / "checkpoints")
    # Started from transformers' weights: 3 Adam steps of lr 1e-5 move a weight by about 3e-5.
    moved = (trained.layers[1].mlp.fc2.weight - ref.model.layers[1].mlp.down_proj.weight).abs().max()
    assert 0 < moved < 1e-4
    export_checkpoint_hf(tmp_path / "run" / "checkpoints", tmp_path / "out", dtype=torch.float32)
    assert read_hf_config(tmp_path / "out")["model_type"] == "mistral"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(ref)
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        ours = trained(tokens)[..., :300]
    torch.testing.assert_close(hf_logits(back, tokens), ours, atol=ATOL, rtol=0)
