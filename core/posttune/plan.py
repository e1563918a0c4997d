"""Resolve a validated config against the installed plugins, in composition order (docs/architecture.md).

Everything here runs before any weight is loaded, so `posttune validate`, `plan` and `train`
refuse an impossible run in a second, with one line naming the field or plugin.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttune import first_party, tracking
from posttune.checkpoint.source import family_for, family_kwargs, is_hub_id, no_directory, read_hf_config
from posttune.config.components import check_components, component_name
from posttune.config.requires import check_requires, device_for
from posttune.config.mixture import dataset_sources
from posttune.config.schema import DatasetConfig, ModelConfig, RunConfig
from posttune.config.typed import check_plugin_options, convert, from_dict, plugin_configs
from posttune.descriptors import STAGES, MeshDim, ModelRole, ParallelPlan
from posttune.errors import ConfigError, PluginError, PosttuneError, UnknownNameError, did_you_mean, first_line
from posttune.registry import Registered, Registry

CHECKPOINT_FORMAT = "hf"


@dataclass(frozen=True)
class Step:
    """One line of the plan: at ``stage``, ``what`` happens, supplied by ``provider``."""

    stage: str
    what: str
    provider: str


@dataclass(frozen=True)
class RolePlan:
    """A model role the method asked for, resolved: where its weights come from and who builds it.

    ``shares_policy``: the role is the policy with its adapters disabled (no second model).
    """

    role: ModelRole
    config: ModelConfig  # the role's model section (the policy's own for a role built from it)
    section: str  # the config section it was read from: "model" or "models.<role>"
    family: Registered
    converter: Registered | None = None
    shares_policy: bool = False


@dataclass
class Plan:
    config: RunConfig
    family: Registered
    method: Registered
    method_config: Any
    world_size: int
    converter: Registered | None = None
    roles: dict[str, RolePlan] = field(default_factory=dict)  # role name -> how it is built
    datasets: dict[str, Registered] = field(default_factory=dict)  # "train"/"validation" -> (its first) format
    # every dataset read, by field ("data.train", or "data.train[1]" in a mixture) -> (its config, its format)
    sources: dict[str, tuple[DatasetConfig, Registered]] = field(default_factory=dict)
    parallel: list[Registered] = field(default_factory=list)  # active plans, in order
    memory: list[Registered] = field(default_factory=list)
    adapter: Registered | None = None  # the adapter kind `adapter.kind` names (None: full fine-tuning)
    mesh: dict[str, int] = field(default_factory=dict)  # dimension -> degree, outermost first
    mesh_dims: dict[str, MeshDim] = field(default_factory=dict)  # dimension -> its declaration, same order
    parallel_options: dict[str, Any] = field(default_factory=dict)  # plan name -> its ``config`` instance
    memory_options: dict[str, Any] = field(default_factory=dict)  # technique name -> its ``config`` instance
    logging: list[Registered] = field(default_factory=list)  # experiment trackers (MetricLogger), in order
    logging_options: dict[str, Any] = field(default_factory=dict)  # tracker name -> its ``config`` instance
    steps: list[Step] = field(default_factory=list)
    components: list[tuple[str, str]] = field(default_factory=list)  # (field, dotted target) of each _component_
    identity: dict[str, Any] | None = None  # what its checkpoints mean, once computed (training/resume_identity.py)


def resolve_plan(config: RunConfig, registry: Registry, *, world_size: int | None = 1) -> Plan:
    """The whole run, checked: plugins by name, requires/conflicts, mesh dims against the world."""
    check_requires(config.requires)
    device_for(config.train.device, "config: train.device", here=False)
    components = check_components(config)  # gated, imported and bound before anything else runs
    family = _family(config.model, registry, "model")
    where = "method.name" if isinstance(config.method, dict) else "method"
    method = _get(registry, "method", config.method_name, where)
    plan = Plan(config, family, method, from_dict(method.descriptor.config, config.method_settings, "method"),
                world_size or 1)
    plan.converter = _converter(config.model, family, registry, "model")
    _datasets(plan, registry)
    _roles(plan, registry)
    plan.parallel = [_get(registry, "parallel_plan", n, f"parallel.plans[{i}]")
                     for i, n in enumerate(config.parallel.plans)]
    plan.memory = [_get(registry, "memory_technique", n, f"memory[{i}]") for i, n in enumerate(config.memory)]
    if config.adapter is not None:
        plan.adapter = _get(registry, "adapter_kind", config.adapter.kind, "adapter.kind")
    if config.train.sample_prompts:  # generated by the one-off engine at each evaluation
        _get(registry, "generation_engine", first_party.ENGINE, "train.sample_prompts")
    _check_pairs(plan, registry)
    plan.parallel_options = _parallel_options(config, plan.parallel)
    plan.memory_options = _memory_options(config, plan.memory)
    plan.logging, plan.logging_options = tracking.resolve(config, registry)
    plan.mesh, plan.mesh_dims = _mesh(config, plan.parallel, world_size)
    if plan.world_size == 1:
        plan.parallel = []  # one process: the same config runs with the plans inactive
    # Plans and techniques see the degrees this launch resolved (a -1 replaced by the rest of the world).
    resolved = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, dims=dict(plan.mesh)))
    _check_frozen(plan)
    _validate_with(method, config, plan.method_config)
    if plan.adapter is not None:
        _validate_with(plan.adapter, config.adapter)
    for item in [*plan.parallel, *plan.memory]:
        _validate_with(item, resolved)
    plan.steps = _steps(plan)
    plan.components = components
    return plan


def _validate_with(item: Registered, *args: Any) -> None:
    """``item``'s own ``validate``, if any. It should refuse a config with `ConfigError` (docs/plugins.md); any other
    exception still reaches the user as one line naming the plugin and its distribution (``--debug``: the traceback)."""
    if item.descriptor.validate is None:
        return
    try:
        item.descriptor.validate(*args)
    except PosttuneError:
        raise
    except Exception as exc:  # noqa: BLE001 - a third party's check: whatever it raises, name who raised it
        raise PluginError(f"{type(item.descriptor).__name__} '{item.descriptor.name}' ({item.provenance}) refused the "
                          f"config with {type(exc).__name__}: {first_line(str(exc)) or 'no message'} "
                          "(--debug: where)") from exc


def model_kwargs(config: RunConfig, registry: Registry | None = None) -> dict[str, Any]:
    """The family's build kwargs for this config (config.json or a named size, overrides on top).

    For plans that check shapes before launch (e.g. heads divisible by the TP degree).
    """
    if registry is None:
        from posttune.plugins import get_registry

        registry = get_registry()
    family = _family(config.model, registry, "model").descriptor
    hf_config = read_hf_config(config.model.path) if config.model.path is not None else None
    return build_kwargs(config.model, family, hf_config)


def build_kwargs(model: ModelConfig, family: Any, hf_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The family builder's kwargs for a model section: from its config.json (``hf_config``) or named
    size, with ``build_overrides`` on top."""
    base = family.from_hf_config(hf_config) if hf_config is not None else dict(family.sizes[model.size])
    return {**base, **model.build_overrides}


def _get(registry: Registry, kind: str, name: str, where: str) -> Registered:
    try:
        return registry.lookup(kind, name)
    except UnknownNameError as exc:
        raise ConfigError(where, str(exc)) from None


def _family(model: ModelConfig, registry: Registry, section: str) -> Registered:
    """The family a model section names, or the one that reads its checkpoint's architecture.

    A local checkpoint's config.json is read, and so its values checked, even when the family is
    named; a hub id's then waits for the run, so that `posttune validate` works offline.
    """
    local = model.path is not None and Path(model.path).expanduser().is_dir()
    hf_config = _hf_config(model, section) if local or model.family is None else None  # read once
    if model.family is not None:
        family = _get(registry, "model_family", model.family, f"{section}.family")
        if local:
            _check_named_family(hf_config, family, registry, section)
    else:
        family = family_for(hf_config, registry, str(model.path))
    read = None
    if local:  # its values, as the family reads them
        try:
            read = family_kwargs(family.descriptor, hf_config)
        except ConfigError:
            raise
        except PosttuneError as exc:
            raise ConfigError(f"{section}.path", f"{model.path}: {exc}") from None
    if model.path is None and model.size not in family.descriptor.sizes:
        sizes = ", ".join(family.descriptor.sizes) or "none"
        raise ConfigError(f"{section}.size", f"family '{family.descriptor.name}' has no size '{model.size}' "
                                             f"(sizes: {sizes})")
    _check_overrides(model, family, section)
    if model.build_overrides and (local or model.path is None):
        _check_built_sizes(model, family, read if local else dict(family.descriptor.sizes[model.size]), section)
    return family


def _check_built_sizes(model: ModelConfig, family: Registered, base: dict[str, Any], section: str) -> None:
    """Overrides build what the run saves: a size of 0 where the family has one (``base``: the kwargs they go over;
    a builder may read 0 as "the default") and a config.json the checks every reader makes would refuse (it would
    train, then be refused by generate and by transformers) are refused now."""
    from posttune.checkpoint.hf_config_check import check_hf_config

    for key, value in model.build_overrides.items():
        was = base.get(key)
        if value == 0 and type(value) is int and type(was) is int and was > 0:
            raise ConfigError(f"{section}.build_overrides.{key}", f"family '{family.descriptor.name}' builds with "
                                                                  f"{key}: expected a positive integer, got 0")
    if family.descriptor.to_hf_config is None:
        return
    kwargs = {**base, **model.build_overrides}
    try:
        check_hf_config(family.descriptor.to_hf_config(kwargs), "the config.json it saves")
    except PosttuneError as exc:
        raise ConfigError(f"{section}.build_overrides", str(exc)) from None
    except Exception:  # noqa: BLE001 - a family's to_hf_config that cannot write these kwargs: the build says why
        return


def _check_named_family(hf_config: dict[str, Any], family: Registered, registry: Registry, section: str) -> None:
    """A named family that does not read the checkpoint's architecture, where another installed family does, is
    a wrong name (a checkpoint named by its family's older sibling fails at load on a tensor the sibling lacks).
    A family may read an architecture it does not list (nothing else claims it), so only that case is refused."""
    from posttune.checkpoint.score_head import causal_architectures

    architectures = set(causal_architectures(hf_config.get("architectures")))
    if not architectures or architectures & set(family.descriptor.architectures):
        return
    readers = [item.descriptor.name for item in registry.items("model_family")
               if architectures & set(item.descriptor.architectures)]
    if readers:
        raise ConfigError(f"{section}.family", f"'{family.descriptor.name}' does not read this checkpoint's "
                                               f"architecture ({', '.join(sorted(architectures))}); "
                                               f"'{readers[0]}' does: set {section}.family: {readers[0]}, or "
                                               "leave it out to take the family from config.json")


def _hf_config(model: ModelConfig, section: str) -> dict[str, Any]:
    """``config.json`` of the section's checkpoint; a local path that holds none is refused naming the field
    (a malformed file is named, with its field, by the reader)."""
    local = Path(str(model.path)).expanduser()
    if not local.is_dir() and not is_hub_id(str(model.path)):
        raise ConfigError(f"{section}.path", no_directory(model.path))
    if local.is_dir() and not (local / "config.json").is_file():
        from posttune.checkpoint.peft_config import what_folder

        raise ConfigError(f"{section}.path", f"{model.path}: not a Hugging Face checkpoint (no config.json)"
                                             f"{what_folder(local)}")
    return read_hf_config(model.path)


def _check_overrides(model: ModelConfig, family: Registered, section: str) -> None:
    """Every ``build_overrides`` key must be an argument of the family's builder (else it fails at build)."""
    import inspect

    try:
        parameters = inspect.signature(family.descriptor.build).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key, value in model.build_overrides.items():
        path = f"{section}.build_overrides.{key}"
        if key not in parameters:
            raise ConfigError(path, f"family '{family.descriptor.name}' ({family.provenance}) builds with no argument "
                                    f"'{key}'{did_you_mean(key, parameters)} (arguments: {', '.join(parameters)})")
        hint = _annotation(family.descriptor.build, key)
        try:  # the YAML value against the builder's annotation, as a config field's; then a size is not negative
            model.build_overrides[key] = convert(hint, value, path)
            if isinstance(value, int) and value < 0 and int in (hint, *typing.get_args(hint)):
                raise ConfigError(path, f"expected a non-negative integer, got {value}")
        except TypeError:  # an annotation no YAML value spells (a Sequence, a class): the build checks it
            continue
        except ConfigError as exc:
            raise ConfigError(path, f"family '{family.descriptor.name}' builds with {key}: {exc.problem}") from None


def _annotation(function: Any, key: str) -> Any:
    """``function``'s annotation of argument ``key``, evaluated alone (the return type may name a class imported
    only for type checkers); ``Any`` when there is none or it does not resolve."""
    annotation = getattr(function, "__annotations__", {}).get(key, Any)
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, getattr(function, "__globals__", {}))  # noqa: S307 - the plugin's own code
        except Exception:  # noqa: BLE001 - whatever it names, the value is left to the build
            return Any
    return annotation


def _converter(model: ModelConfig, family: Registered, registry: Registry, section: str) -> Registered | None:
    if model.path is None:
        return None
    return _get(registry, "checkpoint_converter", f"{family.descriptor.name}:{CHECKPOINT_FORMAT}", f"{section}.path")


def _roles(plan: Plan, registry: Registry) -> None:
    """The model roles the method declares, each resolved to a family and a weight source.

    A `models.<role>` section the method does not use is refused rather than ignored: a model
    that never loads is a mistake the user should hear about before the run, not after it.
    """
    config, method = plan.config, plan.method.descriptor
    wanted: dict[str, ModelRole] = {}
    for role in method.model_roles(plan.method_config):
        who = f"method '{method.name}' ({plan.method.provenance}) declares model role {role.name!r}"
        if role.name in wanted or role.name in ("", "policy"):
            raise ConfigError("method", who + (" twice" if role.name in wanted else ": not a role name"))
        if role.on_policy and not (role.trained and role.score):
            raise ConfigError("method", f"{who} as on_policy: a head on the policy is a trained score head "
                                        "(trained=True, score=True)")
        if role.trained and (role.adapters_off or not role.run_plans):  # it trains as the policy does
            why = "adapters_off" if role.adapters_off else "without the run plans"
            raise ConfigError("method", f"{who} as trained and {why}: a trained role is its own model, built like "
                                        "the policy")
        wanted[role.name] = role
    for name in config.models:
        if name in wanted and wanted[name].on_policy:
            raise ConfigError(f"models.{name}", f"method '{method.name}' reads its {name} from the policy's own "
                                                "hidden states (a head on the policy): remove this section")
        if name not in wanted:
            meant = did_you_mean(name, wanted)
            raise ConfigError(f"models.{name}", f"method '{method.name}' uses no {name} model with these settings"
                                                + (meant or "; remove it"))
    for name, role in wanted.items():
        model, section = config.models.get(name), f"models.{name}"
        if model is None and not (role.from_policy or role.adapters_off or role.on_policy):
            raise ConfigError(section, f"required: method '{method.name}' needs its {name} model "
                                       f"({section}.path, or {section}.family and {section}.size)")
        if model is None:  # built from the policy's source, or the policy itself with adapters off
            model, section = config.model, "model"
        shares = role.adapters_off and config.adapter is not None and section == "model"
        family = plan.family if section == "model" else _family(model, registry, section)
        converter = plan.converter if section == "model" else _converter(model, family, registry, section)
        plan.roles[name] = RolePlan(role, model, section, family, converter, shares)
        if role.score and not role.trained and section != "model":
            _check_score_source(model, name, section)
    _check_vocabularies(plan)
    _check_policy_tokenizer(plan)
    _check_tokenizers(plan)


def _check_score_source(model: ModelConfig, name: str, section: str) -> None:
    """A frozen score role scores with its checkpoint's trained head; a causal LM has none, and the fresh
    head a trained role would learn from scratch would only score noise here. Read from a local config.json."""
    from posttune.checkpoint.score_head import checkpoint_labels

    if model.path is None or not Path(str(model.path)).expanduser().is_dir():
        return
    hf_config = read_hf_config(model.path)
    if checkpoint_labels(hf_config) is None:
        shown = ", ".join(map(str, hf_config.get("architectures") or ())) or "no architectures"
        raise ConfigError(f"{section}.path", f"{model.path} is a causal LM ({shown}), not a sequence classifier: "
                                             f"a frozen {name} model scores with its trained head; point it at a "
                                             "score model (a *ForSequenceClassification checkpoint)")


def _reading_policy_ids(plan: Plan) -> list[tuple[str, RolePlan]]:
    """The roles with weights of their own that read the policy's token ids (not ``ModelRole.own_tokenizer``)."""
    return [(name, role) for name, role in plan.roles.items()
            if role.section != "model" and not role.role.own_tokenizer]


def _check_vocabularies(plan: Plan) -> None:
    """A role with its own weights reads the policy's token ids (it scores the policy's tokens, or reads them),
    so a smaller vocabulary would index past its embedding mid-run. A larger one may be padding rows, which only
    the method can judge (with a setting of its own).
    Sizes come from a local config.json or the named size; a hub id is left to the run (as ``_family`` leaves
    it when the family is named), so that `posttune validate` reaches no network for this check."""
    own = _reading_policy_ids(plan)
    policy = _vocab_size(plan.config.model, plan.family) if own else None
    for name, role in own:
        size = _vocab_size(role.config, role.family) if policy is not None else None
        if size is not None and size < policy:
            raise ConfigError(role.section, f"the {name}'s vocabulary has {size} tokens and the policy's {policy}: it "
                                            f"reads the policy's token ids (up to {policy - 1}: those of the data "
                                            f"and those the policy samples); give both models one vocabulary "
                                            f"size (a policy padded past its tokenizer can be built with {size})")


def _vocab_size(model: ModelConfig, family: Registered) -> int | None:
    """The model's embedding rows from a local config.json or the named size (None for a hub id, or unknown)."""
    if model.path is not None and not Path(str(model.path)).expanduser().is_dir():
        return None
    try:
        hf_config = read_hf_config(model.path) if model.path is not None else None
        return build_kwargs(model, family.descriptor, hf_config).get("vocab_size")
    except PosttuneError:
        return None


def _check_policy_tokenizer(plan: Plan) -> None:
    """The run's tokenizer (a local tokenizer.json) defines no id past the policy's embedding: tokens added
    without resizing it would stop the run at its first forward (``posttune.tokenizer.check_fits`` at build
    time covers hub ids)."""
    from posttune.tokenizer import too_many_ids
    from posttune.tokenizer_files import id_count

    source = plan.config.tokenizer.path or plan.config.model.path
    ids = id_count(source)
    rows = _vocab_size(plan.config.model, plan.family) if ids is not None else None
    if rows is not None and ids > rows:
        raise ConfigError("tokenizer.path" if plan.config.tokenizer.path else "model.path",
                          too_many_ids(str(source), ids, rows))


def _check_tokenizers(plan: Plan) -> None:
    """A role with its own weights must read each token id as the policy's tokenizer writes it: another
    tokenizer's vocabulary of the same size or larger passes the size check and scores other tokens, silently
    (a role's distribution or log-probs over other words). Checked where the policy's
    tokenizer and the role's folder both hold a local tokenizer.json: every id both vocabularies define names
    the same token (added and special tokens aside)."""
    from posttune.tokenizer_files import vocabulary

    own = [(name, role) for name, role in _reading_policy_ids(plan) if role.config.path]
    source = plan.config.tokenizer.path or plan.config.model.path
    policy = vocabulary(source) if own else None
    for name, role in own if policy is not None else ():
        theirs = vocabulary(role.config.path)
        clash = next((i for i in sorted(policy.keys() & (theirs or {}).keys()) if policy[i] != theirs[i]), None)
        if clash is not None:
            raise ConfigError(f"{role.section}.path",
                              f"the {name}'s tokenizer is not the policy's: token id {clash} is {theirs[clash]!r} in "
                              f"{role.config.path} and {policy[clash]!r} in {source}; it reads the policy's token ids, "
                              "so give it a model trained with the policy's tokenizer")


#: the stages that build a model; frozen roles go through these (never adapt, optimizer or loss)
MODEL_STAGES: tuple[str, ...] = ("build", "quantize", "parallelize", "load")


def applies_to_frozen(descriptor: Any) -> bool:
    """Whether a parallel plan or memory technique also acts on frozen model roles."""
    stage = "parallelize" if isinstance(descriptor, ParallelPlan) else descriptor.stage
    return descriptor.frozen == "apply" and stage in MODEL_STAGES


def _check_frozen(plan: Plan) -> None:
    """Plans and techniques that cannot work with frozen roles refuse a method that has them."""
    if not plan.roles:
        return
    for item in [*plan.parallel, *plan.memory]:
        if item.descriptor.frozen == "refuse":
            roles = ", ".join(plan.roles)
            raise ConfigError(_where(item), f"'{item.descriptor.name}' ({item.provenance}) does not support model "
                                            f"roles yet, and method '{plan.method.descriptor.name}' uses {roles}")


def _datasets(plan: Plan, registry: Registry) -> None:
    data = plan.config.data
    if data is None:
        raise ConfigError("data", f"required: method '{plan.method.descriptor.name}' trains on a dataset")
    wanted = plan.method.descriptor.dataset_kinds
    for split, dataset in (("train", data.train), ("validation", data.validation)):
        if dataset is None:
            continue
        for where, source in dataset_sources(dataset, f"data.{split}"):
            fmt = _get(registry, "dataset_format", source.format, f"{where}.format")
            if fmt.descriptor.kind not in wanted:
                method, given = plan.method.descriptor.name, sorted({f.descriptor.kind for f in
                                                                      registry.items("dataset_format")})
                unheard = "" if set(wanted) & set(given) else (  # a misspelt kind in the method's descriptor
                    f" (no installed format gives them: they give {', '.join(given)}; the method is "
                    f"{plan.method.provenance}){did_you_mean(wanted[0], given)}")
                raise ConfigError(f"{where}.format", f"'{source.format}' gives {fmt.descriptor.kind} rows; method "
                                                     f"'{method}' needs {' or '.join(wanted)} rows{unheard}")
            first = plan.datasets.setdefault(split, fmt)
            if fmt.descriptor.kind != first.descriptor.kind:  # one maker reads them all: one kind of row
                raise ConfigError(f"{where}.format", f"'{source.format}' gives {fmt.descriptor.kind} rows and "
                                                     f"data.{split}[0]'s '{first.descriptor.name}' gives "
                                                     f"{first.descriptor.kind} rows; a mixture holds one kind")
            plan.sources[where] = (source, fmt)
    if data.validation_split is not None:  # rows of data.train, read as it is
        plan.datasets["validation"] = plan.datasets["train"]


def _check_pairs(plan: Plan, registry: Registry) -> None:
    """Every ``requires`` is active and no two active parts conflict, named on both sides."""
    active: dict[str, Registered] = {}
    for item in [*plan.parallel, *plan.memory]:
        name = item.descriptor.name
        if name in active:
            raise ConfigError(_where(item), f"'{name}' is listed twice")
        active[name] = item
    for name, item in active.items():
        for needed in item.descriptor.requires:
            if needed not in active:
                raise ConfigError(_where(item), f"'{name}' requires '{needed}'; add it to "
                                                f"{_list_for(needed, registry)}")
        for other in item.descriptor.conflicts:
            if other in active:
                raise ConfigError(_where(item), f"'{name}' ({item.provenance}) conflicts with '{other}' "
                                                f"({active[other].provenance}); remove one")


def _where(item: Registered) -> str:
    return "parallel.plans" if isinstance(item.descriptor, ParallelPlan) else "memory"


def _list_for(name: str, registry: Registry) -> str:
    plans = set(registry.entries["parallel_plan"]) | set(first_party.NAMES["parallel_plan"])
    return "parallel.plans" if name in plans else "memory"


def _parallel_options(config: RunConfig, plans: list[Registered]) -> dict[str, Any]:
    """`parallel.options.<plan>`, with what other listed plans set on it (``ParallelPlan.adjusts``),
    checked against the plan's ``config`` dataclass (defaults if absent)."""
    active = {p.descriptor.name: p for p in plans}
    check_plugin_options(config.parallel.options, active, "parallel.options", "parallel.plans", "plan")
    options = {name: dict(config.parallel.options.get(name, {})) for name in active}
    for item in plans:
        for name, values in item.descriptor.adjusts.items():
            if name in active:  # a plan it must have is in its ``requires``
                _adjust(options[name], values, item, active[name])
    return plugin_configs(active, options, "parallel.options")


def _adjust(options: dict[str, Any], values: Mapping[str, Any], by: Registered, plan: Registered) -> None:
    """Set ``values`` from plan ``by`` into ``plan``'s options: a key the config (or another plan)
    sets differently is refused, and so is one that ``plan``'s config dataclass does not take."""
    who, where = f"plan '{by.descriptor.name}' ({by.provenance})", f"parallel.options.{plan.descriptor.name}"
    if plan.descriptor.config is None:
        raise ConfigError("parallel.plans", f"{who} sets options on '{plan.descriptor.name}', which takes none")
    try:
        from_dict(plan.descriptor.config, values, where)
    except ConfigError as exc:
        raise ConfigError("parallel.plans", f"{who} sets {exc.path}: {exc.problem}") from None
    for key, value in values.items():
        if options.setdefault(key, value) != value:
            raise ConfigError(f"{where}.{key}", f"{who} needs {value!r}, not {options[key]!r}; remove this setting")


def _memory_options(config: RunConfig, techniques: list[Registered]) -> dict[str, Any]:
    """`memory_options.<technique>` checked against the technique's ``config`` dataclass (defaults if absent)."""
    active = {t.descriptor.name: t for t in techniques}
    check_plugin_options(config.memory_options, active, "memory_options", "memory", "memory technique")
    return plugin_configs(active, config.memory_options, "memory_options")


def _mesh(config: RunConfig, plans: list[Registered],
          world_size: int | None) -> tuple[dict[str, int], dict[str, MeshDim]]:
    """Mesh dimension -> degree, and -> its declaration, outermost first (``MeshDim.order``, then
    name). One ``-1`` (or an owned dimension left out) takes the rest of the world."""
    declared: dict[str, MeshDim] = {}
    owners: dict[str, str] = {}
    for item in plans:
        dim = item.descriptor.mesh_dim
        if dim is None:
            continue
        if not isinstance(dim, MeshDim):
            raise ConfigError("parallel.plans", f"plan '{item.descriptor.name}' ({item.provenance}) declares "
                                                f"mesh_dim={dim!r}; expected MeshDim(name, order, splits)")
        if declared.setdefault(dim.name, dim) != dim:
            raise ConfigError("parallel.plans", f"plans '{owners[dim.name]}' and '{item.descriptor.name}' declare "
                                                f"mesh dimension '{dim.name}' differently; remove one")
        owners[dim.name] = item.descriptor.name
    declared = dict(sorted(declared.items(), key=lambda item: (item[1].order, item[0])))
    for dim in config.parallel.dims:
        if dim not in declared:
            owned = ", ".join(f"{d} ({owners[d]})" for d in declared) or "none"
            raise ConfigError(f"parallel.dims.{dim}", f"no active plan owns mesh dimension '{dim}' "
                                                      f"(owned: {owned})")
    dims = {dim: config.parallel.dims.get(dim, -1) for dim in declared}
    if world_size is None or world_size == 1:
        return {dim: 1 for dim in dims}, declared  # unknown (elastic) or a single process
    if not dims:
        hint = first_party.MESH_HINT
        raise ConfigError("parallel.plans", f"{world_size} processes launched but no parallel plan owns a mesh "
                                            f"dimension; add one, e.g. {hint} "
                                            f"(pip install {first_party.NAMES['parallel_plan'][hint]})")
    free = [dim for dim, degree in dims.items() if degree == -1]
    fixed = math.prod(degree for degree in dims.values() if degree != -1)
    shown = " x ".join(f"{d}={n}" for d, n in dims.items() if n != -1) or "no fixed dimension"
    if len(free) > 1:
        raise ConfigError("parallel.dims", f"{' and '.join(free)} are both unsized; give all but one a degree")
    if (free and world_size % fixed) or (not free and fixed != world_size):
        raise ConfigError("parallel.dims", f"{shown} does not fit the {world_size} processes launched")
    if free:
        dims[free[0]] = world_size // fixed
    return dims, declared


def _steps(plan: Plan) -> list[Step]:
    """The plan's lines in the order `posttune train` composes the run (docs/architecture.md)."""
    config, steps = plan.config, []
    by_stage: dict[str, list[Registered]] = {stage: [] for stage in STAGES}
    for item in plan.memory:
        by_stage[item.descriptor.stage].append(item)
    by_stage["parallelize"].extend(plan.parallel)
    by_stage["parallelize"].sort(key=lambda r: r.descriptor.order)

    def add(stage: str, what: str, provider: Any) -> None:
        steps.append(Step(stage, what, str(provider)))

    def add_techniques(stage: str) -> None:
        for item in by_stage[stage]:
            kind = "parallel plan" if isinstance(item.descriptor, ParallelPlan) else "memory technique"
            add(stage, f"{kind} '{item.descriptor.name}'", item.provenance)

    from posttune.version import __version__

    core = f"posttune {__version__}"
    mesh = ", ".join(f"{d}={n}" for d, n in plan.mesh.items()) or "none"
    idle = (f"; parallel.plans {', '.join(config.parallel.plans)} inactive on one process"
            if config.parallel.plans and not plan.parallel else "")
    add("distributed", f"{plan.world_size} process(es), mesh {mesh}{idle}", core)
    source = config.model.path or f"random init, size {config.model.size}"
    add("build", f"policy: model family '{plan.family.descriptor.name}' on the meta device ({source})",
        plan.family.provenance)
    for stage in ("build", "adapt", "quantize", "parallelize", "load"):
        if stage == "adapt" and config.adapter is not None:
            targets = config.adapter.targets or plan.family.descriptor.lora_targets
            targets = (targets if isinstance(targets, str) else ", ".join(targets)) or "family default"
            add(stage, f"{config.adapter.kind} rank {config.adapter.rank} on {targets}", plan.adapter.provenance)
        if stage == "load":
            what = (f"weights from {config.model.path} via converter '{plan.converter.descriptor.name}'"
                    if plan.converter else "random weights")
            add(stage, what, plan.converter.provenance if plan.converter else core)
        add_techniques(stage)
    for name, role in plan.roles.items():
        if role.shares_policy:
            add("roles", f"{name}: the policy with its adapters disabled (no copy)", core)
            continue
        if role.role.on_policy:
            add("roles", f"{name}: a trained score head on the policy's hidden states (no second model)", core)
            continue
        source = role.config.path or f"random init, size {role.config.size}"
        trained = role.role.trained
        applied = [item.descriptor.name for item in plan.parallel + plan.memory
                   if trained or (role.role.run_plans and applies_to_frozen(item.descriptor))]
        how = f", with {', '.join(applied)}" if applied else ""
        kind = (f"trained{' (' + config.adapter.kind + ')' if config.adapter is not None else ''}" if trained
                else "frozen")
        add("roles", f"{name}: {kind} '{role.family.descriptor.name}' model ({source}){how}", role.family.provenance)
    for where, (source, fmt) in plan.sources.items():
        add("data", f"{where.removeprefix('data.')}: {source.path} as '{fmt.descriptor.name}'", fmt.provenance)
    train = config.train
    warmup = (f", warmup {train.warmup_steps} steps" if train.warmup_steps else
              f", warmup {train.warmup_ratio:g} of the steps" if train.warmup_ratio else "")
    add("optimizer", f"optimizer {component_name(train.optimizer)}, lr {train.lr:g}, schedule "
                     f"{component_name(train.scheduler)}{warmup}", core)
    add_techniques("optimizer")
    add_techniques("loss")
    add("method", f"method '{plan.method.descriptor.name}': its data loaders, setup, loss", plan.method.provenance)
    add("train", "trainer loop", core)
    return steps
