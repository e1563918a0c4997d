"""A checkpoint's manifest: every file with its size and sha256, written last (docs/checkpoints.md).

The atomic rename guarantees a checkpoint directory is never half-written by posttune; the
manifest catches what happens to it afterwards (a truncated copy, a disk error, a file
removed by hand). ``resume: latest`` verifies it and falls back to the newest intact
checkpoint; a checkpoint named explicitly must be intact. A checkpoint written before
manifests existed has none and is accepted unverified.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 1 << 24


def write_manifest(directory: Path) -> None:
    """List every file under ``directory`` (sizes and sha256); call it after everything else is written."""
    files = {rel: {"size": (directory / rel).stat().st_size, "sha256": _sha256(directory / rel)}
             for rel in _files(directory)}
    (directory / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")


def damage(directory: Path) -> str | None:
    """What is wrong with the checkpoint at ``directory``, or None when it matches its manifest
    (or has none: an older checkpoint, accepted unverified)."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    if not isinstance(files, dict) or not all(isinstance(entry, dict) and type(entry.get("size")) is int
                                              and isinstance(entry.get("sha256"), str) for entry in files.values()):
        return f"{MANIFEST} is unreadable"  # JSON of another shape: the same as none that parses
    for rel, expected in sorted(files.items()):
        file = directory / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:  # a manifest names files of its own checkpoint only
            return f"{MANIFEST} names {rel!r}, outside the checkpoint"
        if not file.is_file():
            return f"{rel} is missing"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"{rel} has {size} bytes, expected {expected['size']}"
        if _sha256(file) != expected["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
