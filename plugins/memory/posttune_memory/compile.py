"""compile: ``torch.compile`` each decoder layer's training forward, and the plain token loss.

Why per layer and not the whole model: every decoder layer runs the same code, so one graph
serves all of them (Dynamo lifts the parameters into graph inputs), compile time does not
grow with depth, and the model's own Python around the layers (masks, RoPE tables, KV cache,
packed positions) stays eager where it can branch freely. This is torchtitan's recipe.

How it composes (``parallelize`` stage, order 70):

- after ``activation_checkpointing`` (50): the checkpointed forward is what gets compiled, so
  Dynamo sees ``torch.utils.checkpoint`` and recomputes the layer inside the compiled graph.
  A checkpointed region cannot be split, so any graph break in the layer (rows made of
  documents: packing or padding-free; symbolic lengths) would make it run eagerly: ``validate``
  refuses those combinations. (Checkpointing around a compiled forward instead fails: the
  recomputation may select a different graph than the forward did.);
- before plans that wrap layers (FSDP2, order 100): only ``forward`` is compiled, never
  ``__call__``, so FSDP2's all-gather/reshard hooks run eagerly around the compiled layer;
- after plans that make parameters DTensors (tensor parallelism, order 10): the layer's DTensor
  parameters are traced as DTensors;
- LoRA/DoRA adapters are ordinary modules inside the layer; a ``load``-stage quantization (QLoRA's
  NF4) converts weights later, which works because compilation is lazy: the first training step
  traces whatever weights the layer then holds;
- the wrapper is by instance attribute, as checkpointing's: module and parameter names (and
  so loading, saving, adapters and checkpoints) are unchanged.

Only what trains is compiled: a layer called without gradients (evaluation, generation with
a KV cache, a policy used as its own reference) runs the eager forward, so those forwards
never trigger compilations of their own (a KV cache's growing length would recompile every
step). Frozen roles (``frozen="skip"``) are not compiled for the same reason: they only ever
run without gradients.

The loss: unless ``loss`` is false, a ``session.loss_kernel`` is installed whose
cross-entropy (summed, and per-token log-probabilities) is compiled, so the float32 upcast
and log-softmax fuse instead of materialising a float32 copy of the logits; as on the plain
path, only the labelled positions go through the head (``labelled_logits``). A ``loss``-stage
technique (``chunked_cross_entropy``) runs later and replaces the kernel with its own, which
then stays eager; a vocabulary-sharded head (tensor parallelism with a parallel loss) keeps the
core's plain path, which is what torch's ``loss_parallel()`` context parallelises.

Shapes (the recompilation policy, docs/performance.md): ``dynamic: false`` compiles one graph
per distinct (batch, length) shape. Bounded when lengths come in buckets
(``data.pad_to_multiple_of``) or are fixed (packed rows of ``max_seq_len``: the method's ``packing``
without ``padding_free``): ``validate`` asks for one of
the three, and ``apply`` raises Dynamo's recompile limit to the number of buckets. The default
(null) is static with buckets and ``dynamic: true`` without (``compile_is_dynamic``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttune.plugin import IGNORE_INDEX, LossKernel, in_label_shape, is_dtensor, labelled_logits
from posttune_memory.checkpointing import decoder_layers

BATCH_SHAPES = 2  # full batches and a smaller last one: both compile per length bucket


def apply(session: Any, target: Any, options: Any = None, *, fixed_rows: bool = False) -> None:
    """Compile the target's decoder layers and, for the policy, install the compiled loss.

    ``options``: the technique's settings with ``dynamic`` decided (``posttune_memory`` resolves
    the default from the data); the run's ``memory_options`` as given otherwise. ``fixed_rows``:
    whether the method's rows are packed to a fixed length (``posttune_memory.Rows.fixed``).
    """
    options = options if options is not None else session.plan.memory_options["compile"]
    raise_recompile_limit(session.config, options, fixed_rows)
    compile_fn = compiler(options)
    for layer in decoder_layers(target.model, "compile"):
        compile_layer(layer, compile_fn)
    if target.trainable and options.loss and not head_is_sharded(target.model):
        session.loss_kernel = compiled_loss_kernel(compiler(options, loss=True))


#: the loss's mode where the layers' mode records CUDA graphs: those record one graph per shape, and the loss's
#: shape (its labelled count) changes every batch
LOSS_MODES = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def compiler(options: Any, *, loss: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``torch.compile`` with the technique's settings, for one function; for the loss (``loss``), symbolic
    shapes and no CUDA graphs (``compiled_loss_kernel`` says why)."""
    kwargs: dict[str, Any] = {"dynamic": True if loss else options.dynamic, "backend": options.backend,
                              "fullgraph": options.fullgraph}
    mode = LOSS_MODES.get(options.mode, options.mode) if loss else options.mode
    if mode is not None:
        kwargs["mode"] = mode
    return functools.partial(torch.compile, **kwargs)


def compile_layer(layer: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``layer.forward`` (possibly checkpointed already) by a compiled one for training calls."""
    layer.forward = training_compiled(layer.forward, compile_fn(layer.forward))
    layer.compiled = True


def training_compiled(eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` while gradients are recorded and no KV cache is passed, ``eager`` otherwise."""

    @functools.wraps(eager)
    def run(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", args[4] if len(args) > 4 else None)
        if cache is not None or not torch.is_grad_enabled():
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return run


def head_is_sharded(model: nn.Module) -> bool:
    """A head TP already split over the vocabulary: the core's plain loss is what loss parallel handles."""
    head = getattr(model, "output", None)
    return head is not None and is_dtensor(head.weight)


# ---- the loss ------------------------------------------------------------------------------------

def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``posttune.losses.token_cross_entropy``'s arithmetic: float32, summed over labelled tokens.

    ``logits`` are ``[..., vocab]`` with ``labels`` of the leading shape: the labelled rows only
    (``[n, vocab]``) or full rows (``[batch, seq, vocab]``, a model without ``logits_at``)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def label_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """``posttune.losses.token_logps``'s arithmetic: each label's log-prob in ``labels``' shape, 0 where ignored."""
    if temperature != 1.0:
        logits = logits / temperature
    nll = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none")
    return -nll.view(labels.shape)


def compiled_loss_kernel(compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> LossKernel:
    """The plain loss with its logits-to-loss part compiled (the model's forward is called eagerly:
    its layers are compiled already). Without gradients the eager arithmetic runs.

    As on the core's plain path, only the labelled positions reach the head (``labelled_logits``):
    with a large vocabulary the head is a large share of the step, and a prompt often half a row.
    Their count changes every batch while the vocabulary never does, so ``compile_fn`` compiles with
    symbolic shapes whatever the layers' setting: one graph serves every count (static shapes would
    compile one per count, bucketed lengths or not), and without CUDA graphs, which would record one
    per count."""
    summed, logps = compile_fn(summed_cross_entropy), compile_fn(label_logps)

    def cross_entropy(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, labels, _ = labelled_logits(model, batch)
        loss = (summed if torch.is_grad_enabled() else summed_cross_entropy)(logits, labels)
        return loss, (batch["labels"] != IGNORE_INDEX).sum()

    def token_logps(model: Any, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        logits, labels, keep = labelled_logits(model, batch)
        values = (logps if torch.is_grad_enabled() else label_logps)(logits, labels, float(temperature))
        return values if keep is None else in_label_shape(values, labels, keep)

    return LossKernel(cross_entropy=cross_entropy, logps=token_logps, name="compile")


# ---- recompilation -------------------------------------------------------------------------------

def expected_graphs(config: Any, options: Any, fixed_rows: bool = False) -> int | None:
    """How many static-shape graphs each compiled function may need, or None when unbounded/dynamic."""
    if options.dynamic is not False:
        return None
    data = config.data
    if fixed_rows:
        return BATCH_SHAPES
    if data.pad_to_multiple_of:  # a padding-free row holds a whole batch: up to batch_size x max_seq_len
        return BATCH_SHAPES * math.ceil(config.train.batch_size * data.max_seq_len / data.pad_to_multiple_of)
    return None


def raise_recompile_limit(config: Any, options: Any, fixed_rows: bool = False) -> None:
    """Let Dynamo keep one graph per length bucket: past its limit (8 by default) it would silently
    run the remaining shapes eagerly. Only ever raised, so other compiled code keeps its headroom."""
    graphs = expected_graphs(config, options, fixed_rows)
    dynamo = torch._dynamo.config
    if graphs is not None and dynamo.recompile_limit < graphs:
        dynamo.recompile_limit = graphs
