"""A third-party plan with a mesh dimension of its own (``rep``, posttune_thirdparty/mesh.py) is placed
in the mesh, shards the data and trains on 2 gloo ranks exactly like one process, with no core change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from install_support import install

from posttune.plugins import hookimpl
from posttune_thirdparty import mesh


class MeshPlugin:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_parallel_plans(self, register):
        mesh.register_parallel_plans(register)


def write_run(directory: Path, *, batch_size: int, plans: list[str]) -> Path:
    """A 4-step SFT run of a tiny random-init Llama on reverse-a-word chats."""
    directory.mkdir(parents=True)
    words = [f"{a}{b}{c}" for a in "ABCD" for b in "EFGH" for c in "IJ"]
    rows = [{"messages": [{"role": "user", "content": f"Reverse: {w}"}, {"role": "assistant", "content": w[::-1]}]}
            for w in words]
    (directory / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "model": {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "tokenizer": {"path": "package:posttune_llama/demo/tokenizer"},
        "method": "sft",
        "data": {"train": {"path": str(directory / "train.jsonl"), "format": "chat"}, "max_seq_len": 48},
        "train": {"max_steps": 4, "batch_size": batch_size, "lr": 1e-3, "seed": 0, "device": "cpu"},
        "parallel": {"plans": plans},
        "checkpoint": {"output_dir": str(directory / "out")},
    }
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def plugins(register_plugin):
    for name in ("posttune_llama", "posttune_sft"):
        module = pytest.importorskip(name)
        register_plugin(module, distribution=name.replace("_", "-"), version="0.1.0")
    register_plugin(MeshPlugin(), name="thirdparty-mesh", distribution="posttune-thirdparty", version="0.1.0")


def test_the_plan_owns_its_dimension_and_the_core_sizes_it(plugins, posttune_cli, tmp_path):
    config = str(write_run(tmp_path / "run", batch_size=4, plans=["replicas"]))
    result = posttune_cli("plan", config, "--nproc-per-node", "2", "--no-estimate")
    assert result.exit_code == 0, result.stderr
    assert "2 process(es), mesh rep=2" in result.stdout and "parallel plan 'replicas'" in result.stdout
    wrong = posttune_cli("validate", config, "parallel.dims.rep=3", "--nproc-per-node", "2")
    assert wrong.exit_code == 2
    assert wrong.stderr == "posttune: error: config: parallel.dims: rep=3 does not fit the 2 processes launched\n"


def train(config: Path, env: dict[str, str], *launch: str) -> list[dict]:
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(config), *launch]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = (config.parent / "out" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


@pytest.mark.slow
def test_two_replicas_train_exactly_like_one_process_with_the_whole_batch(tmp_path):
    """Each rank of ``rep`` takes 4 of the 8 rows (the loader shards by the dimension because it splits the
    batch) and averages its gradients: the same losses, token counts, gradient norms and final weights as
    one process of batch 8. Sharding by anything else, or not summing over ``rep``, would differ."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    for module in ("posttune_llama", "posttune_sft"):
        pytest.importorskip(module)
    env = install(tmp_path / "site")  # the whole posttune-thirdparty: the run lists only its plan
    want = train(write_run(tmp_path / "single", batch_size=8, plans=[]), env)
    got = train(write_run(tmp_path / "replicas", batch_size=4, plans=["replicas"]), env,
                "--nproc-per-node", "2", "--standalone")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    weights = load_file(tmp_path / "replicas" / "out" / "model" / "model.safetensors")
    reference = load_file(tmp_path / "single" / "out" / "model" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for key, tensor in reference.items():  # AdamW moves a weight by ~lr whatever its gradient: 1% of a step
        torch.testing.assert_close(weights[key], tensor, atol=1e-5, rtol=0, msg=key)


def test_a_replicated_model_is_written_by_rank_0_alone(monkeypatch, tmp_path):
    """Every rank of ``rep`` holds the whole model: a rank other than 0 must not write the final model too
    (two ranks renaming into one directory raced: "Directory not empty" on one of them)."""
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from posttune.training import distributed, state

    monkeypatch.setattr(distributed, "is_main", lambda: False)
    session = SimpleNamespace(model=torch.nn.Linear(2, 2), config=SimpleNamespace(adapter=None))
    assert state.save_model_or_adapter(session, tmp_path / "model") == tmp_path / "model"
    assert not (tmp_path / "model").exists()
