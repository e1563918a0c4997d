"""What a run tells its user: the start banner, OUTPUT/config.yaml, the summary and summary.json.

A run used to start with seconds of silence and end with raw JSON. Now, on the main rank:

- before composing, one line saying what is being prepared (loading can take a while);
- before the progress bar, a few plain lines: model and family, parameters, data, steps,
  effective batch, output folder, device, and where a resume starts;
- the resolved config (every default filled in, the method's settings too) is written to
  ``OUTPUT/config.yaml``, which ``posttune train OUTPUT/config.yaml`` reloads to the same run;
  a resume first names, in one line, what changed since the saved one;
- at the end, aligned summary lines and the same values in ``OUTPUT/summary.json``.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import yaml

from posttune.checkpoint.atomic import fsync_file
from posttune.config.typed import plain
from posttune.training.write_errors import writing

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
#: keys that say how this invocation starts, not what the run is: never reported as a change
HOW_TO_START = ("checkpoint.resume", "checkpoint.overwrite")
#: the checkpoint's optimizer and scheduler carry the old base learning rate; a new one is applied to both
RESCALED = "train.lr "


# ---- the resolved config -------------------------------------------------------------------------

def resolved_config(plan: Any) -> dict[str, Any]:
    """The run config as plain data, with the method's settings resolved to its full config."""
    config = plain(plan.config)
    config["method"] = {"name": plan.config.method_name, **plain(plan.method_config)}
    return config


def save_config(plan: Any, out: Path, resumed: Path | None = None) -> str | None:
    """Write ``OUTPUT/config.yaml`` atomically; when a checkpoint is ``resumed``, first return the line
    naming what changed since it: against the config the checkpoint holds (a run resumed from an earlier
    step, or into another folder, compares with what trained that step), else the folder's last one.
    ``resume: latest`` that finds no checkpoint starts at step 0: nothing is compared."""
    config = resolved_config(plan)
    path = out / CONFIG_FILE
    line = None
    before = resumed / CONFIG_FILE if resumed is not None and (resumed / CONFIG_FILE).is_file() else path
    if resumed is not None and before.is_file():
        changes = config_changes(_read_yaml(before), config)
        if changes:
            line = "config changed since the checkpoint: " + ", ".join(changes)
            if any(change.startswith(RESCALED) for change in changes):
                line += " (the new learning rate applies: the schedule continues from the checkpoint's step)"
    write_atomically(path, yaml.safe_dump(config, sort_keys=False), "config")
    return line


def _read_yaml(path: Path) -> dict[str, Any]:
    """A saved config; one that cannot be read compares as empty (everything reads as changed)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key old -> new`` for every dotted key whose value differs (lists compare whole). A key the old file
    lacks that is null now is a setting added since that file was written, left off: no change."""
    before, after = _flatten(old), _flatten(new)
    changes = []
    for key in sorted(before.keys() | after.keys()):
        if key in HOW_TO_START or before.get(key, _MISSING) == after.get(key, _MISSING):
            continue
        if key not in before and after[key] is None:
            continue
        inner = any(other.startswith(f"{key}.") for other in before.keys() | after.keys())
        if inner and {} in (before.get(key), after.get(key)):
            continue  # an empty section on one side: its keys' own lines say what changed
        changes.append(f"{key} {_show(before.get(key, _MISSING))} -> {_show(after.get(key, _MISSING))}")
    return changes


_MISSING = object()


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(unset)"
    return "null" if value is None else json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


def write_atomically(path: Path, text: str, what: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, fsync it and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with writing(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(text, encoding="utf-8")
            fsync_file(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


# ---- the banner ----------------------------------------------------------------------------------

def preparing(plan: Any) -> str:
    """The line shown while the run composes (building, loading and tokenizing take seconds)."""
    return (f"posttune: preparing {plan.config.method_name} on {_model_name(plan.config.model, plan)} "
            f"-> {plan.config.checkpoint.output_dir} (model, data, optimizer)")


def banner(session: Any) -> list[str]:
    """A few plain lines on what is about to train, printed before the progress bar."""
    from posttune import allocator
    from posttune.training import distributed

    config, plan = session.config, session.plan
    total, trainable = parameter_counts(session.trainable)
    adapter = config.adapter
    tuned = (f"{adapter.kind} rank {adapter.rank} alpha {adapter.alpha:g}" + (", rsLoRA" if adapter.rslora else "")
             + (f", LoRA+ ratio {adapter.loraplus_lr_ratio:g}" if adapter.loraplus_lr_ratio is not None else "")
             if adapter is not None else "full fine-tuning")
    data_ranks = distributed.data_rank(session)[1]
    batch, accumulation = config.train.batch_size, config.train.grad_accum_steps
    method = plan.method.descriptor  # a method that makes its own batches says what train.batch_size counts
    account = (method.batch_text(config, session.method_config) if method.batch_text is not None
               else f"train.batch_size {batch} counts what its docs say")
    lines = [
        f"model: {_model_name(config.model, plan)}, method {config.method_name}, {tuned}",
        f"parameters: {total:,} total, {trainable:,} trainable ({100 * trainable / max(total, 1):.2f}%)",
        "data: " + describe_data(session.train_data)
        + (f"; validation {describe_data(session.validation_data)}" if session.validation_data is not None else ""),
        f"steps: {describe_steps(session)}; " + (
            f"effective batch {batch * accumulation * data_ranks} = {batch} x {accumulation} accumulation x "
            f"{data_ranks} data-parallel rank(s)" if method.batches is None else
            f"{accumulation} micro-batch(es) per step on each of {data_ranks} data-parallel rank(s), made by method "
            f"'{method.name}' ({account})"),
        f"output: {config.checkpoint.output_dir} (config.yaml, metrics.jsonl); device {session.device}, "
        f"world size {distributed.world_size()}, allocator {allocator.in_use()}",
    ]
    if config.train.eval_every and session.validation_data is None:
        lines.append(f"evaluation: none (train.eval_every is {config.train.eval_every}, but there is no "
                     "data.validation to evaluate on)")
    if plan.logging:
        lines.append("trackers: " + ", ".join(item.descriptor.name for item in plan.logging) + " (docs/trackers.md)")
    if adapter is not None and adapter.init_from is not None and session.resume_from is None:
        lines.append(f"adapter: initialised from {adapter.init_from}")
    if session.resume_from is not None:
        lines.append(f"resumed from step {session.step} ({session.resume_from})")
    elif config.checkpoint.resume is not None:  # where it looked, in full: a requeue from another directory
        out = Path(config.checkpoint.output_dir).absolute()
        lines.append(f"resume: no checkpoint yet in {out}, starting at step 0")
    return lines


def _model_name(model: Any, plan: Any) -> str:
    if model.path is not None:
        return f"{model.path} (family {plan.family.descriptor.name})"
    return f"{model.family or plan.family.descriptor.name} size {model.size} (random init)"


def parameter_counts(model: Any) -> tuple[int, int]:
    """(all, trainable) parameters; a sharded (DTensor) parameter counts its full size."""
    total = trainable = 0
    for param in model.parameters():
        count = param.numel()
        total += count
        trainable += count if param.requires_grad else 0
    return total, trainable


def describe_data(loader: Any) -> str:
    """What a loader knows of its data: items per epoch, batches, and tokens when it keeps a store."""
    if getattr(loader, "streaming", False):
        return "streaming (size unknown until read)"
    items = getattr(loader, "num_items", None)
    if items is None:
        return "made by the method as it trains"
    store, packed = getattr(loader, "samples", None), getattr(loader, "packed", False)
    if packed and store is not None:
        text = f"{count(len(store), 'sample')} packed into {count(items, 'row')}"
    else:
        text = count(items, "sample")
    text += f", {count(len(loader), 'batch', 'batches')} an epoch"
    if store is not None:
        text += f", {count(store.ids.numel(), 'token')}"
    skipped = getattr(loader, "skipped", None)
    if skipped is not None and getattr(skipped, "total", 0):
        text += f" ({count(skipped.total, 'row')} skipped)"
    if skipped is not None and getattr(skipped, "truncated", 0):  # their ends do not train: max_seq_len may be short
        text += f" ({count(skipped.truncated, 'sample')} cut to data.max_seq_len)"
    if skipped is not None and getattr(skipped, "split", 0):  # method.long_samples: split: every token trains
        text += f" ({count(skipped.split, 'sample')} split into pieces of data.max_seq_len)"
    if skipped is not None and getattr(skipped, "empty", 0):  # a CSV's empty answers: only the end token trains
        text += f" ({count(skipped.empty, 'sample')} with an empty response)"
    shares = getattr(loader, "shares", None)  # a mixture: what each of its datasets gave
    if shares:
        text += " from " + ", ".join(f"{where.rpartition('.')[2]} {kept:,}" for where, kept in shares)
    return text


def count(number: int, one: str, many: str | None = None) -> str:
    """``1 batch``, ``2 batches``: a number with its noun in the right number."""
    return f"{number:,} {one if number == 1 else many or one + 's'}"


def describe_steps(session: Any) -> str:
    total, accumulation = session.total_steps, session.config.train.grad_accum_steps
    try:
        per_epoch = -(-len(session.train_data) // accumulation)
    except TypeError:
        return f"{total} (train.max_steps)"
    return f"{total} ({total / max(per_epoch, 1):.3g} epoch(s) of {count(per_epoch, 'step')})"


# ---- the summary ---------------------------------------------------------------------------------

def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as aligned ``key  value`` lines (the same keys as summary.json)."""
    width = max((len(key) for key in summary), default=0)
    return [f"  {key:<{width}}  {_value(value)}" for key, value in summary.items()]


def _value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.6g}"


def save_summary(out: Path, summary: dict[str, Any]) -> Path:
    path = out / SUMMARY_FILE
    write_atomically(path, json.dumps(summary, indent=2) + "\n", "summary")
    return path
