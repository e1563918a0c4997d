"""posttune-kd: knowledge distillation -- a student learns a teacher's next-token distributions.

    method:
      name: kd
      divergence: forward_kl        # forward_kl | reverse_kl | jsd (GKD's generalised JSD, with beta)
      temperature: 1.0
      kd_ratio: 0.5                  # divergence weight; 1 - kd_ratio weighs cross-entropy to the labels
      on_policy_fraction: 0.0        # GKD's lambda: that share of batches are the student's own samples
    models:
      teacher: {path: meta-llama/Llama-3.1-8B-Instruct, dtype: bf16}   # or `teacher:` at the top level

The student is the policy (full fine-tuning or LoRA/DoRA/QLoRA), the teacher a frozen ``teacher``
model role: any installed family with the student's vocabulary, quantised and sharded by the
run's techniques and plans like the student. The loss is computed a chunk of trained tokens at a
time, so neither head's full logits exist at once. Written against the public plugin surface
only; importing this package does not import torch. docs/kd.md has every knob.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from posttune.plugin import ConfigError, Method, PosttuneError, RunConfig, configs_in, hookimpl, resolve_engine

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"

CONFIGS = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class KDConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {  # TRL's GKDConfig -> here
        "lmbda": "method.on_policy_fraction", "teacher_model_name_or_path": "models.teacher.path",
        "teacher_model_init_kwargs": "models.teacher (path, dtype, ...)",
    }
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"  # KL(teacher || student), its reverse, or JSD
    temperature: float = 1.0  # divides both models' logits before the divergence
    beta: float = 0.5  # jsd: the mixture's teacher weight (0: forward KL, 1: reverse KL)
    kd_ratio: float = 0.5  # the divergence's weight; 1 - kd_ratio weighs the cross-entropy to the labels
    chunk_size: int | None = 512  # trained tokens projected to the vocabulary at once; null: full logits (tp)
    teacher_extra_vocab: Literal["refuse", "drop"] = "refuse"  # a teacher with more vocabulary rows (padding)
    train_on_input: bool = False  # also distil on the prompt tokens
    packing: bool = False  # concatenate samples into rows of data.max_seq_len tokens (off-policy only)
    on_policy_fraction: float = 0.0  # GKD's lambda: share of batches replaced by the student's own samples
    max_new_tokens: int = 128  # on-policy samples: their length
    generation_temperature: float = 1.0  # on-policy samples: the student's sampling temperature
    engine: str = "builtin"  # on-policy samples: the generation engine (`posttune ls engines`)
    engine_options: dict = field(default_factory=dict)  # the engine's settings, checked against its options


def validate(config: RunConfig, method: KDConfig) -> None:
    for name, low, high in (("kd_ratio", 0.0, 1.0), ("beta", 0.0, 1.0), ("on_policy_fraction", 0.0, 1.0)):
        value = getattr(method, name)
        if not (math.isfinite(value) and low <= value <= high):
            raise ConfigError(f"method.{name}", f"expected a value in [{low:g}, {high:g}], got {value}")
    for name in ("temperature", "generation_temperature"):
        value = getattr(method, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"method.{name}", f"expected a positive number, got {value}")
    if method.chunk_size is not None and method.chunk_size < 1:
        raise ConfigError("method.chunk_size", f"expected a positive integer or null, got {method.chunk_size}")
    if method.max_new_tokens < 1:
        raise ConfigError("method.max_new_tokens", f"expected a positive integer, got {method.max_new_tokens}")
    if method.beta != KDConfig.beta and method.divergence != "jsd":  # a setting that would do nothing, as DPO's
        raise ConfigError("method.beta", f"only divergence jsd uses it (this run: {method.divergence})")
    if method.on_policy_fraction > 0 and method.packing:
        raise ConfigError("method.packing", "on-policy distillation samples one completion per prompt; set packing "
                                            "to false or on_policy_fraction to 0")
    if method.packing and config.data.group_by_length:
        raise ConfigError("data.group_by_length", "packed rows are already full and need no grouping; set "
                                                  "method.packing or data.group_by_length, not both")
    if method.on_policy_fraction > 0 and method.train_on_input:
        raise ConfigError("method.train_on_input", "on-policy distillation completes each row's prompt, which "
                                                   "train_on_input leaves unmarked; set one of them off")
    if "chunked_cross_entropy" in config.memory:
        raise ConfigError("memory", "kd chunks its own loss over both heads (method.chunk_size); drop "
                                    "chunked_cross_entropy")
    if "tp" in config.parallel.plans and method.chunk_size is not None:
        raise ConfigError("method.chunk_size", "kd's chunked loss needs each model's whole head, which tp splits; "
                                               "set it to null with tp")
    for plan in ("loss_parallel", "cp"):
        if plan in config.parallel.plans:
            raise ConfigError("parallel.plans", f"kd does not run with '{plan}' yet; drop it")
    if method.on_policy_fraction > 0 and "tp" in config.parallel.plans and \
            config.parallel.options.get("tp", {}).get("sequence_parallel", True):
        raise ConfigError("parallel.options.tp.sequence_parallel", "on-policy distillation generates one token at "
                                                                   "a time, which sequence parallelism cannot split; "
                                                                   "set it to false")
    from posttune.plugin import Sampling  # torch: imported when a run is validated, not at plugin discovery

    resolve_engine(method.engine, method.engine_options,
                   sampling=Sampling(method.max_new_tokens, temperature=method.generation_temperature))
    check_vocabularies(config, method)


def batch_text(config: Any, method: KDConfig) -> str:
    """The banner's account: the loader's batches, as SFT's, some completed by the student (GKD)."""
    text = f"train.batch_size {config.train.batch_size} conversations a micro-batch, as SFT's"
    if method.on_policy_fraction > 0:
        text += f"; a share of {method.on_policy_fraction:g} of them with the student's own completions"
    return text


def micro_batch_tokens(config: Any, method: KDConfig) -> tuple[int, str]:
    """The tokens of one micro-batch's student forward, for `posttune plan`'s memory estimate.

    Off-policy rows are the data's, cut to ``max_seq_len``; an on-policy batch (any, when
    ``on_policy_fraction > 0``) is each row's prompt (everything before its first target: at most
    ``max_seq_len``) followed by the student's completion of up to ``max_new_tokens``.
    """
    rows, width = config.train.batch_size, config.data.max_seq_len
    if method.on_policy_fraction == 0:
        return rows * width, f"batch_size {rows} x max_seq_len {width}, every row full: the worst case"
    return rows * (width + method.max_new_tokens), (
        f"batch_size {rows} x (max_seq_len {width} + max_new_tokens {method.max_new_tokens}): on-policy rows are a "
        "prompt and the student's completion, every row full: the worst case")


#: fp32 ``[tokens, vocab]`` tensors the loss holds at its peak, as docs/kd.md measured it (vocabulary 128,256, 2048
#: trained tokens): full logits of both heads, their log-probabilities and the student's gradient (6,796 MiB: 6.8);
#: chunked, the same for one chunk at a time (chunks of 256, 512, 1024: 3.3, 3.6, 3.8)
FULL_TENSORS, CHUNK_TENSORS = 7, 4


def estimate(est: Any, plan: Any) -> Any:
    """`posttune plan`'s logits/loss term: both heads' logits over a chunk of trained tokens (``chunk_size``), or
    over all of them (``null``), in place of the generic three tensors of one head."""
    from dataclasses import replace

    if est.shape is None:
        return est
    chunk = plan.method_config.chunk_size
    rows, tensors = (est.tokens, FULL_TENSORS) if chunk is None else (min(chunk, est.tokens), CHUNK_TENSORS)
    return replace(est, logits=tensors * 4 * rows * est.shape.vocab)


def check_vocabularies(config: RunConfig, method: KDConfig) -> None:
    """Teacher and student must share their vocabulary (the teacher's extra rows may be padding to drop).

    Read from each model's config.json or named size; a checkpoint that cannot be read before
    launch (a hub id while offline) is checked when the models are built instead.
    """
    from posttune.plugin import model_kwargs

    try:
        student = model_kwargs(config).get("vocab_size")
        teacher = model_kwargs(dataclasses.replace(config, model=config.models["teacher"])).get("vocab_size")
    except PosttuneError:
        return
    compare_vocabularies(student, teacher, method.teacher_extra_vocab)


def compare_vocabularies(student: int | None, teacher: int | None, extra: str) -> None:
    if student is None or teacher is None or student == teacher:
        return
    if teacher > student and extra == "drop":
        return
    hint = ("; if the teacher's extra rows are padding, set method.teacher_extra_vocab: drop"
            if teacher > student else "")
    raise ConfigError("models.teacher", f"the teacher's vocabulary has {teacher} tokens and the student's "
                                        f"{student}: distillation compares them token by token{hint}")


def _method(name: str) -> Any:
    def call(*args: Any) -> Any:
        from posttune_kd import method as module

        return getattr(module, name)(*args)

    call.__name__ = name
    return call


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="kd",
        config=KDConfig,
        dataset_kind="conversation",
        data=_method("data"),
        loss=_method("loss"),
        batches=_method("batches"),
        roles=("teacher",),
        setup=_method("setup"),
        evaluate=_method("evaluate"),
        close=_method("close"),
        validate=validate,
        micro_batch_tokens=micro_batch_tokens,
        batch_text=batch_text,
        estimate=estimate,
        description="knowledge distillation: forward/reverse KL or JSD to a teacher role, chunked; on-policy (GKD)",
    ))


@hookimpl
def posttune_register_configs(register):
    for config in configs_in(CONFIGS):
        register(config)
