"""What a run reports: one JSON line per logged step in OUTPUT_DIR/metrics.jsonl, and a progress bar."""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from posttune import tracking
from posttune.tracking import Trackers


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: CUDA's allocator peak on GPU, the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


#: the bar's postfix, in this order
POSTFIX = ("loss", "val_loss", "lr", "tok_s")
#: a record's values that are the step's own, never averaged over ``log_every`` steps (as HF Trainer logs
#: the learning rate and gradient norm of the logged step)
OWN = ("step", "epoch", "lr", "grad_norm")


def averaged(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of the last of ``records`` with each per-step number (loss, token counts, the method's
    metrics) its mean over the steps that logged it, peak memory their peak and tokens/s the steps' tokens over
    their time: what HF Trainer and TRL log every ``logging_steps``. Evaluations (``val_*``) and the values in
    ``OWN`` are the last step's."""
    last = dict(records[-1])
    if len(records) == 1:  # log_every 1: the step's record as it is (integers stay integers)
        return last
    timed = [record for record in records if _number(record.get("tokens")) and record.get("tokens_per_s")]
    for key in dict.fromkeys(key for record in records for key in record):  # one a step left out counts too
        values = [record[key] for record in records if _number(record.get(key))]
        if key in OWN or key.startswith("val_") or not values or not _number(last.get(key, 0)):
            continue
        if key == "tokens_per_s" and timed:  # a step's seconds are its tokens over its rate
            last[key] = sum(r["tokens"] for r in timed) / sum(r["tokens"] / r["tokens_per_s"] for r in timed)
            continue
        last[key] = max(values) if key == "peak_memory_mib" else sum(values) / len(values)
    return last


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MetricsLog:
    """Appends step records to ``metrics.jsonl`` (rank 0 only) and keeps a tqdm bar in step.

    The bar ticks every step; a record is written (and shown on the bar) only when ``due``:
    every ``log_every`` steps, on the last step, and on any step that evaluated or was skipped,
    so a sparse log never hides an evaluation or a fault. A written record averages the steps
    since the last one (``averaged``; a skipped step's record is its own, and the steps before it
    wait for the next). ``last_eval`` keeps the latest
    evaluation (step, results) so the end of the run can reuse it instead of evaluating twice.
    Each written record also goes to the run's experiment trackers (``trackers``, default: those
    of the run in progress, ``posttune.tracking``), the same dict as the line.
    """

    def __init__(self, output_dir: Path, *, total_steps: int, initial_step: int, enabled: bool,
                 log_every: int = 1, trackers: Trackers | None = None, pending: list[dict[str, Any]] | None = None):
        self.enabled = enabled
        self.trackers = (trackers if trackers is not None else tracking.active()) if enabled else None
        self.path = output_dir / "metrics.jsonl"
        self.start = time.perf_counter()
        self.total_steps, self.log_every = total_steps, max(1, log_every)
        self.last_eval: tuple[int, dict[str, float]] | None = None
        self.last_loss: float | None = None  # the last written record's (the summary's train_loss)
        # the steps since the last written record (a checkpoint keeps them: ``pending`` is the session's list)
        self.pending: list[dict[str, Any]] = pending if pending is not None else []
        self.postfix: dict[str, str] = {}
        self.bar = None
        self.live = False  # the bar is on a terminal: redrawn in place (else each redraw is a line of a log)
        if enabled:
            from tqdm.auto import tqdm

            output_dir.mkdir(parents=True, exist_ok=True)
            # into a log file (a batch job's stderr) a frame every 30 s, not ten a second; TQDM_DISABLE=1: none
            self.live = sys.stderr.isatty()
            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.1 if self.live else 30.0)

    def due(self, record: dict[str, Any]) -> bool:
        """Whether step ``record`` is written: a multiple of log_every, the last step, an eval or a skip."""
        step = int(record["step"])
        return (step % self.log_every == 0 or step >= self.total_steps or "skipped_nonfinite" in record
                or any(key.startswith("val_") for key in record))

    def write(self, record: dict[str, Any]) -> None:
        """Tick the bar for the step just finished; write and show the record when it is due."""
        if not self.enabled:
            return
        due = self.due(record)
        if "skipped_nonfinite" not in record:
            self.pending.append(record)
            if due:
                record = averaged(self.pending)
                self.pending.clear()
        if due:
            from posttune.training.write_errors import writing

            with writing(self.path, "metrics"), self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            self.last_loss = record.get("loss", self.last_loss)
            if self.trackers is not None:
                self.trackers.log(record)
        if self.bar is not None:
            if due and "loss" in record:  # the postfix first: the refresh of update() shows this step
                self.postfix.update(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                    tok_s=f"{record['tokens_per_s']:.0f}")
            self.bar.set_postfix({key: self.postfix[key] for key in POSTFIX if key in self.postfix}, refresh=False)
            self.bar.update(1)

    def evaluated(self, step: int, results: dict[str, float]) -> None:
        """Keep an evaluation for the summary, print it as one line and keep its loss on the bar."""
        self.last_eval = (step, dict(results))
        if not self.enabled:
            return
        self.note(f"step {step}: " + ", ".join(f"{key} {value:.4f}" for key, value in results.items()))
        if "val_loss" in results:
            self.postfix["val_loss"] = f"{results['val_loss']:.4f}"

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Say on the bar that the run evaluates, so a long evaluation does not look like a hang."""
        if self.bar is not None:
            self.bar.set_description("eval", refresh=self.live)
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.set_description("train", refresh=False)

    def note(self, text: str) -> None:
        if self.enabled:
            # on a terminal above the bar; in a log file as a plain line (tqdm.write redraws the bar after it)
            (self.bar.write if self.bar is not None and self.live else print)(text)

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
