"""What plugins register: one frozen dataclass per kind of contribution.

Descriptors hold plain data and callables. The core never subclasses them and never looks a
model, method or plan up by anything but its registered name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:  # torch is imported lazily so that `posttune plugins` starts fast
    import torch

    from posttune.config.schema import RunConfig
    from posttune.estimate import Estimate
    from posttune.session import Session

#: Composition stages in the order `posttune train` runs them (docs/architecture.md). Memory techniques
#: name the stage they act at; within ``parallelize`` they interleave with parallel plans by
#: ``order`` (activation checkpointing must wrap layers before FSDP2 shards them).
STAGES: tuple[str, ...] = (
    "build",  # model on the meta device
    "adapt",  # adapters (LoRA/DoRA) injected
    "quantize",  # frozen weights quantised (QLoRA NF4, QAT fake-quant)
    "parallelize",  # TP / loss-parallel / CP, activation checkpointing, compile, FSDP2
    "load",  # weights materialised and streamed in
    "optimizer",  # optimizer and LR schedule built (optimizer-in-backward, low-bit optimizers)
    "loss",  # the loss computation (chunked cross-entropy)
)
Stage = Literal["build", "adapt", "quantize", "parallelize", "load", "optimizer", "loss"]

#: A dataset kind: a plain name for what a format's rows become and a method reads (the core's
#: formats give ``conversation``, ``preference`` and ``prompt`` rows; a plugin adds a kind by
#: registering a format of it and a method that reads it). docs/plugins.md, "Dataset kinds".
DatasetKind = str


def current_kind(kind: DatasetKind) -> DatasetKind:
    """A kind by its current name: a plugin written for plugin API 2 may still use an old one."""
    from posttune.first_party import RENAMED_KINDS

    return RENAMED_KINDS.get(kind, kind)

Validator = Callable[["RunConfig"], None]
"""Called before launch with the whole validated config; raises ConfigError to refuse it."""


#: Adapter targets covering every linear layer of the core decoder blocks (fnmatch patterns over
#: native module names): the default QLoRA found necessary to match full fine-tuning. Families
#: assembled from ``posttune.modules`` pass it as ``ModelFamily.lora_targets``.
DECODER_LINEAR_LAYERS: tuple[str, ...] = tuple(
    f"layers.*.{name}" for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
)


#: Tensor-parallel styles for the core decoder blocks (fnmatch patterns over native names), as
#: torchtitan's Llama plan: q/k/v and gate/up split their output features ("colwise"), o/down
#: their input features ("rowwise") so each block needs one reduction; norms run
#: sequence-parallel between blocks; the embedding is split by vocabulary rows and the head by
#: vocabulary columns (which suits tied weights: both split the vocab dim). Families assembled
#: from ``posttune.modules`` pass it (or extend it) as ``ModelFamily.tp_plan``.
DECODER_TP_PLAN: dict[str, str] = {
    "embed": "rowwise",
    "layers.*.attn_norm": "sequence_parallel",
    "layers.*.attn.q_proj": "colwise",
    "layers.*.attn.k_proj": "colwise",
    "layers.*.attn.v_proj": "colwise",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp_norm": "sequence_parallel",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "norm": "sequence_parallel",
    "output": "colwise",
}


@dataclass(frozen=True)
class ModelFamily:
    """A model architecture: how to read its HF config and build it from core blocks."""

    name: str
    architectures: tuple[str, ...]  # HF `architectures` entries this family reads
    from_hf_config: Callable[[Mapping[str, Any]], dict[str, Any]]  # config.json -> build kwargs
    build: Callable[..., torch.nn.Module]  # build(**kwargs) -> module returning logits
    to_hf_config: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None  # build kwargs -> config.json
    sizes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # named build kwargs
    tp_plan: Mapping[str, str] = field(default_factory=dict)  # module-name pattern -> style
    lora_targets: tuple[str, ...] = ()  # default module-name patterns for adapters
    description: str = ""
    # the memory estimate (docs/memory.md, "How the estimate is composed"): ``estimate(est, plan)``
    # returns ``est`` with this family's effect, e.g. the activations of layers unlike posttune.modules' blocks
    estimate: Callable[[Estimate, Any], Estimate] | None = None


@dataclass(frozen=True)
class CheckpointConverter:
    """Maps one family's tensors between a checkpoint format and posttune's native names.

    ``to_native(key, tensor, hf_config)`` returns ``(native_key, tensor)``, or None for a
    tensor the native model does not keep (e.g. cached rotary frequencies); ``from_native`` is
    its inverse. Either may also map one tensor to several (pairs) or several to one (``Join``):
    the contract is in ``posttune/checkpoint/convert.py`` and docs/checkpoints.md.
    """

    family: str
    format: str
    to_native: Callable[[str, torch.Tensor, Mapping[str, Any]], Any]  # pair, pairs, (Join, tensor) or None
    from_native: Callable[[str, torch.Tensor, Mapping[str, Any]], Any]
    description: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}:{self.format}"


@dataclass(frozen=True)
class QuantizedFormat:
    """Reads checkpoints whose config.json says ``quantization_config: {quant_method: NAME}``.

    Quantized weights are tensor subclasses of a quantization library (torchao's ``Int8Tensor``)
    stored as several plain tensors plus metadata; only that library can rebuild them, so the
    core asks the plugin registered under the ``quant_method``. ``read(files)`` yields
    ``(hf_key, tensor)`` for every weight in the checkpoint's safetensors ``files``, quantized
    ones rebuilt; the core maps names with the family's converter, checks them as for any
    checkpoint, and places the tensors in the model as they are (no float copy is made).
    """

    name: str  # the quant_method this reads, e.g. "torchao"
    read: Callable[[Sequence[Path]], Iterable[tuple[str, torch.Tensor]]]
    description: str = ""


@dataclass(frozen=True)
class LossOutput:
    """What ``Method.loss`` returns: a summed loss, what to divide it by, and what it processed.

    The trainer sums ``loss_sum`` and ``normaliser`` over the micro-batches of a step and over
    the ranks that hold different data, and divides once, so a method never normalises by
    itself: SFT's normaliser is its labelled tokens, DPO's its preference pairs (``unit`` names
    it in the logs). ``tokens`` is the non-padding tokens of the rows the step trained on, each
    response with its prompt (a prompt the forward shares, DPO's or GRPO's ``share_prompt``, counts once per
    response, as unshared): the logged ``tokens`` and ``tokens_per_s`` count it, comparable across settings.

    ``metrics``: a plain number is averaged over micro-batches and ranks; a pair
    ``(total, count)`` is reported as ``sum(total) / sum(count)`` over all of them (e.g. a
    reward summed over pairs, and the pair count), which is exact under any batching.
    """

    loss_sum: torch.Tensor
    normaliser: torch.Tensor | float
    tokens: torch.Tensor | int = 0
    metrics: Mapping[str, float | torch.Tensor | tuple[Any, Any]] = field(default_factory=dict)
    unit: str = "labelled_tokens"  # what ``normaliser`` counts, logged under this name ("pairs" for DPO)


@dataclass(frozen=True)
class ModelRole:
    """A model a method uses besides the policy: ``session.models[name]`` (docs/architecture.md, "Model roles").

    The name is the method's own (any name but ``policy``); the config's ``models.<name>`` section
    (the keys of ``model:``) says where its weights come from. Without that section the role is
    refused as missing, unless ``from_policy``: then it is a frozen copy of the policy's source
    (its checkpoint, or the same seeded random init); and with ``adapters_off`` in a LoRA/DoRA run,
    the policy itself with its adapters disabled (no second copy in memory; implies ``from_policy``).

    ``trained``: the role learns alongside the policy (e.g. a value model): built as the policy
    is (the run's adapters, plans and techniques), stepped by the same optimizer and clipped with
    it (one gradient norm over both), saved in checkpoints (``models/<name>/``) and exported beside
    the policy (``<name>/``, or ``<name>-adapter/``). Not with ``adapters_off`` or without ``run_plans``.
    ``on_policy`` (with ``trained`` and ``score``): no second model, a score head reading the policy's
    final hidden states (``checkpoint/score_head.PolicyHead``: a value head sharing the policy's trunk);
    saved as ``<name>/head.safetensors``. The run's parallel plans shard it; no memory technique applies.
    ``run_plans``: the run's parallel plans and memory techniques that act on frozen models act
    on this one too (false: none does; it is built whole on every rank).
    ``score``: the role returns one value per token instead of logits (a reward or value model:
    its source's ``score`` head, or a fresh one replacing a causal LM's; ``checkpoint/score_head.py``).
    A source saved as a sequence classifier gets its score head whatever this says.
    ``own_tokenizer``: the role reads text through its own tokenizer (it scores decoded completions), not
    the policy's token ids: its vocabulary and tokenizer need not be the policy's.
    """

    name: str
    from_policy: bool = False
    adapters_off: bool = False
    trained: bool = False
    run_plans: bool = True
    score: bool = False
    on_policy: bool = False
    own_tokenizer: bool = False


@dataclass(frozen=True)
class Method:
    """A post-training algorithm (plugin API 2). The core owns the loop; the method owns its data,
    its extra models and its loss (docs/architecture.md, "The method lifecycle").

    - ``data(session, dataset, split)`` -> a loader: an iterable of micro-batches, with
      optional ``len()`` (micro-batches per epoch), ``set_epoch(epoch)`` and
      ``state_dict()``/``load_state_dict()`` (mid-epoch resume). Called for ``"train"`` and,
      when configured, ``"validation"``, before the step count and LR schedule are fixed.
    - ``loss(session, batch)`` -> ``LossOutput``.
    - ``dataset_kind``: the kind of rows it reads (``DatasetKind``), or a tuple of the kinds it can
      read; each split's format must give one of them.
    - ``roles``: the model roles it needs (names or ``ModelRole``), or a function of its
      validated config returning them (e.g. none for settings that need no other model).
    - ``batches(session)``: the micro-batches of one epoch; default: the train loader's.
    - ``setup(session)``: after data, optimizer and roles, before resume (e.g. precompute).
    - ``evaluate(session) -> dict``: default: loss and metrics over the validation loader.
    - ``on_step_end(session, record)``: after each optimizer step; may add to ``record``. Also after a step
      skipped for a non-finite loss or gradient (``train.skip_nonfinite``): the step counts, though its
      ``record`` holds ``skipped_nonfinite`` and no loss.
    - ``state_dict(session)`` / ``load_state_dict(session, state)``: kept in checkpoints
      (tensors and plain containers: they are read back with ``weights_only=True``); a ``None`` state
      keeps nothing (no file; a checkpoint without method files resumes without ``load_state_dict``).
    - ``validate(config, method_config)``: before launch; raise ConfigError to refuse.
    - ``micro_batch_tokens(config, method_config) -> (tokens, how)``: the most tokens one
      micro-batch's forward-with-gradient holds, and a phrase saying how that was worked out
      (``posttune plan`` prints it). The memory estimate scales activations and logits by it;
      default (None): ``train.batch_size x data.max_seq_len``, right for one sequence per row,
      wrong for a method that puts several in one forward (DPO's chosen and rejected) or sizes
      its rows from its own settings (GRPO's completions).
    - ``batch_text(config, method_config) -> str``: with ``batches``, what ``train.batch_size`` counts and what
      one rank's micro-batches hold, for the run's banner (GRPO: prompts, their completions).
    - ``estimate(est, plan) -> Estimate``: the method's memory-estimate term, applied after the family's (a loss
      that holds other than three fp32 ``[tokens, vocab]`` tensors at its peak: two models' logits, chunked).
    - ``score_head``: the policy returns one value per token instead of logits (a reward model):
      a fresh head replaces a causal checkpoint's, and it saves as a sequence classifier.
    - ``close(session)``: releases what the method opened (engines, Ray actors, worker processes,
      files). The core calls it once on every way out of a run that reached ``setup`` (success,
      an error, Ctrl-C, SIGTERM), also after a ``setup`` that raised, so it must cope with a
      half-done setup; what it raises is reported as a warning.
    """

    name: str
    config: type  # dataclass validated from the config's `method:` section
    dataset_kind: DatasetKind | tuple[DatasetKind, ...]
    data: Callable[[Session, Any, str], Any]
    loss: Callable[[Session, Any], LossOutput]
    roles: tuple[str | ModelRole, ...] | Callable[[Any], tuple[str | ModelRole, ...]] = ()
    batches: Callable[[Session], Iterable[Any]] | None = None
    setup: Callable[[Session], None] | None = None
    evaluate: Callable[[Session], Mapping[str, float]] | None = None
    on_step_end: Callable[[Session, dict[str, Any]], None] | None = None
    state_dict: Callable[[Session], Any] | None = None
    load_state_dict: Callable[[Session, Any], None] | None = None
    validate: Callable[[RunConfig, Any], None] | None = None
    description: str = ""
    micro_batch_tokens: Callable[[RunConfig, Any], tuple[int, str]] | None = None
    close: Callable[[Session], None] | None = None  # releases what the method opened; see above
    batch_text: Callable[[RunConfig, Any], str] | None = None  # the banner's account of its own batches
    score_head: bool = False  # the policy is a reward model: see above
    estimate: Callable[[Estimate, Any], Estimate] | None = None  # its memory-estimate term: see above
    plot: tuple[str, ...] = ()  # step-record metrics `posttune plot` draws under the loss, a panel each

    @property
    def dataset_kinds(self) -> tuple[DatasetKind, ...]:
        """The kinds of rows it reads: ``dataset_kind`` as a tuple, a renamed kind by its new name."""
        kinds = (self.dataset_kind,) if isinstance(self.dataset_kind, str) else tuple(self.dataset_kind)
        return tuple(current_kind(kind) for kind in kinds)

    def model_roles(self, method_config: Any) -> tuple[ModelRole, ...]:
        """The roles this method needs with ``method_config``, as ``ModelRole``s."""
        roles = self.roles(method_config) if callable(self.roles) else self.roles
        return tuple(role if isinstance(role, ModelRole) else ModelRole(role) for role in roles)


#: What a parallel plan or memory technique does with frozen model roles (``ModelRole``):
#: ``"apply"`` to them as to the policy, ``"skip"`` them (e.g. activation
#: checkpointing: nothing runs backward through a frozen model), or ``"refuse"`` a method
#: that has roles (a plan not yet made to work with them), with a one-line error before launch.
FrozenModels = Literal["apply", "skip", "refuse"]


#: What a mesh dimension splits, i.e. how the data its ranks see differ (docs/parallel.md,
#: "Mesh dimensions"). ``"batch"``: rows; the data loaders shard by it. ``"sequence"``: positions
#: of the same rows, split by the plan in a step context. ``"tokens"``: any other split of the
#: same micro-batch the plan makes itself (rows of it, or tokens routed to other ranks). Those
#: three make ranks hold different tokens: losses and token counts are summed over them, and
#: gradients averaged. ``"none"``: every rank sees the same tokens (e.g. weights split instead).
Splits = Literal["batch", "sequence", "tokens", "none"]


@dataclass(frozen=True)
class MeshDim:
    """A DeviceMesh dimension a parallel plan owns: the core builds the mesh and shards data from these."""

    name: str
    order: int  # position in the mesh, lowest outermost: data parallel outside (slow links), weights inside
    splits: Splits = "none"

    def __post_init__(self) -> None:  # a misspelt split would silently count as "none"
        if self.splits not in get_args(Splits):
            raise ValueError(f"MeshDim '{self.name}': splits must be one of {', '.join(get_args(Splits))}, "
                             f"not {self.splits!r}")


@dataclass(frozen=True)
class ParallelPlan:
    """A way to split models over devices, applied at the ``parallelize`` stage by ``order``.

    ``apply(session, target)`` acts on ``target.model`` (a ``ModelTarget``: the policy, or a
    frozen role when ``frozen`` is ``"apply"``). ``adjusts``: options this plan sets on other
    active plans (plan name -> option -> value), checked against their ``config`` before launch.
    ``init_device(options)``: the device the ``load`` stage materialises the models this plan
    applies to on (e.g. ``"cpu"`` for parameters kept in CPU memory), or None for the run's.
    """

    name: str
    apply: Callable[[Session, Any], None]
    mesh_dim: MeshDim | None = None  # the DeviceMesh dimension this plan owns
    order: int = 0  # lower runs first: plans that rewrite modules before those that wrap them
    requires: tuple[str, ...] = ()  # other plans that must be active
    conflicts: tuple[str, ...] = ()  # plans or memory techniques it cannot run with
    validate: Validator | None = None  # sees ``parallel.dims`` resolved against the world size
    description: str = ""
    config: type | None = None  # dataclass validated from `parallel.options.<name>`; the instance
    #                             is ``session.plan.parallel_options[name]`` when the plan runs
    frozen: FrozenModels = "apply"
    adjusts: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    init_device: Callable[[Any], str | None] | None = None
    # the memory estimate (docs/memory.md, "How the estimate is composed"): ``estimate(est, plan)``
    # returns ``est`` with this plan's effect (e.g. what it shards); None: `posttune plan` notes it is not modelled
    estimate: Callable[[Estimate, Any], Estimate] | None = None


@dataclass(frozen=True)
class MemoryTechnique:
    """A switch that trades compute or precision for memory, applied at one stage.

    ``apply(session, target)``: at the model stages (build .. load) ``target`` is the model
    being built (``target.model``; frozen roles too when ``frozen`` is ``"apply"``); at the
    ``optimizer`` and ``loss`` stages it is the policy's target.
    """

    name: str
    stage: Stage
    apply: Callable[[Session, Any], None]
    order: int = 0  # within the stage; compared with ParallelPlan.order in ``parallelize``
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    saves: str = ""  # what memory it saves, in words, for its reader (the core reads only the estimate)
    validate: Validator | None = None  # sees ``parallel.dims`` resolved against the world size, as a plan's
    description: str = ""
    config: type | None = None  # dataclass validated from `memory_options.<name>`; the instance
    #                             is ``session.plan.memory_options[name]`` when the technique runs
    frozen: FrozenModels = "skip"
    # the memory estimate (docs/memory.md, "How the estimate is composed"): ``estimate(est, plan)``
    # returns ``est`` with this technique's effect; None: `posttune plan` notes it is not modelled
    estimate: Callable[[Estimate, Any], Estimate] | None = None


@dataclass(frozen=True)
class AdapterKind:
    """A kind of adapter (LoRA, DoRA, IA3, ...) that ``adapter.kind`` names. Its layer subclasses
    ``AdaptedLinear`` (posttune.plugin), keeping the wrapped linear as ``base``; the core freezes,
    initialises, switches off, merges, gathers and estimates through that protocol alone.

    - ``wrap(linear, adapter, dtype)``: one adapted layer around ``linear``, from the run's ``adapter:``
      section (``AdapterConfig``) and the adapters' dtype (None: the base's).
    - ``save(model, directory, *, state_dict=None) -> Path``: the model's adapters as files in ``directory``,
      a fresh folder (``save_adapter`` makes it atomic, fsyncs it and adds the tokenizer); the folder holds
      ``adapter_config.json``; ``state_dict``: the adapter tensors gathered whole by model key (sharded runs).
    - ``load(model, directory) -> names``: a saved folder's adapters into ``model`` (applied first when it
      has none, as ``posttune generate --adapter`` and ``posttune merge`` need).
    - ``reads(adapter_config) -> bool``: whether a saved folder (its ``adapter_config.json``) is this kind's.
    - ``validate(adapter)``: before launch, a `ConfigError` for a setting the kind cannot honour, or an
      ``adapter.init_from`` folder it cannot start from.
    """

    name: str
    wrap: Callable[[Any, Any, Any], Any]
    save: Callable[..., Path]
    load: Callable[[Any, Path], list[str]]
    reads: Callable[[Mapping[str, Any]], bool]
    validate: Callable[[Any], None] | None = None
    description: str = ""


@dataclass(frozen=True)
class DatasetFormat:
    """Turns one dataset row into what a method of ``kind`` consumes (e.g. chat messages).

    ``transform`` raises KeyError or ValueError for a bad row; the data pipeline turns that
    into an error naming the row index and the field.
    """

    name: str
    kind: DatasetKind
    transform: Callable[[Mapping[str, Any]], Any]
    columns: tuple[str, ...] = ()  # the fields a row needs, for documentation and errors
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", current_kind(self.kind))


@dataclass(frozen=True)
class EnginePolicy:
    """What a generation engine starts on: the live policy (``model``, used in place by ``builtin``), or
    what a copy is built or loaded from (vLLM; an engine in a Ray actor, given weights by ``update_weights``)."""

    family: str  # the policy's ModelFamily name
    build_kwargs: Mapping[str, Any]  # what the family's ``build`` took: the architecture
    model: torch.nn.Module | None = None  # the live policy in this process; None where there is none (an actor)
    source: str | None = None  # the checkpoint (directory or hub id) the policy was loaded from; None: random init
    device: Any = None  # where to generate; None: the model's device (CPU for a built copy)
    version: int = 0  # the version of the weights it starts with (the learner's optimizer steps); -1: none yet
    options: Any = None  # the validated `engine_options` (an instance of ``GenerationEngine.config``), or None
    sampling: Any = None  # the method's non-greedy ``Sampling`` (rollouts), for an engine that fixes settings at start


@dataclass(frozen=True)
class GenerationEngine:
    """Generates completions for the methods that sample from the policy (GRPO, on-policy KD), which
    name one in their config (``method.engine``). ``start(policy: EnginePolicy)`` returns an object with
    ``generate(prompts, sampling, seeds) -> Completions`` (rows seeded one each, behaviour log-probs
    before filtering), ``update_weights(weights, version)`` (a plain state dict, or None: "the live
    ``policy.model`` changed"), ``version`` (-1 before any weights: a stale engine is visible) and
    ``close()``. The contract in full: docs/plugins.md, "Generation engines".
    """

    name: str
    start: Callable[[EnginePolicy], Any]
    config: type | None = None  # dataclass validated from the method's `engine_options`; given as ``policy.options``
    description: str = ""
    #: ``check(options, sampling)`` before launch: raise a one-line error for a sampling setting the engine
    #: cannot honour (``options`` as validated, or None; ``sampling`` the method's ``Sampling``)
    check: Callable[[Any, Any], None] | None = None


@dataclass(frozen=True)
class RewardFunction:
    """Scores completions: ``fn(prompts, completions, **row_fields) -> list[float | None]``.

    ``prompts`` and ``completions`` are lists of equal length (a prompt repeated once per
    completion of its group); every other field of the dataset row (e.g. ``answer``) arrives
    as a keyword argument holding the same-length list, untouched. None means "cannot score
    this one" (the method decides whether that is an error). With ``config`` (a dataclass) the
    run's options for this reward are validated against it before launch and passed as
    ``reward_options=<instance>`` (not ``options``: a dataset may have a column of that name).

    ``isolated``: for a reward that parses or runs model output and so may hang on one completion
    (sympy, a regex, code execution). The method then calls ``fn`` on one completion at a time in
    worker processes, each under a time limit (GRPO: ``timeout_s``, default 5 s), and counts one
    that overruns as a failure of that reward. ``fn`` and the ``config`` instance travel by pickle:
    define them at module level.
    """

    name: str
    fn: Callable[..., list[float | None]]
    description: str = ""
    config: type | None = None
    isolated: bool = False


@dataclass(frozen=True)
class BundledConfig:
    """A YAML recipe shipped as package data, listed by `posttune ls configs`."""

    name: str
    path: Path
    description: str = ""


@dataclass(frozen=True)
class Command:
    """An extra `posttune` subcommand. ``run`` returns the exit status."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    examples: tuple[str, ...] = ()  # command lines shown under "examples:" in `posttune NAME --help`


@dataclass(frozen=True)
class TrackerRun:
    """What a metric logger's ``start`` is told about the run (on the main rank, before step one).

    ``run_id`` is posttune's lineage id: a resumed run keeps it, so a tracker that can continue a
    run (a W&B run id, an MLflow tag) continues the same one; ``resumed_step`` is the step a
    resumed run continues after (None for a fresh run): records past it were never saved, and a
    tracker that can drop them (TensorBoard's ``purge_step``) should.
    """

    name: str  # a default run name: the output directory's name
    output_dir: Path
    config: Mapping[str, Any]  # the resolved run config, as OUTPUT/config.yaml holds it
    options: Any  # the validated `logging_options.<name>` (an instance of ``MetricLogger.config``), or None
    run_id: str
    resumed_step: int | None
    total_steps: int


@dataclass(frozen=True)
class MetricLogger:
    """An experiment tracker (W&B, TensorBoard, MLflow, ...) fed what the run writes to OUTPUT.

    Called on the main rank only, in this order:

    - ``start(run: TrackerRun) -> handle``: open the tracker's run (log hyper-parameters from
      ``run.config`` where the tracker supports them). Raising stops the run before step one
      with one line naming the tracker.
    - ``log(handle, record)``: each record written to ``metrics.jsonl``, the same dict (``step``,
      ``loss``, ``lr``, ..., ``val_*`` on evaluation steps; a skipped step's ``skipped_nonfinite``
      is text). ``scalar_metrics(record)`` keeps the numbers.
    - ``finish(handle, summary, artefacts)``: ``summary`` is what ``summary.json`` holds, or None
      when the run stopped early (preempted, or an error); ``artefacts`` names the files the run
      wrote (``model`` or ``adapter`` directories, ``plot``, ``metrics``, ``summary``, ``config``).

    A failure in ``log`` or ``finish`` is reported once as a warning and that tracker is
    dropped: the training run is worth more than its dashboard.
    """

    name: str
    start: Callable[[TrackerRun], Any]
    log: Callable[[Any, Mapping[str, Any]], None]
    finish: Callable[[Any, Mapping[str, Any] | None, Mapping[str, Path]], None]
    config: type | None = None  # dataclass validated from `logging_options.<name>`; given as ``TrackerRun.options``
    description: str = ""

