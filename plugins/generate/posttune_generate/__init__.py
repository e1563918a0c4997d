"""posttune-generate: the generation engine ``builtin``, a KV-cached loop on the training model itself.

    method: {name: grpo, engine: builtin}        # the default of every method that samples
    posttune generate --model DIR --prompt "..."  # this distribution's command; and a run's train.sample_prompts

    command.py  `posttune generate`: a checkpoint (and adapter) loaded through the core, prompts completed by
                the engine `builtin` (greedy or sampled; one line naming the option for what cannot run)
    kv_loop.py  generate_batch (batched, left-padded, seeded per row, the same forward count on every
                rank), generate (one prompt) and BuiltinEngine (the loop behind the engine protocol)

Started on the live policy it generates with the very module that trains (sharded or not, no copy,
weights always current); in a Ray actor it builds the architecture and loads the weights it is sent.
Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

from posttune.plugin import GenerationEngine, hookimpl, registering

from posttune_generate.command import COMMAND, ENGINE

POSTTUNE_PLUGIN_API = 2


def start(policy: Any) -> Any:
    from posttune_generate.kv_loop import BuiltinEngine

    return BuiltinEngine(policy)


def __getattr__(name: str) -> Any:
    """``generate_batch`` and ``generate``, the loop's own functions, imported on first use (as
    ``posttune.plugin`` does its torch names), so that importing this package does not import torch."""
    if name not in ("generate_batch", "generate"):
        raise AttributeError(f"module 'posttune_generate' has no attribute '{name}'")
    from posttune_generate import kv_loop

    return getattr(kv_loop, name)


ENGINES = (GenerationEngine(ENGINE, start, description="generate_batch on the training model itself (KV cache, "
                                                        "any parallel plan, no copy)"),)

posttune_register_generation_engines = registering(ENGINES)


@hookimpl
def posttune_register_commands(cli: Any) -> None:
    cli(COMMAND)
