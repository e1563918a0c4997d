"""The run config: what `posttune validate/plan/train` read, as frozen dataclasses.

Every section has defaults except where a run cannot guess (the model, the method). Method
settings live under ``method:`` and are validated against the method plugin's own dataclass
once the plugin is resolved (see ``posttune.plan``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from posttune import first_party
from posttune.config.ranges import check_ranges
from posttune.config.typed import ELSEWHERE, from_dict
from posttune.errors import ConfigError, did_you_mean

Dtype = Literal["fp32", "bf16", "fp16"]
#: what `train.optimizer` and `train.scheduler` may name (built in `posttune.training.optim`)
OPTIMIZER_NAMES = ("adamw", "adam", "sgd")
SCHEDULE_NAMES = ("constant", "linear", "cosine", "wsd")
#: transformers' names (`optim`, `lr_scheduler_type`) for what these are here
HF_CHOICES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
              "constant_with_warmup": "constant with train.warmup_steps",
              "cosine_with_min_lr": "cosine with train.min_lr_ratio", "warmup_stable_decay": "wsd"}
#: keys of transformers' TrainingArguments (which TRL's configs extend) -> where they are here: an unknown key of
#: the run config's sections names its place (`posttune.config.typed`, ``KNOWN_AS``); PEFT's and axolotl's too
TRAINING_ARGUMENTS = {
    "learning_rate": "train.lr",
    "per_device_train_batch_size": "train.batch_size (a method that generates counts prompts in it, where TRL "
                                   "counts completions: divide by the completions per prompt)",
    "gradient_accumulation_steps": "train.grad_accum_steps", "num_train_epochs": "train.epochs",
    "lr_scheduler_type": "train.scheduler (cosine_with_min_lr: cosine with train.min_lr_ratio)",
    "lr_scheduler_kwargs": "train.min_lr_ratio (min_lr_rate) and train.decay_ratio", "eval_steps": "train.eval_every",
    "logging_steps": "train.log_every", "save_steps": "checkpoint.save_every",
    "save_total_limit": "checkpoint.keep_last",
    "metric_for_best_model": "checkpoint.best_metric", "resume_from_checkpoint": "checkpoint.resume",
    "output_dir": "checkpoint.output_dir", "seed": "train.seed", "max_length": "data.max_seq_len",
    "max_seq_length": "data.max_seq_len", "max_prompt_length": "data.max_prompt_len",
    "bf16": "model.dtype: bf16 (weights and updates in bf16, not autocast over fp32 weights: a small lr's updates "
            "round away; fp32 weights: model.dtype fp32, or a sharding plan's mixed precision over an fp32 "
            "model, docs/parallel.md)",
    "fp16": "model.dtype: bf16 (fp16 weights do not train here; HF's fp16 is AMP with loss scaling)",
    "torch_dtype": "model.dtype",
    "per_device_eval_batch_size": "train.batch_size (evaluation batches are training's size)",
    "eval_strategy": "train.eval_every (in steps, or epoch)", "evaluation_strategy": "train.eval_every (in steps, or "
                                                                                     "epoch)",
    "save_strategy": "checkpoint.save_every (in steps, or epoch)", "optim": "train.optimizer",
    "load_best_model_at_end": "checkpoint.best_metric (its best checkpoint is kept)",
    "adam_beta1": "train.optimizer: {_component_: torch.optim.AdamW, betas: [b1, b2]}",
    "adam_beta2": "train.optimizer: {_component_: torch.optim.AdamW, betas: [b1, b2]}",
    "adam_epsilon": "train.optimizer: {_component_: torch.optim.AdamW, eps: ...}",
    "model_name_or_path": "model.path", "dataset_name": "data.train.path (a local file or a hub id)",
    "use_peft": "the adapter section (adapter: {rank: 16, alpha: 32}; none: full fine-tuning)",
    # PEFT's LoraConfig
    "r": "adapter.rank", "lora_alpha": "adapter.alpha", "lora_dropout": "adapter.dropout",
    "target_modules": "adapter.targets", "use_dora": "adapter.kind: dora", "use_rslora": "adapter.rslora",
    # axolotl
    "base_model": "model.path", "sequence_len": "data.max_seq_len", "micro_batch_size": "train.batch_size",
    "num_epochs": "train.epochs", "lr_scheduler": "train.scheduler", "val_set_size": "data.validation_split",
    "datasets": "data.train (a list of them is a mixture)", "test_datasets": "data.validation",
    "lora_r": "adapter.rank", "lora_target_modules": "adapter.targets",
    "lora_target_linear": "adapter.targets: all-linear",
    "peft_use_dora": "adapter.kind: dora", "peft_use_rslora": "adapter.rslora", "lora_model_dir": "adapter.init_from",
    "chat_template": "tokenizer.chat_template (a .jinja file or the template's text)",
    "chat_template_jinja": "tokenizer.chat_template", "merge_lora": "checkpoint.save_merged",
    "cosine_min_lr_ratio": "train.min_lr_ratio", "default_system_message": "the dataset's system_prompt",
    "auto_resume_from_checkpoints": "checkpoint.resume: latest", "evals_per_epoch": "train.eval_every: epoch",
    "saves_per_epoch": "checkpoint.save_every: epoch", "eval_batch_size": "train.batch_size (evaluation's too)",
    "model_type": "model.family (read from config.json's architectures)",
    "special_tokens": "not here (no tokens are added: the tokenizer's own are used)",
    "lora_modules_to_save": "not here (an adapter trains its LoRA weights only; no adapter: full fine-tuning)",
    # torchtune's recipe keys
    "checkpointer": "model.path (its checkpoint_dir: the folder) and checkpoint.output_dir (its output_dir)",
    "dataset": "data.train (source or data_files: path; _component_: format)", "clip_grad_norm": "train.max_grad_norm",
    "log_every_n_steps": "train.log_every", "max_steps_per_epoch": "train.max_steps (the run's total)",
    "shuffle": "data.shuffle (on by default: each epoch's order drawn from train.seed)",
    "log_peak_memory_stats": "always on (peak_memory_mib in each step's record)",
    "lora_rank": "adapter.rank", "lora_attn_modules": "adapter.targets (q_proj, k_proj, v_proj, o_proj)",
    "apply_lora_to_mlp": "adapter.targets (gate_proj, up_proj, down_proj; all-linear: every linear layer)",
    "apply_lora_to_output": "adapter.targets (lm_head)",
}
#: what the run config's sections name: the keys above, and those whose place is a first-party plugin's setting
#: (their names live in posttune.first_party); a plugin's own config is told only the core's places (ELSEWHERE)
SECTION_KNOWN_AS = {**TRAINING_ARGUMENTS, **first_party.KNOWN_AS}
#: why weights that train are refused in fp16 (torchtune refuses it too)
FP16_TRAINING = ("fp16 weights cannot train here: with no loss scaling and AdamW's state in fp16, small gradients "
                 "underflow and the run diverges (NaN within a few steps); use bf16, or fp32 on a GPU without bf16 "
                 "(fp16 suits frozen models: models.<role>.dtype, and generate)")
#: and under an adapter, where the fp16 base is frozen but its activations' gradients are not
FP16_ADAPTED = ("an fp16 base cannot train an adapter here: its activations' gradients run in fp16 with no loss "
                "scaling and underflow (PEFT pairs fp16 with autocast and a gradient scaler); use bf16, or fp32 on a "
                "GPU without bf16")
DECAY_RATIO = 0.1  # wsd's decay, when train.decay_ratio is not set: the last tenth of the run


@dataclass(frozen=True)
class ModelConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {**SECTION_KNOWN_AS, "_component_": "model.path (a checkpoint's config.json "
                                          "names its family) or model.family and model.size"}
    path: str | None = None  # HF checkpoint directory or hub id
    family: str | None = None  # else read from config.json `architectures`
    size: str | None = None  # a named size of the family, randomly initialised (no path)
    dtype: Dtype = "fp32"  # dtype of the weights (and of the computation)
    build_overrides: dict[str, Any] = field(default_factory=dict)  # builder kwargs over config.json's or the size's


@dataclass(frozen=True)
class TokenizerConfig:
    path: str | None = None  # defaults to model.path
    # a chat template to use instead of the checkpoint's (a base model often has none): a .jinja file, or the
    # template itself (text holding {% or {{); the run's saved tokenizer carries it
    chat_template: str | None = None
    # variables every render of the chat template gets, e.g. {enable_thinking: false} for Qwen3's template
    # (transformers' apply_chat_template(**kwargs), TRL's chat_template_kwargs)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {  # torchtune's dataset builders' arguments
        **SECTION_KNOWN_AS, "_component_": "the dataset's format (alpaca, chat, text, ...: posttune ls datasets)",
        "source": "the dataset's path", "data_files": "the dataset's path",
        "conversation_column": "the dataset's column_map: {messages: COLUMN}",
        "new_system_prompt": "the dataset's system_prompt",
        "dataset_text_field": "the dataset's column_map: {text: COLUMN} (format: text)",
        "type": "format (axolotl's chat_template and sharegpt: chat)",
        "field_messages": "column_map: {messages: COLUMN} (ShareGPT from/value turns: {conversations: COLUMN})",
        "roles_to_train": "not here (assistant turns train; a turn's weight: 0 mutes one, method.train_on_input "
                          "trains every turn)",
        "train_on_eos": "not here (an assistant turn's end-of-turn token trains with it)",
        "message_property_mappings": "not here (turns are role/content or from/value)",
    }
    path: str  # a local json/jsonl/parquet/csv file or directory, or a hub dataset name
    # how a row reads: alpaca, chat, text, completion, preference, preference_text, prompt (`posttune ls datasets`)
    format: str = "chat"
    split: str = "train"  # the dataset split to read
    subset: str | None = None  # hub dataset configuration name
    streaming: bool = False  # read rows as they are consumed, not loaded whole (needs train.max_steps)
    column_map: dict[str, str] = field(default_factory=dict)  # format field -> dataset column
    system_prompt: str | None = None  # a system turn put before each chat that has none
    weight: float | None = None  # in a streamed list of datasets: its share of the rows drawn (default 1)
    # a mixture's datasets (``data.train`` written as a list), each read with its own settings; the fields above
    # are the first one's, so code that reads one dataset sees it. Set by `mixture`, never written in YAML.
    sources: tuple[DatasetConfig, ...] = field(default=(), init=False, repr=False)
    # ``data.validation_split``'s rows of this dataset: (share, seed, the held-out share or the rest); set by
    # `held_out`, never written in YAML
    holdout: tuple[float, int, bool] | None = field(default=None, init=False, repr=False)


def held_out(data: DataConfig, seed: int) -> tuple[DatasetConfig, DatasetConfig | None]:
    """(train, validation) datasets of ``data``: as written, or with ``validation_split`` the same dataset twice,
    once for the rows held out and once for the rest (`posttune.data.build.holdout_rows` draws them); of a list
    of datasets, the same share of each."""
    if data.validation_split is None:
        return data.train, data.validation

    def part(dataset: DatasetConfig, held: bool) -> DatasetConfig:
        split = replace(dataset)  # ``sources`` and ``holdout`` are not init fields: set on the copy
        if dataset.sources:
            object.__setattr__(split, "sources", tuple(part(source, held) for source in dataset.sources))
        else:
            object.__setattr__(split, "holdout", (data.validation_split, seed, held))
        return split

    return part(data.train, False), part(data.train, True)


def mixture(sources: list[DatasetConfig], where: str) -> DatasetConfig:
    """The datasets of a ``data.train`` (or ``validation``) list as one dataset section holding them.

    A map-style mixture is read whole, its rows concatenated in the order listed and shuffled as one: a
    source's share of an epoch is its share of the rows (list a file twice to double it). A streamed one
    (every entry ``streaming: true``) interleaves its datasets, each next row drawn from one chosen at
    random in proportion to its ``weight`` (`posttune.data.build`), so weights belong to streams only.
    """
    if not sources:
        raise ConfigError(where, "an empty list: name at least one dataset")
    streamed = sources[0].streaming
    for i, source in enumerate(sources):
        if source.streaming != streamed:
            raise ConfigError(f"{where}[{i}].streaming", f"{where}[0] {'streams' if streamed else 'does not stream'}; "
                                                        "the datasets of a list all stream, or none does")
        if source.weight is not None and not (streamed and len(sources) > 1):
            raise ConfigError(f"{where}[{i}].weight", "weights draw rows from streamed datasets; a map-style list "
                                                     "takes every row of each (slice one with split: train[:50%], "
                                                     "or list one twice)")
    if len(sources) == 1:
        return sources[0]
    mixed = replace(sources[0])
    object.__setattr__(mixed, "sources", tuple(sources))
    return mixed


@dataclass(frozen=True)
class DataConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {**SECTION_KNOWN_AS, "path": "data.train.path (a dataset: path, format, ...)",
                                          "format": "data.train.format"}
    train: DatasetConfig  # the training dataset, or a list of them read as one (a mixture, docs/training.md)
    validation: DatasetConfig | None = None  # a dataset (or a list) for the validation loss (see train.eval_every)
    # or: this share of data.train's rows, in (0, 1), drawn at random (train.seed) and held out of training as
    # the validation set (axolotl's val_set_size); not with data.validation
    validation_split: float | None = None
    max_seq_len: int = 2048  # tokens per sample (prompt and response together)
    max_prompt_len: int | None = None  # preference/prompt data: keep the prompt's last N tokens
    skip_bad_rows: bool = False  # skip and count rows that cannot be read or rendered, instead of stopping
    # draw each epoch's order of the training rows from train.seed; false: the rows in the order read (a
    # curriculum), every epoch alike (validation is always read in order)
    shuffle: bool = True
    group_by_length: bool = False  # map-style, unpacked: batch rows of similar length (less padding)
    pad_to_multiple_of: int | None = None  # round each batch's padded length up to a multiple


@dataclass(frozen=True)
class TrainConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = SECTION_KNOWN_AS
    epochs: int = 1  # passes over the training data (when max_steps is null)
    max_steps: int | None = None  # optimizer steps to run, over epochs (required with streaming data)
    batch_size: int = 1  # rows (samples, pairs, or prompts for a method that generates) per micro-batch and rank
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 2e-5  # peak learning rate, reached after warmup_steps
    weight_decay: float = 0.0  # the optimizer's weight decay
    optimizer: str | dict[str, Any] = "adamw"  # a name, or a mapping with `_component_`
    scheduler: str | dict[str, Any] = "constant"  # constant | linear | cosine | wsd, or `_component_`
    warmup_steps: int = 0  # optimizer steps of linear warmup to lr
    warmup_ratio: float | None = None  # or warm up over this fraction of the run's steps, rounded up (HF's)
    min_lr_ratio: float = 0.0  # linear, cosine, wsd: decay to lr * this, not to 0 (HF's min_lr_rate)
    decay_ratio: float | None = None  # wsd: hold lr, then decay (cosine) over this last fraction of the steps
    max_grad_norm: float | None = 1.0  # clip the gradients' total norm to this
    skip_nonfinite: int = 0  # optimizer steps with a NaN/Inf loss or gradient norm to skip before the run stops
    seed: int = 0  # seeds the data order, a random init and sampling
    device: str = "auto"  # auto (CUDA if available, else CPU), or a torch device: cpu, cuda, cuda:1
    log_every: int = 1  # write a metrics record every N optimizer steps (and the last), averaging those steps
    # evaluate (val_loss, or the method's val_* metrics) every N optimizer steps, or at every epoch's end (epoch);
    # needs data.validation or data.validation_split
    eval_every: int | Literal["epoch"] | None = None
    early_stopping_patience: int | None = None  # stop after N evaluations without a better checkpoint.best_metric
    # greedy completions shown before and after, each a user turn of the chat template (plain text without one)
    sample_prompts: list[str] = field(default_factory=list)
    sample_max_new_tokens: int = 32  # tokens generated for each of sample_prompts


@dataclass(frozen=True)
class AdapterConfig:
    FROM_STRING: ClassVar[str] = "kind"  # `adapter: lora`, as axolotl writes it: that kind with these defaults
    kind: str = first_party.ADAPTER_KIND  # a registered adapter kind (`posttune ls adapters`): lora, dora, ...
    rank: int = 8  # rank of the low-rank update
    alpha: float = 16.0  # the update is scaled by alpha / rank (alpha / sqrt(rank) with rslora)
    rslora: bool = False  # rank-stabilised LoRA (PEFT's use_rslora): scale by alpha / sqrt(rank), for high ranks
    dropout: float = 0.0  # dropout on the adapter's input
    # module-name patterns, or all-linear (PEFT's: every linear layer but the head); default: the family's
    targets: list[str] | Literal["all-linear"] | None = None
    init_from: str | None = None  # a saved PEFT adapter dir to start from (same rank/alpha/kind/targets)
    # LoRA+: the B matrices (and DoRA's magnitudes) learn at train.lr times this (PEFT's and axolotl's
    # loraplus_lr_ratio; the paper suggests 16, with a smaller train.lr than plain LoRA's)
    loraplus_lr_ratio: float | None = None
    # the adapters' weights and optimizer state; null: the model's (torchtune's). fp32 over a bf16 model is PEFT's
    # default (autocast_adapter_dtype): updates too small for bf16 are kept, for twice the adapters' bytes and an
    # fp32 copy of each adapted layer's input kept for backward (posttune plan counts both)
    dtype: Dtype | None = None


@dataclass(frozen=True)
class ParallelConfig:
    plans: list[str] = field(default_factory=list)  # parallel plans by name, as `posttune ls plans` lists them
    dims: dict[str, int] = field(default_factory=dict)  # mesh dimension -> degree; -1: the rest
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # plan name -> its settings
    # seconds a collective waits for the other ranks before the run fails (a rank stalled on a filesystem or a
    # device); null: torch's default (30 minutes on gloo, 10 on NCCL)
    timeout_s: float | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = SECTION_KNOWN_AS
    output_dir: str = "outputs/run"  # checkpoints, the final model or adapter, metrics.jsonl
    # a resumable checkpoint every N optimizer steps, or at the end of every epoch (epoch), and at the end
    save_every: int | Literal["epoch"] | None = None
    keep_last: int | None = 2  # checkpoints kept; older ones are deleted (the best one stays too)
    best_metric: str | None = None  # an evaluation's metric (val_loss, val_reward): its best checkpoint is kept
    greater_is_better: bool | None = None  # for best_metric; default: lower for a *loss, higher otherwise (HF's)
    resume: str | None = None  # "latest" or a checkpoint path
    save_merged: bool = False  # with an adapter: also write the merged HF model at the end
    overwrite: bool = False  # start afresh in an output_dir that holds another run's results


@dataclass(frozen=True)
class RunConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = SECTION_KNOWN_AS
    model: ModelConfig  # the policy: the model that trains
    method: str | dict[str, Any]  # a name, or a mapping with `name` and the method's settings
    description: str = ""  # one line, shown by `posttune ls configs` for a bundled config
    requires: list[str] = field(default_factory=list)  # PEP 508: ["posttune-qwen>=0.1"]
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # the tokenizer (default: the model's)
    data: DataConfig | None = None  # the datasets (required to train)
    train: TrainConfig = field(default_factory=TrainConfig)  # the optimisation loop
    adapter: AdapterConfig | None = None  # adapters of an installed kind (LoRA/DoRA: posttune-lora); null: full FT
    #: the method's other models by role name (`posttune plan` lists them), each with `model`'s keys
    models: dict[str, ModelConfig] = field(default_factory=dict)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # models split over processes (docs/parallel.md)
    memory: list[str] = field(default_factory=list)  # memory techniques by name (`posttune ls memory`, docs/memory.md)
    memory_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # technique name -> its settings
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # output directory, checkpoints, resume
    #: experiment trackers fed every metrics record (`posttune ls loggers`, docs/trackers.md), e.g. [wandb, tensorboard]
    logging: list[str] = field(default_factory=list)
    logging_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # tracker name -> its settings

    @property
    def method_name(self) -> str:
        return self.method if isinstance(self.method, str) else self.method["name"]

    @property
    def method_settings(self) -> dict[str, Any]:
        return {} if isinstance(self.method, str) else {k: v for k, v in self.method.items() if k != "name"}


def _places() -> dict[str, str]:
    """Each section's keys by name -> ``section.key`` (names two sections share left out, e.g. ``path``), and the
    other libraries' keys: what ``posttune.config.typed`` names for a key written in the wrong place."""
    from dataclasses import fields

    sections = {"model": ModelConfig, "tokenizer": TokenizerConfig, "data": DataConfig, "train": TrainConfig,
                "adapter": AdapterConfig, "parallel": ParallelConfig, "checkpoint": CheckpointConfig}
    seen: dict[str, list[str]] = {}
    for section, cls in sections.items():
        for f in fields(cls):
            seen.setdefault(f.name, []).append(f"{section}.{f.name}")
    for f in fields(RunConfig):
        seen.setdefault(f.name, []).append(f.name)
    return {**{name: places[0] for name, places in seen.items() if len(places) == 1}, **TRAINING_ARGUMENTS}


ELSEWHERE.update(_places())


#: `data:` keys that became settings of the methods that use them: refused where they were
MOVED_TO_METHOD = ("packing", "padding_free")


def _check_decay(train: TrainConfig) -> None:
    """A decay or warmup setting the schedule would ignore is refused: the run would not do what the config says."""
    name = train.scheduler if isinstance(train.scheduler, str) else "a _component_ mapping"
    if train.min_lr_ratio and name not in ("linear", "cosine", "wsd"):
        raise ConfigError("train.min_lr_ratio", f"train.scheduler {name} has no decay to end at a floor "
                                                "(linear, cosine and wsd have)")
    if train.decay_ratio is not None and name != "wsd":
        raise ConfigError("train.decay_ratio", f"only the wsd schedule has a separate decay phase "
                                               f"(train.scheduler: {name})")
    if isinstance(train.scheduler, dict):  # the component is the whole schedule: posttune adds no warmup to it
        for key, value in (("train.warmup_steps", train.warmup_steps), ("train.warmup_ratio", train.warmup_ratio)):
            if value:
                raise ConfigError(key, "a _component_ scheduler is the whole schedule, without posttune's warmup "
                                       "(the named schedules have it); set it to 0, or warm up in the component "
                                       "(e.g. torch.optim.lr_scheduler.SequentialLR)")


def _check_best(config: RunConfig) -> None:
    """``checkpoint.best_metric`` needs evaluations that score every checkpoint; early stopping needs the metric."""
    checkpoint, train = config.checkpoint, config.train
    for field_name, every in (("checkpoint.save_every", checkpoint.save_every), ("train.eval_every", train.eval_every)):
        if every == "epoch" and config.data is not None and config.data.train.streaming:
            raise ConfigError(field_name, "epoch (give a number of steps) is not possible with streaming data (the "
                                          "epoch length is unknown)")
    if checkpoint.best_metric is None:
        for key, value in (("checkpoint.greater_is_better", checkpoint.greater_is_better),
                           ("train.early_stopping_patience", train.early_stopping_patience)):
            if value is not None:
                raise ConfigError(key, "set checkpoint.best_metric too: the evaluation metric it judges")
        return
    if not checkpoint.best_metric.startswith("val_"):
        raise ConfigError("checkpoint.best_metric", f"'{checkpoint.best_metric}' is not an evaluation's metric; "
                                                    "name one it logs, e.g. val_loss (GRPO: val_reward)")
    if not train.eval_every or (config.data is not None and config.data.validation is None
                                and config.data.validation_split is None):
        raise ConfigError("checkpoint.best_metric", "needs evaluations: set train.eval_every and data.validation "
                                                    "(or data.validation_split)")
    if isinstance(checkpoint.save_every, int) and isinstance(train.eval_every, int) \
            and checkpoint.save_every % train.eval_every:
        raise ConfigError("checkpoint.save_every", f"with checkpoint.best_metric it must be a multiple of "
                                                   f"train.eval_every ({train.eval_every}), so that every checkpoint "
                                                   "is scored")


def validate(raw: dict[str, Any]) -> RunConfig:
    """Check a raw config mapping against the schema; the first problem raises ConfigError."""
    data = raw.get("data") if isinstance(raw, dict) else None
    for key in MOVED_TO_METHOD:
        if isinstance(data, dict) and key in data:
            raise ConfigError(f"data.{key}", f"moved: set method.{key}")
    train = raw.get("train") if isinstance(raw, dict) else None
    warmup = train.get("warmup_steps") if isinstance(train, dict) else None
    if isinstance(warmup, float) and 0 < warmup < 1:  # transformers 5's spelling of a ratio
        raise ConfigError("train.warmup_steps", f"{warmup} is a fraction (transformers reads a warmup_steps below 1 as "
                                                f"a ratio of the run); set train.warmup_ratio: {warmup}")
    checkpoint = raw.get("checkpoint") if isinstance(raw, dict) else None
    if isinstance(checkpoint, dict) and checkpoint.get("resume") is True:  # HF's resume_from_checkpoint=True
        raise ConfigError("checkpoint.resume", "true means the newest checkpoint here: write latest (or a "
                                               "checkpoint's path)")
    if isinstance(checkpoint, dict) and checkpoint.get("resume") is False:  # torchtune's resume_from_checkpoint
        raise ConfigError("checkpoint.resume", "false means a fresh start here: write null (or leave it out)")
    config = from_dict(RunConfig, _mixtures(role_sections(raw)))
    if config.checkpoint.output_dir.startswith("~"):  # every writer sees one folder (a shell leaves ~ in key=~/x)
        config = replace(config, checkpoint=replace(config.checkpoint,
                                                    output_dir=os.path.expanduser(config.checkpoint.output_dir)))
    if isinstance(config.method, dict) and not isinstance(config.method.get("name"), str):
        raise ConfigError("method.name", "required: the method to run (e.g. sft)")
    if "policy" in config.models:
        raise ConfigError("models.policy", "the policy is the `model:` section; models holds the method's others")
    for section, model in [("model", config.model), *((f"models.{role}", m) for role, m in config.models.items())]:
        if model.path is None and (model.family is None or model.size is None):
            raise ConfigError(section, "set `path` (a checkpoint) or both `family` and `size` (random init)")
    check_ranges(config)
    if config.model.dtype == "fp16":  # a trained role's too, once composed (training.compose)
        raise ConfigError("model.dtype", FP16_ADAPTED if config.adapter is not None else FP16_TRAINING)
    if config.adapter is not None and config.adapter.dtype == "fp16":
        raise ConfigError("adapter.dtype", FP16_TRAINING)
    if config.adapter is not None and config.adapter.targets == []:  # [] would read as "the family's default"
        raise ConfigError("adapter.targets", "an empty list adapts nothing: list module-name patterns, or leave it "
                                             "out for the family's default targets")
    _check_low_bit_optimizer(config.train.optimizer)
    _check_choice(config.train.optimizer, "train.optimizer", OPTIMIZER_NAMES)
    _check_choice(config.train.scheduler, "train.scheduler", SCHEDULE_NAMES)
    if config.train.warmup_ratio is not None and config.train.warmup_steps:
        raise ConfigError("train.warmup_ratio", f"train.warmup_steps ({config.train.warmup_steps}) sets the warmup "
                                                "too; keep one (train.warmup_steps=0 to use the ratio)")
    _check_decay(config.train)
    _check_best(config)
    data = config.data
    if data is not None and data.max_prompt_len is not None and data.max_prompt_len >= data.max_seq_len:
        raise ConfigError("data.max_prompt_len", f"must be below data.max_seq_len ({data.max_seq_len}) "
                                                 "to leave room for a response")
    if data is not None:
        _check_grouping(data)
        _check_validation_split(data)
        for split, dataset in (("train", data.train), ("validation", data.validation)):
            if dataset is not None and not dataset.sources and dataset.weight is not None:
                raise ConfigError(f"data.{split}.weight", "a weight shares the rows drawn between the datasets of a "
                                                         "streamed list; this section names one dataset")
    for index, name in enumerate(config.logging):  # listed twice would start two of the same tracker: refused
        if name in config.logging[:index]:
            raise ConfigError(f"logging[{index}]", f"'{name}' is listed twice")
    for dim, degree in config.parallel.dims.items():
        if degree != -1 and degree < 1:
            raise ConfigError(f"parallel.dims.{dim}", f"expected a positive degree or -1, got {degree}")
    return config


def role_sections(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the first-party roles' old top-level sections (from before `models:`) read as
    `models.<role>`; both spellings of one role is a mistake to name, not to merge."""
    old = [name for name in first_party.ROLE_SECTIONS if isinstance(raw, dict) and name in raw]
    if not old:
        return raw
    raw, models = dict(raw), raw.get("models")
    for name in old:
        section = raw.pop(name)
        if section is None or not isinstance(models, (dict, type(None))):  # null: an old config.yaml's default
            continue
        if (models or {}).get(name) is not None:
            raise ConfigError(name, f"given twice: `{name}:` is the old spelling of `models.{name}`; keep one")
        models = {**(models or {}), name: section}
    if models is not None:
        raw["models"] = models
    return raw


def _mixtures(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with a ``data.train`` / ``data.validation`` list read into one dataset section (`mixture`)."""
    data = raw.get("data") if isinstance(raw, dict) else None
    lists = [split for split in ("train", "validation") if isinstance(data, dict) and isinstance(data.get(split), list)]
    if not lists:
        return raw
    data = dict(data)
    for split in lists:
        sources = [from_dict(DatasetConfig, entry, f"data.{split}[{i}]") for i, entry in enumerate(data[split])]
        data[split] = mixture(sources, f"data.{split}")
    return {**raw, "data": data}


def _check_validation_split(data: DataConfig) -> None:
    """A share of one map-style training dataset, and the only validation set."""
    share = data.validation_split
    if share is None:
        return
    if data.validation is not None:
        raise ConfigError("data.validation_split", "data.validation is given too; keep one")
    if data.train.streaming:
        raise ConfigError("data.validation_split", "data.train is streamed (its rows are not all read first); give "
                                                   "data.validation (a split may be sliced: split: train[95%:])")


def _check_grouping(data: DataConfig) -> None:
    """Grouping reorders a map-style epoch of rows; a stream would ignore it silently."""
    if data.group_by_length and data.train.streaming:
        raise ConfigError("data.group_by_length", "needs a map-style dataset (the whole epoch to sort), "
                                                  "but data.train is streaming; set streaming: false or drop it")
    if data.group_by_length and not data.shuffle:
        raise ConfigError("data.group_by_length", "groups a shuffled order, but data.shuffle is false (the rows "
                                                  "in the order read); keep one")


def _check_low_bit_optimizer(value: str | dict[str, Any]) -> None:
    """``adamw8bit`` and the like: low-bit AdamW is a memory technique over ``adamw``, say so."""
    if not isinstance(value, str):
        return
    plain = value.lower().replace("_", "").replace("-", "")
    for bits in ("8bit", "4bit"):
        if plain.startswith("adamw") and plain.endswith(bits):
            raise ConfigError("train.optimizer", f"unknown name '{value}': low-bit AdamW is the memory technique "
                                                 f"'adamw_{bits}' (posttune-torchao); set train.optimizer: adamw "
                                                 f"and memory: [adamw_{bits}]")


def _check_choice(value: str | dict[str, Any], where: str, names: tuple[str, ...]) -> None:
    """A built-in name, or a mapping that names a callable (checked with the other components)."""
    if isinstance(value, dict):
        if "_component_" not in value:
            raise ConfigError(where, f"a mapping needs `_component_: dotted.path` (or give a name: {', '.join(names)})")
    elif value not in names:
        here = f"; transformers' {value} is {HF_CHOICES[value]} here" if value in HF_CHOICES else ""
        raise ConfigError(where, f"unknown name '{value}' (known: {', '.join(names)}, or a _component_ mapping)"
                                 f"{here or did_you_mean(value, names)}")

