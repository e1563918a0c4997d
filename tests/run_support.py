"""Tiny Llama runs for tests: small reversal datasets (SFT chats or preference pairs) written per
test, run configs over them, and a composed session without training."""

from __future__ import annotations

import json
import random
import re
import string
import subprocess
import sys
from pathlib import Path
from typing import Any

import posttune_llama

TOKENIZER = str(Path(posttune_llama.__file__).parent / "demo" / "tokenizer")


def words(count: int, seed: int, lengths: tuple[int, int]) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(*lengths))) for _ in range(count)]


def reversal_rows(count: int, seed: int = 0) -> list[dict]:
    """Chats asking to reverse 3-6 capital letters, answered right."""
    return [{"messages": [{"role": "user", "content": f"Reverse: {word}"},
                          {"role": "assistant", "content": word[::-1]}]} for word in words(count, seed, (3, 6))]


def preference_rows(count: int, seed: int = 0) -> list[dict]:
    """Reverse-a-string prompts: chosen the reversal, rejected the string copied (3-7 letters)."""
    return [{"prompt": f"Reverse: {word}", "chosen": word[::-1], "rejected": word}
            for word in words(count, seed, (3, 7))]


def prompt_rows(count: int, seed: int = 0) -> list[dict]:
    """Reverse-a-string prompts with their answer (for exact_answer), 3-6 letters."""
    return [{"prompt": f"Reverse: {word}", "answer": word[::-1]} for word in words(count, seed, (3, 6))]


def write(tmp_path: Path, config: dict, name: str = "run.yaml") -> Path:
    """``config`` as the YAML file ``tmp_path / name``, for `posttune train/validate FILE`."""
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def metrics(output_dir: str | Path) -> list[dict]:
    """A run's ``metrics.jsonl`` records."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def tiny_run_config(tmp_path: Path, rows: list[dict], *, fmt: str, base_method: dict, batch_size: int,
                    **sections: Any) -> dict:
    """A tiny random-init Llama run over ``rows`` (written to a file); sections merged over the defaults
    (a ``method`` section over ``base_method``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config: dict[str, Any] = {
        "model": {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": TOKENIZER},
        "method": base_method,
        "data": {"train": {"path": str(train), "format": fmt}, "max_seq_len": 48},
        "train": {"epochs": 1, "batch_size": batch_size, "lr": 1e-3, "seed": 0, "device": "cpu"},
        "checkpoint": {"output_dir": str(tmp_path / "out")},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def sft_config(tmp_path: Path, *, rows: int = 16, **sections: Any) -> dict:
    return tiny_run_config(tmp_path, reversal_rows(rows), fmt="chat", base_method={"name": "sft"}, batch_size=2,
                           **sections)


def dpo_config(tmp_path: Path, *, rows: int = 16, **sections: Any) -> dict:
    return tiny_run_config(tmp_path, preference_rows(rows), fmt="preference", base_method={"name": "dpo", "beta": 0.5},
                           batch_size=4, **sections)


def feedback_rows(count: int, seed: int = 0) -> list[dict]:
    """Unpaired feedback (KTO's ``unpaired`` format): ``count`` reverse-a-string prompts, each with both answers
    as separate rows, the reversal desirable and the string copied undesirable (3-7 letters)."""
    return [{"prompt": f"Reverse: {word}", "completion": answer, "label": label}
            for word in words(count, seed, (3, 7)) for answer, label in ((word[::-1], True), (word, False))]


def kto_config(tmp_path: Path, *, prompts: int = 8, rows: list[dict] | None = None, **sections: Any) -> dict:
    return tiny_run_config(tmp_path, rows if rows is not None else feedback_rows(prompts), fmt="unpaired",
                           base_method={"name": "kto", "beta": 0.5}, batch_size=4, **sections)


def grpo_config(tmp_path: Path, *, rows: int = 8, **sections: Any) -> dict:
    """GRPO on a random tiny Llama: 4 completions of up to 6 tokens per prompt, exact_answer reward."""
    method = {"name": "grpo", "group_size": 4, "max_new_tokens": 6, "rewards": [{"name": "exact_answer"}]}
    config = tiny_run_config(tmp_path, prompt_rows(rows), fmt="prompt", base_method=method, batch_size=2, **sections)
    config["train"].setdefault("max_steps", 3)
    return config


def pair_rows(batch: dict) -> dict:
    """A pair batch as padded rows [2b, longest] (pad 0, labels -100), the chosen responses first: a
    padding-free batch's document d becomes row d; with a shared prompt (``positions``), pair i's documents
    2i and 2i + 1 become rows i and b + i, the prompt written out again in front of the second; a padded
    batch is returned as it is."""
    import torch

    if "document_ids" not in batch:
        return batch
    ids, labels, documents = batch["input_ids"][0], batch["labels"][0], batch["document_ids"][0]
    rows = [(ids[documents == d], labels[documents == d]) for d in range(2 * batch["rows"].numel())]
    if "positions" in batch:
        starts = [int(batch["positions"][0][documents == d][0]) for d in range(len(rows))]
        rows = [(torch.cat([rows[d - 1][0][:starts[d]], row_ids]),
                 torch.cat([torch.full((starts[d],), -100), row_labels])) if d % 2 else (row_ids, row_labels)
                for d, (row_ids, row_labels) in enumerate(rows)]
        rows = rows[0::2] + rows[1::2]
    width = max(len(row_ids) for row_ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    padded_labels = torch.full_like(input_ids, -100)
    for index, (row_ids, row_labels) in enumerate(rows):
        input_ids[index, : len(row_ids)], padded_labels[index, : len(row_ids)] = row_ids, row_labels
    return {"input_ids": input_ids, "labels": padded_labels}


def assert_same_step(got: tuple[Any, dict], expected: tuple[Any, dict], *, loss_atol: float, msg: str) -> None:
    """Two (LossOutput, gradients by name) of one step on the same weights: the same loss sum (``loss_atol``),
    metrics (1e-5, or 1e-6 relative: a sum of log-probs over a batch is in the hundreds, where one fp32 step
    is 1.5e-5 and the layouts sum in another order; seen off by that step on an AMD EPYC) and gradients (1e-6),
    naming ``msg`` on a failure."""
    import torch

    (out, grads), (want, want_grads) = got, expected
    torch.testing.assert_close(out.loss_sum, want.loss_sum, rtol=0, atol=loss_atol, msg=msg)
    for key, (total, _count) in want.metrics.items():
        torch.testing.assert_close(out.metrics[key][0], total, rtol=1e-6, atol=1e-5, msg=f"{msg} {key}")
    assert grads.keys() == want_grads.keys()
    for key, grad in want_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=0, atol=1e-6, msg=f"{msg} {key}")


def assert_loss_kernel_keeps_the_step(config_for: Any, tmp_path: Path, technique: str, *,
                                      prepare: Any = None) -> None:
    """``config_for(directory, memory)`` -> a run config: the first batch's loss and gradients with the loss-kernel
    technique ``technique`` in ``memory`` equal those of the plain path within 1e-5; ``prepare(model)`` runs on
    each composed model first."""
    import torch

    results = []
    for memory in ([], [technique]):
        session = compose_run(config_for(tmp_path / str(len(memory)), memory))
        assert (session.loss_kernel is not None) == bool(memory)
        if prepare is not None:
            prepare(session.model)
        out = session.plan.method.descriptor.loss(session, next(iter(session.train_data)))
        (out.loss_sum / out.normaliser).backward()
        results.append((out.loss_sum.detach(), {name: p.grad.clone() for name, p in session.model.named_parameters()
                                                if p.grad is not None}))
    (plain, plain_grads), (kernel, kernel_grads) = results
    torch.testing.assert_close(kernel, plain, atol=1e-5, rtol=0)
    assert kernel_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(kernel_grads[name], grad, atol=1e-5, rtol=0, msg=name)


def compose_run(config: dict) -> Any:
    """The session `posttune train` would run, composed from a config mapping (no training)."""
    from posttune.config import validate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry
    from posttune.training.compose import compose

    return compose(resolve_plan(validate(config), get_registry()))


#: a tiny teacher's shape (the student of ``kd_config`` is posttune-llama's ``tiny``: hidden 64, 2 layers)
TEACHER_SHAPE = {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 6,
                 "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


def save_hf_teacher(path: Path, *, family: str = "llama", vocab_size: int = 384, seed: int = 0,
                    **overrides: Any) -> Path:
    """A random tiny HF checkpoint written by transformers itself (``LlamaForCausalLM``, Qwen2, Qwen3),
    with enough weight scale that its next-token distributions are far from uniform."""
    import torch
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_class, model_class = (getattr(transformers, name) for name in classes[family])
    torch.manual_seed(seed)
    config = config_class(vocab_size=vocab_size, tie_word_embeddings=False, **{**TEACHER_SHAPE, **overrides})
    config.initializer_range = 0.2
    model = model_class(config).eval()
    model.save_pretrained(path)
    return path


def kd_config(tmp_path: Path, teacher_path: Path, *, rows: int = 16, **sections: Any) -> dict:
    """Distillation into posttune-llama's random ``tiny`` from the checkpoint at ``teacher_path``."""
    method = {"name": "kd", "chunk_size": 16, **sections.pop("method", {})}
    teacher_section = {"path": str(teacher_path), "family": "llama", **sections.pop("teacher", {})}
    config = tiny_run_config(tmp_path, reversal_rows(rows), fmt="chat", base_method=method, batch_size=2,
                             **sections)
    config["teacher"] = teacher_section
    return config


def check_bundled_config(posttune_cli: Any, configs: Path, name: str) -> None:
    """A method's bundled config starts with the command that runs it and passes ``posttune validate``."""
    assert (configs / f"{name}.yaml").read_text().splitlines()[0] == f"# posttune train {name}"
    result = posttune_cli("validate", name)
    assert result.exit_code == 0, result.stderr


def stated_number(config: Path, label: str) -> float:
    """The ``# label: number`` line an example config states its promise in (a reward rise, a fall)."""
    return float(re.search(rf"^# {label}: ([0-9.]+)", config.read_text(), re.MULTILINE).group(1))


def run_python(*args: str, timeout: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python *args`` in a fresh process; its exit status must be 0."""
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def prepare_grpo_example(out: Path) -> Path:
    """The GRPO CPU example's warm start (``python -m posttune_grpo.example prepare``), saved at ``out``."""
    run_python("-m", "posttune_grpo.example", "prepare", "--out", str(out), timeout=900)
    return out


def check_grpo_example_rises(warm_start: Path, out: Path, *overrides: str, env: dict[str, str] | None = None,
                             steps: int = 200, window: int = 40) -> list:
    """``posttune train grpo-tiny-reverse`` from ``warm_start`` for ``steps`` steps (with ``overrides``, which may
    end with launcher arguments) raises the mean reward: the last ``window`` steps' mean beats the first
    ``window``'s by the margin the config states, and the model is saved. Returns the step records."""
    import statistics

    import posttune_grpo

    config = posttune_grpo.CONFIGS / "grpo-tiny-reverse.yaml"
    run_python("-m", "posttune.cli.main", "train", "grpo-tiny-reverse", f"model.path={warm_start}",
               f"checkpoint.output_dir={out}", f"train.max_steps={steps}", *overrides, timeout=1800, env=env)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps
    first = statistics.mean(r["reward"] for r in records[:window])
    last = statistics.mean(r["reward"] for r in records[-window:])
    assert last >= first + stated_number(config, "reward rise"), (first, last)
    assert (out / "model" / "config.json").is_file()
    return records
