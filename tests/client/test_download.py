"""Checkpoint downloads become a folder safely: hostile archives are refused, manifests are checked."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from megatrain.client.download import (
    DownloadError,
    extract_checkpoint_files,
    extract_checkpoint_tar,
    safe_relative_path,
)


def _tar(members: dict[str, bytes], *, mode: str = "w", extra: list[tarfile.TarInfo] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info)
    return buf.getvalue()


def _checkpoint_files() -> dict[str, bytes]:
    weights, state = b"\x00" * 1000 + b"weights", b'{"step": 20}'
    manifest = {
        "files": [
            {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in (("model.safetensors", weights), ("trainer_state.json", state))
        ]
    }
    return {
        "model.safetensors": weights,
        "trainer_state.json": state,
        "manifest.json": json.dumps(manifest).encode(),
    }


def _chunks(data: bytes, size: int = 97) -> list[bytes]:
    # Odd-sized chunks exercise the reader's buffering across tar block boundaries.
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_tar_stream_extracts_and_strips_the_iter_folder(tmp_path: Path, mode: str) -> None:
    files = {f"iter_0000020/{k}": v for k, v in _checkpoint_files().items()}
    dest = extract_checkpoint_tar(_chunks(_tar(files, mode=mode)), tmp_path / "ckpt")
    assert dest == tmp_path / "ckpt"
    assert sorted(p.name for p in dest.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "trainer_state.json",
    ]
    assert (dest / "trainer_state.json").read_bytes() == b'{"step": 20}'
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging folder left behind


def test_flat_tar_lands_directly_in_dest(tmp_path: Path) -> None:
    dest = extract_checkpoint_tar([_tar(_checkpoint_files())], tmp_path / "a" / "b")
    assert (dest / "model.safetensors").stat().st_size == 1007


@pytest.mark.parametrize("name", ["/etc/evil", "../evil", "iter_1/../../evil", "a\\..\\evil"])
def test_path_traversal_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(DownloadError, match="refusing"):
        extract_checkpoint_tar([_tar({"manifest.json": b"{}", name: b"x"})], tmp_path / "ckpt")
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE])
def test_links_and_devices_are_refused(tmp_path: Path, kind: bytes) -> None:
    link = tarfile.TarInfo("model.safetensors")
    link.type = kind
    link.linkname = "/etc/passwd"
    with pytest.raises(DownloadError, match="not a regular file"):
        extract_checkpoint_tar([_tar({"manifest.json": b"{}"}, extra=[link])], tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_manifest_mismatch_is_an_error(tmp_path: Path) -> None:
    files = _checkpoint_files()
    files["model.safetensors"] = b"\x01" * 1007  # same size, different bytes
    with pytest.raises(DownloadError, match="sha256"):
        extract_checkpoint_tar([_tar(files)], tmp_path / "ckpt")
    files = _checkpoint_files()
    del files["trainer_state.json"]
    with pytest.raises(DownloadError, match="missing trainer_state.json"):
        extract_checkpoint_tar([_tar(files)], tmp_path / "ckpt")


def test_not_a_tar_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="not a valid tar"):
        extract_checkpoint_tar([b"<html>oops</html>"], tmp_path / "ckpt")


def test_existing_destination_rules(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    extract_checkpoint_tar([_tar(_checkpoint_files())], dest)
    (dest / "stale.txt").write_text("from an older download")
    # An old checkpoint folder is replaced as a whole …
    extract_checkpoint_tar([_tar(_checkpoint_files())], dest)
    assert not (dest / "stale.txt").exists()
    # … but a folder that is not a checkpoint is never wiped.
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    with pytest.raises(DownloadError, match="not a checkpoint folder"):
        extract_checkpoint_tar([_tar(_checkpoint_files())], other)
    assert (other / "notes.txt").read_text() == "precious"


def test_listing_of_urls(tmp_path: Path) -> None:
    files = _checkpoint_files()
    listing = {
        "files": [
            {"path": k, "url": f"https://s3.example/{k}?sig=1", "size": len(v)} for k, v in files.items()
        ]
    }
    fetched: list[tuple[str, str]] = []

    def fetch(url: str, target: Path, base: str) -> None:
        fetched.append((url, base))
        target.write_bytes(files[url.split("/")[-1].split("?")[0]])

    dest = extract_checkpoint_files(listing, tmp_path / "ckpt", fetch, base="http://api/")
    assert len(fetched) == 3 and (dest / "model.safetensors").read_bytes() == files["model.safetensors"]
    bad = {"files": [{"path": "../x", "url": "https://s3.example/x"}]}
    with pytest.raises(DownloadError):
        extract_checkpoint_files(bad, tmp_path / "other", fetch, base="http://api/")


def test_safe_relative_path() -> None:
    assert str(safe_relative_path("./iter_1/model.safetensors")) == "iter_1/model.safetensors"
    assert safe_relative_path("./") is None
