"""`_component_` runs code: only torch, torchao, posttune and the plugins' packages unless the user opts in."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import yaml
from run_support import sft_config

import posttune_llama
import posttune_sft
from posttune.config.components import TRUST_ENV, import_dotted
from posttune.errors import ConfigError

CONFIG = """\
model: {family: fam, size: tiny}
method: fsft
data:
  train: {path: d.jsonl, format: chat}
"""
OPT_IN = "pass --trust-components or set POSTTUNE_TRUST_COMPONENTS=1"


@pytest.fixture(autouse=True)
def untrusted(monkeypatch):
    """No opt-in from the environment; whatever a test (or --trust-components) sets is undone after it."""
    monkeypatch.delenv(TRUST_ENV, raising=False)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def llama_sft(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")


def shell_component(marker: Path) -> list[str]:
    return ["method={name: fsft}", "method.hook._component_=os.system", f"method.hook.command='touch {marker}'"]


@pytest.mark.parametrize("command", ["validate", "plan", "train"])
def test_os_system_is_refused_in_one_line(fake_plugin, posttune_cli, config_file, tmp_path, command):
    marker = tmp_path / "ran"
    result = posttune_cli(command, str(config_file), *shell_component(marker))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("posttune: error: config: method.hook._component_: refusing 'os.system': ")
    assert OPT_IN in result.stderr
    assert not marker.exists()


def test_with_the_opt_in_validate_accepts_and_lists_it_without_calling_it(fake_plugin, posttune_cli, config_file,
                                                                          tmp_path):
    marker = tmp_path / "ran"
    result = posttune_cli("validate", str(config_file), *shell_component(marker), "--trust-components")
    assert result.exit_code == 0, result.stderr
    assert "components: method.hook -> os.system" in result.stdout.splitlines()
    assert not marker.exists()  # validate imports and binds; it never calls
    assert os.environ[TRUST_ENV] == "1"  # what torchrun's workers inherit when `train` launches them


@pytest.fixture
def marker_module(tmp_path, monkeypatch) -> Path:
    """A module outside the allow-list: an optimizer factory that leaves a marker file; importing it leaves another."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "posttune_test_marker.py").write_text(textwrap.dedent("""
        from pathlib import Path

        import torch

        Path(__file__).with_name("imported").touch()


        def sgd(params, lr, marker):
            Path(marker).write_text("built")
            return torch.optim.SGD(params, lr=lr)
    """))
    monkeypatch.syspath_prepend(str(site))
    yield site
    import sys

    sys.modules.pop("posttune_test_marker", None)


def test_the_gate_runs_before_the_module_is_imported(fake_plugin, posttune_cli, config_file, marker_module):
    result = posttune_cli("validate", str(config_file), "train.optimizer._component_=posttune_test_marker.sgd",
                          "train.optimizer.marker=x")
    assert result.exit_code == 2 and "refusing 'posttune_test_marker.sgd'" in result.stderr
    assert not (marker_module / "imported").exists()


@pytest.mark.parametrize("opt_in", ["flag", "env"])
def test_train_runs_a_component_outside_the_allow_list_with_the_opt_in(llama_sft, posttune_cli, tmp_path,
                                                                        marker_module, monkeypatch, opt_in):
    marker = tmp_path / "built"
    config = sft_config(tmp_path, rows=4, train={"max_steps": 1, "device": "cpu", "optimizer": {
        "_component_": "posttune_test_marker.sgd", "marker": str(marker)}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    refused = posttune_cli("train", str(path))
    assert refused.exit_code == 2 and "refusing 'posttune_test_marker.sgd'" in refused.stderr
    assert not marker.exists()
    if opt_in == "env":
        monkeypatch.setenv(TRUST_ENV, "1")
    result = posttune_cli("train", str(path), *(["--trust-components"] if opt_in == "flag" else []))
    assert result.exit_code == 0, result.stderr
    assert marker.read_text() == "built"


@pytest.mark.parametrize("path, why", [
    ("torch.os.system", "(it resolves into 'os'): it is outside the packages a config may name"),
    ("torch.nn.modules.module.torch.hub.load", "(it resolves into 'torch.hub'): it starts programs or loads code"),
    ("torch.distributed.run.main", ": it starts programs or loads code"),
    ("torch.load", ": it starts programs or loads code"),
    ("torch.optim.AdamW.__init__", ": it is private"),
    ("posttune.config.loader.Path.write_text", "(it resolves into 'pathlib.Path.write_text')"),
    ("subprocess.run", ": it is outside the packages a config may name"),
])
def test_ways_around_the_allow_list_are_refused(posttune_plugins, path, why):
    with pytest.raises(ConfigError) as error:
        import_dotted(path, "train.optimizer._component_")
    assert str(error.value).startswith(f"config: train.optimizer._component_: refusing '{path}' {why}".replace(
        "' :", "':"))


def test_the_installed_plugins_packages_are_allowed(register_plugin):
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    assert callable(import_dotted("posttune_sft.posttune_register_methods", "x._component_"))
    assert import_dotted("torch.optim.AdamW", "x._component_").__name__ == "AdamW"
