"""torchao's terms in `posttune plan`'s memory estimate (docs/memory.md, "How the estimate is composed").

Each is ``term(est, plan) -> est`` with the technique's effect on the parts:

- ``qlora_nf4``: the frozen ``nn.Linear`` weights inside ``model.layers`` are NF4 (what
  ``qlora.py`` quantises at load); embedding, head, norms and adapters stay dense. On CPU,
  dequantising them per call leaves heap blocks resident.
- ``adamw_8bit`` / ``adamw_4bit``: AdamW's two states block-quantised; tensors under 4096
  values keep full-precision states (what torchao's optimizers do).
- every technique, ``qat`` included, imports torchao when the run composes: resident memory
  on CPU, counted once whatever the techniques. ``qat``'s training effect (fake-quantised
  linears) is not modelled, and the plan says so.

Importing this module imports neither torch nor torchao.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from posttune.plugin import Estimate

MIB = 2**20
#: torchao's import: the tiny negligible run of the core's ``CPU_BASELINE`` with qlora_nf4 measured +14 MiB.
IMPORT_BYTES = 14 * MIB
#: NF4 (torchao ``to_nf4``, block 64, scales double-quantised per 256): 4-bit codes, an int8
#: scale per 64 values and an fp32 factor per 256 scales.
NF4_BYTES_PER_VALUE = 0.5 + 1 / 64 + 4 / (64 * 256)
#: Heap bytes left resident per NF4 value on CPU: dequantising a weight (forward and backward)
#: frees int64 code indices, fp32 lookups and scaled copies, ~40 bytes per value per step;
#: measured 10.6 (10M parameters) and 12.3 (42M) bytes per value stay resident.
NF4_HEAP_BYTES = 12
#: glibc's largest mmap threshold: a freed block above it goes back to the system, so only weights whose
#: temporaries (an fp32 copy, 4 bytes per value, and smaller) fit under it leave heap behind
MMAP_CEILING = 32 * 2**20
#: torchao's block-quantised AdamW: bytes per state value (codes + one fp32 scale per block).
LOW_BIT_STATE_BYTES = {"adamw_8bit": 1 + 4 / 256, "adamw_4bit": 0.5 + 4 / 128}
LOW_BIT_MIN_SIZE = 4096  # smaller tensors keep full-precision states


def with_import(est: Estimate) -> Estimate:
    """``est`` with torchao's import in the CPU baseline (once: keyed by the library)."""
    if est.device != "cpu":
        return est
    return replace(est, baselines={**est.baselines, "torchao": IMPORT_BYTES})


def nf4_values(model: Any, *, heap_only: bool = False) -> int:
    """Values qlora_nf4 stores as NF4 in ``model``: frozen nn.Linear weights and frozen stacked experts
    (3-D parameters) inside ``model.layers``; ``heap_only``: of the weights whose dequantising temporaries
    stay on glibc's heap (``MMAP_CEILING``), so the heap term does not grow without bound on real sizes."""
    from torch import nn

    layers = getattr(model, "layers", None)
    if layers is None:
        return 0
    weights = {id(m.weight): m.weight for m in layers.modules()
               if isinstance(m, nn.Linear) and not m.weight.requires_grad}
    weights.update({id(p): p for p in layers.parameters() if p.dim() == 3 and not p.requires_grad})
    return sum(w.numel() for w in weights.values() if not heap_only or 4 * w.numel() <= MMAP_CEILING)


def qlora(est: Estimate, plan: Any) -> Estimate:
    models = []
    for model in est.models:
        values = nf4_values(model.module) if model.run_plans else 0
        models.append(replace(model, weights_bytes=model.weights_bytes - values * model.width
                              + int(values * NF4_BYTES_PER_VALUE)))
    heap = (NF4_HEAP_BYTES * nf4_values(est.models[0].module, heap_only=True)
            if est.device == "cpu" and est.shape is not None else 0)
    return with_import(replace(est, models=tuple(models), allocator=est.allocator + heap))


def low_bit(name: str) -> Any:
    """The term of ``adamw_8bit`` or ``adamw_4bit``: the trainable model's optimizer state."""
    per_value = LOW_BIT_STATE_BYTES[name]

    def term(est: Estimate, plan: Any) -> Estimate:
        return with_import(replace(est, models=tuple(replace(m, optimizer_bytes=states(m, per_value))
                                                     if m.trainable else m for m in est.models)))

    return term


def states(model: Any, per_value: float) -> int:
    """Two states per trainable value: ``per_value`` bytes each, the model's width for small tensors."""
    total = 0.0
    for p in {id(p): p for p in model.module.parameters()}.values():
        if p.requires_grad:
            total += 2 * p.numel() * (per_value if p.numel() >= LOW_BIT_MIN_SIZE else model.width)
    return int(total)


def qat(est: Estimate, plan: Any) -> Estimate:
    return with_import(replace(est, unmodelled=(*est.unmodelled, "qat")))
