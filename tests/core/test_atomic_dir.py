"""Writing a directory atomically touches the target, its temporary twin and the parent's entry only.

The parent of a save is often a busy shared folder (/tmp, a home directory): its other files
are not ours to flush, and some cannot be opened at all (a unix socket, a FIFO).
"""

from __future__ import annotations

import socket

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
