"""Writing a directory atomically touches the target, its temporary twin and the parent's entry only.

The parent of a save is often a busy shared folder (/tmp, a home directory): its other files
are not ours to flush, and some cannot be opened at all (a unix socket, a FIFO).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from posttune.checkpoint.atomic import atomic_dir


def test_a_socket_beside_the_target_does_not_stop_the_save(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "server.sock"))  # opening it for fsync fails with ENXIO
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        sock.close()
    assert (tmp_path / "model" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "server.sock"]


def test_a_failed_write_leaves_the_previous_directory(tmp_path):
    with atomic_dir(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "model", replaceable=("config.json",)) as tmp:
        (tmp / "config.json").write_text("new")
        raise RuntimeError("killed")
    assert (tmp_path / "model" / "config.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_failed_final_rename_puts_the_previous_directory_back(tmp_path, monkeypatch):
    """The old directory is moved aside before the new one takes its name: when that second rename fails (a full
    disk, a quota, EIO) the old one is renamed back, never left as ``.model.old-*`` (which the next run removes)."""
    import os

    with atomic_dir(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("old")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".model.tmp-"):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="No space left"), atomic_dir(tmp_path / "model",
                                                                    replaceable=("config.json",)) as tmp:
        (tmp / "config.json").write_text("new")
    assert (tmp_path / "model" / "config.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_every_file_is_flushed_before_the_rename_and_the_rename_after(tmp_path, monkeypatch):
    """Crash safety: a power loss after the rename must find the files' data on disk (fsync each file, and the
    directory, before it), and the rename itself (fsync the parent after it)."""
    import os

    events, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", Path(src).name, Path(dst).name))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    with atomic_dir(tmp_path / "model") as tmp:
        with open(tmp / "weights.bin", "wb") as file:
            file.write(b"x" * 10)
    renamed = next(i for i, event in enumerate(events) if event[0] == "rename")
    assert ("fsync", "weights.bin") in events[:renamed] and ("fsync", tmp.name) in events[:renamed]
    assert events[renamed] == ("rename", tmp.name, "model") and events[renamed + 1:] == [("fsync", tmp_path.name)]
