"""What a run reports: one JSON line per step in OUTPUT_DIR/metrics.jsonl, a progress bar, a summary."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: CUDA's allocator peak on GPU, the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


class MetricsLog:
    """Appends step records to ``metrics.jsonl`` (rank 0 only) and keeps a tqdm bar in step."""

    def __init__(self, output_dir: Path, *, total_steps: int, initial_step: int, enabled: bool):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.start = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            output_dir.mkdir(parents=True, exist_ok=True)
            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from posttune.training.write_errors import writing

        with writing(self.path, "metrics"), self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.bar is not None and "loss" in record:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)

    def note(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """The step records of ``OUTPUT_DIR/metrics.jsonl``; a torn last line (a run killed while
    writing it) is dropped, a broken line before it is an error naming the line."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number == len(lines):
                break
            from posttune.errors import PosttuneError

            raise PosttuneError(f"{path}: line {number} is not JSON") from None
    return records
