"""The peak memory of a training run, per process, for `posttune plan` (docs/memory.md, "Memory estimate").

Every model of the run (the policy, and each frozen role the method asks for: a reference, a
teacher) is built on the meta device (no memory, no download of weights: only config.json is
read), adapters injected into the policy as the run would, and its tensors counted. The peak
of a step is the sum of what the step holds at its busiest moment, one small function per part:

    weights      every parameter in its dtype; NF4 (~0.52 bytes) for QLoRA's frozen decoder linears
    gradients    one per trainable parameter, in its dtype (one parameter's at a time with
                 optimizer_in_backward)
    optimizer    AdamW/Adam: two states per trainable parameter (8- or 4-bit with adamw_8bit/4bit)
    activations  what autograd saves for backward in each decoder layer, per token, derived from
                 the architecture (``layer_bytes_per_token``); with activation checkpointing only
                 the layer inputs plus one layer recomputed
    logits/loss  the fp32 log-softmax of [tokens, vocab] kept for backward and its two gradients
                 (one chunk of rows with chunked_cross_entropy)
    allocator    CPU only: what glibc's heap keeps resident beyond the live tensors (measured)
    baseline     CPU only: the resident memory of a run with a negligible model (measured)

Gradients and activations are added although backward frees activations as it produces
gradients: on CPU the measured peaks include both (glibc's heap keeps the previous step's
gradient blocks), on CUDA the sum is an upper bound by at most the gradients.
The token count is the worst case: ``train.batch_size x data.max_seq_len`` per micro-batch
(packing fills every row; unpacked batches are usually shorter), or what the method says one
micro-batch's forward holds (``Method.micro_batch_tokens``: DPO's chosen and rejected rows,
GRPO's completions). On CUDA the number is what ``torch.cuda.max_memory_allocated`` reports:
the CUDA context and the caching allocator's reserve come on top. Sharded runs divide weights,
gradients and optimizer state by the ``dp_shard`` degree; activations are per process as they are.

Calibrated against real runs with ``benchmarks/memory_estimate.py`` (table in docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttune.errors import PosttuneError

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MIB = 2**20

#: CPU resident memory of a run whose model is negligible (hidden 64, vocab 384, 1 x 32 tokens):
#: the peak ``VmHWM`` of a fresh process that imports torch and posttune, composes the run (the
#: tokenizer, the datasets/pyarrow stack the data pipeline imports, posttune-llama) and trains 3
#: steps; measured 423 MiB with torch 2.13 (CPU build) on Linux. An idle ``import torch, posttune``
#: is 220 MiB of it. Not counted on CUDA: ``max_memory_allocated`` sees only tensors.
CPU_BASELINE = 423 * MIB
#: extra baseline of techniques whose plugin imports a large library when the run composes:
#: torchao's import measured +14 MiB (the same tiny run with qlora_nf4).
PLUGIN_BASELINE = {"qlora_nf4": 14 * MIB, "adamw_8bit": 14 * MIB, "adamw_4bit": 14 * MIB, "qat": 14 * MIB,
                   "fp8": 14 * MIB}

#: AdamW/Adam keep exp_avg and exp_avg_sq in the parameter's dtype; SGD without momentum keeps none.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
#: torchao's block-quantised AdamW: bytes per state value (codes + one fp32 scale per block).
#: Tensors under 4096 values keep full-precision states.
LOW_BIT_STATE_BYTES = {"adamw_8bit": 1 + 4 / 256, "adamw_4bit": 0.5 + 4 / 128}
LOW_BIT_MIN_SIZE = 4096

#: NF4 (torchao ``to_nf4``, block 64, scales double-quantised per 256): 4-bit codes, an int8
#: scale per 64 values and an fp32 factor per 256 scales.
NF4_BYTES_PER_VALUE = 0.5 + 1 / 64 + 4 / (64 * 256)

#: Memory techniques the estimate models (others are assumed to change nothing, and the plan says so).
MODELLED = {"activation_checkpointing", "chunked_cross_entropy", "optimizer_in_backward", "qlora_nf4",
            "adamw_8bit", "adamw_4bit", "activation_offloading"}


@dataclass(frozen=True)
class ModelEstimate:
    """One model of the run: the policy (trainable) or a frozen role."""

    role: str
    parameters: int
    trainable: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Shape:
    """The decoder's dimensions the activation formula needs (read from the meta-built model)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    adapters_per_layer: int = 0  # LoRA-adapted linear layers in one decoder layer
    rank: int = 0


@dataclass(frozen=True)
class Estimate:
    models: list[ModelEstimate]
    shards: int
    shared: list[str] = field(default_factory=list)  # roles that are the policy without adapters
    tokens: int = 0  # per micro-batch forward: batch_size x max_seq_len, or the method's own count
    assumed: str = ""  # how ``tokens`` was worked out, for the plan's line
    activations: int = 0
    logits: int = 0
    allocator: int = 0
    baseline: int = 0
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def parameters(self) -> int:
        return self.models[0].parameters

    @property
    def trainable(self) -> int:
        return self.models[0].trainable

    def components(self) -> dict[str, int]:
        policy = self.models[0]
        return {"weights": sum(m.weights_bytes for m in self.models), "gradients": policy.gradient_bytes,
                "optimizer": policy.optimizer_bytes, "activations": self.activations, "logits_loss": self.logits,
                "allocator": self.allocator, "baseline": self.baseline}

    @property
    def total(self) -> int:
        return sum(self.components().values())

    def lines(self) -> list[str]:
        per = f"per process ({self.shards} shards)" if self.shards > 1 else "per process"
        policy = self.models[0]
        parts = self.components()
        lines = [f"parameters: {policy.parameters:,} ({policy.trainable:,} trainable)",
                 f"peak memory estimate on {self.device}, {per}, assuming {self.tokens:,} tokens per micro-batch "
                 f"({self.assumed}):"]
        for model in self.models:
            if model.trainable:
                lines.append(f"  {model.role}: weights {gib(model.weights_bytes)}, gradients "
                             f"{gib(model.gradient_bytes)}, optimizer {gib(model.optimizer_bytes)}")
            else:
                lines.append(f"  {model.role} (frozen, {model.parameters:,} parameters): weights "
                             f"{gib(model.weights_bytes)}")
        for role in self.shared:
            lines.append(f"  {role}: the policy with adapters disabled, no extra memory")
        lines.append(f"  activations {gib(parts['activations'])} (saved for backward)")
        lines.append(f"  logits/loss {gib(parts['logits_loss'])}")
        if self.device == "cpu":
            lines.append(f"  allocator {gib(parts['allocator'])} (freed blocks glibc's heap keeps resident)")
            lines.append(f"  baseline {gib(parts['baseline'])} (torch, posttune and the data stack)")
        lines.extend(f"  note: {note}" for note in self.notes)
        lines.append(f"  total {gib(self.total)}")
        return lines


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- the parts ---------------------------------------------------------------------------------


def weight_bytes(model: Any, width: int, *, nf4: bool) -> int:
    """Every parameter once (tied weights once), in the run's dtype.

    With ``qlora_nf4`` the frozen ``nn.Linear`` weights inside ``model.layers`` are NF4 (what
    the plugin quantises at load); embedding, head, norms and adapters stay dense.
    """
    unique = {id(p): p for p in model.parameters()}
    quantised = set(nf4_weights(model)) if nf4 else set()
    dense = sum(p.numel() for key, p in unique.items() if key not in quantised) * width
    return dense + int(sum(unique[key].numel() for key in quantised) * NF4_BYTES_PER_VALUE)


def nf4_values(model: Any) -> int:
    """Values qlora_nf4 stores as NF4 in ``model``."""
    unique = {id(p): p for p in model.parameters()}
    return sum(unique[key].numel() for key in set(nf4_weights(model)))


def nf4_weights(model: Any) -> list[int]:
    """ids of the weights qlora_nf4 quantises: frozen nn.Linear weights inside ``model.layers``."""
    from torch import nn

    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return [id(m.weight) for m in layers.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]


def gradient_bytes(trainable: list[Any], width: int, *, in_backward: bool) -> int:
    """One gradient per trainable parameter, in its dtype, all alive when backward ends.

    With ``optimizer_in_backward`` each gradient is applied and freed as soon as it is
    accumulated, so at most about one parameter's gradient exists at a time.
    """
    if in_backward:
        return max((p.numel() for p in trainable), default=0) * width
    return sum(p.numel() for p in trainable) * width


def optimizer_bytes(trainable: list[Any], width: int, optimizer: Any, techniques: set[str]) -> int:
    """AdamW's two moments per trainable value (``exp_avg``, ``exp_avg_sq``) in the parameter's dtype.

    torchao's ``adamw_8bit``/``adamw_4bit`` keep them block-quantised; tensors under 4096 values
    stay full precision. A ``_component_`` optimizer is assumed to keep two states, like AdamW.
    """
    low_bit = next((name for name in LOW_BIT_STATE_BYTES if name in techniques), None)
    if low_bit is not None:
        total = 0.0
        for p in trainable:
            per_value = LOW_BIT_STATE_BYTES[low_bit] if p.numel() >= LOW_BIT_MIN_SIZE else width
            total += 2 * p.numel() * per_value
        return int(total)
    states = OPTIMIZER_STATES.get(optimizer, 2) if isinstance(optimizer, str) else 2
    return states * sum(p.numel() for p in trainable) * width


def layer_bytes_per_token(shape: Shape, width: int) -> int:
    """What autograd saves for backward in one decoder layer, per token (bytes).

    Derived from the modules (posttune.modules) and checked against ``saved_tensors_hooks`` on a
    real layer (exact for fp32 and bf16):

    - RMSNorm (two per layer) saves its input as fp32 (the residual stream itself in fp32, a
      copy otherwise), the normalised value and its output (the input of the next matmuls,
      which the linear layers save): ``h * (4 + 2 * width)``, plus one fp32 rsqrt.
    - Attention: q and k after RoPE, v (what SDPA saves), SDPA's output (also o_proj's input:
      fused SDPA returns it in [batch, seq, heads, dim] layout, so the reshape is a view) and
      its fp32 log-sum-exp per head. No [seq, seq] scores: fused kernels (flash on CPU and
      CUDA, memory-efficient on CUDA with a mask) keep none. RoPE's cos/sin, cast to the model
      dtype per call outside fp32: 4 x head_dim.
    - SwiGLU MLP: gate, act(gate), up, and their product (down_proj's input): 4 x intermediate.
    - LoRA: each adapted linear saves its low-rank ``A x`` (rank values); the input ``x`` is
      already saved. QLoRA saves the same (NF4 linears keep only the quantised weight).
    """
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (h * (4 + 2 * width) + 4)
    rope = 4 * shape.head_dim * width if width != 4 else 0
    attention = width * (2 * q + 2 * kv) + 4 * shape.heads + rope
    mlp = 4 * shape.intermediate * width
    lora = shape.adapters_per_layer * shape.rank * width
    return norms + attention + mlp + lora


def activation_bytes(shape: Shape, width: int, tokens: int, *, checkpoint_every: int | None) -> int:
    """Saved activations of every decoder layer, plus the final norm, for ``tokens`` tokens.

    A checkpointed layer keeps only its input (``hidden`` values per token) and is recomputed
    in backward, so one layer's full activations come back at a time (counted once). The
    final RMSNorm saves what a layer's norm saves.
    """
    per_layer = layer_bytes_per_token(shape, width) * tokens
    final_norm = (shape.hidden * (4 + 2 * width) + 4) * tokens
    if checkpoint_every is None:
        return shape.layers * per_layer + final_norm
    checkpointed = shape.layers // checkpoint_every
    kept = (shape.layers - checkpointed) * per_layer + checkpointed * shape.hidden * width * tokens
    return kept + per_layer + final_norm


def logits_bytes(shape: Shape, tokens: int, *, chunk: int | None) -> int:
    """The loss over [tokens, vocab] at the start of backward: three fp32 [tokens, vocab] tensors.

    ``cross_entropy`` keeps its fp32 log-softmax for backward; backward then holds the gradient
    of that log-softmax and the gradient of its input at once (the logits themselves are freed
    when the loss function returns). Measured: forward end + 2 x [tokens, vocab] x 4 bytes at
    the backward's peak. chunked_cross_entropy materialises one chunk of rows at a time.
    """
    rows = min(tokens, chunk) if chunk else tokens
    return 3 * 4 * rows * shape.vocab


#: Share of a layer's freed forward temporaries that glibc's heap keeps resident (CPU). Measured
#: with benchmarks/memory_estimate.py as (peak - the other parts) / freed bytes: 0.56-0.68 for
#: full and LoRA runs of 10M and 42M parameters.
HEAP_RETAINED = 2 / 3
#: Heap bytes left resident per NF4 value on CPU: dequantising a weight (forward and backward)
#: frees int64 code indices, fp32 lookups and scaled copies, ~40 bytes per value per step;
#: measured 10.6 (10M parameters) and 12.3 (42M) bytes per value stay resident.
NF4_HEAP_BYTES = 12


def allocator_bytes(shape: Shape, width: int, tokens: int, *, device: str, checkpoint_every: int | None,
                    nf4_values: int) -> int:
    """CPU: what glibc's heap keeps resident beyond the live tensors at the peak (0 on CUDA).

    glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), so after
    the first step every activation-sized tensor comes from the heap, and a block freed between
    blocks still in use stays resident. Each decoder layer's forward frees temporaries while
    its saved tensors are being allocated around them (``freed_bytes_per_token``); about two
    thirds of them stay resident. A checkpointed layer's forward saves nothing, so only the
    recomputed layer counts. QLoRA's per-call dequantisation adds ``NF4_HEAP_BYTES`` per NF4
    value. Exporting ``MALLOC_MMAP_THRESHOLD_=1048576`` (a fixed threshold) removes this term:
    measured, the other parts then match the peak within 7%.
    """
    if device != "cpu":
        return 0
    layers = shape.layers if checkpoint_every is None else shape.layers - shape.layers // checkpoint_every + 1
    freed = freed_bytes_per_token(shape, width) * tokens * layers
    return int(HEAP_RETAINED * freed) + NF4_HEAP_BYTES * nf4_values


def freed_bytes_per_token(shape: Shape, width: int) -> int:
    """What one decoder layer's forward allocates and frees again, per token (bytes).

    RMSNorm's fp32 square (and, below fp32, its fp32 normalised value) twice; q/k projections
    and RoPE's three temporaries of each (``x * cos``, ``rotate_half(x)`` with its negated
    half, ``* sin``): 4.5 x (q + kv); the attention and MLP outputs added into the residual;
    per LoRA-adapted linear the base output, the update and the scaled update (3 x out_features).
    """
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (4 * h + (4 * h if width != 4 else 0))
    attention = width * (9 * (q + kv) // 2 + 2 * h)
    lora = 3 * width * adapted_out_features(shape) if shape.adapters_per_layer else 0
    return norms + attention + lora


def adapted_out_features(shape: Shape) -> int:
    """Output width summed over one layer's adapted linears (all seven of q, k, v, o, gate, up, down when
    every one is adapted; with fewer, the widest are assumed: an upper bound)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    every = [q, kv, kv, shape.hidden, shape.intermediate, shape.intermediate, shape.hidden]
    return sum(sorted(every, reverse=True)[:shape.adapters_per_layer])


def baseline_bytes(device: str, techniques: set[str]) -> int:
    """CPU: the resident memory of a run with a negligible model (``CPU_BASELINE``); 0 on CUDA."""
    if device != "cpu":
        return 0
    return CPU_BASELINE + max((PLUGIN_BASELINE.get(name, 0) for name in techniques), default=0)


# -- the run -----------------------------------------------------------------------------------


def estimate(plan: Any) -> Estimate:
    """Count every model the run holds, built on the meta device as the run would build it."""
    from posttune.session import ModelTarget
    from posttune.training.compose import build_model

    config = plan.config
    shards = plan.mesh.get("dp_shard", 1) if plan.parallel else 1
    techniques = {item.descriptor.name for item in plan.memory}
    policy = build_model(ModelTarget("policy", plan.family.descriptor, config.model))
    adapter = config.adapter
    if adapter is not None:
        from posttune.adapters import apply_adapters

        apply_adapters(policy, targets=adapter.targets or list(plan.family.descriptor.lora_targets),
                       rank=adapter.rank, alpha=adapter.alpha, dropout=adapter.dropout, kind=adapter.kind)
    width = BYTES[config.model.dtype]
    trainable = [p for p in {id(p): p for p in policy.parameters()}.values() if p.requires_grad]
    in_backward = "optimizer_in_backward" in techniques
    models = [ModelEstimate(
        "policy", sum(p.numel() for p in {id(p): p for p in policy.parameters()}.values()),
        sum(p.numel() for p in trainable),
        weight_bytes(policy, width, nf4="qlora_nf4" in techniques) // shards,
        gradient_bytes(trainable, width, in_backward=in_backward) // shards,
        optimizer_bytes(trainable, width, config.train.optimizer, techniques) // shards)]
    shared = []
    for name, role in plan.roles.items():
        if role.shares_policy:
            shared.append(name)
            continue
        model = build_model(ModelTarget(name, role.family.descriptor, role.config))
        parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        nf4 = "qlora_nf4" in techniques  # the plugin quantises a frozen role whole
        weights = weight_bytes(model, BYTES[role.config.dtype], nf4=nf4) // shards
        models.append(ModelEstimate(name, parameters, 0, weights, 0, 0))
    device = run_device(config.train.device)
    tokens, assumed = micro_batch_tokens(plan)
    notes = [f"'{name}' is not modelled: its effect is not in the estimate"
             for name in sorted(techniques - MODELLED)]
    shape = decoder_shape(policy, adapter.rank if adapter is not None else 0)
    if shape is None:
        notes.append("activations not estimated: the model has no decoder layers (model.layers[i].attn/.mlp)")
        return Estimate(models, shards, shared, tokens, assumed, 0, 0, 0, baseline_bytes(device, techniques), device,
                        notes)
    if getattr(policy.layers[0].attn, "softcap", None) is not None:
        notes.append("soft-capped attention runs explicit attention: its [heads, seq, seq] scores are not counted")
    every = None
    if "activation_checkpointing" in techniques:
        every = getattr(plan.memory_options.get("activation_checkpointing"), "every", 1)
    chunk = None
    if "chunked_cross_entropy" in techniques:
        chunk = getattr(plan.memory_options.get("chunked_cross_entropy"), "chunk_size", 1024)
    activations = activation_bytes(shape, width, tokens, checkpoint_every=every)
    if "activation_offloading" in techniques and device != "cpu":
        activations -= shape.layers * shape.hidden * width * tokens  # the layer inputs live on the host
    return Estimate(models, shards, shared, tokens, assumed, activations, logits_bytes(shape, tokens, chunk=chunk),
                    allocator_bytes(shape, width, tokens, device=device, checkpoint_every=every,
                                    nf4_values=nf4_values(policy) if "qlora_nf4" in techniques else 0),
                    baseline_bytes(device, techniques), device, notes)


def micro_batch_tokens(plan: Any) -> tuple[int, str]:
    """Tokens one micro-batch's forward-with-gradient holds, and how that was worked out.

    The method says (``Method.micro_batch_tokens``) when its rows are not one sequence of at most
    ``data.max_seq_len`` tokens each: DPO scores chosen and rejected in one forward, GRPO trains on
    its own micro-batches of prompt + completion rows. Otherwise ``train.batch_size x
    data.max_seq_len``, every row full: the worst case.
    """
    config, method = plan.config, plan.method.descriptor
    hook = method.micro_batch_tokens
    if hook is None:
        return (config.train.batch_size * config.data.max_seq_len,
                f"batch_size {config.train.batch_size} x max_seq_len {config.data.max_seq_len}, every row full: "
                "the worst case")
    result = hook(config, plan.method_config)
    if (not isinstance(result, tuple) or len(result) != 2 or isinstance(result[0], bool)
            or not isinstance(result[0], int) or result[0] < 1 or not isinstance(result[1], str)):
        raise PosttuneError(f"method '{method.name}' ({plan.method.provenance}): micro_batch_tokens returned "
                            f"{result!r}, expected (a positive int, a string saying how)")
    return result


def run_device(wanted: str) -> str:
    """``cpu`` or ``cuda``, as the run would pick (``auto``: CUDA when available)."""
    if wanted == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if wanted.startswith("cuda") else "cpu"


def decoder_shape(model: Any, rank: int) -> Shape | None:
    """Dimensions from the native decoder contract (``posttune.modules``), or None for other models."""
    layers = getattr(model, "layers", None)
    embed = getattr(model, "embed", None)
    if not layers or embed is None:
        return None
    layer = layers[0]
    attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not hasattr(attn, "num_heads") or not hasattr(mlp, "gate_proj"):
        return None
    from posttune.adapters.lora import LoRALinear

    adapted = sum(isinstance(m, LoRALinear) for m in layer.modules())
    vocab, hidden = embed.weight.shape
    return Shape(hidden, mlp.gate_proj.out_features, len(layers), attn.num_heads, attn.num_kv_heads,
                 attn.head_dim, vocab, adapted, rank if adapted else 0)
