"""posttune-thirdparty (tests/third_party), installed as pip installs an outside plugin, extends every
open set of the core at once and trains on 2 gloo ranks: a Phi-3 checkpoint with fused tensors, the
method ``anchored_lm`` reading ``snippet`` rows and holding the policy near its ``anchor`` role, the
plan ``replicas`` with its own mesh dimension, the technique ``frozen_embedding`` with its own
estimate term, and GRPO generating with the ``recorder`` engine. The core knows none of these names
(tests/core/test_core_names.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from install_support import install
from run_support import TOKENIZER, grpo_config

torch = pytest.importorskip("torch")
pytest.importorskip("posttune_grpo")
WORDS = [f"{a}{b}{c}" for a in "ABCD" for b in "EFGH" for c in "IJ"]


def save_phi3(path: Path) -> Path:
    """transformers' own tiny random Phi3ForCausalLM: fused qkv_proj and gate_up_proj on disk."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    Phi3ForCausalLM(config).save_pretrained(path)
    return path


def posttune(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posttune.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def anchored_run(directory: Path, checkpoint: Path, *, batch_size: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "train.jsonl").write_text("".join(json.dumps({"snippet": f"{w} -> {w[::-1]}"}) + "\n" for w in WORDS))
    config = {
        # named: posttune-phi3 reads Phi3ForCausalLM too, and a named family wins over the architecture
        "model": {"path": str(checkpoint), "family": "fused_phi3"},
        "models": {"anchor": {"path": str(checkpoint), "family": "fused_phi3"}},
        "tokenizer": {"path": TOKENIZER},
        "method": {"name": "anchored_lm", "beta": 0.5},
        "data": {"train": {"path": str(directory / "train.jsonl"), "format": "snippet"}, "max_seq_len": 32},
        "train": {"max_steps": 4, "batch_size": batch_size, "lr": 3e-3, "seed": 0, "device": "cpu"},
        "parallel": {"plans": ["replicas"]},
        "memory": ["frozen_embedding"],
        "checkpoint": {"output_dir": str(directory / "out")},
    }
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(run: Path) -> list[dict]:
    lines = (run.parent / "out" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("thirdparty")
    return install(root / "site"), save_phi3(root / "phi3")


def test_posttune_sees_every_piece_of_the_installed_plugin(setup, tmp_path):
    env, checkpoint = setup
    listed = posttune(env, "plugins")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if "posttune-thirdparty" in line)
    for name in ("fused_phi3", "anchored_lm", "snippet", "replicas", "frozen_embedding", "recorder"):
        assert name in listed.stdout, name
    assert "posttune-thirdparty 0.1.0" in line
    plan = posttune(env, "plan", str(anchored_run(tmp_path / "run", checkpoint, batch_size=4)),
                    "--nproc-per-node", "2")
    assert plan.returncode == 0, plan.stderr
    assert "2 process(es), mesh rep=2" in plan.stdout
    assert "anchor" in plan.stdout and "model family 'fused_phi3'" in plan.stdout
    assert "not modelled" not in plan.stdout  # frozen_embedding brought its own estimate term


@pytest.mark.slow
def test_two_ranks_train_the_fused_family_with_the_new_role_kind_plan_and_technique(setup, tmp_path):
    """2 ranks of ``rep`` with 4 rows each take the steps of one process with all 8: same losses, token
    counts and weights. The anchor is loaded through the fused converter too, the embedding stays as
    loaded (frozen_embedding), and the checkpoint saved is fused again, as transformers reads it."""
    from safetensors.torch import load_file
    from transformers import Phi3ForCausalLM

    env, checkpoint = setup
    single, pair = anchored_run(tmp_path / "one", checkpoint, batch_size=8), anchored_run(tmp_path / "two", checkpoint,
                                                                                          batch_size=4)
    for run, launch in ((single, ()), (pair, ("--nproc-per-node", "2", "--standalone"))):
        result = posttune(env, "train", str(run), *launch)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    want, got = losses(single), losses(pair)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["anchor_gap"] == pytest.approx(b["anchor_gap"], abs=1e-5)
    assert got[0]["anchor_gap"] == 0 and got[-1]["anchor_gap"] > 0  # the policy left its anchor
    saved = load_file(pair.parent / "out" / "model" / "model.safetensors")
    original = load_file(checkpoint / "model.safetensors")
    assert saved.keys() == original.keys() and "model.layers.0.self_attn.qkv_proj.weight" in saved
    torch.testing.assert_close(saved["model.embed_tokens.weight"], original["model.embed_tokens.weight"],
                               atol=0, rtol=0)
    assert not torch.equal(saved["model.layers.0.mlp.gate_up_proj.weight"],
                           original["model.layers.0.mlp.gate_up_proj.weight"])
    for key, tensor in load_file(single.parent / "out" / "model" / "model.safetensors").items():
        # AdamW moves a weight by up to lr (3e-3) a step whatever its gradient: within 1% of 4 steps' moves
        torch.testing.assert_close(saved[key], tensor, atol=1.2e-4, rtol=0, msg=key)
    Phi3ForCausalLM.from_pretrained(pair.parent / "out" / "model")  # every tensor where transformers wants it


@pytest.mark.slow
def test_grpo_on_two_ranks_generates_with_the_plugin_s_engine(setup, tmp_path):
    env, checkpoint = setup
    log = tmp_path / "engine.jsonl"
    config = grpo_config(tmp_path / "grpo", parallel={"plans": ["replicas"]}, train={"max_steps": 2},
                         method={"engine": "recorder", "engine_options": {"log": str(log)}})
    config["model"] = {"path": str(checkpoint), "family": "fused_phi3"}  # not the tiny random Llama
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune(env, "train", str(path), "--nproc-per-node", "2", "--standalone")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    per_rank = {}
    for event in events:
        per_rank.setdefault(event["pid"], []).append((event["event"], event["version"]))
    assert len(per_rank) == 2
    for seen in per_rank.values():  # each rank: started on the loaded weights, brought to step 1's, closed
        assert seen == [("start", 0), ("generate", 0), ("update", 1), ("generate", 1), ("close", 1)]
    assert [r["step"] for r in losses(tmp_path / "grpo" / "run.yaml")] == [1, 2]


def test_formats_for_other_layouts_feed_the_first_party_methods(setup, tmp_path):
    """``judged`` rows train DPO and ``task`` rows GRPO, one step each, with the same meaning as the core's
    formats: a judged row is the preference row with its fields renamed, so DPO's first loss is the same."""
    from run_support import dpo_config, preference_rows

    env, _ = setup
    rows = preference_rows(8)
    renamed = [{"question": r["prompt"], "better": r["chosen"], "worse": r["rejected"]} for r in rows]
    first_loss = {}
    for name, data in (("preference", rows), ("judged", renamed)):
        config = dpo_config(tmp_path / name, rows=8, train={"max_steps": 1})
        Path(config["data"]["train"]["path"]).write_text("".join(json.dumps(row) + "\n" for row in data))
        config["data"]["train"]["format"] = name
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        result = posttune(env, "train", str(path))
        assert result.returncode == 0, result.stderr[-3000:]
        first_loss[name] = losses(tmp_path / name / "run.yaml")[0]["loss"]
    assert first_loss["judged"] == first_loss["preference"]
    config = grpo_config(tmp_path / "task", train={"max_steps": 1})
    tasks = [{"task": f"Reverse: {w}", "answer": w[::-1]} for w in WORDS[:8]]
    Path(config["data"]["train"]["path"]).write_text("".join(json.dumps(row) + "\n" for row in tasks))
    config["data"]["train"]["format"] = "task"
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune(env, "train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in losses(tmp_path / "task" / "run.yaml")] == [1]
    bad = posttune(env, "validate", str(path), "data.train.format=judged")
    assert bad.returncode == 2 and "gives preference rows; method 'grpo' needs prompt rows" in bad.stderr
