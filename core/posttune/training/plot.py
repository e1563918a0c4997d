"""`posttune plot OUTPUT_DIR`: the train (and validation) loss curves of a run, as a PNG.

Under the loss, a panel for each metric the run's method names in its ``plot`` (an RL method's mean reward, say),
with its validation curve; the method is the one the run's config.yaml names, when it is installed.

matplotlib is an optional dependency (``pip install posttune[plot]``): training never needs it.
"""

from __future__ import annotations

from pathlib import Path

from posttune.errors import PosttuneError
from posttune.training.metrics import read_metrics


def loss_unit(record: dict) -> str:
    """What the logged loss is averaged over: the trainer writes the method's ``LossOutput.unit`` as the key after
    ``tokens``, its count as the value (``labelled_tokens`` -> "per labelled token", ``pairs`` -> "per pair")."""
    keys = list(record)
    if "tokens" not in keys[:-1]:
        return "per unit"
    words = keys[keys.index("tokens") + 1].replace("_", " ")
    return f"per {words.removesuffix('s')}"


def method_panels(output_dir: Path) -> tuple[str, ...]:
    """The ``plot`` metrics of the method the run's config.yaml names; none when it cannot tell."""
    import yaml

    from posttune.plugins import get_registry

    try:
        method = (yaml.safe_load((output_dir / "config.yaml").read_text(encoding="utf-8")) or {}).get("method")
        name = method if isinstance(method, str) else method.get("name")
        return tuple(get_registry().get("method", name).plot)
    except Exception:  # noqa: BLE001 - no config, another shape, a method not installed: the loss alone
        return ()


def plot_losses(output_dir: str | Path, out: str | Path | None = None, panels: tuple[str, ...] | None = None) -> Path:
    """The plot of ``output_dir``'s metrics.jsonl; ``panels``: the metrics drawn under the loss (default: those of
    the method its config.yaml names)."""
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
    drawn = [("loss", f"loss ({loss_unit(train_record(records))})")]
    for key in method_panels(output_dir) if panels is None else panels:
        if any(key in r for r in records):
            drawn.append((key, key.replace("_", " ")))
    figure, axes = plt.subplots(len(drawn), 1, figsize=(7, 4 * len(drawn)), dpi=100, sharex=True, squeeze=False)
    for axis, (key, label) in zip(axes[:, 0], drawn):
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


def train_record(records: list[dict]) -> dict:
    """The first record of a trained step (a skipped step's, or an evaluation's alone, has no unit)."""
    return next((r for r in records if "loss" in r and "tokens" in r), records[0])
