"""What a posttune model remembers about where it came from, so it can be saved back.

A native model is a plain ``nn.Module`` that knows nothing of Hugging Face. Saving it as a
checkpoint transformers can load needs its family (for the converter and ``to_hf_config``),
its build kwargs, and the original ``config.json`` when there was one (it carries fields
posttune does not model: token ids, rope scaling details, ``transformers_version``...).
``load_model`` and ``build_model`` attach that as a frozen :class:`ModelOrigin` under the
attribute ``posttune_origin``; ``save_model`` reads it back. A plain attribute, not a buffer
or a parameter: it is never part of the state dict, survives ``.to()`` and in-place wrappers
such as FSDP2's ``fully_shard``, and is copied by ``copy.deepcopy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from posttune.errors import PosttuneError

ATTRIBUTE = "posttune_origin"


@dataclass(frozen=True)
class ModelOrigin:
    """The family a model was built by, with what it was built from."""

    family: str  # registered ModelFamily name
    build_kwargs: Mapping[str, Any]  # what family.build received
    hf_config: Mapping[str, Any] | None = None  # config.json it was loaded from; None if built from a size
    generation_config: Mapping[str, Any] | None = None  # generation_config.json, when the checkpoint had one
    source: str | None = None  # the path or hub id it was loaded from, for messages
    extra: Mapping[str, Any] = field(default_factory=dict)  # room for plugins (e.g. adapter settings)

    def __post_init__(self) -> None:
        # Own copies: later edits to the caller's dicts must not change what gets saved.
        for name in ("build_kwargs", "hf_config", "generation_config", "extra"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, dict(value))


def attach(model: Any, origin: ModelOrigin) -> None:
    # object.__setattr__ skips nn.Module.__setattr__'s parameter/submodule bookkeeping.
    object.__setattr__(model, ATTRIBUTE, origin)


def origin_of(model: Any) -> ModelOrigin:
    """The model's origin; a clear error for a module posttune did not build."""
    for candidate in (model, getattr(model, "_orig_mod", None), getattr(model, "module", None)):
        origin = getattr(candidate, ATTRIBUTE, None) if candidate is not None else None
        if isinstance(origin, ModelOrigin):
            return origin
    raise PosttuneError(f"{type(model).__name__}: not a posttune model (no {ATTRIBUTE}); build it with "
                        f"posttune.load_model or posttune.build_model")
