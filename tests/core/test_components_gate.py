"""`_component_` runs code: by default only optimizer and LR scheduler classes of torch, torchao, posttune and the
plugins' packages, at any depth of a config, unless the user opts in."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from run_support import sft_config

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
from posttune.config.components import TRUST_ENV, import_dotted, instantiate
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
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
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


def test_with_the_opt_in_validate_accepts_and_lists_it_without_calling_it(llama_sft, posttune_cli, tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(sft_config(tmp_path, rows=4)))
    shell = ["train.optimizer._component_=torch.optim.SGD", "train.optimizer.momentum._component_=os.system",
             f"train.optimizer.momentum.command='touch {marker}'"]
    result = posttune_cli("validate", str(path), *shell, "--trust-components")
    assert result.exit_code == 0, result.stderr
    assert "components: train.optimizer.momentum -> os.system, train.optimizer -> torch.optim.SGD" in \
        result.stdout.splitlines()
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


OUTSIDE = "it is outside the packages a config may name"


@pytest.mark.parametrize("path, why", [
    ("torch.os.system", f"(it resolves into 'os'): {OUTSIDE}"),
    ("torch.nn.modules.module.torch.hub.load", ": it is a function, not an optimizer class"),
    ("torch.utils.collect_env.run", ": it is a function, not an optimizer class"),
    ("torch.distributed.run.main", ": it is a function, not an optimizer class"),
    ("torch.load", ": it is a function, not an optimizer class"),
    ("torch.optim.AdamW.__init__", ": it is private"),
    ("posttune.config.loader.Path.write_text", ": it is a function, not an optimizer class"),
    ("posttune.config.loader.Path", f"(it resolves into 'pathlib.Path'): {OUTSIDE}"),
    ("torch.nn.Linear", ": it is a class, but not an optimizer class"),
    ("torch.optim.lr_scheduler.StepLR", ": it is a class, but not an optimizer class"),
    ("subprocess.run", f": {OUTSIDE}"),
])
def test_ways_around_the_allow_list_are_refused(posttune_plugins, path, why):
    with pytest.raises(ConfigError) as error:
        import_dotted(path, "train.optimizer._component_")
    assert str(error.value).startswith(f"config: train.optimizer._component_: refusing '{path}' {why}".replace(
        "' :", "':"))


# ---- the allow-list: optimizer and LR scheduler classes, by field -------------------------------

def public_classes(module, base: type) -> list[str]:
    return [f"{module.__name__}.{name}" for name in module.__all__ if not name.startswith("_")
            and isinstance(getattr(module, name), type) and issubclass(getattr(module, name), base)]


OPTIMIZERS = public_classes(torch.optim, torch.optim.Optimizer)
SCHEDULERS = public_classes(torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler)


def test_torch_s_optimizers_and_schedulers_are_all_listed():
    assert {"torch.optim.AdamW", "torch.optim.SGD", "torch.optim.Adafactor"} <= set(OPTIMIZERS)
    assert {"torch.optim.lr_scheduler.StepLR", "torch.optim.lr_scheduler.ReduceLROnPlateau"} <= set(SCHEDULERS)


@pytest.mark.parametrize("path", OPTIMIZERS)
def test_every_torch_optimizer_is_allowed_at_train_optimizer(posttune_plugins, path):
    assert import_dotted(path, "train.optimizer._component_").__name__ == path.rsplit(".", 1)[1]
    with pytest.raises(ConfigError, match=f"refusing '{path}': it is a class, but not an LR scheduler class; "):
        import_dotted(path, "train.scheduler._component_")


@pytest.mark.parametrize("path", SCHEDULERS)
def test_every_torch_lr_scheduler_is_allowed_at_train_scheduler(posttune_plugins, path):
    assert import_dotted(path, "train.scheduler._component_").__name__ == path.rsplit(".", 1)[1]
    with pytest.raises(ConfigError, match=f"refusing '{path}': it is a class, but not an optimizer class; "):
        import_dotted(path, "train.optimizer._component_")


def test_elsewhere_either_kind_is_allowed(posttune_plugins):
    assert import_dotted("torch.optim.SGD", "method.x._component_") is torch.optim.SGD
    assert import_dotted("torch.optim.lr_scheduler.StepLR", "train.optimizer.y[0]._component_").__name__ == "StepLR"


def test_torchao_s_low_bit_optimizers_are_allowed(posttune_plugins):
    optim = pytest.importorskip("torchao.optim")
    names = [name for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit", "CPUOffloadOptimizer")
             if hasattr(optim, name)]
    assert "AdamW8bit" in names
    for name in names:
        assert import_dotted(f"torchao.optim.{name}", "train.optimizer._component_") is getattr(optim, name)


@pytest.mark.parametrize("where, allowed", [
    ("train.optimizer", "train.optimizer may name only an optimizer class (a subclass of torch.optim.Optimizer, "
                        "e.g. torch.optim.AdamW) of torch, torchao, posttune or an installed plugin's package; "),
    ("train.scheduler", "train.scheduler may name only an LR scheduler class (a subclass of "
                        "torch.optim.lr_scheduler.LRScheduler, e.g. torch.optim.lr_scheduler.StepLR) of torch, "),
    ("method.hook", "method.hook may name only an optimizer or LR scheduler class (a subclass of "
                    "torch.optim.Optimizer or torch.optim.lr_scheduler.LRScheduler, e.g. torch.optim.AdamW) of "),
])
def test_a_refusal_says_what_the_field_may_name(posttune_plugins, where, allowed):
    with pytest.raises(ConfigError) as error:
        import_dotted("torch.utils.collect_env.run", f"{where}._component_")
    message = str(error.value)
    assert message.startswith(f"config: {where}._component_: refusing 'torch.utils.collect_env.run': it is a ")
    assert allowed in message and message.endswith(OPT_IN) and "\n" not in message


@pytest.fixture
def optimizer_plugin(tmp_path, monkeypatch, register_plugin):
    """An installed plugin whose package defines an optimizer class and a function, and re-exports another
    package's optimizer class."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "untrusted_optim.py").write_text("import torch\n\n\nclass Evil(torch.optim.SGD):\n    pass\n")
    (site / "posttune_test_optim.py").write_text(textwrap.dedent("""
        from pathlib import Path

        import torch
        from untrusted_optim import Evil

        POSTTUNE_PLUGIN_API = 2


        class Lion(torch.optim.SGD):
            pass


        def touch(path):
            Path(path).touch()
    """))
    monkeypatch.syspath_prepend(str(site))
    import posttune_test_optim

    register_plugin(posttune_test_optim, distribution="posttune-test-optim", version="0.1.0")
    yield posttune_test_optim
    sys.modules.pop("posttune_test_optim", None)
    sys.modules.pop("untrusted_optim", None)


def test_an_installed_plugin_s_optimizer_class_is_allowed_but_not_its_functions(optimizer_plugin):
    assert import_dotted("posttune_test_optim.Lion", "train.optimizer._component_") is optimizer_plugin.Lion
    with pytest.raises(ConfigError, match="refusing 'posttune_test_optim.touch': it is a function, not an "):
        import_dotted("posttune_test_optim.touch", "train.optimizer._component_")
    with pytest.raises(ConfigError, match=f"refusing 'posttune_test_optim.Evil' \\(it resolves into "
                                          f"'untrusted_optim.Evil'\\): {OUTSIDE}; "):
        import_dotted("posttune_test_optim.Evil", "train.optimizer._component_")
    with pytest.raises(ConfigError, match="refusing 'posttune_sft.posttune_register_methods': it is outside "):
        import_dotted("posttune_sft.posttune_register_methods", "x._component_")  # not installed in this test


# ---- the probe: a nested component that runs a shell command ------------------------------------

PROBE = "train.optimizer={_component_: torch.optim.SGD, momentum: {_component_: torch.utils.collect_env.run, " \
        "command: 'id > PWNED'}}"
PROBE_REFUSAL = ("posttune: error: config: train.optimizer.momentum._component_: refusing "
                 "'torch.utils.collect_env.run': it is a function, not an optimizer or LR scheduler class; ")


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_a_nested_shell_command_is_refused_in_one_line(fake_plugin, posttune_cli, config_file, tmp_path,
                                                       monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    result = posttune_cli(command, str(config_file), PROBE)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(PROBE_REFUSAL) and result.stderr.endswith(OPT_IN + "\n")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "PWNED").exists()


def test_train_refuses_a_nested_shell_command_before_anything_runs(llama_sft, posttune_cli, tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(sft_config(tmp_path, rows=4, train={"max_steps": 1, "device": "cpu"})))
    monkeypatch.chdir(tmp_path)
    result = posttune_cli("train", str(path), PROBE)
    assert result.exit_code == 2 and result.stderr.startswith(PROBE_REFUSAL)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out").exists()


def test_instantiate_refuses_it_again_without_validate(tmp_path):
    from posttune.config.schema import TrainConfig
    from posttune.training.optim import build_optimizer

    marker = tmp_path / "ran"
    train = TrainConfig(optimizer={"_component_": "torch.optim.SGD", "momentum": {
        "_component_": "torch.utils.collect_env.run", "command": f"touch {marker}"}})
    with pytest.raises(ConfigError, match="config: train.optimizer.momentum._component_: refusing "):
        build_optimizer([("w", torch.nn.Parameter(torch.zeros(2, 2)))], train)
    assert not marker.exists()


def test_instantiate_gates_the_whole_tree_before_it_calls_anything(posttune_plugins):
    """The refused outer component is found before the nested one is built (which would fail: no optimizer)."""
    node = {"_component_": "torch.utils.collect_env.run", "command": "true",
            "x": {"_component_": "torch.optim.lr_scheduler.LRScheduler"}}
    with pytest.raises(ConfigError, match="config: opt._component_: refusing 'torch.utils.collect_env.run'"):
        instantiate(node, where="opt")


def test_the_opt_in_still_lets_anything_through(posttune_plugins, monkeypatch):
    monkeypatch.setenv(TRUST_ENV, "1")
    assert import_dotted("torch.utils.collect_env.run", "train.optimizer.momentum._component_") is \
        sys.modules["torch.utils.collect_env"].run
    assert import_dotted("torch.nn.Linear", "train.optimizer._component_") is torch.nn.Linear



def test_a_module_beside_the_config_is_found_as_python_m_finds_it(posttune_plugins, monkeypatch, tmp_path):
    """The console script's sys.path has no working directory: `mycomp.MySGD` needed PYTHONPATH=$PWD."""
    (tmp_path / "beside_optim.py").write_text("import torch\n\n\nclass MySGD(torch.optim.SGD):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "beside_optim", raising=False)
    with pytest.raises(ConfigError, match=f"refusing 'beside_optim.MySGD': .*{OPT_IN}"):  # the gate still holds
        import_dotted("beside_optim.MySGD", "train.optimizer._component_")
    assert "beside_optim" not in sys.modules  # refused before its code ran
    monkeypatch.setenv(TRUST_ENV, "1")
    assert import_dotted("beside_optim.MySGD", "train.optimizer._component_").__name__ == "MySGD"
    assert sys.path[-1] == str(tmp_path)  # after the installed packages: it shadows none of them
