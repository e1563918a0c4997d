"""The peak memory of a training run, per process, for `posttune plan` (docs/memory.md, "Memory estimate").

A sum of parts: per model its weights, gradients and optimizer state; per process the
activations saved for backward, the logits and loss, and on CPU the heap (``allocator``) and the
process ``baseline``. The core counts what a plain run holds: every model built on the meta device
as the run builds it (only config.json is read), the tokens the method says one forward holds,
and the activations of ``posttune.modules``' decoder blocks. Then each descriptor of the run
applies its ``estimate(est, plan) -> Estimate`` term, the parts with its effect: the policy's
family, the memory techniques in the order the run applies them, then the parallel plans (a plan
divides what the techniques leave). One without a term is named in a note (docs/memory.md, "How
the estimate is composed"). Calibrated against real runs with ``benchmarks/memory_estimate.py``.

Gradients and activations are added although backward frees activations as it produces
gradients: on CPU the measured peaks include both (glibc's heap keeps the previous step's gradient
blocks), on CUDA the sum is an upper bound by at most the gradients. On CUDA the total is what
``torch.cuda.max_memory_allocated`` reports: the context and the caching allocator's reserve come on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from posttune.allocator import ENV as ALLOCATOR_ENV
from posttune.allocator import chosen_library
from posttune.descriptors import STAGES
from posttune.errors import PosttuneError, first_line

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MIB = 2**20

#: CPU resident memory of a run whose model is negligible (hidden 64, vocab 384, 1 x 32 tokens):
#: the peak ``VmHWM`` of a fresh process that imports torch and posttune, composes the run (the
#: tokenizer, the datasets/pyarrow stack the data pipeline imports, the model family) and trains 3
#: steps; measured 423 MiB with torch 2.13 (CPU build) on Linux. An idle ``import torch, posttune``
#: is 220 MiB of it. Not counted on CUDA: ``max_memory_allocated`` sees only tensors.
CPU_BASELINE = 423 * MIB

#: AdamW/Adam keep exp_avg and exp_avg_sq in the parameter's dtype; SGD without momentum keeps none.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}

#: Share of a layer's freed forward temporaries that glibc's heap keeps resident (CPU). Measured
#: with benchmarks/memory_estimate.py as (peak - the other parts) / freed bytes: 0.56-0.68 for
#: full and LoRA runs of 10M and 42M parameters.
HEAP_RETAINED = 2 / 3


@dataclass(frozen=True)
class ModelEstimate:
    """One model of the run: the policy, a trained role (gradients, optimizer state) or a frozen role."""

    role: str
    parameters: int
    trainable: int
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    width: int = 4  # bytes per value of its dtype
    run_plans: bool = True  # the run's parallel plans and model-stage techniques act on it
    module: Any = field(default=None, compare=False, repr=False)  # built on the meta device, for terms to count

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
    # adapters wider than the model (adapter.dtype: fp32 over bf16) save their own copy of each input, and their
    # rank-wide values at their width: the bytes per token and layer that adds (``widened_adapter_bytes``)
    widened: int = 0


@dataclass(frozen=True)
class Estimate:
    """The parts of one training step's peak, per process, in bytes: what the descriptors' terms adjust.

    ``shape`` is None when the policy is not built from ``posttune.modules``' decoder blocks: then
    activations, logits and the heap are not estimated (a note says so) unless the family's term
    fills them in. ``baselines`` (CPU only) names what brings resident memory beyond the tensors:
    ``"posttune"`` (torch, posttune and the data stack) and, once each, a library a plugin imports.
    ``unmodelled``: the techniques and plans whose effect is not in the estimate, named in notes.
    """

    models: tuple[ModelEstimate, ...]  # the policy first, then each frozen role built apart
    tokens: int  # per micro-batch forward
    assumed: str  # how ``tokens`` was worked out, for the plan's line
    device: str = "cpu"
    shape: Shape | None = None
    activations: int = 0
    logits: int = 0
    allocator: int = 0
    baselines: Mapping[str, int] = field(default_factory=dict)
    shards: int = 1  # processes that share the models' parts (shown in the plan's line)
    shared: tuple[str, ...] = ()  # roles that are the policy without adapters
    notes: tuple[str, ...] = ()
    unmodelled: tuple[str, ...] = ()

    @property
    def parameters(self) -> int:
        """The policy's and every role's that trains too, as `posttune train`'s banner counts them."""
        return sum(m.parameters for i, m in enumerate(self.models) if i == 0 or m.trainable)

    @property
    def trainable(self) -> int:
        return sum(m.trainable for m in self.models)

    @property
    def baseline(self) -> int:
        return sum(self.baselines.values())

    def components(self) -> dict[str, int]:
        return {"weights": sum(m.weights_bytes for m in self.models),
                "gradients": sum(m.gradient_bytes for m in self.models),
                "optimizer": sum(m.optimizer_bytes for m in self.models),
                "activations": self.activations, "logits_loss": self.logits,
                "allocator": self.allocator, "baseline": self.baseline}

    @property
    def total(self) -> int:
        return sum(self.components().values())

    def sharded(self, degree: int) -> Estimate:
        """This estimate with 1/``degree`` of the weights, gradients and optimizer state of every model the
        run's plans act on (``run_plans``) on each process: a plan's term for what it shards."""
        models = tuple(replace(m, weights_bytes=m.weights_bytes // degree, gradient_bytes=m.gradient_bytes // degree,
                               optimizer_bytes=m.optimizer_bytes // degree) if m.run_plans else m
                       for m in self.models)
        return replace(self, models=models, shards=self.shards * degree)

    def lines(self) -> list[str]:
        per = f"per process ({self.shards} shards)" if self.shards > 1 else "per process"
        parts = self.components()
        lines = [f"parameters: {self.parameters:,} ({self.trainable:,} trainable)",
                 f"peak memory estimate on {self.device}, {per}, assuming {self.tokens:,} tokens per micro-batch "
                 f"({self.assumed}):"]
        for model in self.models:
            if model.trainable:
                lines.append(f"  {model.role}: weights {gib(model.weights_bytes)}, gradients "
                             f"{gib(model.gradient_bytes)}, optimizer {gib(model.optimizer_bytes)}")
            else:
                lines.append(f"  {model.role} (frozen, {model.parameters:,} parameters): weights "
                             f"{gib(model.weights_bytes)}")
        lines.extend(f"  {role}: the policy with adapters disabled, no extra memory" for role in self.shared)
        lines.append(f"  activations {gib(parts['activations'])} (saved for backward)")
        lines.append(f"  logits/loss {gib(parts['logits_loss'])}")
        if self.device == "cpu":
            lines.append(f"  allocator {gib(parts['allocator'])} (freed blocks glibc's heap keeps resident)")
            lines.append(f"  baseline {gib(parts['baseline'])} (torch, posttune and the data stack)")
        notes = [f"'{name}' is not modelled: its effect is not in the estimate" for name in sorted(self.unmodelled)]
        lines.extend(f"  note: {note}" for note in [*notes, *self.notes])
        lines.append(f"  total {gib(self.total)}")
        return lines


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- the per-token formulas of posttune.modules' decoder blocks ---------------------------------


def layer_bytes_per_token(shape: Shape, width: int) -> int:
    """What autograd saves for backward in one decoder layer, per token (bytes): checked equal to what
    ``saved_tensors_hooks`` records on a real layer in fp32 and bf16; each term's reason is in
    docs/memory.md ("Saved per token and decoder layer"). No [seq, seq] scores: fused SDPA keeps none.
    """
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * 2 * h * width
    rope = 4 * shape.head_dim * width if width != 4 else 0
    attention = width * (2 * q + 2 * kv) + 4 * shape.heads + rope
    mlp = 3 * shape.intermediate * width
    lora = shape.adapters_per_layer * shape.rank * width + shape.widened
    return norms + attention + mlp + lora


def activation_bytes(shape: Shape, width: int, tokens: int) -> int:
    """Saved activations of every decoder layer, plus the final RMSNorm (what a layer's norm saves)."""
    return shape.layers * layer_bytes_per_token(shape, width) * tokens + 2 * shape.hidden * width * tokens


def logits_bytes(shape: Shape, rows: int) -> int:
    """The loss over [rows, vocab] at the start of backward: three fp32 [rows, vocab] tensors (the
    log-softmax ``cross_entropy`` keeps, then its gradient and its input's at once; measured)."""
    return 3 * 4 * rows * shape.vocab


def heap_bytes(est: Estimate, layers: int) -> int:
    """CPU: what glibc's heap keeps resident of ``layers`` decoder layers' forward temporaries (0 on CUDA).

    glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), so activation-
    sized tensors come from the heap, and a block freed between blocks still in use stays resident
    (``MALLOC_MMAP_THRESHOLD_=1048576`` removes this term; docs/memory.md).
    """
    if est.device != "cpu" or est.shape is None:
        return 0
    return int(HEAP_RETAINED * (freed_bytes_per_token(est.shape, est.models[0].width) * est.tokens * layers))


def freed_bytes_per_token(shape: Shape, width: int) -> int:
    """What one decoder layer's forward allocates and frees again, per token (bytes): RMSNorm's fp32
    temporaries, q/k with RoPE's three temporaries each, the outputs added into the residual, the
    MLP's ``act(gate)``, and per adapted linear its base output, update and scaled update (docs/memory.md)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (8 * h + (4 * h if width != 4 else 0))
    attention = width * (9 * (q + kv) // 2 + 2 * h)
    mlp = width * shape.intermediate
    lora = 3 * width * adapted_out_features(shape) if shape.adapters_per_layer else 0
    return norms + attention + mlp + lora


def adapted_out_features(shape: Shape) -> int:
    """Output width summed over one layer's adapted linears (all seven of q, k, v, o, gate, up, down when
    every one is adapted; with fewer, the widest are assumed: an upper bound)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    every = [q, kv, kv, shape.hidden, shape.intermediate, shape.intermediate, shape.hidden]
    return sum(sorted(every, reverse=True)[:shape.adapters_per_layer])


def unique_parameters(module: Any) -> list[Any]:
    """Every parameter once (tied weights once), in ``parameters()`` order."""
    return list({id(p): p for p in module.parameters()}.values())


# -- the run -----------------------------------------------------------------------------------


def estimate(plan: Any) -> Estimate:
    """Count every model the run holds, built on the meta device as the run would build it, then
    apply the terms of the family, the memory techniques and the parallel plans (module docstring)."""
    from posttune.session import ModelTarget
    from posttune.training.compose import build_model, inject_adapters

    config = plan.config
    adapter = config.adapter

    def trained(target: ModelTarget) -> Any:  # built as the run builds a model the optimizer steps
        target.model = build_model(target)
        if adapter is not None:
            inject_adapters(adapter, target)
        return target.model

    policy = trained(ModelTarget("policy", plan.family.descriptor, config.model,
                                 score=plan.method.descriptor.score_head))
    models = [counted("policy", policy, BYTES[config.model.dtype], config.train.optimizer)]
    shared = []
    for name, role in plan.roles.items():
        if role.shares_policy:
            shared.append(name)
            continue
        target = ModelTarget(name, role.family.descriptor, role.config, score=role.role.score)
        if role.role.on_policy:  # a score head on the policy's hidden states: its weights alone
            from posttune.checkpoint.score_head import PolicyHead

            models.append(counted(name, PolicyHead(policy, device="meta"), BYTES[config.model.dtype],
                                  config.train.optimizer))
            continue
        if role.role.trained:
            models.append(counted(name, trained(target), BYTES[role.config.dtype], config.train.optimizer))
            continue
        model = build_model(target).requires_grad_(False)
        models.append(counted(name, model, BYTES[role.config.dtype], None, role.role.run_plans))
    device = run_device(config.train.device)
    tokens, assumed = micro_batch_tokens(plan)
    shape = decoder_shape(policy, adapter.rank if adapter is not None else 0)
    est = Estimate(tuple(models), tokens, assumed, device, shape, shared=tuple(shared),
                   baselines={"posttune": CPU_BASELINE} if device == "cpu" else {})
    if shape is None:
        est = replace(est, notes=("activations not estimated: the model has no decoder layers "
                                  "(model.layers[i].attn/.mlp)",))
    else:
        softcap = getattr(policy.layers[0].attn, "softcap", None) is not None
        est = replace(est, activations=activation_bytes(shape, models[0].width, tokens),
                      logits=logits_bytes(shape, tokens), allocator=heap_bytes(est, shape.layers),
                      notes=("soft-capped attention runs explicit attention: its [heads, seq, seq] scores are "
                             "not counted",) if softcap else ())
    for model in est.models[1:]:  # a trained role runs forward with gradients on the same rows (a value model)
        role_shape = (decoder_shape(model.module, adapter.rank if adapter is not None else 0) if model.trainable
                      else None)
        if role_shape is not None:
            est = replace(est, activations=est.activations + activation_bytes(role_shape, model.width, tokens))
    if device == "cpu" and est.allocator and (library := _preloaded_by_train()) is not None:
        est = replace(est, notes=(*est.notes, f"posttune train preloads {library} here ({ALLOCATOR_ENV}): the "
                                  "allocator term is glibc's heap, so the run should peak below this total "
                                  "(docs/memory.md, \"The allocator (CPU)\")"))
    return with_terms(est, plan)


def _preloaded_by_train() -> str | None:
    """The allocator library `posttune train` would preload on this machine, by file name (None: glibc's)."""
    try:
        library = chosen_library()
    except PosttuneError:  # a bad POSTTUNE_ALLOCATOR: `posttune train` reports it; the plan still estimates
        return None
    return Path(library).name if library else None


def with_terms(est: Estimate, plan: Any) -> Estimate:
    """``est`` with each descriptor's ``estimate`` term applied: the policy's family, the method, the memory
    techniques by stage and order (as the run applies them), then the parallel plans by order."""
    techniques = sorted(plan.memory, key=lambda item: (STAGES.index(item.descriptor.stage), item.descriptor.order))
    for item in [plan.family, plan.method, *techniques, *sorted(plan.parallel, key=lambda item: item.descriptor.order)]:
        term = item.descriptor.estimate
        if term is None:
            if item not in (plan.family, plan.method):  # a family or method without one: what the formulas describe
                est = replace(est, unmodelled=(*est.unmodelled, item.descriptor.name))
            continue
        where = f"'{item.descriptor.name}' ({item.provenance})"
        try:
            est = term(est, plan)
        except Exception as exc:  # a plugin's bug: the plan's other lines are still worth printing
            raise PosttuneError(f"{where}: its estimate term failed: {type(exc).__name__}: "
                                f"{first_line(str(exc))}") from exc
        if not isinstance(est, Estimate):
            raise PosttuneError(f"{where}: its estimate term returned {type(est).__name__}, expected the "
                                "Estimate it was given with its effect (dataclasses.replace)")
    return est


def counted(role: str, module: Any, width: int, optimizer: Any, run_plans: bool = True) -> ModelEstimate:
    """A model as plain training holds it: every parameter in its dtype, and per value that requires a
    gradient a gradient and the ``optimizer``'s states (a ``_component_`` one is assumed to keep two,
    like AdamW), each in its parameter's dtype (fp32 adapters on a bf16 model: ``adapter.dtype``). A frozen
    role's parameters require none. ``width``: the model's dtype's bytes, its activations'."""
    parameters = unique_parameters(module)
    count = sum(p.numel() for p in parameters)
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    trained_bytes = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    states = OPTIMIZER_STATES.get(optimizer, 2) if isinstance(optimizer, str) else 2
    return ModelEstimate(role, count, trainable, sum(p.numel() * p.element_size() for p in parameters),
                         trained_bytes, states * trained_bytes, width, run_plans, module)


def micro_batch_tokens(plan: Any) -> tuple[int, str]:
    """Tokens one micro-batch's forward-with-gradient holds, and how that was worked out.

    The method says (``Method.micro_batch_tokens``) when its rows are not one sequence of at most
    ``data.max_seq_len`` tokens each (several sequences in one forward, or rows sized by its own
    settings). Otherwise ``train.batch_size x data.max_seq_len``, every row full: the worst case.
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
    # any MLP with a down projection (a family's own, e.g. with a fused gate_up_proj), or one that
    # says how wide a token's path through it is (a mixture of experts: top-k experts + shared)
    width = getattr(mlp, "intermediate_per_token", None)
    if width is None:
        width = getattr(getattr(mlp, "down_proj", None), "in_features", None)
    if attn is None or not hasattr(attn, "num_heads") or width is None:
        return None
    from posttune.adapters import AdaptedLinear

    adapters = [m for m in layer.modules() if isinstance(m, AdaptedLinear)]
    vocab, hidden = embed.weight.shape
    vocab = getattr(getattr(model, "output", None), "out_features", vocab)  # a score head: a value or a few
    return Shape(hidden, width, len(layers), attn.num_heads, attn.num_kv_heads,
                 attn.head_dim, vocab, len(adapters), rank if adapters else 0, widened_adapter_bytes(adapters))


def widened_adapter_bytes(adapters: list[Any]) -> int:
    """Per token: what adapted layers whose adapters are wider than their base save beyond ``rank`` values at the
    model's width: each one's input cast to the adapters' dtype (for their weights' gradients) and the
    rank-wide values at the adapters' width. An upper bound: the model-width inputs the adapters then no longer
    keep are not taken off (a bf16 Llama layer with fp32 all-linear adapters: 16% above what autograd saved)."""
    from posttune.adapters.layer import adapter_parameter_names

    extra = 0
    for layer in adapters:
        base = layer.base.weight.element_size()
        wide = max((layer.get_parameter(name).element_size() for name in adapter_parameter_names(layer)),
                   default=base)
        if wide > base:
            extra += layer.in_features * wide + layer.rank * (wide - base)
    return extra
