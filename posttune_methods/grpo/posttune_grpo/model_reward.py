"""The ``reward_model`` reward: completions scored by a reward model, a frozen role of the run.

    models:
      reward: {path: outputs/rm/final/model}   # a sequence classifier (posttune-rm, transformers, TRL)
    method:
      rewards: [{name: reward_model, weight: 1.0}, {name: format, weight: 0.2}]

The reward model is the role ``reward`` (``ModelRole("reward", score=True)``): the core builds it
like every frozen role, so the run's parallel plans shard it and its quantising technique
(``qlora_nf4``) stores it in NF4. Each completion is scored as the reward model was trained: the
prompt's messages and the completion as the assistant's turn, rendered with the reward model's
own chat template (the tokenizer saved beside it, else the policy's), the head's value at the
last token. It runs in the learner process, between generation and advantages, in fixed chunks
of ``batch_size`` rows (placeholders included), so every rank runs the same forwards.

Registered as a reward function so that ``posttune ls rewards`` lists it and its options are
checked like any other's, but it is not a function of text alone: ``scoring.score`` leaves it to
the method (``ResolvedReward.in_learner``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttune.plugin import PosttuneError, RewardFunction, Session

if TYPE_CHECKING:
    import torch

NAME = "reward_model"
ROLE = "reward"


@dataclass(frozen=True)
class ModelRewardOptions:
    batch_size: int = 16  # completions per forward of the reward model


def scored_in_learner(prompts: Any, completions: Any, **_: Any) -> list[float]:
    raise PosttuneError(f"reward '{NAME}' is scored by the GRPO method with its '{ROLE}' model, not called on text")


REWARD = RewardFunction(NAME, scored_in_learner, "a reward model's score (models.reward: a sequence classifier, "
                        "e.g. posttune-rm's); GRPO with generation: local", config=ModelRewardOptions)


def load_reward_tokenizer(session: Session) -> Any:
    """The reward model's tokenizer, saved beside it; else the policy's (the same vocabulary is assumed)."""
    from posttune.plugin import load_tokenizer

    path = session.plan.roles[ROLE].config.path
    if path is not None and (Path(path).expanduser() / "tokenizer.json").is_file():
        return load_tokenizer(Path(path).expanduser())
    return session.tokenizer


def conversation_ids(tokenizer: Any, prompt: Any, completion: str, tools: Any = None) -> list[int]:
    """The prompt's messages and the completion as the assistant's turn, as the reward model's tokenizer renders
    it; with the row's ``tools`` (a list of definitions or its JSON string), as the policy saw them."""
    from posttune.plugin import as_messages, row_tools

    if tokenizer.chat_template is None:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return list(tokenizer.encode(text + completion))
    messages = [*as_messages(prompt, "prompt", "user"), {"role": "assistant", "content": completion}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                              tools=row_tools({"tools": tools})))


def model_scores(session: Session, prompts: list[Any], completions: list[str], batch_size: int, *,
                 tools: list[Any] | None = None) -> torch.Tensor:
    """``[n]``: the reward model's score of each (prompt, completion), ``batch_size`` rows per forward;
    ``tools``: each row's tool definitions (None: no row has any)."""
    import torch

    from posttune.plugin import pad_id, score_pad_id, sequence_scores

    state = session.method_state
    tokenizer = state.reward_tokenizer
    model = session.models[ROLE]
    # pooled as transformers pools this checkpoint: by its config.json's pad id (a Llama 3 RM may have none: then
    # at each row's last token), not the tokenizer's, which may differ or fall back to EOS
    pooled_by = score_pad_id(model, pad_id(tokenizer))
    pad = pad_id(tokenizer) if pooled_by is None else pooled_by
    tools = tools if tools is not None else [None] * len(prompts)
    rows = [conversation_ids(tokenizer, p, c, t) for p, c, t in zip(prompts, completions, tools, strict=True)]
    values = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids = torch.full((len(chunk), max(len(r) for r in chunk)), pad, dtype=torch.long)
        for i, row in enumerate(chunk):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        ids = ids.to(session.device)
        with torch.no_grad():
            scores = model(ids)
        if pooled_by is None:
            last = torch.tensor([len(row) - 1 for row in chunk], device=scores.device)
            values.append(scores[torch.arange(len(chunk), device=scores.device), last, 0].float().cpu())
        else:
            values.append(sequence_scores(scores, ids, pooled_by)[:, 0].float().cpu())
    return torch.cat(values)
