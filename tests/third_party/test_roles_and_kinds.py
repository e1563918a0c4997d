"""A third-party data kind (``snippet``) and model role (``anchor``, posttune_thirdparty/roles_and_kinds.py):
the method that declares them trains end to end through `posttune train`, `posttune plan` lists the
role, and kinds and roles are checked before launch as the first-party ones are, with no core change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from posttune.plugins import hookimpl
from posttune.training.metrics import read_metrics
from posttune_thirdparty import roles_and_kinds

#: the anchor: a tiny Llama of one layer (the policy has two), so the two models disagree from step one
ANCHOR = {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384, "num_layers": 1}}


class RolesAndKindsPlugin:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_datasets(self, register):
        roles_and_kinds.register_datasets(register)

    @hookimpl
    def posttune_register_methods(self, register):
        roles_and_kinds.register_methods(register)


@pytest.fixture
def plugins(register_plugin):
    for name in ("posttune_llama", "posttune_sft"):
        module = pytest.importorskip(name)
        register_plugin(module, distribution=name.replace("_", "-"), version="0.1.0")
    register_plugin(RolesAndKindsPlugin(), name="thirdparty-roles", distribution="posttune-thirdparty",
                    version="0.1.0")


def write_run(directory: Path, **sections) -> Path:
    """A 4-step anchored_lm run of a tiny random-init Llama on snippets of reversed words."""
    directory.mkdir(parents=True, exist_ok=True)
    words = [f"{a}{b}{c}" for a in "ABCD" for b in "EFGH" for c in "IJ"]
    (directory / "train.jsonl").write_text("".join(json.dumps({"snippet": f"{w} {w[::-1]}"}) + "\n" for w in words))
    config = {
        "model": {"family": "llama", "size": "tiny", "build_overrides": {"vocab_size": 384}},
        "models": {"anchor": ANCHOR},
        "tokenizer": {"path": "package:posttune_llama/demo/tokenizer"},
        "method": {"name": "anchored_lm", "beta": 0.5},
        "data": {"train": {"path": str(directory / "train.jsonl"), "format": "snippet"}, "max_seq_len": 32},
        "train": {"max_steps": 4, "batch_size": 8, "lr": 1e-3, "seed": 0, "device": "cpu"},
        "checkpoint": {"output_dir": str(directory / "out")},
        **sections,
    }
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_method_trains_with_its_role_and_kind_through_the_cli(plugins, posttune_cli, tmp_path):
    result = posttune_cli("train", str(write_run(tmp_path)))
    assert result.exit_code == 0, result.stderr
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["anchor_gap"] > 0 for r in records)  # the anchor is another model, and it was used
    assert (tmp_path / "out" / "model").is_dir()


def test_plan_lists_the_role_and_counts_its_weights(plugins, posttune_cli, tmp_path):
    result = posttune_cli("plan", str(write_run(tmp_path)))
    assert result.exit_code == 0, result.stderr
    assert "roles        anchor: frozen 'llama' model (random init, size tiny)" in result.stdout
    assert "  anchor (frozen, " in result.stdout
    assert "train: " in result.stdout and "as 'snippet'" in result.stdout


@pytest.mark.parametrize("change, message", [
    ({"models": {}}, "config: models.anchor: required: method 'anchored_lm' needs its anchor model "
                     "(models.anchor.path, or models.anchor.family and models.anchor.size)"),
    ({"models": {"anchor": ANCHOR, "critic": ANCHOR}},
     "config: models.critic: method 'anchored_lm' uses no critic model with these settings; remove it"),
    ({"data": {"train": {"path": "PATH", "format": "chat"}}},
     "config: data.train.format: 'chat' gives conversation rows; method 'anchored_lm' needs snippet rows"),
    ({"method": "sft"},
     "config: data.train.format: 'snippet' gives snippet rows; method 'sft' needs conversation rows"),
])
def test_kinds_and_roles_are_checked_before_launch(plugins, posttune_cli, tmp_path, change, message):
    path = write_run(tmp_path)
    config = yaml.safe_load(path.read_text())
    if "data" in change:
        change["data"]["train"]["path"] = config["data"]["train"]["path"]
        change = {"data": {**config["data"], **change["data"]}}
    path.write_text(yaml.safe_dump({**config, **change}))
    result = posttune_cli("validate", str(path))
    assert result.exit_code == 2
    assert result.stderr == f"posttune: error: {message}\n"
