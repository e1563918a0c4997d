"""`posttune plot OUTPUT_DIR`: the train (and validation) loss curves of a run, as a PNG.

matplotlib is an optional dependency (``pip install posttune[plot]``): training never needs it.
"""

from __future__ import annotations

from pathlib import Path

from posttune.errors import PosttuneError
from posttune.training.metrics import read_metrics


#: the unit a method's normaliser counts (logged under its name) -> how the loss axis reads
UNITS = {"labelled_tokens": "per token", "pairs": "per pair"}


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
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    axis.plot(*zip(*train), label="train", linewidth=1.2)
    if val:
        axis.plot(*zip(*val), "o-", label="validation", markersize=4)
    axis.set_xlabel("step")
    axis.set_ylabel(f"loss ({loss_unit(records[0])})")
    axis.set_title(output_dir.name)
    axis.grid(alpha=0.3)
    axis.legend()
    path = Path(out) if out is not None else output_dir / "loss.png"
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
