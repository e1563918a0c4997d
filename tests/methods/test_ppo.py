"""PPO end to end on tiny random models: four roles in the plan, the trained value model checkpointed,
resumed bitwise after SIGKILL and exported as a transformers sequence classifier; whitening over ranks
equals the one-process formula. (The loss formulas themselves: test_ppo_advantages.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from kill_support import run, together
from run_support import prompt_rows, tiny_run_config

#: a reward every random model earns unevenly (installed with posttune-grpo: `format` with a pattern)
ANY_VOWEL = {"name": "format", "options": {"pattern": ".*[AEIOU].*"}}
PPO = {"name": "ppo", "max_new_tokens": 6, "rewards": [ANY_VOWEL], "ppo_epochs": 2, "num_mini_batches": 2}


def ppo_config(tmp_path: Path, *, rows: int = 8, **sections) -> dict:
    config = tiny_run_config(tmp_path, prompt_rows(rows), fmt="prompt", base_method=PPO, batch_size=4, **sections)
    config["train"].setdefault("max_steps", 4)
    return config


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def reward_model(path: Path) -> Path:
    """A tiny random sequence classifier written by transformers (the reward role's checkpoint)."""
    import transformers

    from posttune.testing.tiny import TINY

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 384, "num_labels": 1, "pad_token_id": 4})
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    return path


def test_plan_lists_the_four_roles_with_their_memory(tmp_path):
    config = ppo_config(tmp_path, method={**PPO, "rewards": [{"name": "reward_model"}]},
                        models={"reward": {"path": str(reward_model(tmp_path / "rm"))}})
    result = subprocess.run([sys.executable, "-m", "posttune.cli.main", "plan", str(write(tmp_path, config))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "value: trained 'llama' model" in out and "reference: frozen 'llama' model" in out
    assert "reward: frozen 'llama' model" in out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    assert "gradients" in lines["policy"] and "gradients" in lines["value"]  # both train
    frozen = [line for line in out.splitlines() if "(frozen," in line]
    assert sorted(line.split()[0] for line in frozen) == ["reference", "reward"]


def test_sigkill_then_resume_gives_the_same_ppo_steps(tmp_path):
    """Checkpoints every 3 steps, 4 micro-batches per rollout batch (2 passes x 2 mini-batches): the kill
    at step 5 resumes from step 3, half-way through a batch, with the policy, the value model and the
    optimizer of both restored; every step's loss, reward and gradient norm equal the straight run's."""
    paths = {}
    for name in ("straight", "killed"):
        config = ppo_config(tmp_path / name, train={"max_steps": 8, "lr": 5e-3},
                            checkpoint={"save_every": 3, "keep_last": 2})
        paths[name] = write(tmp_path / name, config)
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 5)))
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -9
    checkpoint = tmp_path / "killed" / "out" / "checkpoints" / "step-00000003"
    assert (checkpoint / "models" / "value" / "model.safetensors").is_file()
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr

    def curve(name: str) -> list[tuple]:
        lines = (tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["reward"], r["value_loss"], r["grad_norm"]) for r in map(json.loads, lines)]

    expected = curve("straight")
    assert [step for step, *_ in expected] == list(range(1, 9))
    assert any(row[1] != 0 for row in expected) and len({row[3] for row in expected}) > 1
    assert curve("killed") == expected


def test_the_value_model_is_exported_beside_the_policy_as_a_sequence_classifier(tmp_path):
    import transformers

    config = ppo_config(tmp_path, train={"max_steps": 2, "lr": 5e-3})
    result = run(str(write(tmp_path, config)))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    value = transformers.AutoModelForSequenceClassification.from_pretrained(out / "value").eval()
    policy = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert value.config.num_labels == 1 and value.score.weight.shape == (1, value.config.hidden_size)
    # trained: the value model moved away from the policy it started as (same seeded trunk before step 1)
    trunk = dict(value.model.named_parameters())
    moved = [name for name, p in policy.model.named_parameters() if not torch.equal(p, trunk[name])]
    assert moved
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.isfinite(value(ids).logits).all()


def test_whitening_over_ranks_on_one_process_is_the_formula():
    from posttune_ppo.advantages import masked_whiten
    from posttune_ppo.experience import whiten

    torch.manual_seed(0)
    values = torch.randn(5, 9) * 3 + 1
    mask = torch.zeros(5, 9, dtype=torch.bool)
    for row, (start, length) in enumerate([(1, 4), (0, 9), (3, 2), (2, 0), (4, 5)]):
        mask[row, start:start + length] = True
    session = SimpleNamespace(mesh=None, device=torch.device("cpu"), plan=SimpleNamespace(mesh={}))
    for shift in (True, False):
        got, want = whiten(session, values, mask, shift_mean=shift), masked_whiten(values, mask, shift_mean=shift)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(whiten(session, values, mask), whiten(session, values, mask, shift_mean=False))


@pytest.mark.parametrize("section, message", [
    ({"num_mini_batches": 3}, "config: method.num_mini_batches: num_mini_batches x train.grad_accum_steps = 3 must "
                              "divide train.batch_size x group_size = 4 completions per rank"),
    ({"lam": 1.5}, "config: method.lam: expected a value in [0, 1], got 1.5"),
    ({"cliprange_value": 0}, "config: method.cliprange_value: expected a positive number or null, got 0.0"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, section, message):
    from posttune.config import validate
    from posttune.errors import PosttuneError
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    config = ppo_config(tmp_path, method={**PPO, **section})
    with pytest.raises(PosttuneError) as error:
        resolve_plan(validate(config), get_registry())
    assert str(error.value) == message


@pytest.mark.parametrize("name", ["ppo-tiny-reverse", "qwen2.5-1.5b-ppo"])
def test_bundled_configs_validate_and_show_their_command(name, tmp_path):
    import posttune_ppo

    assert (posttune_ppo.CONFIGS / f"{name}.yaml").read_text().splitlines()[0] == f"# posttune train {name}"
    result = subprocess.run([sys.executable, "-m", "posttune.cli.main", "validate", name], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.stem for p in posttune_ppo.CONFIGS.glob("*.yaml")) == ["ppo-tiny-reverse", "qwen2.5-1.5b-ppo"]


def test_lora_ppo_adapts_the_value_model_too_and_peft_loads_both(tmp_path):
    """Under LoRA: the reference is the policy with its adapters off (no copy), the value model gets its own
    adapters (its fresh head trains whole), and both save as PEFT adapters -- the value's a SEQ_CLS one that
    PEFT applies to transformers' sequence classifier with the scores of the merged value model."""
    peft = pytest.importorskip("peft")
    import transformers

    from posttune.testing.tiny import save_tiny_hf_checkpoint, tiny_llama_config

    source = tmp_path / "causal"
    save_tiny_hf_checkpoint(source, tiny_llama_config(vocab_size=384))
    config = ppo_config(tmp_path, train={"max_steps": 5, "lr": 5e-3}, adapter={"rank": 4, "alpha": 8},
                        checkpoint={"save_merged": True})
    config["model"] = {"path": str(source), "family": "llama"}
    plan = subprocess.run([sys.executable, "-m", "posttune.cli.main", "plan", str(write(tmp_path, config))],
                          capture_output=True, text=True, timeout=120)
    assert "reference: the policy with its adapters disabled (no copy)" in plan.stdout, plan.stdout
    assert "value: trained (lora) 'llama' model" in plan.stdout
    result = run(str(tmp_path / "run.yaml"))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    saved = json.loads((out / "value-adapter" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["score"]
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the second rollout batch (step 5) samples from a policy the adapters moved off its base (the reference)
    assert steps[0]["kl"] == 0 and steps[-1]["kl"] != 0

    base = transformers.AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=torch.float32)
    base.config.pad_token_id = 4
    value = peft.PeftModel.from_pretrained(base, out / "value-adapter").eval()
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(out / "value", dtype=torch.float32).eval()
    ids = torch.randint(5, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, folded = value(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(theirs, folded, atol=1e-5, rtol=0), (theirs, folded)
    drawn = torch.randn(1, base.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.02
    assert (merged.score.weight - drawn).abs().max() > 1e-4  # the head trained beside the adapters


def test_the_estimate_counts_the_value_models_gradients_optimizer_and_activations(tmp_path):
    """The value model (the policy's shape with a one-value head) adds its gradients, AdamW state and
    activations to the policy's in the estimate; the frozen reference adds weights only."""
    from posttune.config import validate
    from posttune.estimate import activation_bytes, decoder_shape, estimate
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    est = estimate(resolve_plan(validate(ppo_config(tmp_path)), get_registry()))
    policy, value, reference = est.models
    assert (policy.role, value.role, reference.role) == ("policy", "value", "reference")
    assert value.trainable == value.parameters > 0 and value.gradient_bytes == value.trainable * value.width
    assert value.optimizer_bytes == 2 * value.gradient_bytes  # AdamW: two moments
    assert reference.gradient_bytes == reference.optimizer_bytes == 0
    # the plan's "parameters:" line counts what trains, as the train banner does: not the frozen reference
    assert est.parameters == est.trainable == policy.parameters + value.parameters
    parts = est.components()
    assert parts["gradients"] == policy.gradient_bytes + value.gradient_bytes
    assert parts["optimizer"] == policy.optimizer_bytes + value.optimizer_bytes
    both = [activation_bytes(decoder_shape(m.module, 0), m.width, est.tokens) for m in (policy, value)]
    assert both[0] > 0 and est.activations == sum(both)


def test_a_value_head_on_the_policy_reads_the_policys_own_forward(tmp_path):
    """``value_model: head``: one policy forward gives the log-probs token_logps gives and the values the head
    gives on the trunk's hidden states; the head is the only extra trained tensor."""
    from posttune.plugin import token_logps
    from posttune_ppo.experience import logps_and_values
    from run_support import compose_run

    session = compose_run(ppo_config(tmp_path, method={**PPO, "value_model": "head", "temperature": 0.7,
                                                       "padding_free": False}))  # values at every position
    value = session.models["value"]
    hidden = session.model.output.weight.shape[1]
    assert [name for name, _ in value.named_parameters()] == ["score.weight"]
    assert sum(p.numel() for p in session.trainable.parameters()) == sum(
        p.numel() for p in session.model.parameters()) + hidden
    ids = torch.randint(5, 300, (3, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, 4:11] = ids[:, 5:12]
    batch = {"input_ids": ids, "labels": labels}
    with torch.no_grad():
        logps, values = logps_and_values(session, batch)
        torch.testing.assert_close(logps, token_logps(session, batch, temperature=0.7), rtol=1e-6, atol=1e-6)
        trunk = session.model(ids, return_hidden=True)
        torch.testing.assert_close(values, (trunk @ value.score.weight.T)[..., 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(values, value(ids)[..., 0], rtol=0, atol=0)


@pytest.mark.extended  # the value model's resume stays in the default run (above)
def test_a_value_head_run_resumes_bitwise_and_saves_the_head(tmp_path):
    paths = {}
    method = {**PPO, "value_model": "head"}
    for name in ("straight", "killed"):
        config = ppo_config(tmp_path / name, method=method, train={"max_steps": 8, "lr": 5e-3},
                            checkpoint={"save_every": 3, "keep_last": 2})
        paths[name] = write(tmp_path / name, config)
    plan = subprocess.run([sys.executable, "-m", "posttune.cli.main", "plan", str(paths["straight"])],
                          capture_output=True, text=True, timeout=120)
    assert "value: a trained score head on the policy's hidden states (no second model)" in plan.stdout, plan.stdout
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 5)))
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -9
    assert (tmp_path / "killed" / "out" / "checkpoints" / "step-00000003" / "models" / "value" /
            "head.safetensors").is_file()
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr

    def curve(name: str) -> list[tuple]:
        lines = (tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["value_loss"], r["grad_norm"]) for r in map(json.loads, lines)]

    assert curve("killed") == curve("straight") and len({row[2] for row in curve("straight")}) > 1
    from safetensors.torch import load_file

    out = tmp_path / "straight" / "out"
    head = load_file(str(out / "value" / "head.safetensors"))["score.weight"]
    drawn = torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * 0.02  # train.seed 0
    assert head.shape[0] == 1 and (head - drawn).abs().max() > 1e-4  # trained
    assert not (out / "value" / "config.json").exists() and (out / "model" / "config.json").is_file()


def test_a_value_head_under_lora_trains_beside_the_adapters(tmp_path):
    config = ppo_config(tmp_path, method={**PPO, "value_model": "head"}, adapter={"rank": 4, "alpha": 8},
                        train={"max_steps": 2, "lr": 5e-3})
    result = run(str(write(tmp_path, config)))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "value" / "head.safetensors").is_file()
    assert not (out / "value-adapter").exists()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["value_loss"] != steps[1]["value_loss"]  # the head learned between the two passes


def test_a_value_head_has_no_models_section(tmp_path):
    from posttune.config import validate
    from posttune.errors import PosttuneError
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    config = ppo_config(tmp_path, method={**PPO, "value_model": "head"}, models={"value": {"path": str(tmp_path)}})
    with pytest.raises(PosttuneError) as error:
        resolve_plan(validate(config), get_registry())
    assert str(error.value) == ("config: models.value: method 'ppo' reads its value from the policy's own hidden "
                                "states (a head on the policy): remove this section")


def test_max_new_tokens_past_the_context_is_refused_before_any_rollout(tmp_path):
    """As GRPO's: generation stops at max_position_embeddings, so completions past it would be cut silently."""
    model = {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384, "max_position_embeddings": 64}}
    config = ppo_config(tmp_path, model=model, method={**PPO, "max_new_tokens": 64}, train={"max_steps": 1})
    result = subprocess.run([sys.executable, "-m", "posttune.cli.main", "train", str(write(tmp_path, config))],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, (
        "posttune: error: config: method.max_new_tokens: 64 leaves no room for a prompt in the model's context of 64 "
        "tokens (max_position_embeddings)"))


def test_a_trained_value_model_in_fp16_is_refused_naming_its_section(tmp_path):
    """The value model trains: fp16 weights diverge there as the policy's would (config.md, "dtype")."""
    from posttune.errors import ConfigError
    from run_support import compose_run

    config = ppo_config(tmp_path, models={"value": {"family": "llama", "size": "tiny", "dtype": "fp16",
                                                    "build_overrides": {"vocab_size": 384}}})
    with pytest.raises(ConfigError) as error:
        compose_run(config)
    assert str(error.value).startswith("config: models.value.dtype: fp16 weights cannot train here: with no loss "
                                       "scaling")


def test_adapter_dropout_is_refused_for_ppo(tmp_path):
    from posttune.config import validate
    from posttune.errors import ConfigError
    from posttune.plan import resolve_plan
    from posttune.plugins import get_registry

    with pytest.raises(ConfigError, match=r"^config: adapter.dropout: ppo compares the policy's log-probs"):
        resolve_plan(validate(ppo_config(tmp_path, adapter={"rank": 4, "dropout": 0.05})), get_registry())
