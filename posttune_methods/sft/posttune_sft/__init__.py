"""posttune-sft: supervised fine-tuning.

The method builds its loaders with the core's data toolkit (chat template, prompt masked unless
``train_on_input``, truncation, optional packing) and trains a plain token cross-entropy on
the labelled tokens. Labels arrive pre-shifted (``labels[:, t]`` is the target of position t,
-100 where nothing is learned), so packed documents never predict across a boundary; the
trainer divides the summed loss by the labelled-token count across micro-batches and ranks.
``neftune_alpha`` adds NEFTune's noise to the input embeddings while training; ``loss_type: dft``
weighs each token's loss by its probability (docs/training.md). Importing this package does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

from posttune.plugin import (ConfigError, DatasetConfig, LossOutput, Method, RunConfig, Session, dataset_sources,
                             hookimpl)

POSTTUNE_PLUGIN_API = 2


@dataclass(frozen=True)
class SFTConfig:
    KNOWN_AS: ClassVar[dict[str, str]] = {  # TRL's SFTConfig -> here
        "max_length": "data.max_seq_len", "max_seq_length": "data.max_seq_len",
        "completion_only_loss": "method.train_on_input negated (only responses train by default; TRL's false is "
                                "train_on_input: true)",
        "assistant_only_loss": "method.train_on_input negated (only assistant turns train by default; TRL's false "
                               "is train_on_input: true)",
        "packing_strategy": "method.packing (in order, greedy) with method.long_samples: split (long samples in "
                            "pieces, none cut)",
        "neftune_noise_alpha": "method.neftune_alpha", "dataset_text_field": "data.train.column_map",
    }
    train_on_input: bool = False  # also learn the prompt (user/system) tokens
    packing: bool = False  # concatenate samples into rows of data.max_seq_len tokens (docs/training.md)
    # a sample longer than data.max_seq_len: truncate (its end does not train), or split into pieces of
    # max_seq_len tokens, each a sample, so every token trains (continued pretraining on long documents)
    long_samples: Literal["truncate", "split"] = "truncate"
    # the batch's samples (or its packed rows' samples) end to end in one row, no padding computed
    # (the padded batch's loss); false: padded rows (packed: rows of exactly max_seq_len, fixed shapes)
    padding_free: bool = True
    # NEFTune (Jain et al. 2023; TRL's neftune_noise_alpha): uniform noise in +-alpha/sqrt(L*d) on the input
    # embeddings of each training forward (L: the batch's row length, d: hidden); null: none
    neftune_alpha: float | None = None
    # nll: the token cross-entropy; dft: Dynamic Fine-Tuning (Wu et al. 2025), each token's -log p weighted by
    # its probability p (detached), TRL's loss_type="dft"
    loss_type: Literal["nll", "dft"] = "nll"


def validate(config: RunConfig, method: SFTConfig) -> None:
    if method.neftune_alpha is not None and not method.neftune_alpha > 0:
        raise ConfigError("method.neftune_alpha", f"expected a number > 0 (typical: 5), got {method.neftune_alpha!r}")
    if method.long_samples == "split":
        sections = [(f"data.{name}", getattr(config.data, name)) for name in ("train", "validation")]
        streamed = [at for where, dataset in sections if dataset is not None
                    for at, source in dataset_sources(dataset, where) if source.streaming]
        if streamed:
            raise ConfigError("method.long_samples", f"split needs map-style data: {streamed[0]} is streamed (a "
                                                     "streamed row's pieces could straddle a checkpoint)")
    if method.packing and config.data.group_by_length:
        raise ConfigError("data.group_by_length", "packed rows are already full and need no grouping; set "
                                                  "method.packing or data.group_by_length, not both")


def data(session: Session, dataset: DatasetConfig, split: str) -> Any:
    """SFT samples of one split: one sample a row, padded per batch or packed into rows."""
    from posttune.plugin import data_rank, dataset_format, shuffled

    rank, world = data_rank(session)
    train, method = session.config.train, session.method_config
    return sft_loader(dataset, data=session.config.data, fmt=dataset_format(session, split),
                      tokenizer=session.tokenizer, batch_size=train.batch_size, seed=train.seed,
                      shuffle=shuffled(session, split),
                      train_on_input=method.train_on_input, packing=method.packing,
                      padding_free=method.padding_free, rank=rank, world_size=world, where=f"data.{split}",
                      split_long=method.long_samples == "split")


def sft_loader(dataset: Any, *, data: Any, fmt: Any, tokenizer: Any, batch_size: int, seed: int = 0,
               shuffle: bool = True, train_on_input: bool = False, packing: bool = False, padding_free: bool = True,
               rank: int = 0, world_size: int = 1, where: str = "data.train", split_long: bool = False) -> Any:
    """SFT's loader from explicit settings (``data`` is the run's `data:` section; ``packing`` and
    ``padding_free`` SFT's own): what ``data`` builds for a run, callable without one (tests, tools)."""
    from posttune.plugin import SampleMaker, flat_batch, make_loader, pad_id, packed_batch, padded_batch

    make = SampleMaker(fmt, tokenizer, max_seq_len=data.max_seq_len, train_on_input=train_on_input,
                       skip_bad_rows=data.skip_bad_rows, column_map=dataset.column_map, where=where,
                       system_prompt=dataset.system_prompt, split_long=split_long)
    pad = pad_id(tokenizer)
    if packing and not padding_free:  # rows of exactly max_seq_len, their tails padding
        collate = partial(packed_batch, pad_id=pad, max_seq_len=data.max_seq_len)
    else:  # padding-free unless switched off: the padded batch's loss without computing its padding;
        # packed rows go end to end the same way, their tails dropped (the same documents, in order)
        collate = partial(flat_batch if padding_free else padded_batch, pad_id=pad,
                          pad_to_multiple_of=data.pad_to_multiple_of)
    return make_loader(dataset, make=make, collate=collate, max_seq_len=data.max_seq_len, batch_size=batch_size,
                       seed=seed, shuffle=shuffle, rank=rank, world_size=world_size, packing=packing,
                       where=where, group_by_length=data.group_by_length)


def setup(session: Session) -> None:
    """NEFTune: a forward hook on the policy's input embedding, active in training mode only (validation
    losses and samples see clean embeddings), drawing from the run's RNG (saved with each checkpoint)."""
    alpha = session.method_config.neftune_alpha
    if alpha is None:
        return
    import torch

    embed = getattr(session.model, "embed", None)
    if not isinstance(embed, torch.nn.Module):
        raise ConfigError("method.neftune_alpha", f"the model of family '{session.plan.family.descriptor.name}' has "
                                                  "no input embedding at `embed` to add noise to")
    embed.register_forward_hook(partial(noisy_embeddings, alpha=alpha))


def noisy_embeddings(module: Any, inputs: Any, output: Any, *, alpha: float) -> Any:
    """NEFTune's noise on an embedding's output while the module trains: uniform in +-alpha/sqrt(L*d), the bound
    computed in float32 as transformers computes it, so a seeded draw is the same as theirs."""
    if not module.training:
        return None
    import torch

    bound = float(alpha / torch.sqrt(torch.tensor(output.size(1) * output.size(2))))
    return output + torch.zeros_like(output).uniform_(-bound, bound)


def loss(session: Session, batch: dict[str, Any]) -> LossOutput:
    """The labelled tokens' summed loss and their count (the trainer divides the step's sums once). DFT's
    weight, the token's probability, is detached: its gradient is ``-p * grad(log p)``, the cross-entropy's
    rescaled per token (the paper's reading: SFT's gradient as a policy gradient with reward 1 / p, corrected)."""
    from posttune.plugin import token_cross_entropy, token_logps

    if session.method_config.loss_type == "dft":
        logps = token_logps(session, batch)  # 0 where nothing is learned
        labelled = batch["labels"] != -100
        return LossOutput(-(logps.detach().exp() * logps)[labelled].sum(), labelled.sum(),
                          tokens=batch.get("num_tokens", 0))
    loss_sum, labelled = token_cross_entropy(session, batch)
    return LossOutput(loss_sum, labelled, tokens=batch.get("num_tokens", 0))


@hookimpl
def posttune_register_methods(register):
    register(Method(
        name="sft",
        config=SFTConfig,
        dataset_kind="conversation",
        data=data,
        loss=loss,
        setup=setup,
        validate=validate,
        description="supervised fine-tuning: cross-entropy on response tokens",
    ))
