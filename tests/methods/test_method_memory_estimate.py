"""The tokens `posttune plan`'s memory estimate assumes for DPO and GRPO (``Method.micro_batch_tokens``),
against the micro-batches their own loaders and rollouts build for the loss's forward."""

from __future__ import annotations

import random
import string
from pathlib import Path

import posttune_grpo
import pytest
import yaml
from posttune.config import validate
from posttune.estimate import estimate
from posttune.plan import resolve_plan
from posttune.plugins import get_registry
from run_support import compose_run, tiny_run_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def long_text(rng: random.Random, words: int = 60) -> str:
    """Well over the tiny configs' 48 tokens (the demo tokenizer spends a token or more per word)."""
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(5)) for _ in range(words))


def full_pairs(count: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt": f"Continue: {i}", "chosen": long_text(rng), "rejected": long_text(rng)} for i in range(count)]


def planned_tokens(config: dict) -> tuple[int, str]:
    est = estimate(resolve_plan(validate(config), get_registry()))
    return est.tokens, est.lines()[1]


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding_free", "padded"])
@pytest.mark.parametrize("multiple", [None, 32, 100])
def test_dpo_estimate_counts_the_tokens_its_forward_holds(llama_dpo, tmp_path, multiple, padding_free):
    """Chosen and rejected responses cut to max_seq_len 48: padded rows ``[2 x batch_size, width]`` (48
    rounded up to 64 or 100 by pad_to_multiple_of), or one padding-free row of 384 (rounded up to 400):
    the estimate's tokens are exactly the first micro-batch's."""
    data = {"pad_to_multiple_of": multiple} if multiple else {}
    config = tiny_run_config(tmp_path, full_pairs(8), fmt="preference", batch_size=4, data=data,
                             base_method={"name": "dpo", "padding_free": padding_free, "share_prompt": False})
    tokens, _ = planned_tokens(config)
    batch = next(iter(compose_run(config).train_data))
    if padding_free:
        assert batch["input_ids"].shape == (1, 400 if multiple == 100 else 384)
    else:
        assert batch["input_ids"].shape == (2 * 4, {None: 48, 32: 64, 100: 100}[multiple])
    assert tokens == batch["input_ids"].numel()
    if padding_free:  # a shared prompt (the default) only shortens the row: the estimate stays the worst case
        config["method"]["share_prompt"] = True
        assert tokens > next(iter(compose_run(config).train_data))["input_ids"].numel()


def test_dpo_estimate_is_an_upper_bound_for_short_pairs(llama_dpo, tmp_path, make_dpo_config):
    config = make_dpo_config(tmp_path)  # 3-7 letter reversals: far below max_seq_len
    tokens, _ = planned_tokens(config)
    widest = max(batch["input_ids"].numel() for batch in compose_run(config).train_data)
    assert widest < tokens == 2 * 4 * 48


def test_dpo_plan_says_chosen_and_rejected_share_one_forward(llama_dpo, posttune_cli, tmp_path, make_dpo_config):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(make_dpo_config(tmp_path)))
    result = posttune_cli("plan", str(path))
    assert result.exit_code == 0, result.stderr
    assert ("peak memory estimate on cpu, per process, assuming 384 tokens per micro-batch (2 x batch_size 4 x "
            "max_seq_len 48: chosen and rejected in one forward, every row full: the worst case):") in result.stdout


@pytest.fixture
def llama_grpo(llama_dpo, register_plugin):
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")


def grpo_run(tmp_path: Path, **data) -> dict:
    """2 prompts longer than any max_prompt_len below, 4 completions of up to 6 tokens each, trained 4 at a time."""
    rng = random.Random(0)
    rows = [{"prompt": long_text(rng), "answer": "x"} for _ in range(4)]
    method = {"name": "grpo", "group_size": 4, "max_new_tokens": 6, "micro_batch_size": 4,
              "rewards": [{"name": "exact_answer"}]}
    return tiny_run_config(tmp_path, rows, fmt="prompt", base_method=method, batch_size=2, data=data,
                           train={"grad_accum_steps": 2, "max_steps": 1})


@pytest.mark.parametrize("layout", ["shared_prompt", "padding_free", "padded"])
def test_grpo_estimate_counts_its_micro_batch_of_completions(llama_grpo, tmp_path, layout):
    """A micro-batch of 4 completions of one group, max_prompt_len 16, max_new_tokens 6 (a random model
    hardly ever stops within 6 tokens): padded rows ``[4, 16 + 6]``; padding-free, the same 88 tokens in
    one row; sharing the group's prompt (the default), 16 + 3 x 1 + 4 x 6 = 43 (the completions after the
    first keep the prompt's last token). The estimate's tokens are exactly what the learner's forward takes."""
    from posttune.plugin import pad_id, rows_as_documents
    from posttune_grpo.method import batches

    config = grpo_run(tmp_path, max_prompt_len=16)
    config["method"].update({"padding_free": layout != "padded", "share_prompt": layout == "shared_prompt"})
    tokens, line = planned_tokens(config)
    session = compose_run(config)
    batch = next(iter(batches(session)))
    assert batch["input_ids"].shape == (4, 16 + 6)
    if layout == "padded":
        assert "(micro_batch_size 4 completions x (max_prompt_len 16 + max_new_tokens 6), every row full" in line
        assert tokens == batch["input_ids"].numel()
        return
    flat = rows_as_documents(batch["input_ids"], batch["labels"], batch["prompt_lengths"] + batch["lengths"],
                             pad_id=pad_id(session.tokenizer), share_prompt=layout == "shared_prompt")
    assert tokens == flat["input_ids"].numel() == {"shared_prompt": 43, "padding_free": 88}[layout]
    if layout == "shared_prompt":
        assert ("micro_batch_size 4 completions x (max_new_tokens 6 + 1) + 1 group prompt(s) x "
                "(max_prompt_len 16 - 1)") in line


@pytest.mark.parametrize("group_size", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8, 12])
def test_prompts_touched_is_the_most_groups_a_micro_batch_spans(rows, group_size):
    """Against counting: 24 rows ordered group by group, cut into micro-batches of ``rows``."""
    groups = [row // group_size for row in range(24)]
    spans = [len(set(groups[start:start + rows])) for start in range(0, 24, rows)]
    assert posttune_grpo.prompts_touched(rows, group_size) >= max(spans)
    if 24 % rows == 0 and 24 % group_size == 0:  # every window shape occurs within 24 rows: the bound is hit
        assert posttune_grpo.prompts_touched(rows, group_size) == max(spans)


def test_grpo_estimate_without_max_prompt_len_says_what_it_assumed(llama_grpo, tmp_path):
    tokens, line = planned_tokens(grpo_run(tmp_path))
    assert tokens == 4 * (6 + 1) + 48 - 1  # one group's prompt, computed once
    assert "prompts taken as max_seq_len 48 long: data.max_prompt_len is not set" in line
