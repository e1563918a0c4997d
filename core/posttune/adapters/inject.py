"""Put adapters into any model, generically: by module name, never by model type.

The trainer's order (docs/architecture.md) is: build on the meta device -> ``apply_adapters`` ->
quantise / parallelise -> materialise and load base weights -> ``init_adapters``. On a real
(non-meta) model ``apply_adapters`` initialises the adapters itself.

State-dict names with adapters (see ``layer.py``): a base tensor gains one ``.base`` segment
(``layers.0.attn.q_proj.weight`` -> ``layers.0.attn.q_proj.base.weight``); ``base_key`` undoes
that, so a checkpoint loader maps native names with ``adapted_key`` / ``base_key``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from posttune.adapters.layer import AdaptedLinear, adapter_parameter_names
from posttune.checkpoint.keymap import BASE
from posttune.checkpoint.materialize import tie_groups
from posttune.errors import PosttuneError

GLOB_CHARS = "*?["
#: PEFT's ``target_modules="all-linear"``: every linear layer but the output head
ALL_LINEAR = "all-linear"


def apply_adapters(model: nn.Module, *, targets: Sequence[str] | str, wrap: Callable[[nn.Linear], nn.Module],
                   aliases: Mapping[str, str] | None = None) -> list[str]:
    """Wrap every ``nn.Linear`` matching a pattern of ``targets`` with ``wrap`` (an adapter kind's layer, an
    ``AdaptedLinear``); freeze the rest.

    A pattern is an exact module name, a dotted suffix (``q_proj``, ``attn.q_proj``) or an
    fnmatch glob over the name or a dotted suffix of it (``layers.*.mlp.*``, ``*_proj``).
    It may name a layer natively (``output``, ``attn.q_proj``) or by its checkpoint's Hugging Face
    module name (``lm_head``, ``self_attn.q_proj``): what PEFT configs and a saved ``adapter_config.json``
    hold, so they can be pasted in. A pattern selects every layer it names in either naming (the union:
    both name the same layers, only spelled differently). ``aliases`` maps a native name to that other
    name (``checkpoint_module_names``); none: native names only.
    Returns the adapted module names. Every pattern must match at least one linear layer:
    a typo would otherwise silently train fewer layers than asked. ``targets="all-linear"`` is PEFT's
    spelling for every linear layer but the output head (``model.output``, the LM or score head).
    """
    if (isinstance(targets, str) and targets != ALL_LINEAR) or not targets:
        raise PosttuneError(f"adapters: targets must be a non-empty list of module-name patterns or "
                            f"'{ALL_LINEAR}', got {targets!r}")
    if adapted_modules(model):
        raise PosttuneError("adapters: the model already has adapters; apply them once")
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    aliases = aliases or {}
    if targets == ALL_LINEAR:
        _check_all_linear(model)
        head = getattr(model, "output", None)
        targets = [name for name, module in linears.items() if module is not head]
    chosen: list[str] = []
    for pattern in targets:
        found = [name for name in linears if matches(name, pattern) or matches(aliases.get(name), pattern)]
        if not found:
            raise PosttuneError(_stacked(model, pattern) or _unmatched(pattern, linears, aliases) + _moe_note(model))
        chosen.extend(name for name in found if name not in chosen)
    chosen.sort(key=list(linears).index)
    for name in chosen:
        _replace(model, name, wrap(linears[name]))
    freeze_base(model)
    return chosen


def matches(name: str | None, pattern: str) -> bool:
    """Whether module ``name`` is what ``pattern`` (exact, dotted suffix, or glob) means; no name matches nothing.

    Exact names and dotted suffixes are PEFT's rule for a ``target_modules`` list; globs are posttune's."""
    if name is None:
        return False
    if name == pattern or name.endswith(f".{pattern}"):
        return True
    if any(c in pattern for c in GLOB_CHARS):
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")
    return False


def _unmatched(pattern: str, linears: Iterable[str], aliases: Mapping[str, str]) -> str:
    """One line naming the pattern and every linear layer (none hidden: the head is often the one wanted),
    generalised over layer index, each with its Hugging Face name in parentheses where that is spelled
    differently: ``layers.*.attn.q_proj (self_attn.q_proj), ..., output (lm_head)``."""
    shapes: dict[str, str | None] = {}
    for name in linears:
        shapes.setdefault(_generalised(name), _alias_shape(name, aliases))
    listed = ", ".join(shape if alias is None else f"{shape} ({alias})" for shape, alias in shapes.items())
    return f"adapters: target '{pattern}' matches no linear layer (linear layers: {listed or 'none'})"


def _generalised(name: str) -> str:
    """A module name with its layer (and expert) indices as ``*``: one entry per kind of layer."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def _alias_shape(name: str, aliases: Mapping[str, str]) -> str | None:
    """A short pattern over Hugging Face names picking exactly the layers of ``name``'s kind (the part
    after the layer index when that suffices, else the whole generalised name); None when the native
    spelling already says it (``layers.*.mlp.up_proj`` and ``mlp.up_proj``) or there is no other name."""
    alias = aliases.get(name)
    if alias is None:
        return None
    shape = _generalised(alias)
    short = shape.rpartition("*.")[2]
    same_kind = {other for other in aliases.values() if _generalised(other) == shape}
    if {other for other in aliases.values() if matches(other, short)} != same_kind:
        short = shape
    native = _generalised(name)
    return None if native == short or native.endswith(f".{short}") else short


def _stacked(model: nn.Module, pattern: str) -> str | None:
    """The reason a pattern that names stacked (3-D) parameters, a mixture of experts' experts, is refused."""
    named = [name for name in _stacked_parameters(model)
             if matches(name, pattern) or matches(name.rpartition(".")[0], pattern)]
    if not named:
        return None
    shape = re.sub(r"\.\d+\.", ".*.", named[0])
    return (f"adapters: target '{pattern}' names stacked expert weights ({shape}), which adapters do not adapt yet "
            "(PEFT's target_parameters layout is not written); target the attention and shared experts, or train "
            "the experts in full without an adapter")


def _moe_note(model: nn.Module) -> str:
    """On a mixture of experts, what a PEFT recipe's router and per-expert names (``mlp.gate``,
    ``mlp.experts.0.gate_proj``) mean here: neither is a linear layer an adapter wraps."""
    stacked = next(_stacked_parameters(model), None)
    if stacked is None:
        return ""
    return (f"; on this mixture of experts the routers and the stacked experts ({_generalised(stacked)}, Hugging "
            "Face's mlp.gate and mlp.experts.N.*) take no adapter yet (docs/moe.md)")


def _check_all_linear(model: nn.Module) -> None:
    """PEFT's all-linear on a mixture of experts also adapts its routers and experts; adapters here wrap neither,
    so the same words would train fewer layers than they do in PEFT: refused rather than silently so."""
    stacked = next(_stacked_parameters(model), None)
    if stacked is not None:
        raise PosttuneError(f"adapters: targets 'all-linear' on a mixture of experts ({_generalised(stacked)}): "
                            "PEFT's all-linear also adapts the routers and the stacked experts, which adapters do not "
                            "adapt here yet; list the layers to adapt (e.g. attn.*)")


def _stacked_parameters(model: nn.Module) -> Iterator[str]:
    """Names of the stacked (3-D) parameters: a mixture of experts' experts, which no adapter wraps."""
    return (name for name, param in model.named_parameters() if param.dim() == 3)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def adapted_modules(model: nn.Module) -> dict[str, AdaptedLinear]:
    """Every adapted layer by module name, in model order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, AdaptedLinear)}


def plain_state_dict(model: nn.Module, *, device: torch.device | str = "cpu",
                     adapters: bool = True) -> dict[str, torch.Tensor]:
    """The weights as a plain model of the family holds them, on ``device``: each adapter
    folded into its base weight under the base name (``adapters=False``: left out, the base weights
    alone), each sharded (DTensor) tensor gathered whole.

    What an engine that keeps its own copy of the policy receives (``update_weights``). Gathering
    is a collective when parameters are sharded (DTensors): call it on every rank.
    """
    from posttune.training.distributed import is_dtensor

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        return (tensor.full_tensor() if is_dtensor(tensor) else tensor).to(device)

    adapted = adapted_modules(model)
    state = {}
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            module, _, leaf = key.rpartition(".")
            owner = module.removesuffix(f".{BASE}") if module.endswith(f".{BASE}") else None
            if owner in adapted:
                merge = adapters and leaf == "weight"
                state[f"{owner}.{leaf}"] = whole(adapted[owner].merged_weight() if merge else tensor)
            elif not any(key.startswith(f"{name}.") for name in adapted):
                state[key] = whole(tensor)
    return state


def _adapter_keys(model: nn.Module) -> list[str]:
    return [f"{name}.{param}" for name, layer in adapted_modules(model).items()
            for param in adapter_parameter_names(layer)]


def adapted_key(native_key: str, model: nn.Module) -> str:
    """The state-dict key of ``model`` holding the base model's tensor ``native_key``."""
    module, _, param = native_key.rpartition(".")
    if module in adapted_modules(model):
        return f"{module}.{BASE}.{param}"
    return native_key


def freeze_base(model: nn.Module) -> None:
    """Adapter tensors trainable, every other parameter frozen."""
    trainable = {id(layer.get_parameter(name)) for layer in adapted_modules(model).values()
                 for name in adapter_parameter_names(layer)}
    for param in model.parameters():
        param.requires_grad_(id(param) in trainable)


def init_adapters(model: nn.Module, generator: torch.Generator | None = None) -> list[str]:
    """(Re)initialise every adapter: needed after a meta-device model got its base weights, since a kind's
    initial tensors may depend on them (DoRA's magnitude: the loaded weight's row norms). Returns the names."""
    layers = adapted_modules(model)
    for name, layer in layers.items():
        if layer.base.weight.device.type == "meta":
            raise PosttuneError(f"adapters: '{name}' is still on the meta device; materialise and load "
                                f"the base weights before init_adapters")
        layer.reset_adapter(generator)
    return list(layers)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, each shared (tied) tensor counted once."""
    params = list(model.parameters())  # nn.Module.parameters() already skips duplicates
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, under their native-model keys (``...q_proj.<tensor of the kind>``)."""
    state = model.state_dict()
    return {key: state[key] for key in _adapter_keys(model)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model without a second copy (DPO's reference model, KL to the base).

    Inside the block every adapted layer computes exactly its base layer; the previous state
    is restored on exit, also after an error.
    """
    layers = list(adapted_modules(model).values())
    if not layers:
        raise PosttuneError("adapters_disabled: the model has no adapters (apply_adapters first)")
    previous = [layer.disabled for layer in layers]
    for layer in layers:
        layer.disabled = True
    try:
        yield model
    finally:
        for layer, state in zip(layers, previous):
            layer.disabled = state


class AdaptersOff:
    """A model role that is the policy with its adapters disabled: a frozen base at no memory cost.

    What LoRA DPO uses as its reference and GRPO for its KL term. Calling it runs the policy
    inside ``adapters_disabled``; ``active()`` yields the policy switched that way for code
    that calls several of its parts (hidden states, then the head), as the chunked losses do.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        with adapters_disabled(self.model) as model:
            yield model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.active() as model:
            return model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"AdaptersOff({type(self.model).__name__})"


def active_model(model: Any) -> contextlib.AbstractContextManager:
    """``with active_model(m) as module:`` -- the module to call for a model or a model role."""
    return model.active() if isinstance(model, AdaptersOff) else contextlib.nullcontext(model)


@torch.no_grad()
def merge_adapters(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Fold each adapter into its base weight in place and put the plain ``nn.Linear`` back.

    The merged model has the base model's module names and state-dict keys, so
    ``posttune.save_model`` writes it as an ordinary checkpoint. The base weights keep the
    ``requires_grad`` flags ``apply_adapters`` gave them (frozen). A weight shared with
    another module (a tied output head) cannot be merged: the embedding would change too.
    ``dtype``: the merged weights' (default: each base weight's), rounded once from the fp32 sum.
    """
    layers = adapted_modules(model)
    tied = unmergeable(model)
    if tied:
        raise PosttuneError(f"adapters: cannot merge into '{tied[0]}': its weight is shared with another "
                            f"module (tied embeddings); save the adapter instead")
    for name, layer in layers.items():
        if dtype is None or dtype == layer.base.weight.dtype:
            layer.base.weight.copy_(layer.merged_weight())
        else:
            layer.base.weight = nn.Parameter(layer.merged_weight(dtype), requires_grad=layer.base.weight.requires_grad)
        _replace(model, name, layer.base)
    return list(layers)


def unmergeable(model: nn.Module) -> list[str]:
    """The adapted layers whose base weight another module shares (a tied output head): merging one would change
    the embedding too."""
    shared = {name for group in tie_groups(model) for name in group}
    return [name for name in adapted_modules(model) if f"{name}.{BASE}.weight" in shared]
