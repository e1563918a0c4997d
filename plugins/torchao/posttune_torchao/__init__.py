"""posttune-torchao: memory techniques built on torchao.

    memory: [adamw_8bit]                      # or adamw_4bit: AdamW states in 8 (4) bits
    memory: [qlora_nf4]   + an adapter: section  # frozen base weights stored as NF4
    memory: [qat]         memory_options: {qat: {scheme: 8da4w, group_size: 32}}
    memory: [fp8]                             # float8 matmuls (CUDA, compute capability >= 8.9)

    posttune quantize --model runs/sft/model -o runs/sft/int8   # an int8/int4 export (docs/quantize.md)

Stages, and why (docs/architecture.md, docs/memory.md):

- ``qat`` at ``quantize``: linear layers are swapped for fake-quantised ones while the model is
  still on the meta device, before parallel plans wrap or shard them; parameter names do not
  change, so weights load into them as usual.
- ``fp8`` at ``quantize`` for the same reason (module swap before TP/FSDP2, as torchtitan does).
- ``qlora_nf4`` at ``load``: NF4 quantisation needs the real base weights, which exist only
  once the ``load`` stage has streamed them in; the adapters are initialised by then too.
- ``adamw_8bit`` / ``adamw_4bit`` at ``optimizer``: they replace the AdamW the core built (same
  param groups, LR and weight decay) and rebuild the LR schedule around it.

Their terms in `posttune plan`'s memory estimate (NF4 weight widths, low-bit optimizer states,
torchao's import) are in estimate.py.

After training, the ``quantize`` command (quantize.py) writes a torchao weight-only export in
the format transformers loads, and the ``torchao`` quantized format (checkpoint.py) lets
``load_model`` / ``posttune generate`` read it back.

Importing this module imports neither torch nor torchao (``posttune plugins`` stays fast).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from posttune import hookimpl
from posttune.plugin import ConfigError, MemoryTechnique, ModelTarget, QuantizedFormat, RunConfig, Session, require_cuda

from posttune_torchao import estimate, quantize

#: torchao's import reports the kernels it could not load; these two serve MX formats and CUTLASS fp8 on
#: Hopper-class GPUs, which nothing here uses, and their wheels fail to load on CPU-only machines and
#: with some torch builds. With torch's deprecation of torchao registering its enums (``KernelPreference``,
#: ``ScaleCalculationMode``), that was three or more alarming lines before every QLoRA run, with nothing wrong.
UNUSED_KERNELS = ("_C_mxfp8", "_C_cutlass_90a")


def _quiet(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if message.startswith("Failed to load"):
        return not any(name in message for name in UNUSED_KERNELS)
    return "register_constant() on Enum subclasses is deprecated" not in message  # torchao's enums, at its import


for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).addFilter(_quiet)

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"


@dataclass(frozen=True)
class QATOptions:
    scheme: Literal["8da4w", "4w"] = "8da4w"  # int8 dynamic activations + int4 weights, or int4 weights only
    group_size: int = 32  # weights share one int4 scale per this many input features


def _apply(module: str) -> Any:
    """``apply`` of ``posttune_torchao.<module>``, imported (with torchao) on first use."""

    def run(session: Session, target: ModelTarget) -> None:
        import importlib

        importlib.import_module(f"posttune_torchao.{module}").apply(session, target)

    return run


def _low_bit(name: str) -> Any:
    def run(session: Session, target: ModelTarget) -> None:
        from posttune_torchao.low_bit_optim import apply

        apply(session, name)

    return run


def validate_adamw(name: str) -> Any:
    def check(config: RunConfig) -> None:
        if config.train.optimizer != "adamw":
            raise ConfigError("train.optimizer", f"{name} replaces the optimizer 'adamw'; got "
                                                 f"{config.train.optimizer!r}: set it to adamw or drop {name}")

    return check


def validate_qlora(config: RunConfig) -> None:
    if config.adapter is None:
        raise ConfigError("adapter", "qlora_nf4 stores the frozen base weights as NF4 under LoRA adapters; add an "
                                     "`adapter:` section (e.g. {kind: lora, rank: 16})")
    if config.adapter.kind != "lora":
        raise ConfigError("adapter.kind", f"qlora_nf4 supports kind 'lora'; '{config.adapter.kind}' needs the "
                                          "dense base weight's row norms")


def validate_fp8(config: RunConfig) -> None:
    require_cuda(config, "fp8", "float8 matmuls run on GPUs of compute capability 8.9 or newer")


TECHNIQUES = (
    MemoryTechnique(
        name="adamw_8bit", stage="optimizer", apply=_low_bit("adamw_8bit"),
        conflicts=("adamw_4bit", "optimizer_in_backward"), validate=validate_adamw("adamw_8bit"),
        estimate=estimate.low_bit("adamw_8bit"),
        saves="AdamW's two moment tensors in 8 bits with a scale per 256 values (about 4x smaller)",
        description="torchao AdamW8bit in place of AdamW (tensors under 4096 elements keep fp32 state)",
    ),
    MemoryTechnique(
        name="adamw_4bit", stage="optimizer", apply=_low_bit("adamw_4bit"),
        conflicts=("optimizer_in_backward",), validate=validate_adamw("adamw_4bit"),
        estimate=estimate.low_bit("adamw_4bit"),
        saves="AdamW's two moment tensors in 4 bits with a scale per 128 values (about 8x smaller)",
        description="torchao AdamW4bit in place of AdamW (tensors under 4096 elements keep fp32 state)",
    ),
    MemoryTechnique(
        name="qlora_nf4", stage="load", apply=_apply("qlora"), validate=validate_qlora, estimate=estimate.qlora,
        conflicts=("qat", "fp8", "fsdp2", "tp"),
        frozen="apply",  # a frozen teacher or reference is stored in NF4 too
        saves="frozen base weights of the decoder layers as 4-bit NormalFloat (about 0.52 bytes/parameter)",
        description="QLoRA: NF4 base weights under LoRA adapters; the merged export is dequantised",
    ),
    MemoryTechnique(
        name="qat", stage="quantize", apply=_apply("qat"), config=QATOptions, conflicts=("fp8",), estimate=estimate.qat,
        saves="nothing in training; trains weights to survive int4 quantisation (smaller deployed model)",
        description="quantisation-aware training (int4 weights, int8 activations); exports grid-snapped weights",
    ),
    MemoryTechnique(
        name="fp8", stage="quantize", apply=_apply("fp8"), validate=validate_fp8,
        saves="activation and matmul bandwidth: float8 inputs to the linear layers' matmuls",
        description="float8 training of linear layers (torchao.float8; CUDA, compute capability >= 8.9)",
    ),
)


@hookimpl
def posttune_register_memory_techniques(register):
    for technique in TECHNIQUES:
        register(technique)


def _read_checkpoint(files):
    """``posttune_torchao.checkpoint.read``, imported (with torchao) when a checkpoint is loaded."""
    from posttune_torchao.checkpoint import read

    return read(files)


QUANTIZED_FORMAT = QuantizedFormat(
    name="torchao", read=_read_checkpoint,
    description="torchao weight-only checkpoints (transformers' TorchAoConfig format; posttune quantize)",
)


@hookimpl
def posttune_register_quantized_formats(register):
    register(QUANTIZED_FORMAT)


@hookimpl
def posttune_register_commands(cli):
    cli(quantize.COMMAND)
