"""The plugin API: every hook a posttune plugin may implement.

Registration hooks receive a typed register object; a plugin calls it once per descriptor.
The core calls each plugin's implementation on its own, so every registered name knows the
distribution and version it came from. Plugins declare ``POSTTUNE_PLUGIN_API = 2``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from posttune.registry import Register

PROJECT = "posttune"
hookspec = pluggy.HookspecMarker(PROJECT)


@hookspec
def posttune_register_model_families(register: Register) -> None:
    """Register model families: ``register(ModelFamily(...))``."""


@hookspec
def posttune_register_checkpoint_converters(register: Register) -> None:
    """Register (family, format) checkpoint converters: ``register(CheckpointConverter(...))``."""


@hookspec
def posttune_register_quantized_formats(register: Register) -> None:
    """Register readers of quantized checkpoints, by ``quant_method``: ``register(QuantizedFormat(...))``."""


@hookspec
def posttune_register_methods(register: Register) -> None:
    """Register training methods: ``register(Method(...))``."""


@hookspec
def posttune_register_parallel_plans(register: Register) -> None:
    """Register parallel plans: ``register(ParallelPlan(...))``."""


@hookspec
def posttune_register_adapter_kinds(register: Register) -> None:
    """Register adapter kinds (``adapter.kind``): ``register(AdapterKind(...))``."""


@hookspec
def posttune_register_memory_techniques(register: Register) -> None:
    """Register memory techniques: ``register(MemoryTechnique(...))``."""


@hookspec
def posttune_register_datasets(register: Register) -> None:
    """Register dataset formats (row -> messages): ``register(DatasetFormat(...))``."""


@hookspec
def posttune_register_reward_functions(register: Register) -> None:
    """Register GRPO reward functions: ``register(RewardFunction(...))``."""


@hookspec
def posttune_register_generation_engines(register: Register) -> None:
    """Register generation engines for methods that sample: ``register(GenerationEngine(...))``."""


@hookspec
def posttune_register_metric_loggers(register: Register) -> None:
    """Register experiment trackers fed the run's metrics: ``register(MetricLogger(...))``."""


@hookspec
def posttune_register_configs(register: Register) -> None:
    """Register bundled YAML recipes: ``register(BundledConfig(...))``."""


@hookspec
def posttune_register_commands(cli: Register) -> None:
    """Register extra `posttune` subcommands: ``cli(Command(...))``."""
