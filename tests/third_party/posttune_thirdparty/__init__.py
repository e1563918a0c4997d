"""posttune-thirdparty: every open set of the core extended by one outside plugin (tests only).

Each piece is its own module, written against ``posttune.plugin`` alone, and registered here:

- ``mesh``: the parallel plan ``replicas``, owner of the mesh dimension ``rep`` (splits the batch);
- ``roles_and_kinds``: the data kind ``snippet`` (format ``snippet``) and the method ``anchored_lm``,
  which declares the model role ``anchor`` (config ``models.anchor``);
- ``formats``: formats of the core's kinds for other layouts, ``judged`` (preference) and ``task`` (prompt);
- ``engine``: the generation engine ``recorder``;
- ``estimate_term``: the memory technique ``frozen_embedding`` with its own memory-estimate term;
- ``fused_family``: the family ``phi3``, whose converter splits fused HF tensors and joins them on save;
- ``ia3``: the adapter kind ``ia3`` (IA³), saved in PEFT's IA3 layout.
"""

from __future__ import annotations

from typing import Any

from posttune.plugin import hookimpl

from posttune_thirdparty import engine, estimate_term, formats, fused_family, ia3, mesh, roles_and_kinds

POSTTUNE_PLUGIN_API = 2


@hookimpl
def posttune_register_parallel_plans(register: Any) -> None:
    mesh.register_parallel_plans(register)


@hookimpl
def posttune_register_datasets(register: Any) -> None:
    roles_and_kinds.register_datasets(register)
    formats.register_datasets(register)


@hookimpl
def posttune_register_methods(register: Any) -> None:
    roles_and_kinds.register_methods(register)


@hookimpl
def posttune_register_generation_engines(register: Any) -> None:
    engine.register_generation_engines(register)


@hookimpl
def posttune_register_memory_techniques(register: Any) -> None:
    estimate_term.register_memory_techniques(register)


@hookimpl
def posttune_register_model_families(register: Any) -> None:
    fused_family.register_model_families(register)


@hookimpl
def posttune_register_checkpoint_converters(register: Any) -> None:
    fused_family.register_checkpoint_converters(register)


@hookimpl
def posttune_register_adapter_kinds(register: Any) -> None:
    ia3.register_adapter_kinds(register)
