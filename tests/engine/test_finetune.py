"""Fine-tuning data: chat templates (built-in, and Jinja ones checked against transformers' own
apply_chat_template), the records' loss masks, the cache, splits and epochs, and a loss that ignores
prompt tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.data.chat_templates import ChatTemplateError, load_chat_template
from megatrain.engine.data.finetune import RecordError, build_finetune_datasets, encode_chat
from megatrain.engine.data.tokenizers import ByteTokenizer, HFTokenizer
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.models.gpt import GPTModel
from megatrain.spec import DataSpec

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Red, or green."},
]


def assistant_text(messages: list[dict], template: str) -> tuple[str, str]:
    """(whole rendered text, the text of its loss tokens) through the byte tokenizer."""
    tok = ByteTokenizer()
    ids, flags = encode_chat(messages, load_chat_template(template), tok)
    return tok.decode(ids.tolist()), tok.decode([int(i) for i, f in zip(ids, flags, strict=True) if f])


def test_builtin_templates_render_and_mask_the_assistant_turns() -> None:
    text, loss = assistant_text(CHAT, "chatml")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\nBlue.<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n"
        "<|im_start|>assistant\nRed, or green.<|im_end|>\n"
    )
    assert loss == "Blue.<|im_end|>\nRed, or green.<|im_end|>\n"
    text, loss = assistant_text(CHAT, "llama3")
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    )
    assert loss == "Blue.<|eot_id|>Red, or green.<|eot_id|>"
    # plain: no markers; the end-of-document id closes each assistant turn (and carries loss).
    tok = ByteTokenizer()
    ids, flags = encode_chat(CHAT[1:3], load_chat_template(None), tok)
    assert tok.decode(ids.tolist()) == "Name a colour.\nBlue."
    assert ids[-1] == tok.eod and flags[-1] == 1
    assert tok.decode([int(i) for i, f in zip(ids, flags, strict=True) if f]) == "Blue."
    assert flags.sum() == len("Blue.") + 1


def test_an_assistant_turn_of_weight_zero_is_context() -> None:
    """OpenAI's per-turn `weight`: the same text, no loss on the turn with weight 0; a chat with no
    trained turn is a record error naming it."""
    weighted = [dict(m) for m in CHAT]
    weighted[2]["weight"] = 0
    text, loss = assistant_text(weighted, "chatml")
    assert text == assistant_text(CHAT, "chatml")[0]
    assert loss == "Red, or green.<|im_end|>\n"
    weighted[4]["weight"] = 0
    from megatrain.engine.data.finetune import record_messages

    with pytest.raises(RecordError, match="no assistant message to train on"):
        record_messages({"messages": weighted}, DataSpec(train=[{"path": "file:///x"}]), "x.jsonl:1")
    weighted[4]["weight"] = 2
    with pytest.raises(RecordError, match=r"messages\[4\].weight must be 0 or 1"):
        record_messages({"messages": weighted}, DataSpec(train=[{"path": "file:///x"}]), "x.jsonl:1")


def test_bad_templates_are_named() -> None:
    with pytest.raises(ChatTemplateError, match="neither a built-in template"):
        load_chat_template("vicuna")
    with pytest.raises(ChatTemplateError, match="does not exist"):
        load_chat_template("file:///nowhere/tokenizer_config.json")


def _write_config(tmp_path: Path, config: object) -> str:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(config))
    return path.as_uri()


def test_tokenizer_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        load_chat_template(_write_config(tmp_path, {"eos_token": "</s>"}))
    with pytest.raises(ChatTemplateError, match="line 1"):
        load_chat_template(_write_config(tmp_path, {"chat_template": "{% for m in messages %}"}))
    bad = load_chat_template(_write_config(tmp_path, {"chat_template": "{{ raise_exception('no system') }}"}))
    with pytest.raises(ChatTemplateError, match="no system"):
        bad.render(CHAT)
    # A template that rewrites earlier turns once later ones exist: its turns cannot be located.
    rewrite = load_chat_template(
        _write_config(
            tmp_path,
            {"chat_template": "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"},
        )
    )
    with pytest.raises(ChatTemplateError, match="assistant turn 2 cannot be located"):
        rewrite.spans(CHAT)


# A ChatML-like Jinja template as tokenizer_config.json files carry them: bos_token, a default system
# message, loop controls, and transformers' {% generation %} marks for its assistant mask.
JINJA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou help.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] | trim + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture
def hf_tokenizer(tmp_path: Path) -> tuple[object, Path]:
    """A byte-level BPE trained here, wrapped as transformers' PreTrainedTokenizerFast with JINJA."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [m["content"] for m in CHAT] * 20 + ["system user assistant You help. colour green"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    fast.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = JINJA
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert reloaded.chat_template == JINJA
    return reloaded, tmp_path


@pytest.mark.parametrize(
    "chat", [CHAT, CHAT[1:3], [*CHAT[1:4], {"role": "assistant", "content": " spaced  "}]]
)
def test_a_jinja_template_matches_transformers(hf_tokenizer: tuple[object, Path], chat: list[dict]) -> None:
    reference, folder = hf_tokenizer
    template = load_chat_template((folder / "tokenizer_config.json").as_uri())
    assert template.special_tokens["bos_token"] == "<s>"
    for gen in (False, True):
        want = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)  # type: ignore[attr-defined]
        assert template.render(chat, add_generation_prompt=gen) == want
    ours = HFTokenizer(str(folder / "tokenizer.json"))
    ids, flags = encode_chat(chat, template, ours)
    theirs = reference.apply_chat_template(  # type: ignore[attr-defined]
        chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids.tolist() == list(theirs["input_ids"])
    assert flags.tolist() == list(theirs["assistant_masks"])
    assert flags.any() and not flags.all()


# -- datasets ------------------------------------------------------------------------------------------


def write_records(path: Path, n: int = 30) -> Path:
    """Chats, and question/answer pairs (custom keys: the spec names them)."""
    with open(path, "w") as f:
        for i in range(n):
            if i % 3 == 0:
                record = {
                    "messages": [
                        {"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": "a" * (i % 7 + 1)},
                    ]
                }
            elif i % 3 == 1:
                record = {"question": f"p{i}:", "answer": "r" * (i % 5 + 2)}
            else:
                record = {"question": "x" * 40, "answer": "y"}  # too long for the window
            f.write(json.dumps(record) + "\n")
    return path


def spec(path: Path, **fields: object) -> DataSpec:
    return DataSpec(train=[{"path": path.as_uri()}], **fields)


def test_records_are_tokenized_once_split_packed_and_counted(tmp_path: Path) -> None:
    path = write_records(tmp_path / "chat.jsonl")
    data = spec(path, split="80,20,0", prompt_key="question", response_key="answer")
    built = build_finetune_datasets(
        data, ByteTokenizer(), 24, seed=5, cache_dir=tmp_path / "cache", packing=True
    )
    train, valid = built["train"], built["valid"]
    assert train is not None and valid is not None and built["test"] is None
    assert train.stats["records"] == 24 and valid.stats["records"] == 6
    # The 40-character questions fill the 25-token window: truncated and then without a target, dropped.
    assert train.stats["dropped"] == 8 and valid.stats["dropped"] == 2
    assert len(train) < train.stats["records"] - train.stats["dropped"]  # several records per sample
    # One epoch covers every kept record exactly once.
    records = np.concatenate([train.samples[i] for i in range(len(train))])
    assert len(records) == len(set(records.tolist())) == 16
    batch = train.batch(list(range(len(train))))
    assert batch.tokens.shape == (len(train), 24) and batch.segment_ids is not None
    # Every loss token is a response token: the byte of 'a' or 'r', or the end-of-document id.
    assert set(batch.labels[batch.loss_mask > 0].tolist()) <= {ord("a"), ord("r"), 256}
    # Epochs wrap in a seeded order; the same seed gives the same batches.
    again = build_finetune_datasets(
        data, ByteTokenizer(), 24, seed=5, cache_dir=tmp_path / "cache", packing=True
    )
    assert again["train"] is not None
    ids = [0, len(train), 2 * len(train) + 1]
    np.testing.assert_array_equal(train.batch(ids).tokens, again["train"].batch(ids).tokens)
    assert sorted(train._order(1).tolist()) == list(range(len(train)))
    assert len(list((tmp_path / "cache").glob("*.idx"))) == 2  # tokens and mask, written once
    # Unpacked: one record per sample, no ids, the same loss tokens in all.
    flat = build_finetune_datasets(
        data, ByteTokenizer(), 24, seed=5, cache_dir=tmp_path / "cache", packing=False
    )
    assert flat["train"] is not None and len(flat["train"]) == 16
    unpacked = flat["train"].batch(list(range(16)))
    assert unpacked.segment_ids is None and unpacked.loss_mask.sum() == batch.loss_mask.sum()
    # Trained tokens count the records' tokens, not the padding: in an unpacked sample, segment 0.
    one = flat["train"]
    for n in (0, 5, 16, 16 + 7):
        real = sum(int((one.sample(i)[2] == 0).sum()) for i in range(n))
        assert one.tokens_through(n) == real <= n * 25 - n, n
    # Packed or not, an epoch trains on the same tokens.
    assert train.tokens_through(2 * len(train)) == 2 * one.tokens_through(16)


def test_long_records_are_truncated_on_the_right(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "q:", "response": "z" * 50}) + "\n")
    built = build_finetune_datasets(spec(path, split="1,0,0"), ByteTokenizer(), 16, 0, tmp_path / "c", True)
    ds = built["train"]
    assert ds is not None and ds.stats == {"records": 1, "truncated": 1, "dropped": 0, "samples": 1}
    batch = ds.batch([0])
    assert bytes(batch.tokens[0].tolist()) == b"q:\n" + b"z" * 13
    assert batch.loss_mask[0].tolist() == [0.0] * 2 + [1.0] * 14


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"bad.jsonl:2: not valid JSON"),
        ('{"prompt": "a"}', r"bad.jsonl:2: needs a 'messages' list, or string 'prompt' and 'response'"),
        ('{"messages": [{"role": "user"}]}', r"bad.jsonl:2: messages\[0\] needs string 'role' and 'content'"),
        ("[1, 2]", r"bad.jsonl:2: a record must be a JSON object"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + line + "\n")
    with pytest.raises(RecordError, match=message):
        build_finetune_datasets(spec(path), ByteTokenizer(), 16, 0, tmp_path / "c", True)
    assert not list((tmp_path / "c").glob("*.idx"))  # nothing half-written is left to be reused


# -- the loss ignores prompt tokens ---------------------------------------------------------------------


def test_a_finetune_loss_ignores_prompt_tokens(tmp_path: Path) -> None:
    path = write_records(tmp_path / "chat.jsonl")
    cfg = TransformerConfig.preset("tiny-llama", vocab_size=320, seq_length=64)
    data = spec(path, split="1,0,0", chat_template="chatml", prompt_key="question", response_key="answer")
    ds = build_finetune_datasets(data, ByteTokenizer(), cfg.seq_length, 0, tmp_path / "c", True)["train"]
    assert ds is not None
    batch = ds.batch([0, 1, 2])
    torch.manual_seed(0)
    model = GPTModel(cfg)

    def loss_and_grads(labels: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor]]:
        mb = MicroBatch.from_batch(batch, "cpu")
        mb.labels = torch.as_tensor(labels)
        model.zero_grad()
        loss = model.loss(mb.tokens, mb.labels, mb.loss_mask, **mb.model_inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(batch.labels)
    prompt = batch.loss_mask == 0
    assert prompt.any() and (~prompt).any()
    changed = batch.labels.copy()
    changed[prompt] = (changed[prompt] + 7) % cfg.vocab_size
    loss2, grads2 = loss_and_grads(changed)
    assert torch.equal(loss, loss2)
    for g, g2 in zip(grads, grads2, strict=True):
        assert torch.equal(g, g2)
    # ... and it is the masked cross-entropy written out by hand.
    with torch.no_grad():
        logits = model(
            torch.as_tensor(batch.tokens),
            torch.as_tensor(batch.position_ids),
            torch.as_tensor(batch.segment_ids),
        )
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, torch.as_tensor(batch.labels).unsqueeze(-1)).squeeze(-1)
        mask = torch.as_tensor(batch.loss_mask)
        torch.testing.assert_close(loss, (nll * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-6)
    # Changing a response label does change it.
    response = changed.copy()
    response[~prompt] = (response[~prompt] + 1) % cfg.vocab_size
    assert not torch.equal(loss_and_grads(response)[0], loss)


# -- the train step: per-token loss over the global batch, across layouts -------------------------------


def _step_rank(rank: int, world: int, workdir: str, parallelism: dict) -> dict:
    """One TrainLoop step and one validation on a packed fine-tuning dataset under `parallelism`."""
    from megatrain.engine.build import build_model, make_trainable
    from megatrain.engine.config import train_config, transformer_config
    from megatrain.engine.loop import Rates, TrainLoop
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.engine.sink import RunLog
    from megatrain.plan.layout import resolve_layout
    from megatrain.spec import ParallelismSpec, parse_spec

    from .helpers import tiny_spec

    root = Path(workdir)
    raw = tiny_spec(root / "chat.jsonl", global_batch_size=8, micro_batch_size=2, precision="fp32")
    raw["model"].update(num_layers=4, seq_length=64)
    raw["data"].update(split="1,0,0", chat_template="chatml", prompt_key="question", response_key="answer")
    raw["parallelism"] = {**parallelism, "distributed_optimizer": False}
    raw["resources"] = {"devices": world}
    spec = parse_spec(raw)
    layout = resolve_layout(spec, world)
    cfg = train_config(spec, layout.dp)
    tokenizer = ByteTokenizer()
    mcfg = transformer_config(spec, tokenizer.vocab_size)
    ds = build_finetune_datasets(spec.data, tokenizer, mcfg.seq_length, cfg.seed, root / f"cache{rank}", True)
    state = ParallelState.build(layout)
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    train = make_trainable(build_model(mcfg, state, cfg.seed, "cpu"), cfg, par, "fp32", mcfg)
    out = root / f"out{world}-{rank}"
    out.mkdir(exist_ok=True)
    loop = TrainLoop(
        train,
        cfg,
        {"train": ds["train"], "valid": ds["train"]},
        RunLog(out, rank == 0),
        Rates(1.0, 1, None),
        print,
    )
    extra = {}
    if world == 1:  # the whole global batch at once, and each micro-batch's loss-token count
        from megatrain.engine.models.gpt import lm_loss

        whole = MicroBatch.from_batch(ds["train"].batch(list(range(8))), "cpu")
        with torch.no_grad():
            logits = train.model.module(whole.tokens, **whole.model_inputs)
            real = train.model.module.config.real_vocab_size  # padding rows are not in the softmax
            extra["by_hand"] = lm_loss(logits[..., :real], whole.labels, whole.loss_mask).item()
            kept = whole.loss_mask > 0
            right = (logits[..., :real].argmax(-1) == whole.labels) & kept
            extra["accuracy_by_hand"] = (right.sum() / kept.sum()).item()
            extra["tokens"] = int(kept.sum())
        extra["counts"] = [
            MicroBatch.from_batch(ds["train"].batch(ids), "cpu").num_loss_tokens for ids in loop._micro_ids(0)
        ]
    loss, result = loop.step(0)
    from megatrain.engine.loop import reduce_mean, token_accuracy, total_hits

    # The step's, counted in its forward passes: each of the 4 micro-batches' loss once, whatever
    # the layout (the pipeline's last stage, every dp rank's own, tensor-parallel ranks not twice).
    calls = total_hits(loop.last_hits[0], state)[1]
    accuracy = token_accuracy(*loop.last_hits, state)
    val, val_accuracy = loop.evaluate()
    return {"loss": reduce_mean(loss, state), "grad_norm": result.grad_norm, "val": val,
            "val_accuracy": val_accuracy, "accuracy": accuracy, "calls": calls,
            "tokens_counted": loop.last_hits[1], **extra}  # fmt: skip


@pytest.mark.distributed
def test_the_step_loss_is_per_token_over_the_global_batch_in_every_layout(tmp_path: Path) -> None:
    from .parallel._launch import run_distributed

    write_records(tmp_path / "chat.jsonl", n=60)
    ref = run_distributed(_step_rank, 1, str(tmp_path), {})[0]
    # Micro-batches with different loss-token counts: a mean of per-micro-batch means would differ.
    assert len(set(ref["counts"])) > 1
    assert abs(ref["loss"] - ref["by_hand"]) < 1e-5  # Σ masked token losses / loss tokens, in one go
    assert ref["accuracy"] == pytest.approx(ref["accuracy_by_hand"], abs=1e-9)
    assert ref["calls"] == 4 and ref["tokens_counted"] == ref["tokens"]
    assert 0.0 < ref["val_accuracy"] < 1.0  # valid_mean_token_accuracy: counted as the step's is
    one_token = 1 / ref["tokens"]  # another summation order may flip a near-tie's argmax, not more
    for layout in ({"dp": 2}, {"pp": 2, "dp": 1}, {"tp": 2, "dp": 1, "sequence_parallel": True}):
        got = run_distributed(_step_rank, 2, str(tmp_path), layout)[0]
        assert abs(got["loss"] - ref["loss"]) < 1e-5, layout
        assert abs(got["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"], layout
        assert abs(got["val"] - ref["val"]) < 1e-5, layout
        assert abs(got["val_accuracy"] - ref["val_accuracy"]) < 1e-2, layout  # (a near-tie may flip)
        assert abs(got["accuracy"] - ref["accuracy"]) <= one_token + 1e-9, layout
        assert got["calls"] == 4 and got["tokens_counted"] == ref["tokens"], layout


def test_a_held_out_file_is_the_validation_split_whole(tmp_path: Path) -> None:
    """data.valid (OpenAI's validation_file): every record of it validates, none trains; data.split
    still takes its own valid share of data.train."""
    train_path = write_records(tmp_path / "train.jsonl", 30)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"question": f"h{i}:", "answer": "z" * 3}) + "\n" for i in range(5)))
    keys = {"prompt_key": "question", "response_key": "answer"}
    only = DataSpec(
        train=[{"path": train_path.as_uri()}], valid=[{"path": held.as_uri()}], split="1,0,0", **keys
    )
    built = build_finetune_datasets(
        only, ByteTokenizer(), 24, seed=5, cache_dir=tmp_path / "c", packing=False
    )
    train, valid = built["train"], built["valid"]
    assert train is not None and valid is not None and built["test"] is None
    assert train.stats["records"] == 30 and valid.stats["records"] == 5
    answers = valid.batch(list(range(len(valid))))
    assert set(answers.labels[answers.loss_mask > 0].tolist()) == {ord("z"), 256}  # the held-out answers
    shared = DataSpec(
        train=[{"path": train_path.as_uri()}], valid=[{"path": held.as_uri()}], split="80,20,0", **keys
    )
    both = build_finetune_datasets(
        shared, ByteTokenizer(), 24, seed=5, cache_dir=tmp_path / "c", packing=False
    )
    assert both["train"].stats["records"] == 24 and both["valid"].stats["records"] == 6 + 5
