"""`megatrain checkpoints` and `megatrain export` end to end: a live API, an engine-trained
checkpoint in the job's storage, the export run by the real task (handed out by the scheduler's
dispatch, on a thread), downloaded and loaded with transformers (a LoRA job's adapter with peft)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.checkpoints import exports_in_background, train_job_checkpoint
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.client import Client
from megatrain.storage import open_store


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


@pytest.fixture
def export_workers(live_api: LiveApi) -> Iterator[None]:
    with exports_in_background(live_api.settings):
        yield


def test_checkpoints_and_export_to_a_folder(
    live_api: LiveApi, export_workers: None, tmp_path: Path, s3_bucket_url: str
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with Client() as client:
        job_id = client.submit(live_api.spec("exported")).id
    code, out = run("checkpoints", job_id)
    assert code == 0 and "no checkpoints yet" in out, out
    train_job_checkpoint(live_api.settings, job_id, tmp_path / "train")

    code, out = run("checkpoints", job_id)
    assert code == 0 and re.search(r"^\s*2\s+\S+ (KiB|MiB)\s+\d{4}-", out, re.M), out

    dest = tmp_path / "model"
    code, out = run("export", f"{job_id}@2", "--to", str(dest), "--dtype", "fp32")
    assert code == 0, out
    assert "exports/hf/iter_0000002-fp32" in out and f"downloaded to {dest}" in out, out
    assert "AutoModelForCausalLM.from_pretrained" in out and "AutoTokenizer.from_pretrained" in out, out
    files = {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert {p.name for p in dest.iterdir()} >= files
    model = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape[:2] == (1, 3)

    # To object storage: the same folder, uploaded with the caller's credentials (moto's S3 here).
    code, out = run("export", f"{job_id}@2", "--to", f"{s3_bucket_url}/models/m1", "--dtype", "fp32")
    assert code == 0 and f"uploaded to {s3_bucket_url}/models/m1" in out, out
    store = open_store(f"{s3_bucket_url}/models/m1")
    assert sorted(o.key for o in store.list()) == sorted(p.name for p in dest.iterdir())
    for p in dest.iterdir():
        assert store.get_bytes(p.name) == p.read_bytes(), p.name

    # The same export again (the ready one is reused) over the earlier download; then the listing.
    code, out = run("export", job_id, "--to", str(dest), "--dtype", "fp32")
    assert code == 0 and f"downloaded to {dest}" in out, out
    code, out = run("checkpoints", job_id)
    assert code == 0 and "ready" in out and "fp32" in out and "iter_0000002-fp32" in out, out

    # The SDK the CLI calls: a bf16 export of the latest step, waited for, downloaded.
    with Client() as client:
        exp = client.export(job_id, dtype="bf16", wait=True, timeout_s=120, poll_interval_s=0.2)
        assert (exp.status, exp.step, exp.dtype) == ("ready", 2, "bf16")
        assert [e.dtype for e in client.exports(job_id)] == ["fp32", "bf16"]
        path = client.download_export(job_id, exp.id, tmp_path / "bf16")
    assert transformers.AutoModelForCausalLM.from_pretrained(path).dtype == torch.bfloat16


def test_a_lora_job_exports_its_adapter_and_its_merged_model(
    live_api: LiveApi, export_workers: None, tmp_path: Path
) -> None:
    """`--adapter` downloads PEFT's folder, which peft loads on the job's frozen base; the default
    (`--merged`) downloads the model with the adapters merged in: the same logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    lora = {"rank": 4, "alpha": 8.0}
    with Client() as client:
        job_id = client.submit(live_api.spec("lora-exported", method="lora", lora=lora)).id
    train_job_checkpoint(live_api.settings, job_id, tmp_path / "train", lora=lora)

    adapter = tmp_path / "adapter"
    code, out = run("export", job_id, "--to", str(adapter), "--adapter", "--dtype", "fp32")
    assert code == 0, out
    assert "exports/hf/iter_0000002-fp32-adapter" in out and f"downloaded to {adapter}" in out, out
    assert "PeftModel.from_pretrained" in out and "AutoModelForCausalLM.from_pretrained(BASE)" in out, out
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json",
    }  # fmt: skip
    merged = tmp_path / "merged"
    code, out = run("export", job_id, "--to", str(merged), "--merged", "--dtype", "fp32")
    assert code == 0 and "exports/hf/iter_0000002-fp32 " in out and f"downloaded to {merged}" in out, out
    code, out = run("checkpoints", job_id)
    assert (
        code == 0
        and re.search(r"\s2\s+adapter\s+fp32\s+ready", out)
        and re.search(r"\s2\s+model\s+fp32", out)
    )

    # The job's frozen base, as transformers' model (engine-side: the product exports no bare base).
    from megatrain.engine.checkpoint import CheckpointReader
    from megatrain.engine.interop.hf import export_hf

    reader = CheckpointReader(
        f"{live_api.settings.resolved_storage_url}/jobs/{job_id}/checkpoints/iter_0000002"
    )
    export_hf(reader.tensor, reader.model_config, tmp_path / "base", dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    tokens = torch.tensor(
        [transformers.AutoTokenizer.from_pretrained(adapter).encode("class Point:\n    x = 0")]
    )
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(tokens).logits
        # fp32 logits of the same weights: merged (W + s·B̃·A) and peft's two-path sum round apart
        torch.testing.assert_close(with_adapter(tokens).logits, want, atol=1e-5, rtol=0)
        with with_adapter.disable_adapter():
            assert (with_adapter(tokens).logits - want).abs().max() > 1e-3  # the adapters moved


def test_export_errors_are_one_red_line(live_api: LiveApi, tmp_path: Path) -> None:
    with Client() as client:
        job_id = client.submit(live_api.spec("no-ckpt")).id
    cases = [
        (("export", job_id, "--to", "gs://bucket/model"), "unsupported storage URL"),
        (("export", f"{job_id}@x", "--to", str(tmp_path)), "JOB@STEP"),
        (("export", job_id, "--to", str(tmp_path), "--dtype", "fp16"), "bf16, fp32"),
        (("export", job_id, "--to", str(tmp_path)), "no checkpoints yet"),
        (("export", "job-0000000000000000", "--to", str(tmp_path)), "not found"),
        (("export", job_id, "--to", str(tmp_path), "--adapter", "--merged"), "exclude each other"),
        # A job that trained every weight has no adapters, whether or not it has checkpoints yet.
        (
            ("export", job_id, "--to", str(tmp_path), "--adapter"),
            f"--adapter: job {job_id} trained every weight (training.method is 'full'): it has no LoRA",
        ),
    ]
    for args, expected in cases:
        code, out = run(*args)
        assert code == 1 and "error:" in out and expected in out, (args, out)
        assert len(out.strip().splitlines()) == 1, out
