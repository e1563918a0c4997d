"""What a checkpoint means, so that a resume never reads it as something else.

A checkpoint's weights, adapter and optimizer state belong to the run that wrote them: its
method, its base model (family, architecture and the builder's arguments: the weight shapes and
what they compute), its adapter (kind, rank, alpha, targets) and its model roles. Every checkpoint
records these in ``trainer_state.json`` (``identity``). A resume compares them with its own config
before any weight loads (`posttune validate` too) and refuses a difference in one line naming
both values; what a resume may change (``train.max_steps``, ``train.lr``, evaluation and save
cadence, logging, ...) is not part of it. docs/training.md, "What a resume may change".
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from posttune.config.components import component_name
from posttune.errors import ConfigError

IDENTITY = "identity"
SHARES_POLICY = "the policy with its adapters disabled"


def of(plan: Any) -> dict[str, Any]:
    """The identity of ``plan``'s checkpoints (computed once: it reads the models' config.json)."""
    if plan.identity is None:
        config, family = plan.config, plan.family.descriptor
        adapter = config.adapter
        # the weights a resume reads from model.path: an adapter's base, a frozen role's own (a fully fine-tuned
        # policy's come from the checkpoint)
        models = {"policy": _model(config.model, family, weights=adapter is not None)}
        for name, role in plan.roles.items():
            models[name] = SHARES_POLICY if role.shares_policy else _model(role.config, role.family.descriptor)
        identity = {
            "method": plan.method.descriptor.name,
            "adapter": None if adapter is None else {
                "kind": adapter.kind, "rank": adapter.rank, "alpha": adapter.alpha,
                "targets": _targets(adapter.targets or family.lora_targets),
                # LoRA+'s groups shape the optimizer state (written only when set: older checkpoints match)
                **({"loraplus_lr_ratio": adapter.loraplus_lr_ratio} if adapter.loraplus_lr_ratio is not None else {}),
                **({"rslora": True} if adapter.rslora else {})},
            "models": models,
            "optimizer": optimizer_of(plan),
        }
        plan.identity = json.loads(json.dumps(identity, default=str))  # as it reads back from the file
    return plan.identity


def optimizer_of(plan: Any) -> str:
    """What the optimizer state is: the optimizer's name or ``_component_``, and the techniques of the optimizer
    stage that replace or split it (a low-bit optimizer, optimizer-in-backward), each with a state of its own."""
    stages = [item.descriptor.name for item in plan.memory if item.descriptor.stage == "optimizer"]
    return " + ".join([component_name(plan.config.train.optimizer), *stages])


def _targets(targets: str | list[str]) -> str | list[str]:
    """A list of patterns in any order, or PEFT's ``all-linear`` as written."""
    return targets if isinstance(targets, str) else sorted(targets)


def _model(model: Any, family: Any, *, weights: bool = True) -> dict[str, Any]:
    from posttune.checkpoint.source import read_hf_config, weights_fingerprint
    from posttune.plan import build_kwargs

    hf_config = read_hf_config(model.path) if model.path is not None else None
    found = {"family": family.name, "architectures": list((hf_config or {}).get("architectures") or []),
             "build": build_kwargs(model, family, hf_config)}
    fingerprint = weights_fingerprint(Path(model.path).expanduser()) if weights and model.path is not None else None
    return {**found, "weights": fingerprint} if fingerprint is not None else found


def saved(checkpoint: Path) -> Mapping[str, Any] | None:
    """The identity a checkpoint recorded; None for one written before identities were (or unreadable)."""
    from posttune.training.output_dir import STATE_FILE, json_field

    found = json_field(checkpoint / STATE_FILE, IDENTITY)
    return found if isinstance(found, Mapping) else None


def check_global_batch(plan: Any, checkpoint: Path | None) -> None:
    """Before launch, what the loader refuses once the model has loaded: a data position saved with another global
    batch (train.batch_size x data-parallel ranks: this launch's, from the plan's mesh), or another seed."""
    import math

    from posttune.training.output_dir import STATE_FILE, json_field

    data = json_field(checkpoint / STATE_FILE, "data") if checkpoint is not None else None  # None: unreadable
    ranks = math.prod(degree for name, degree in plan.mesh.items() if plan.mesh_dims[name].splits == "batch") \
        if plan.mesh else plan.world_size
    saved, mine = (data or {}).get("global_batch_size"), plan.config.train.batch_size * ranks
    if isinstance(saved, int) and saved != mine:
        from posttune.data.loader import other_global_batch  # torch: only on this way out (validate stays fast)

        raise ConfigError("train.batch_size", f"checkpoint {checkpoint}: {other_global_batch(saved, mine, ranks)}")
    seed = (data or {}).get("seed")  # None: the data was not shuffled, nothing to match
    if data and "seed" in data and seed is None and not data.get("streaming") and plan.config.data.shuffle:
        raise ConfigError("data.shuffle", f"checkpoint {checkpoint}: its rows were read in order (data.shuffle: "
                                          "false), this run shuffles them; set data.shuffle: false to resume it")
    if isinstance(seed, int) and not plan.config.data.shuffle:
        raise ConfigError("data.shuffle", f"checkpoint {checkpoint}: its data order was shuffled (seed {seed}), this "
                                          "run reads the rows in order; set data.shuffle: true to resume it")
    if isinstance(seed, int) and seed != plan.config.train.seed:
        raise ConfigError("train.seed", f"checkpoint {checkpoint}: its data order was drawn with seed {seed}, this "
                                        f"run has {plan.config.train.seed}; set train.seed: {seed} to resume it")


def check(plan: Any, checkpoint: Path | None) -> None:
    """Refuse to resume ``checkpoint`` with a config that would read it as another run's."""
    recorded = saved(checkpoint) if checkpoint is not None else None
    if recorded is None:
        return
    weights = ("its shards written as a model first, as docs/parallel.md shows" if (checkpoint / "sharded").is_dir()
               else "model.path or adapter.init_from set to its model/")  # sharded_state.SHARDED, without torch
    for field, problem in _differences(recorded, of(plan), plan):
        raise ConfigError(field, f"cannot resume {checkpoint}: {problem}; a resume continues the run that wrote "
                                 f"it: to start from its weights, begin a new run in another checkpoint.output_dir "
                                 f"({weights})")


def _differences(old: Mapping[str, Any], new: Mapping[str, Any], plan: Any) -> Iterator[tuple[str, str]]:
    if old.get("method") != new["method"]:
        yield "method", f"it was trained by method '{old.get('method')}', this run's method is '{new['method']}'"
    yield from _adapter(old.get("adapter"), new["adapter"])
    if "optimizer" in old and old["optimizer"] != new["optimizer"]:  # recorded since 2026-12: older ones match
        yield "train.optimizer", (f"its optimizer state is {old['optimizer']}'s, this run's optimizer is "
                                  f"{new['optimizer']}")
    sections = {"policy": "model", **{name: role.section for name, role in plan.roles.items()}}
    saved_models, models = old.get("models") or {}, new["models"]
    for role in [*models, *(r for r in saved_models if r not in models)]:
        section = sections.get(role, role)
        before, now = saved_models.get(role), models.get(role)
        if before is None or now is None:
            yield section, (f"this run's method uses a {role} model and the checkpoint's did not" if before is None
                            else f"the checkpoint's run used a {role} model and this run's does not")
        elif before == now:
            continue
        elif SHARES_POLICY in (before, now) or before["family"] != now["family"] \
                or before["architectures"] != now["architectures"]:
            yield section, f"its {role} model is {_describe(before)}, this run's is {_describe(now)}"
        else:
            for key in sorted(before["build"].keys() & now["build"].keys()):
                if before["build"][key] != now["build"][key]:
                    yield section, (f"its {role} model has {key} {_show(before['build'][key])}, this run's has "
                                    f"{_show(now['build'][key])}")
            if before.get("weights") not in (None, now.get("weights")) and now.get("weights") is not None:
                yield f"{section}.path", (f"its {role} model had other weights than this run's {section}.path holds "
                                          "(their safetensors differ; a moved copy of the same files is accepted)")


def _adapter(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> Iterator[tuple[str, str]]:
    if old is None and new is not None:
        yield "adapter", f"it is full fine-tuning (no adapter), this run trains a {new['kind']} adapter"
    elif old is not None and new is None:
        yield "adapter", (f"it trained a {old['kind']} adapter (rank {old['rank']}, alpha {_show(old['alpha'])}) and "
                          "this run has no adapter: section (keep it to continue; posttune merge folds the adapter "
                          "into its base)")
    elif old is not None and new is not None:
        for key in ("kind", "rank", "alpha", "targets", "loraplus_lr_ratio", "rslora"):
            default = False if key == "rslora" else None  # recorded only when on
            before, after = old.get(key, default), new.get(key, default)
            if before != after:
                yield f"adapter.{key}", f"its adapter has {key} {_show(before)}, this run's {_show(after)}"


def _describe(model: Any) -> str:
    if model == SHARES_POLICY:
        return model
    architectures = ", ".join(model["architectures"])
    return f"family '{model['family']}'" + (f" ({architectures})" if architectures else "")


def _show(value: Any) -> str:
    if value is None:
        return "null"
    return (json.dumps(value) if isinstance(value, (list, dict, str, bool))
            else f"{value:g}" if isinstance(value, float) else str(value))
