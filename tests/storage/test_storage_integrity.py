"""What storage does for integrity beyond a write's atomic rename: the directory fsynced after it
(file://), and a full-object CRC32 recorded with every upload and checked on download (s3://)."""

from __future__ import annotations

from pathlib import Path

import pytest

import megatrain.storage as storage
from megatrain.storage import FileStore, fsync_dir


def test_fsync_dir_on_a_real_directory(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"1")
    fsync_dir(tmp_path)
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "x")


def test_a_file_put_fsyncs_its_directory_and_the_ones_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the rename, the object's folder is fsynced (with the object in it), and so is the
    parent of every folder the put created, up to the first that existed."""
    seen: list[tuple[Path, list[str]]] = []
    real = storage.fsync_dir

    def record(path: str | Path) -> None:
        seen.append((Path(path), sorted(p.name for p in Path(path).iterdir())))
        real(path)

    monkeypatch.setattr(storage, "fsync_dir", record)
    root = tmp_path / "root"
    root.mkdir()
    store = FileStore(root)
    store.put_bytes("a/b/manifest.json", b"{}")
    assert seen == [(root / "a" / "b", ["manifest.json"]), (root / "a", ["b"]), (root, ["a"])]
    seen.clear()
    src = tmp_path / "src"
    src.write_bytes(b"data")
    store.put_file("a/b/shard.bin", src)
    assert seen == [(root / "a" / "b", ["manifest.json", "shard.bin"])]
