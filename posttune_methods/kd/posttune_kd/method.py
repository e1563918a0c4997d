"""Distillation as a posttune method: SFT data, the teacher role, a chunked divergence, on-policy batches.

- ``data``: chat/alpaca/text samples through the core's toolkit (the prompt masked unless
  ``train_on_input``), with each row's dataset index (on-policy batches seed by it).
- ``batches``: the loader's micro-batches; with ``on_policy_fraction`` lambda, a deterministic
  share of them (by run seed, epoch and position: the same on every rank and after a resume)
  is replaced by the student's own completions of the same prompts (GKD, Agarwal et al. 2024).
- ``loss``: ``kd_ratio * divergence + (1 - kd_ratio) * cross-entropy`` per trained token, summed
  (the trainer divides by the trained tokens of the step); on-policy batches use the divergence
  alone (cross-entropy to the student's own samples teaches nothing). Chunked (``chunked.py``)
  unless ``chunk_size`` is null or a model lacks the native decoder contract.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from posttune.plugin import DatasetConfig, IGNORE_INDEX, LossOutput, Session

from posttune_kd.chunked import Head, KDSums, Settings, chunked_kd_loss, plain_kd_loss

TEACHER = "teacher"
#: the on-policy draw's salt (derive_seed keys), so it does not coincide with another use of the run seed
ON_POLICY_DRAW = 0x6B64


# ---- data -----------------------------------------------------------------------------------------

def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    from posttune.plugin import SampleMaker, build_loader, dataset_format, pad_id

    config = session.config.data
    make = SampleMaker(dataset_format(session, split), session.tokenizer, max_seq_len=config.max_seq_len,
                       train_on_input=session.method_config.train_on_input, skip_bad_rows=config.skip_bad_rows,
                       column_map=dataset.column_map, where=f"data.{split}", system_prompt=dataset.system_prompt)
    packing = session.method_config.packing
    collate = partial(batch_with_rows, pad=pad_id(session.tokenizer), max_seq_len=config.max_seq_len,
                      packing=packing, pad_to_multiple_of=config.pad_to_multiple_of)
    return build_loader(session, dataset, split, make=make, collate=collate, packing=packing)


def batch_with_rows(items: list, *, pad: int, max_seq_len: int, packing: bool,
                    pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """The SFT collate, plus each row's dataset index (-1 for a packed row or a placeholder)."""
    from posttune.plugin import packed_batch, padded_batch

    if packing:
        batch = packed_batch(items, pad_id=pad, max_seq_len=max_seq_len)
        batch["rows"] = torch.full((batch["input_ids"].shape[0],), -1, dtype=torch.long)
        return batch
    batch = padded_batch(items, pad_id=pad, pad_to_multiple_of=pad_to_multiple_of)
    rows = [sample.row for item in items for sample in item]
    batch["rows"] = torch.tensor(rows or [-1], dtype=torch.long)
    return batch


# ---- batches: off-policy as loaded, or the student's own samples ---------------------------------

def batches(session: Session) -> Any:
    loader = session.train_data
    for batch in loader:
        if on_policy(session, loader.position):
            batch = student_samples(session, batch)
        yield batch


def on_policy(session: Session, position: int) -> bool:
    """Whether the loader's batch at ``position`` (of the current epoch) becomes on-policy."""
    fraction = session.method_config.on_policy_fraction
    if fraction <= 0:
        return False
    from posttune.plugin import derive_seed

    draw = derive_seed(session.config.train.seed, ON_POLICY_DRAW, session.epoch, position) & ((1 << 53) - 1)
    return draw / float(1 << 53) < fraction


@torch.no_grad()
def student_samples(session: Session, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's prompts completed by the student (sampled), as rows whose labels are the completions."""
    from posttune.plugin import Sampling, derive_seed, pad_id

    config, tokenizer = session.method_config, session.tokenizer
    prompts, rows = [], []
    for ids, labels, row in zip(batch["input_ids"], batch["labels"], _rows(batch), strict=True):
        trained = (labels != IGNORE_INDEX).nonzero()
        start = int(trained[0]) + 1 if len(trained) else 1  # the prompt: everything before the first target
        prompts.append(ids[:start].tolist())
        rows.append(row if len(trained) else -1)
    seeds = [derive_seed(session.config.train.seed, session.epoch, max(row, 0), 1) for row in rows]
    sampling = Sampling(config.max_new_tokens, temperature=config.generation_temperature,
                        stop_token_ids=tuple(tokenizer.eos_ids), pad_id=pad_id(tokenizer))
    was_training = session.model.training
    session.model.eval()
    out = student_engine(session, sampling).generate(prompts, sampling, seeds)
    session.model.train(was_training)
    completions = out.token_lists()
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    input_ids = torch.full((len(prompts), length), pad_id(tokenizer), dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for index, (prompt, completion, row) in enumerate(zip(prompts, completions, rows, strict=True)):
        input_ids[index, :len(prompt)] = torch.tensor(prompt)
        input_ids[index, len(prompt):len(prompt) + len(completion)] = torch.tensor(completion, dtype=torch.long)
        if row >= 0 and completion:
            labels[index, len(prompt) - 1:len(prompt) + len(completion) - 1] = torch.tensor(completion)
    tokens = sum(len(p) + len(c) for p, c, r in zip(prompts, completions, rows, strict=True) if r >= 0)
    return {"input_ids": input_ids, "labels": labels, "rows": torch.tensor(rows), "on_policy": True,
            "num_tokens": torch.tensor(tokens)}


def student_engine(session: Session, sampling: Any) -> Any:
    """The engine that samples from the student (``method.engine``) with ``sampling``, started on the first
    on-policy batch and brought to the current weights (version: the optimizer step) before each use."""
    state = session.method_state
    if state["engine"] is None:
        from posttune.plugin import start_engine

        config = session.method_config
        state["engine"] = start_engine(config.engine, config.engine_options, session, sampling=sampling)
    if state["engine"].version != session.step:
        state["engine"].update_weights(None, session.step)
    return state["engine"]


def _rows(batch: dict[str, Any]) -> list[int]:
    rows = batch["rows"].tolist()
    return rows if len(rows) == batch["input_ids"].shape[0] else [-1] * batch["input_ids"].shape[0]


# ---- the loss -------------------------------------------------------------------------------------

def settings(session: Session, *, on_policy_batch: bool = False) -> Settings:
    """The loss's settings; an on-policy batch is scored by the divergence alone (its labels are the
    student's own samples: cross-entropy to them would teach the student nothing)."""
    config = session.method_config
    return Settings(config.divergence, config.temperature, config.beta,
                    1.0 if on_policy_batch else config.kd_ratio, session.method_state["vocab"])


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    sums, trained = kd_sums(session, batch, settings(session, on_policy_batch=bool(batch.get("on_policy"))))
    count = float(trained)
    metrics = {"divergence": (float(sums.divergence), count), "ce": (float(sums.ce), count),
               "on_policy": float(bool(batch.get("on_policy")))}
    return LossOutput(sums.loss, trained, tokens=batch["num_tokens"], metrics=metrics)


def kd_sums(session: Session, batch: dict[str, Any], how: Settings) -> tuple[KDSums, torch.Tensor]:
    """The summed loss and its terms over the batch's trained tokens, and their count."""
    labels = batch["labels"]
    keep = labels != IGNORE_INDEX
    student, teacher = session.model, session.models[TEACHER]
    extra = {"document_ids": batch["document_ids"]} if "document_ids" in batch else {}
    if session.method_state["chunked"]:
        # Through forward (return_hidden), so FSDP2's hooks gather the root's head and reduce its gradient.
        student_hidden = student(batch["input_ids"], return_hidden=True, **extra)
        with torch.no_grad():
            teacher_hidden = teacher(batch["input_ids"], return_hidden=True, **extra)
        sums = chunked_kd_loss(student_hidden[keep], head_of(student, trainable=True), teacher_hidden[keep],
                               head_of(teacher, trainable=False), labels[keep], how,
                               chunk_size=session.method_config.chunk_size)
        release(teacher)
    else:
        student_logits = _full(student(batch["input_ids"], **extra))
        with torch.no_grad():
            teacher_logits = _full(teacher(batch["input_ids"], **extra))
        sums = plain_kd_loss(student_logits[keep], teacher_logits[keep], labels[keep], how)
    return sums, keep.sum()


def head_of(model: Any, *, trainable: bool) -> Head:
    from posttune.plugin import PosttuneError, head_weight, is_dtensor

    weight, bias = head_weight(model.output) if trainable else (model.output.weight, model.output.bias)
    if is_dtensor(weight):
        raise PosttuneError("kd: the chunked loss found an output head still sharded after the forward pass; "
                            "set method.chunk_size to null for this parallel layout")
    return Head(weight, bias, getattr(model, "logit_softcap", None))


def release(model: Any) -> None:
    """Reshard an FSDP2 teacher's root (embedding, head) once the loss no longer needs it."""
    reshard = getattr(model, "reshard", None)
    if callable(reshard):
        reshard()


def _full(logits: torch.Tensor) -> torch.Tensor:
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


# ---- lifecycle ------------------------------------------------------------------------------------

def setup(session: Session) -> None:
    """Check the two vocabularies on the built models, on-policy ``max_new_tokens`` against the student's context
    (a prompt is shorter than ``data.max_seq_len``), and choose the chunked or the plain loss.

    Chunked needs the native decoder contract (``forward(..., return_hidden=True)`` and an
    ``output`` head) in both models and heads that FSDP2 gathers whole (tensor parallelism
    splits them over the vocabulary: validate refuses a chunk size there).
    """
    from posttune.plugin import check_new_tokens
    from posttune_kd import compare_vocabularies

    config = session.method_config
    student, teacher = session.model, session.models[TEACHER]
    student_vocab, teacher_vocab = _vocab(student), _vocab(teacher)
    compare_vocabularies(student_vocab, teacher_vocab, config.teacher_extra_vocab)
    if config.on_policy_fraction > 0:
        # a prompt ends at a row's first target, which has a token after it: at most data.max_seq_len - 1 tokens
        check_new_tokens(student, config.max_new_tokens, "method.max_new_tokens", session.config.data.max_seq_len - 1,
                         prompt_field="data.max_seq_len - 1")
    native = all(getattr(model, "output", None) is not None and callable(getattr(model, "hidden_states", None))
                 for model in (student, teacher))
    session.method_state = {"vocab": student_vocab, "chunked": config.chunk_size is not None and native,
                            "engine": None}
    keep = getattr(teacher, "set_reshard_after_forward", None)  # an FSDP2 teacher's root
    if session.method_state["chunked"] and callable(keep):
        keep(False, recurse=False)  # gathered after its forward for the chunked loss's head; `release` frees it


def close(session: Session) -> None:
    """The on-policy engine, if one was started."""
    engine = (session.method_state or {}).get("engine")
    if engine is not None:
        session.method_state["engine"] = None
        engine.close()


def _vocab(model: Any) -> int | None:
    head = getattr(model, "output", None)
    return None if head is None else int(head.weight.shape[0])


@torch.no_grad()
def evaluate(session: Session) -> dict[str, float]:
    """The validation set's loss, divergence and cross-entropy per trained token, across ranks."""
    from posttune.plugin import step_context, sum_over_token_ranks, to_device

    totals = torch.zeros(4, dtype=torch.float64, device=session.device)
    for batch in session.validation_data:
        batch = to_device(batch, session.device)
        with step_context(session, batch):
            sums, count = kd_sums(session, batch, settings(session))
        totals += torch.stack([sums.loss, sums.divergence, sums.ce, count.float()]).double()
    loss_sum, divergence, ce, count = sum_over_token_ranks(totals, session).tolist()
    count = max(count, 1.0)
    return {"loss": loss_sum / count, "divergence": divergence / count, "ce": ce / count}
