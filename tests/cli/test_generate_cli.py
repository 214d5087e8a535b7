"""`megatrain generate` on a checkpoint a tiny training run wrote, on a job's checkpoint through the
API (downloaded once into the cache), and its one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app

SEQ_LENGTH = 32


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    # An exception that escaped the command (CliRunner catches it) is a traceback for a user.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint root of a one-step training run of a tiny Llama (byte tokenizer)."""
    from megatrain.engine.train import run as train
    from megatrain.spec import parse_spec

    tmp = tmp_path_factory.mktemp("generate")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"def f{i}(x): return x * {i}\n"}) + "\n" for i in range(40))
    )
    spec = {
        "name": "tiny-generate",
        "model": {"arch": "llama", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": SEQ_LENGTH},
        "data": {"train": [{"path": corpus.as_uri()}], "split": "100,0,0"},
        "training": {"train_iters": 1, "global_batch_size": 2, "micro_batch_size": 2, "precision": "fp32",
                     "checkpoint_interval": 1, "eval_interval": 0, "warmup_iters": 0, "log_interval": 1},
        "resources": {"devices": 1},
    }  # fmt: skip
    train(parse_spec(spec), tmp / "out")
    return tmp / "out" / "checkpoints"


def expected(source: Path, ids: list[int], n: int, **sampling: object) -> list[int]:
    """What the library gives for the same checkpoint: the byte tokenizer's eod and vocabulary."""
    from megatrain.engine.checkpoint import load_checkpoint
    from megatrain.engine.generate import generate

    model, _ = load_checkpoint(source)
    return generate(model, ids, n, eos_id=256, vocab_limit=257, **sampling)  # type: ignore[arg-type]


def ids_line(stdout: str, name: str) -> list[int]:
    line = next(x for x in stdout.splitlines() if x.startswith(f"{name}: "))
    text = line.removeprefix(f"{name}: ")
    return [int(i) for i in text.split(",")] if text else []


def test_prompt_ids_on_a_checkpoint_folder_and_root(checkpoint_root: Path) -> None:
    folder = checkpoint_root / "iter_0000001"
    want = expected(folder, [100, 101, 102], 6)
    for source in (folder, checkpoint_root):
        code, out, _ = run("generate", str(source), "--prompt-ids", "100, 101,102", "--max-new-tokens", "6")
        assert code == 0, out
        assert ids_line(out, "prompt ids") == [100, 101, 102]
        assert ids_line(out, "new ids") == want
        assert out.splitlines()[0] == bytes(i for i in [100, 101, 102, *want] if i < 256).decode(
            "utf-8", errors="replace"
        )


def test_text_prompt_and_seeded_sampling(checkpoint_root: Path) -> None:
    args = ("generate", str(checkpoint_root), "--prompt", "def f", "--max-new-tokens", "8")
    code, out, _ = run(*args)
    want = expected(checkpoint_root, list(b"def f"), 8)
    assert code == 0 and out.rstrip("\n") == bytes(list(b"def f") + [i for i in want if i < 256]).decode(
        "utf-8", errors="replace"
    ), out
    sample = ("--temperature", "1.5", "--top-k", "50", "--top-p", "0.9", "--seed", "4", "--prompt-ids", "1,2")
    code, out, _ = run("generate", str(checkpoint_root), *sample)
    want = expected(checkpoint_root, [1, 2], 30, greedy=False, temperature=1.5, top_k=50, top_p=0.9, seed=4)
    assert code == 0 and ids_line(out, "new ids") == want, out
    assert len(want) == SEQ_LENGTH - 2 or want[-1] == 256  # it ran to seq_length or to eod


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "x", "--prompt-ids", "1"], "exactly one of"),
        ([], "exactly one of"),
        (["--prompt-ids", "1,x"], "'x' is not an integer"),
        (["--prompt-ids", "1,300"], "prompt id 300 is outside the vocabulary [0, 257)"),
        (["--prompt-ids", ",".join(["1"] * (SEQ_LENGTH + 1))], "seq_length is 32"),
        (["--prompt", "x" * (SEQ_LENGTH + 1)], "seq_length is 32"),
        (["--prompt-ids", "1", "--greedy", "--top-k", "3"], "--greedy takes no sampling options (--top-k)"),
        (["--prompt-ids", "1", "--temperature", "0"], "temperature=0.0 must be > 0"),
        (["--prompt-ids", "1", "--device", "tpu"], "is not cpu, cuda or cuda:N"),
    ],
)
def test_bad_input_is_one_error_line(checkpoint_root: Path, args: list[str], message: str) -> None:
    code, out, err = run("generate", str(checkpoint_root), *args)
    assert code == 1 and out == "", out
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_missing_sources_are_one_error_line(tmp_path: Path, megatrain_home: Path) -> None:
    for source, message in [
        (str(tmp_path / "nowhere"), "no checkpoint folder at"),
        (str(tmp_path), "complete checkpoint"),  # an empty folder
        ("job-0000000000000000@x", "the step after @ must be a number"),
    ]:
        code, out, err = run("generate", source, "--prompt-ids", "1")
        assert code == 1 and err.count("\n") == 1 and message in err, (source, err)


def test_a_job_checkpoint_is_downloaded_once(live_api: LiveApi, checkpoint_root: Path) -> None:
    from megatrain.client import Client
    from megatrain.db.models import Checkpoint
    from megatrain.db.session import session_scope
    from megatrain.storage import open_store

    with Client() as client:
        job_id = client.submit(live_api.spec()).id
    code, _, err = run("generate", job_id, "--prompt-ids", "1")
    assert code == 1 and err.count("\n") == 1 and "no checkpoints" in err, err
    # The training run's checkpoint stored where the job's would be, with its row.
    store = open_store(f"{live_api.settings.resolved_storage_url}/jobs/{job_id}/checkpoints")
    folder = checkpoint_root / "iter_0000001"
    for f in folder.iterdir():
        store.put_file(f"iter_0000003/{f.name}", f)
    with session_scope(live_api.settings.resolved_database_url) as session:
        session.add(Checkpoint(job_id=job_id, step=3, uri=f"{store.url}/iter_0000003", size_bytes=1))
    want = expected(folder, [5, 6], 4)
    code, out, err = run("generate", job_id, "--prompt-ids", "5,6", "--max-new-tokens", "4")
    assert code == 0 and ids_line(out, "new ids") == want, out + err
    cached = live_api.settings.home / "cache" / "checkpoints" / job_id / "iter_0000003"
    assert (cached / "manifest.json").is_file()
    # The next call reads the cache: the stored copy is no longer needed.
    shutil.rmtree(Path(store.url.removeprefix("file://")) / "iter_0000003")
    code, out, err = run("generate", f"{job_id}@3", "--prompt-ids", "5,6", "--max-new-tokens", "4")
    assert code == 0 and ids_line(out, "new ids") == want, out + err
    code, out, err = run("generate", f"{job_id}@9", "--prompt-ids", "5,6")
    assert code == 1 and err.count("\n") == 1 and "404" in err, err


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random transformers Llama saved with save_pretrained, and a word-level tokenizer.json
    of its 100 ids (</s>, id 2, ends a text)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, max_position_embeddings=SEQ_LENGTH, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / "model")
    shutil.copytree(folder / "model", folder / "with_tokenizer")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 100)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    tok.save(str(folder / "with_tokenizer" / "tokenizer.json"))
    return folder


def test_an_hf_model_with_and_without_its_tokenizer(hf_folder: Path) -> None:
    from megatrain.engine.generate import generate
    from megatrain.engine.interop.hf import load_hf_model

    model, _ = load_hf_model(str(hf_folder / "model"))
    want = generate(model, [5, 6, 7], 10, eos_id=2, vocab_limit=100)
    code, out, _ = run(
        "generate", f"hf:{hf_folder / 'with_tokenizer'}", "--prompt", "w5 w6 w7", "--max-new-tokens", "10"
    )
    assert code == 0 and out.rstrip("\n") == " ".join(
        f"w{i}" if i > 2 else "</s>" for i in [5, 6, 7, *want]
    ), out
    code, out, err = run(
        "generate", f"hf:{hf_folder / 'model'}", "--prompt-ids", "5,6,7", "--max-new-tokens", "10"
    )
    # Without a tokenizer: no text and no eos to stop at, the ids all the same.
    assert code == 0 and ids_line(out, "new ids") == generate(model, [5, 6, 7], 10), out
    assert "has no tokenizer.json" in err
    code, out, err = run("generate", f"hf:{hf_folder / 'model'}", "--prompt", "w5")
    assert code == 1 and err.count("\n") == 1 and "--prompt needs the model's tokenizer" in err, err
    code, out, err = run("generate", f"hf:{hf_folder / 'model'}", "--prompt-ids", "100")
    assert code == 1 and "prompt id 100 is outside the vocabulary [0, 100)" in err, err
    code, out, err = run("generate", f"hf:{hf_folder / 'nothing'}", "--prompt-ids", "1")
    assert code == 1 and err.count("\n") == 1, err


def test_an_export_of_a_byte_tokenizer_job(checkpoint_root: Path, tmp_path: Path) -> None:
    """The export task's folder of a byte-tokenizer job carries a tokenizer: `generate hf:EXPORT
    --prompt` gives the checkpoint's text, and transformers' own tokenizer and generate() agree."""
    import torch
    import transformers

    from megatrain.worker.exports import _run_export

    folder = checkpoint_root / "iter_0000001"
    _run_export(folder.as_uri(), str(tmp_path / "export"), "fp32", None)
    code, want, _ = run("generate", str(folder), "--prompt", "def f", "--max-new-tokens", "8")
    assert code == 0
    code, out, err = run(
        "generate", f"hf:{tmp_path / 'export'}", "--prompt", "def f", "--max-new-tokens", "8"
    )
    assert code == 0 and out == want, out + err

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = tokenizer("def f é", return_tensors="pt").input_ids
    assert ids[0].tolist() == list("def f é".encode())
    new = expected(folder, ids[0].tolist(), 8)
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert theirs == new  # greedy, stopping at the end-of-document id generation_config.json names
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 256
    text = bytes(i for i in new if i < 256).decode("utf-8", errors="replace")
    assert tokenizer.decode(theirs + [256], skip_special_tokens=True) == text
