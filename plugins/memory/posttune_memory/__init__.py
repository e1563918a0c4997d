"""posttune-memory: memory techniques in plain PyTorch (docs/memory.md).

    memory: [activation_checkpointing, chunked_cross_entropy, optimizer_in_backward]
    memory_options: {activation_checkpointing: {every: 2}}

    checkpointing.py          activation_checkpointing: recompute decoder layers in backward
    offloading.py             activation_offloading: saved activations to pinned host memory (CUDA)
    optimizer_in_backward.py  optimizer_in_backward: step and free each gradient as it is produced
    linear_cross_entropy.py   chunked_cross_entropy: the loss without [batch, seq, vocab] logits
    compile.py                compile: torch.compile each decoder layer's training forward and the loss

Importing this module does not import torch (``posttune plugins`` stays fast): each ``apply``
imports its technique when a run composes. Orders within ``parallelize`` interleave with
parallel plans (TP 10, FSDP2 100): layers are wrapped (checkpointing 50, offloading 60) and
compiled (70) before FSDP2 shards them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from posttune.plugin import (
    ConfigError,
    Estimate,
    MemoryTechnique,
    from_dict,
    heap_bytes,
    layer_bytes_per_token,
    logits_bytes,
    lookup,
    registering,
    require_cuda,
    unique_parameters,
)

POSTTUNE_PLUGIN_API = 2

CHECKPOINTING_ORDER = 50  # after TP (10), before FSDP2 (100)
OFFLOADING_ORDER = 60  # wraps the checkpointed layers, still before FSDP2
COMPILE_ORDER = 70  # compiles the (checkpointed) layers before FSDP2 shards them
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CheckpointingConfig:
    every: int = 1  # checkpoint every k-th decoder layer (1: all of them)


@dataclass(frozen=True)
class ChunkedCrossEntropyConfig:
    chunk_size: int = 1024  # labelled tokens projected to the vocabulary at a time


@dataclass(frozen=True)
class CompileConfig:
    # false: static shapes, one graph per padded length (bound them with data.pad_to_multiple_of or
    # fixed packed rows); true: lengths symbolic from the first compile; null: static where the data
    # buckets lengths (fixed packed rows, pad_to_multiple_of), symbolic otherwise (``compile_is_dynamic``)
    dynamic: bool | None = None
    backend: str = "inductor"  # any torch.compile backend ("aot_eager" checks tracing without codegen)
    mode: str | None = None  # inductor mode: default, reduce-overhead (CUDA graphs), max-autotune, ...
    fullgraph: bool = False  # true: a graph break inside a layer is an error instead of a split graph
    loss: bool = True  # also compile the plain cross-entropy (a loss-stage kernel replaces it)


def _checkpointing(session: Any, target: Any) -> None:
    from posttune_memory.checkpointing import apply

    apply(session, target)


def _offloading(session: Any, target: Any) -> None:
    from posttune_memory.offloading import apply

    apply(session, target)


def _optimizer_in_backward(session: Any, target: Any) -> None:
    from posttune_memory.optimizer_in_backward import apply

    apply(session, target)


def _chunked_cross_entropy(session: Any, target: Any) -> None:
    from posttune_memory.linear_cross_entropy import apply

    apply(session, target)


def _compile(session: Any, target: Any) -> None:
    from posttune_memory.compile import apply

    options = session.plan.memory_options["compile"]
    fixed = method_rows(session.config, session.method_config).fixed
    apply(session, target, replace(options, dynamic=compile_is_dynamic(session.config, options.dynamic, fixed)),
          fixed_rows=fixed)


def validate_checkpointing(config: Any) -> None:
    every = config.memory_options.get("activation_checkpointing", {}).get("every", 1)
    if isinstance(every, int) and every < 1:
        raise ConfigError("memory_options.activation_checkpointing.every", f"expected a positive integer, got {every}")


def validate_offloading(config: Any) -> None:
    require_cuda(config, "activation_offloading", "it moves saved activations to pinned host memory on a CUDA stream")


def sharding_plan(config: Any) -> str | None:
    """The plan that shards the trained weights on this launch (fsdp2 or tp, its dimension above 1), or None."""
    for plan, dim in (("fsdp2", "dp_shard"), ("tp", "tp")):
        if plan in config.parallel.plans and config.parallel.dims.get(dim, 1) > 1:
            return plan
    return None


def validate_optimizer_in_backward(config: Any) -> None:
    if (plan := sharding_plan(config)) is not None:  # before launch, what its apply refuses (compose)
        raise ConfigError("memory", f"optimizer_in_backward does not support a model sharded by {plan} yet (its "
                                    "checkpoints need a plain optimizer); drop one of the two")
    train = config.train
    if train.grad_accum_steps != 1:
        raise ConfigError("train.grad_accum_steps", f"optimizer_in_backward steps each parameter during backward, "
                                                    f"so gradients cannot accumulate; set it to 1 (got "
                                                    f"{train.grad_accum_steps})")
    if train.max_grad_norm is not None:
        raise ConfigError("train.max_grad_norm", "must be null with optimizer_in_backward: a parameter is stepped "
                                                 "before the global gradient norm is known")


def validate_chunked_cross_entropy(config: Any) -> None:
    plan = sharding_plan(config)
    if plan == "fsdp2":
        raise ConfigError("memory", "chunked_cross_entropy projects with the output head outside its forward, where "
                                    "fsdp2 keeps the head sharded; drop chunked_cross_entropy under fsdp2")
    if plan == "tp":
        raise ConfigError("memory", "chunked_cross_entropy needs the output head whole, which tp shards; use "
                                    "loss_parallel for a vocabulary-sharded loss instead")
    size = config.memory_options.get("chunked_cross_entropy", {}).get("chunk_size", 1)
    if isinstance(size, int) and size < 1:
        raise ConfigError("memory_options.chunked_cross_entropy.chunk_size", f"expected a positive integer, got {size}")
    adapter = config.adapter  # the head's adapter, named as either spelling, is folded into one weight
    if adapter is not None and adapter.dropout > 0 and isinstance(adapter.targets, list) and (
            {"output", "lm_head"} & set(adapter.targets)):
        raise ConfigError("adapter.dropout", f"chunked_cross_entropy folds the output head's adapter into one weight, "
                                             f"which dropout ({adapter.dropout:g}) does not allow; set adapter.dropout "
                                             "to 0, or leave the head (lm_head) out of adapter.targets")


def validate_compile(config: Any) -> None:
    """Refuse settings torch.compile would reject at the first step, and unbounded recompilation."""
    options = config.memory_options.get("compile", {})
    mode, backend = options.get("mode"), options.get("backend", "inductor")
    if mode not in COMPILE_MODES:
        raise ConfigError("memory_options.compile.mode", f"expected one of {', '.join(map(str, COMPILE_MODES[1:]))} "
                                                         f"or null, got {mode!r}")
    if mode is not None and backend != "inductor":
        raise ConfigError("memory_options.compile.mode", f"modes are inductor's; backend is '{backend}'")
    if mode == "reduce-overhead":
        require_cuda(config, "compile", "mode reduce-overhead records CUDA graphs")
    if sharding_plan(config) == "tp":  # tried: tracing the TP layers' DTensor autograd recursed without end
        raise ConfigError("memory", "compile does not trace tp's layers yet (the first step failed in autograd "
                                    "tracing, torch 2.13); drop one of the two (compile with fsdp2 works)")
    check_compile_backend(backend)
    rows = method_rows(config)
    dynamic = compile_is_dynamic(config, options.get("dynamic"), rows.fixed)
    if dynamic is False and not rows.fixed and config.data.pad_to_multiple_of is None:
        raise ConfigError("data.pad_to_multiple_of", "compile with static shapes (memory_options.compile.dynamic: "
                                                     "false) compiles once per padded length; set it (e.g. 64) to "
                                                     "bound recompilation, or use method.packing with "
                                                     "padding_free: false, or dynamic: true")
    check_compile_graph_breaks(config, options, dynamic, rows)


@dataclass(frozen=True)
class Rows:
    """How a method lays out its rows, from its settings ``packing`` and ``padding_free`` (the
    methods that do either name them so). Packed rows that are also padding-free drop their tails:
    documents end to end, of varying length."""

    packing: bool = False
    padding_free: bool = False

    @property
    def fixed(self) -> bool:
        """Rows of exactly ``max_seq_len``: one shape for every batch."""
        return self.packing and not self.padding_free

    @property
    def joined(self) -> bool:
        """Samples end to end in a row as documents."""
        return self.packing or self.padding_free


def method_rows(config: Any, method_config: Any = None) -> Rows:
    """The method's ``Rows``, its defaults included. ``method_config``: the validated settings, when
    the run has them; else they are validated here from the config."""
    if method_config is None:
        method_config = from_dict(lookup("method", config.method_name).config, config.method_settings, "method")
    return Rows(bool(getattr(method_config, "packing", False)), bool(getattr(method_config, "padding_free", False)))


def compile_is_dynamic(config: Any, dynamic: bool | None, fixed_rows: bool = False) -> bool:
    """``memory_options.compile.dynamic`` as set, or by default: static shapes when the data comes
    in few lengths (packed rows of a fixed length, or padded to a multiple), symbolic lengths otherwise (a padded or
    padding-free batch can have any length up to batch_size x max_seq_len)."""
    if dynamic is not None:
        return bool(dynamic)
    return not (fixed_rows or config.data.pad_to_multiple_of)


def check_compile_graph_breaks(config: Any, options: dict, dynamic: Any, rows: Rows) -> None:
    """Refuse what would break each layer's graph where that silently undoes compile or fails.

    A checkpointed layer cannot be split: on any graph break torch.compile runs the whole
    checkpointed layer eagerly. Rows made of documents (packing, padding-free batches) break at
    the per-document attention (kept out of graphs on purpose); symbolic lengths break at SDPA's
    ``is_causal`` (docs/performance.md).
    """
    if rows.joined and options.get("fullgraph", False):
        raise ConfigError("memory_options.compile.fullgraph", "must be false with rows of documents (method.packing "
                                                              "or method.padding_free): their attention runs each "
                                                              "document outside the compiled graph")
    if "activation_checkpointing" not in config.memory:
        return
    # the whole of what the pair needs, in each message: a user meets these one after the other otherwise
    needs = ("compile with activation_checkpointing needs padded rows of few lengths (method.packing and "
             "method.padding_free false, data.pad_to_multiple_of set, memory_options.compile.dynamic not true)")
    if rows.packing:
        raise ConfigError("method.packing", "compile with activation_checkpointing would run every layer eagerly: "
                                            "packed attention breaks the graph inside the checkpointed layer; "
                                            f"{needs}, or drop one of the two")
    if rows.padding_free:
        raise ConfigError("method.padding_free", "must be false with compile and activation_checkpointing: rows "
                                                 "joined as documents break the graph inside the checkpointed "
                                                 f"layer, which then runs eagerly; {needs}")
    if dynamic is not False:
        unset = options.get("dynamic") is None  # symbolic by default: the lengths are not bucketed
        raise ConfigError("data.pad_to_multiple_of" if unset else "memory_options.compile.dynamic",
                          ("must be set" if unset else "must be false") + " with compile and "
                          "activation_checkpointing: symbolic lengths break the graph inside the checkpointed layer, "
                          f"which then runs eagerly; {needs}")


def check_compile_backend(backend: Any) -> None:
    """A misspelt backend would otherwise fail only at the first training step, after loading."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError("memory_options.compile.backend", f"unknown torch.compile backend {backend!r} "
                                                            f"(known: {', '.join(sorted(known))})")


# -- their terms in `posttune plan`'s memory estimate (docs/memory.md, "How the estimate is composed") -----------


def estimate_checkpointing(est: Estimate, plan: Any) -> Estimate:
    """A checkpointed layer keeps only its input (``hidden`` values per token) and is recomputed in
    backward, so one layer's full activations come back at a time (counted once). On CPU the heap keeps
    the freed temporaries of the layers that still save, and of the recomputed one."""
    if est.shape is None:
        return est
    shape, width, tokens = est.shape, est.models[0].width, est.tokens
    checkpointed = shape.layers // plan.memory_options["activation_checkpointing"].every
    layer = layer_bytes_per_token(shape, width) * tokens
    saved = layer - checkpointed * (layer - shape.hidden * width * tokens)
    heap = heap_bytes(est, shape.layers - checkpointed + 1) - heap_bytes(est, shape.layers)
    note = ("activation_checkpointing's term is not calibrated: measured peaks were up to a third above the estimate "
            "(LoRA 16-34%, full fine-tuning 12% on CPU); leave that margin (docs/memory.md)")
    return replace(est, activations=est.activations + saved, allocator=est.allocator + heap,
                   notes=(*est.notes, note))


def estimate_offloading(est: Estimate, plan: Any) -> Estimate:
    """On CUDA the layer inputs checkpointing keeps live in pinned host memory (on CPU: nothing moves)."""
    if est.shape is None or est.device == "cpu":
        return est
    inputs = est.shape.layers * est.shape.hidden * est.models[0].width * est.tokens
    return replace(est, activations=est.activations - inputs)


def estimate_optimizer_in_backward(est: Estimate, plan: Any) -> Estimate:
    """Each gradient is applied and freed as soon as it is accumulated: about one parameter's at a time."""
    def largest(model: Any) -> int:
        return max((p.numel() for p in unique_parameters(model.module) if p.requires_grad), default=0) * model.width

    return replace(est, models=tuple(replace(m, gradient_bytes=largest(m)) if m.trainable else m for m in est.models))


def estimate_chunked_cross_entropy(est: Estimate, plan: Any) -> Estimate:
    """The loss materialises one chunk of ``chunk_size`` labelled tokens' logits at a time."""
    if est.shape is None:
        return est
    rows = min(est.tokens, plan.memory_options["chunked_cross_entropy"].chunk_size)
    return replace(est, logits=est.logits - logits_bytes(est.shape, est.tokens) + logits_bytes(est.shape, rows))


TECHNIQUES = (
    MemoryTechnique(
        name="activation_checkpointing", stage="parallelize", apply=_checkpointing, order=CHECKPOINTING_ORDER,
        saves="activations inside decoder layers: kept only at layer boundaries, recomputed in backward",
        validate=validate_checkpointing, config=CheckpointingConfig, estimate=estimate_checkpointing,
        description="recompute decoder layers in backward (all, or every k-th: memory_options.every)",
    ),
    MemoryTechnique(
        name="activation_offloading", stage="parallelize", apply=_offloading, order=OFFLOADING_ORDER,
        requires=("activation_checkpointing",),
        saves="the layer-boundary activations checkpointing keeps: moved to pinned host memory",
        validate=validate_offloading, estimate=estimate_offloading,
        description="saved activations to pinned CPU memory on a side CUDA stream (CUDA only; the head exempt)",
    ),
    MemoryTechnique(
        name="optimizer_in_backward", stage="optimizer", apply=_optimizer_in_backward,
        saves="the gradients: each is applied and freed as soon as backward produces it",
        validate=validate_optimizer_in_backward, estimate=estimate_optimizer_in_backward,
        description="one optimizer per parameter, stepped from its gradient hook (no accumulation, no clipping)",
    ),
    MemoryTechnique(
        name="chunked_cross_entropy", stage="loss", apply=_chunked_cross_entropy,
        saves="the [batch, seq, vocab] logits and their gradient: only one chunk of labelled tokens at a time",
        validate=validate_chunked_cross_entropy, config=ChunkedCrossEntropyConfig,
        estimate=estimate_chunked_cross_entropy,
        description="linear cross-entropy: drop ignored tokens, project to the vocabulary chunk by chunk",
    ),
    MemoryTechnique(
        name="compile", stage="parallelize", apply=_compile, order=COMPILE_ORDER,
        conflicts=("activation_offloading",),
        saves="mostly time (fused kernels); the compiled loss need not keep a float32 copy of the logits",
        validate=validate_compile, config=CompileConfig,
        description="torch.compile each decoder layer's training forward (after checkpointing, before FSDP2) "
                    "and the plain cross-entropy",
    ),
)


posttune_register_memory_techniques = registering(TECHNIQUES)
