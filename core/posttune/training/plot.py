"""`posttune plot OUTPUT_DIR`: the train (and validation) loss curves of a run, as a PNG.

A run that logs a ``reward`` (GRPO) gets a second panel with the reward curve (and the
validation reward).

matplotlib is an optional dependency (``pip install posttune[plot]``): training never needs it.
"""

from __future__ import annotations

from pathlib import Path

from posttune.errors import PosttuneError
from posttune.training.metrics import read_metrics


#: the unit a method's normaliser counts (logged under its name) -> how the loss axis reads
UNITS = {"labelled_tokens": "per token", "pairs": "per pair", "completion_tokens": "per completion token",
         "completions": "per completion"}


def loss_unit(record: dict) -> str:
    """What the logged loss is averaged over, from the unit key its step record carries."""
    return next((shown for key, shown in UNITS.items() if key in record), "per unit")


def plot_losses(output_dir: str | Path, out: str | Path | None = None) -> Path:
    output_dir = Path(output_dir)
    records = read_metrics(output_dir)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    if not train:
        raise PosttuneError(f"{output_dir}: no metrics.jsonl with training steps to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PosttuneError("posttune plot needs matplotlib — pip install 'posttune[plot]'") from None
    panels = [("loss", f"loss ({loss_unit(records[0])})")]
    if any("reward" in r for r in records):
        panels.append(("reward", "mean reward"))
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 4 * len(panels)), dpi=100, sharex=True, squeeze=False)
    for axis, (key, label) in zip(axes[:, 0], panels):
        curve = [(r["step"], r[key]) for r in records if key in r]
        val = [(r["step"], r[f"val_{key}"]) for r in records if f"val_{key}" in r]
        axis.plot(*zip(*curve), label="train", linewidth=1.2)
        if val:
            axis.plot(*zip(*val), "o-", label="validation", markersize=4)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    axes[0, 0].set_title(output_dir.name)
    axes[-1, 0].set_xlabel("step")
    path = Path(out) if out is not None else output_dir / "loss.png"
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
