"""The model server's core (megatrain/engine/serving): greedy tokens equal generate() and
transformers' generate() on the exported model; continuous batching gives each request the tokens
it gets alone; rows of different LoRA adapters of one base share one batch and each answers as its
merged checkpoint does; chats are tokenized as fine-tuning tokenized them; stop strings, max_tokens
and log-probabilities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain.engine.build import build_model
from megatrain.engine.checkpoint import load_checkpoint
from megatrain.engine.config import TransformerConfig, transformer_config
from megatrain.engine.data.chat_templates import load_chat_template
from megatrain.engine.data.finetune import encode_chat
from megatrain.engine.data.tokenizers import ByteTokenizer
from megatrain.engine.generate import generate
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.serving import AdapterBank, Batcher, SamplingParams, TextStream, encode_chat_prompt
from megatrain.engine.train import run
from megatrain.spec import parse_spec

from .helpers import tiny_spec, write_corpus

BYTES = ByteTokenizer()
EOD = BYTES.eod
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def tiny(preset: str, seed: int = 0, **overrides: Any) -> GPTModel:
    torch.manual_seed(seed)
    # A wide init gives peaked logits: no near-ties for a rounding difference to flip.
    cfg = TransformerConfig.preset(preset, init_method_std=0.3, vocab_size=384, seq_length=32, **overrides)
    return GPTModel(cfg).eval()


def serve(
    batcher: Batcher, requests: list[tuple[list[int], SamplingParams]], arrive_every: int = 1
) -> list[list[int]]:
    """Submit the requests one every `arrive_every` steps (joining a running batch), step to the end."""
    seqs, pending = [], list(requests)
    step = 0
    while pending or batcher.busy:
        if pending and step % arrive_every == 0:
            seqs.append(batcher.submit(*pending.pop(0)))
        batcher.step()
        step += 1
    return [s.tokens for s in seqs]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_greedy_equals_generate_and_transformers_generate(preset: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from megatrain.engine.interop.hf import export_model_hf

    model = tiny(preset, **({"num_query_groups": 2} if preset == "tiny-llama" else {}))
    export_model_hf(model, tmp_path, dtype=torch.float32, extra_config={"eos_token_id": EOD})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = [[5, 17, 99, 3], [42], [72, 101, 108, 108, 111, 44, 32]]
    served = serve(Batcher(model, BYTES, max_batch=2), [(p, GREEDY) for p in prompts])
    for prompt, got in zip(prompts, served, strict=True):
        assert got == generate(model, prompt, 12, eos_id=EOD, vocab_limit=BYTES.vocab_size)
        ids = torch.tensor([prompt])
        # The exported model's vocabulary is our padded one: its padding rows are suppressed as ours are.
        bad = [[t] for t in range(BYTES.vocab_size, model.config.vocab_size)]
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=EOD, eos_token_id=EOD, bad_words_ids=bad)  # fmt: skip
        assert got == out[0, len(prompt) :].tolist()


def test_continuous_batching_gives_each_request_its_tokens_alone() -> None:
    model = tiny("tiny-llama")
    requests = [
        ([1, 2, 3], GREEDY),
        ([200, 100, 7, 7, 7, 7, 7, 7, 9], SamplingParams(max_tokens=5, temperature=0)),
        ([9], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3)),
        ([44, 45], SamplingParams(max_tokens=9, temperature=1.3, seed=11)),
        ([60] * 20, GREEDY),  # reaches seq_length (32) before max_tokens
        ([3, 1, 4, 1, 5], SamplingParams(max_tokens=7, temperature=1.0, seed=0)),
    ]
    alone = [serve(Batcher(model, BYTES, max_batch=1), [r])[0] for r in requests]
    # Three rows for six requests arriving every other step: rows join and leave mid-batch, some wait.
    batched = Batcher(model, BYTES, max_batch=3)
    assert serve(batched, requests, arrive_every=2) == alone
    assert batched.stats.most_rows == 3
    assert len(alone[4]) == 32 - 20  # the model's seq_length ends it
    # A seeded request draws what generate(seed=...) draws.
    _, p = requests[2]
    want = generate(model, [9], 20, greedy=False, temperature=0.8, top_p=0.9, seed=3, eos_id=EOD,
                    vocab_limit=BYTES.vocab_size)  # fmt: skip
    assert alone[2] == want


def test_a_requests_n_choices_share_one_prefill() -> None:
    """n sequences of one prompt (a request's `n`, seeded apart) prefill it once: the others copy the
    first one's cached prompt, and each draws what it draws alone; a later arrival with the same
    prompt copies it from a running row too, another prompt prefills its own."""
    model = tiny("tiny-llama")
    prompt = [7, 8, 9, 10, 11, 12]
    requests = [(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=i)) for i in range(4)]
    requests += [(prompt, GREEDY), ([5, 6], GREEDY)]
    alone = [serve(Batcher(model, BYTES, max_batch=1), [r])[0] for r in requests]
    batched = Batcher(model, BYTES, max_batch=4)
    assert serve(batched, requests) == alone
    assert batched.stats.prefills == 2 and batched.stats.shared_prefills == 4
    assert len({tuple(t) for t in alone[:4]}) > 1  # the seeds drew differently


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two LoRA runs on one (seeded) base, trained apart: their checkpoints hold adapters only."""
    tmp = tmp_path_factory.mktemp("serve-lora")
    corpus = write_corpus(tmp / "c.jsonl", num_docs=40)
    specs = {}
    for name, lr in (("a", 5e-2), ("b", 2e-2)):
        raw = tiny_spec(corpus, train_iters=2, checkpoint_interval=2, eval_interval=0, lr=lr, warmup_iters=0,
                        global_batch_size=2, async_checkpoint=False, method="lora",
                        lora={"rank": 4, "alpha": 8.0})  # fmt: skip
        raw["model"]["init_method_std"] = 0.3  # peaked logits (see `tiny`)
        specs[name] = parse_spec(raw)
        run(specs[name], tmp / name)
    return {"tmp": tmp, "specs": specs}


def test_adapters_of_one_base_share_a_batch_and_answer_as_their_checkpoints(
    lora_runs: dict[str, Any],
) -> None:
    tmp, spec = lora_runs["tmp"], lora_runs["specs"]["a"]
    mcfg = transformer_config(spec, BYTES.vocab_size)
    base = build_model(mcfg, ParallelState.single(), spec.training.seed, "cpu").module.eval()
    bank = AdapterBank(base, mcfg, None)
    batcher = Batcher(base, BYTES, max_batch=4, adapters=bank)
    urls = {name: (tmp / name / "checkpoints").as_uri() for name in ("a", "b")}
    adapters = {name: bank.read(url) for name, url in urls.items()}
    assert bank.read(urls["a"]) is adapters["a"]  # read once, kept
    prompt = [100, 101, 102]
    seqs = {
        "a": batcher.submit(prompt, GREEDY, adapter=adapters["a"]),
        "b": batcher.submit(prompt, GREEDY, adapter=adapters["b"]),
        "base": batcher.submit(prompt, GREEDY),
    }
    while batcher.busy:
        batcher.step()
    assert batcher.stats.most_rows == 3 and batcher.stats.mixed_steps > 0
    for name in ("a", "b"):  # megatrain generate's model: the checkpoint with its adapters merged
        merged, _ = load_checkpoint(tmp / name / "checkpoints")
        assert seqs[name].tokens == generate(merged, prompt, 12, eos_id=EOD, vocab_limit=BYTES.vocab_size)
    assert seqs["base"].tokens == generate(base, prompt, 12, eos_id=EOD, vocab_limit=BYTES.vocab_size)
    assert len({tuple(s.tokens) for s in seqs.values()}) == 3  # the adapters changed the answers


def test_an_adapter_of_another_base_is_refused(lora_runs: dict[str, Any]) -> None:
    from megatrain.engine.serving import AdapterError

    tmp, spec = lora_runs["tmp"], lora_runs["specs"]["a"]
    mcfg = transformer_config(spec, BYTES.vocab_size)
    base = build_model(mcfg, ParallelState.single(), 0, "cpu").module
    with pytest.raises(AdapterError, match="holds adapters of None; this server holds hf:"):
        AdapterBank(base, mcfg, "hf:file:///elsewhere").read((tmp / "a" / "checkpoints").as_uri())


@pytest.mark.parametrize(
    ("targets", "rslora"),
    [(["q_proj", "v_proj"], False),  # PEFT's default for Llama: k_proj's part of our qkv stays zero
     (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], True)],  # up_proj's too
)  # fmt: skip
def test_a_peft_adapter_folder_answers_as_peft_does(targets: list[str], rslora: bool, tmp_path: Path) -> None:
    """A PEFT LoRA folder (written by peft on the exported base, its B random: a fresh one is zero)
    served over our base beside a row without it: greedy equals peft's own model's generate."""
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    from megatrain.engine.interop.hf import export_model_hf

    model = tiny("tiny-llama", num_query_groups=2)
    export_model_hf(model, tmp_path / "base", dtype=torch.float32, extra_config={"eos_token_id": EOD})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, use_rslora=rslora, target_modules=targets
    )
    tuned = peft.get_peft_model(hf, config).eval()
    for name, p in tuned.named_parameters():  # peaked: no near-ties for a rounding difference to flip
        if "lora_B" in name:
            p.data.normal_(0.0, 0.5)
    tuned.save_pretrained(tmp_path / "adapter")
    bank = AdapterBank(model, model.config, "hf:base")
    adapter = bank.read(f"hf:{(tmp_path / 'adapter').as_uri()}")
    batcher = Batcher(model, BYTES, max_batch=2, adapters=bank)
    prompt = [72, 101, 108, 108, 111]
    seqs = [batcher.submit(prompt, GREEDY, adapter=adapter), batcher.submit(prompt, GREEDY)]
    while batcher.busy:
        batcher.step()
    ids = torch.tensor([prompt])
    bad = [[t] for t in range(BYTES.vocab_size, model.config.vocab_size)]
    with torch.no_grad():
        out = tuned.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, pad_token_id=EOD, eos_token_id=EOD,
                             bad_words_ids=bad)  # fmt: skip
    assert seqs[0].tokens == out[0, len(prompt) :].tolist()
    assert seqs[1].tokens == generate(model, prompt, 12, eos_id=EOD, vocab_limit=BYTES.vocab_size)
    assert seqs[0].tokens != seqs[1].tokens and batcher.stats.mixed_steps > 0
    # A folder that is no adapter is named.
    from megatrain.engine.serving import AdapterError

    with pytest.raises(AdapterError, match="adapter_config.json"):
        bank.read(f"hf:{(tmp_path / 'base').as_uri()}")


def test_a_chat_prompt_is_tokenized_as_finetuning_tokenized_the_chat() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye?"}]  # fmt: skip
    answer = {"role": "assistant", "content": "bye"}
    for name in ("plain", "chatml"):
        template = load_chat_template(name)
        trained, flags = encode_chat([*chat, answer], template, BYTES)
        prompt = encode_chat_prompt(chat, template, BYTES)
        first_answer_token = len(flags) - list(reversed(flags)).index(0)  # after the last prompt token
        assert prompt == trained[:first_answer_token].tolist(), name


def test_stop_strings_max_tokens_and_logprobs() -> None:
    model = tiny("tiny-llama")
    free = serve(Batcher(model, BYTES), [([72, 105], SamplingParams(max_tokens=12, temperature=0))])[0]
    text = BYTES.decode(free)
    stop = text[3:5]
    batcher = Batcher(model, BYTES)
    seq = batcher.submit([72, 105], SamplingParams(max_tokens=12, temperature=0, stop=(stop,), logprobs=3))
    while batcher.busy:
        batcher.step()
    assert seq.finish_reason == "stop" and seq.text == text[: text.index(stop)]
    logits = model(torch.tensor([[72, 105]]))[0, -1, : BYTES.vocab_size].float()
    first = seq.logprobs[0]
    assert first.token == free[0] and len(first.top) == 3 and first.top[0][0] == free[0]
    assert first.logprob == pytest.approx(torch.log_softmax(logits, -1)[free[0]].item(), abs=1e-5)
    batcher = Batcher(model, BYTES)
    seq = batcher.submit([72, 105], SamplingParams(max_tokens=4, temperature=0))
    while batcher.busy:
        batcher.step()
    assert seq.finish_reason == "length" and seq.tokens == free[:4]


def test_text_stream_holds_back_a_possible_stop_and_incomplete_characters() -> None:
    stream = TextStream(BYTES, stop=("END",))
    out = [stream.push(t) for t in "héllo E".encode()]
    assert "".join(t for t, _ in out) == "héllo "  # "E" may begin "END"; é's first byte waits
    assert stream.push(ord("N")) == ("", False)
    assert stream.push(ord("D")) == ("", True) and stream.text == "héllo "
    stream = TextStream(BYTES, stop=("END",))
    for t in b"ok E":
        stream.push(t)
    assert stream.rest() == "E"  # the sequence ended: what was held back is final


def test_a_full_queue_says_busy() -> None:
    from megatrain.engine.serving import Busy

    batcher = Batcher(tiny("tiny-llama"), BYTES, max_batch=1, max_waiting=2)
    for _ in range(2):
        batcher.submit([1, 2], GREEDY)
    with pytest.raises(Busy):
        batcher.submit([1, 2], GREEDY)
    batcher.step()  # one joins the batch: a place to wait is free again
    batcher.submit([1, 2], GREEDY)
