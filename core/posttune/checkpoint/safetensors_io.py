"""Streaming reads and writes of the safetensors file format, one tensor at a time.

Why not ``safetensors.safe_open`` / ``save_file``: ``safe_open`` memory-maps the whole file,
and every page it touches counts in the process's resident memory until the file is closed,
so loading a 1-shard checkpoint would peak at twice its size; ``save_file`` serialises a
whole shard in memory before writing it. Here a read goes with plain ``readinto`` into one
freshly allocated tensor, and a write sends each tensor's bytes straight to the file, so
memory beyond the model itself is bounded by the largest single tensor.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`` padded with spaces, then the tensors' bytes, contiguous,
little-endian, offsets relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from posttune.errors import PosttuneError

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100_000_000  # the reference implementation's limit; guards against garbage files
CHUNK = 1 << 28  # bytes per read/write call: the OS may shorten larger ones


@dataclass(frozen=True)
class Entry:
    """One tensor as the header describes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> list[Entry]:
    """The tensors a file holds, in file order, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PosttuneError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise PosttuneError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PosttuneError(f"{path}: corrupt safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    entries = [_entry(path, name, info, 8 + length) for name, info in header.items()]
    end = max((e.begin + e.nbytes for e in entries), default=8 + length)
    if end > size:
        raise PosttuneError(f"{path}: truncated (header says {end} bytes, file has {size})")
    entries.sort(key=lambda e: e.begin)
    for before, after in zip(entries, entries[1:]):  # two tensors sharing bytes: the file is not what it says
        if before.begin + before.nbytes > after.begin:
            raise PosttuneError(f"{path}: corrupt safetensors header: tensors '{before.name}' and '{after.name}' "
                                "overlap")
    return entries


def _entry(path: Path, name: str, info: dict, data_start: int) -> Entry:
    dtype = DTYPES.get(info.get("dtype"))
    if dtype is None:
        raise PosttuneError(f"{path}: tensor '{name}' has unsupported dtype {info.get('dtype')!r}")
    shape = tuple(int(n) for n in info["shape"])
    begin, end = (int(n) for n in info["data_offsets"])
    if begin < 0 or any(n < 0 for n in shape):  # a crafted header: bytes read from before the data, or no shape
        raise PosttuneError(f"{path}: corrupt safetensors header: tensor '{name}' has offsets {[begin, end]} and "
                            f"shape {list(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise PosttuneError(f"{path}: tensor '{name}' holds {end - begin} bytes; "
                            f"{info['dtype']}{list(shape)} needs {nbytes}")
    return Entry(name, dtype, shape, data_start + begin, nbytes)


def iter_tensors(path: Path, entries: Iterable[Entry] | None = None,
                 into: Callable[[Entry], torch.Tensor | None] | None = None,
                 ) -> Iterator[tuple[Entry, torch.Tensor]]:
    """Each tensor of the file, in file order, read into ``into(entry)`` or a new CPU tensor.

    ``into`` lets a caller read straight into a model's parameter (it must be a contiguous CPU
    tensor of the entry's dtype and shape), so no second copy exists even briefly. Otherwise
    the caller drops each tensor before asking for the next: at most one is alive here.
    """
    entries = read_header(path) if entries is None else entries
    with open(path, "rb", buffering=0) as f:
        for entry in entries:
            tensor = into(entry) if into is not None else None
            if tensor is None:
                tensor = torch.empty(entry.shape, dtype=entry.dtype)
            elif not fits(tensor, entry):
                raise ValueError(f"cannot read '{entry.name}' ({entry.dtype}{list(entry.shape)}) into "
                                 f"{tensor.dtype}{list(tensor.shape)} on {tensor.device}")
            f.seek(entry.begin)
            _read_exactly(f, _bytes_of(tensor.detach()), path, entry.name)
            yield entry, tensor


def fits(tensor: torch.Tensor, entry: Entry) -> bool:
    """Whether ``iter_tensors`` may read ``entry`` straight into ``tensor``'s memory."""
    return (tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype == entry.dtype
            and tuple(tensor.shape) == entry.shape)


def _read_exactly(f, view: memoryview, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        got = f.readinto(view[done:done + CHUNK])
        if not got:
            raise PosttuneError(f"{path}: truncated while reading tensor '{name}'")
        done += got


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


@dataclass(frozen=True)
class Planned:
    """A tensor to be written: its name, dtype and shape, known before its bytes are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_file(path: Path, planned: list[Planned], produce: Callable[[str], torch.Tensor]) -> None:
    """Write a safetensors file whose tensors ``produce(name)`` returns one at a time, then fsync.

    The header needs every shape and offset up front, hence ``planned``; each produced
    tensor is checked against its plan so a non-deterministic producer cannot corrupt the file.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in planned:
        header[item.name] = {"dtype": NAMES[item.dtype], "shape": list(item.shape),
                             "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for item in planned:
            tensor = produce(item.name).detach()
            if tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
                raise RuntimeError(f"tensor '{item.name}' changed between planning and writing: "
                                   f"{tensor.dtype}{list(tensor.shape)} vs {item.dtype}{list(item.shape)}")
            tensor = tensor.to("cpu").contiguous()
            f.write(_bytes_of(tensor))
            del tensor
        f.flush()
        os.fsync(f.fileno())
