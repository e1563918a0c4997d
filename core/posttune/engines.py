"""Generation engines, an open set: chosen by name, validated, started.

A method that samples from the policy (GRPO, on-policy KD) names an engine in its config
(``method.engine``) and starts it with ``start_engine``; ``complete`` runs one for a one-off
generation. Every engine is a plugin's ``GenerationEngine`` (docs/plugins.md, "Generation engines"):
posttune-generate's ``builtin`` (KV-cached, on the training model itself), posttune-vllm's ``vllm``.
Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from posttune.descriptors import EnginePolicy, GenerationEngine
from posttune.errors import ConfigError, PosttuneError


def resolve_engine(name: str, options: Mapping[str, Any] | None = None, *, where: str = "method",
                   sampling: Any = None) -> tuple[GenerationEngine, Any]:
    """The engine registered as ``name``, and ``options`` validated against its ``config``.

    For a method's ``validate``: an unknown name or a bad option is a one-line ConfigError at
    ``{where}.engine`` or ``{where}.engine_options`` (with a did-you-mean), before launch; so is a
    ``sampling`` (the method's ``Sampling``) that the engine's ``check`` refuses.
    """
    from posttune.config.typed import from_dict
    from posttune.plugins import get_registry

    registry = get_registry()
    try:
        found = registry.lookup("generation_engine", name)
    except PosttuneError as exc:
        raise ConfigError(f"{where}.engine", str(exc)) from None
    engine: GenerationEngine = found.descriptor
    if engine.config is not None:
        settings = from_dict(engine.config, dict(options or {}), f"{where}.engine_options")
    elif options:
        raise ConfigError(f"{where}.engine_options", f"generation engine '{name}' ({found.provenance}) takes no "
                                                     "options")
    else:
        settings = None
    if sampling is not None and engine.check is not None:
        try:
            engine.check(settings, sampling)
        except PosttuneError as exc:
            raise ConfigError(f"{where}.engine", f"generation engine '{name}': {exc}") from None
    return engine, settings


def start_engine(name: str, options: Mapping[str, Any] | None, policy: Any, *, where: str = "method",
                 sampling: Any = None) -> Any:
    """The engine ``name`` started on ``policy``: an ``EnginePolicy``, or a ``Session`` for the policy
    that trains in this process (the live model, at the session's step). ``sampling``: the method's
    non-greedy ``Sampling``, for an engine that fixes settings when it starts (``EnginePolicy.sampling``)."""
    engine, settings = resolve_engine(name, options, where=where, sampling=sampling)
    if not isinstance(policy, EnginePolicy):
        from posttune.checkpoint.origin import origin_of

        origin = origin_of(policy.model)
        policy = EnginePolicy(origin.family, origin.build_kwargs, model=policy.model, source=origin.source,
                              device=policy.device, version=policy.step)
    return engine.start(dataclasses.replace(policy, options=settings, sampling=sampling or policy.sampling))


def complete(model: Any, prompts: Sequence[Sequence[int]], sampling: Any, *, seeds: Sequence[int] | None = None,
             engine: str | None = None, options: Mapping[str, Any] | None = None, where: str = "engine") -> Any:
    """``prompts`` (token-id lists) completed by the engine ``engine`` (default ``first_party.ENGINE``) started
    on ``model``, a model posttune loaded or built, then closed: ``Completions``. For one-off generation
    outside a run (``posttune generate``, a run's sample prompts, a script): any installed engine serves, and one
    that keeps its own copy is refreshed from ``model`` first (an adapter loaded into it, weights trained here)."""
    from posttune.checkpoint.origin import origin_of
    from posttune.first_party import ENGINE

    origin = origin_of(model)
    policy = EnginePolicy(origin.family, origin.build_kwargs, model=model, source=origin.source)
    started = start_engine(engine or ENGINE, options, policy, where=where,
                           sampling=sampling if sampling.temperature > 0 else None)
    try:
        started.update_weights(None, policy.version)  # an engine with its own copy takes the model's weights as is
        return started.generate(prompts, sampling, seeds)
    finally:
        started.close()
