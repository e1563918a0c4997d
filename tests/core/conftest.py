"""Fixtures for core tests: fake installed distributions, and one plugin that registers every kind."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from posttune.descriptors import (AdapterKind, CheckpointConverter, MemoryTechnique, MeshDim, Method, ModelFamily,
                                  ParallelPlan)
from posttune.errors import ConfigError
from posttune.plugins import hookimpl


@pytest.fixture(autouse=True)
def run_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each core test runs in a folder of its own (not ``tmp_path``, which tests list) that holds
    ``d.jsonl``, the chat data their configs name: validate checks that every data file exists.
    Relative output directories land there too."""
    folder = tmp_path_factory.mktemp("cwd")
    row = {"messages": [{"role": "user", "content": "Reverse: AB"}, {"role": "assistant", "content": "BA"}]}
    (folder / "d.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the Arrow cache of local files inside the test's folder (data tests: ``pytestmark``)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """``fake_distribution(dist, module, source, version="1.0", requires=())`` installs a plugin distribution.

    It writes ``MODULE.py`` and a ``.dist-info`` with a ``posttune`` entry point into a folder on
    ``sys.path``, so ``importlib.metadata`` discovers it exactly as it would a pip-installed one.
    """
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def make(dist: str, module: str, source: str, version: str = "1.0", entry: str | None = None,
             requires: tuple[str, ...] = ()) -> str:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        requirements = "".join(f"Requires-Dist: {text}\n" for text in requires)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n{requirements}")
        (info / "entry_points.txt").write_text(f"[posttune]\n{entry or module} = {module}\n")
        sys.modules.pop(module, None)
        make.made.add(dist)
        return module

    make.made = set()
    yield make
    for path in root.glob("*.py"):
        sys.modules.pop(path.stem, None)


@pytest.fixture
def installed(fake_distribution, posttune_plugins):
    """A plugin set (built-ins plus the fake distributions' entry points), active for the test. It asks for
    ``posttune_plugins`` so that its swap is undone first, whatever other fixture the test asks for (with
    ``posttune_cli`` alone, the isolated set was restored over the process's and stayed for later tests)."""
    from posttune.plugins import entry_points, load_entry_points, new_plugin_set, set_plugins

    made = []

    def load():
        plugins = new_plugin_set()
        eps = [ep for ep in entry_points() if ep.dist and ep.dist.name in fake_distribution.made]
        load_entry_points(plugins, eps)
        made.append(set_plugins(plugins))
        return plugins

    yield load
    if made:
        set_plugins(made[0])



def noop(*_):
    return None


@dataclass(frozen=True)
class FakeDPOConfig:
    beta: float = 0.1


class FakePlugin:
    """Everything a plan can name, registered from one object (a class works as well as a module)."""

    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_model_families(self, register):
        register(ModelFamily("fam", ("FamForCausalLM",), dict, dict, sizes={"tiny": {}},
                             lora_targets=("q", "v")))

    @hookimpl
    def posttune_register_checkpoint_converters(self, register):
        register(CheckpointConverter("fam", "hf", noop, noop))

    @hookimpl
    def posttune_register_methods(self, register):
        register(Method("fsft", dict, "sft", data=noop, loss=noop))
        register(Method("fdpo", FakeDPOConfig, "preference", data=noop, loss=noop, roles=("reference",)))

    @hookimpl
    def posttune_register_parallel_plans(self, register):
        register(ParallelPlan("fsdp", noop, mesh_dim=MeshDim("dp_shard", order=10, splits="batch"), order=100))
        register(ParallelPlan("tensor", noop, mesh_dim=MeshDim("tp", order=30), order=10))
        register(ParallelPlan("lossp", noop, order=20, requires=("tensor",)))

    @hookimpl
    def posttune_register_adapter_kinds(self, register):
        register(AdapterKind("fadapt", noop, noop, noop, noop))

    @hookimpl
    def posttune_register_memory_techniques(self, register):
        register(MemoryTechnique("ckpt", "parallelize", noop, order=50))
        register(MemoryTechnique("offload", "parallelize", noop, order=60, requires=("ckpt",)))
        register(MemoryTechnique("opt_bwd", "optimizer", noop, conflicts=("offload",),
                                 validate=refuse_accumulation))


def refuse_accumulation(config):
    if config.train.grad_accum_steps > 1:
        raise ConfigError("train.grad_accum_steps", "opt_bwd cannot accumulate gradients; set it to 1")


@pytest.fixture
def fake_plugin(register_plugin, posttune_plugins):
    """The registry with FakePlugin registered as distribution posttune-fake 9.9."""
    register_plugin(FakePlugin(), name="fake", distribution="posttune-fake", version="9.9")
    return posttune_plugins.registry
