"""Property-based: a `_component_` that names anything torch, torchao, posttune or a first-party plugin re-exports
from os/subprocess/shutil/builtins, or a function of theirs that wraps one, is refused by `check_components` at any
depth under any field, naming that field, and nothing runs. Deterministic (``derandomize``)."""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import types
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttune.config import validate
from posttune.config.components import COMPONENT, TRUST_ENV, check_components
from posttune.errors import ConfigError

OPT_IN = "if you trust this config, pass --trust-components or set POSTTUNE_TRUST_COMPONENTS=1"


@pytest.fixture(autouse=True)
def untrusted(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)


@pytest.fixture
def first_party_and_fake(fake_plugin, register_plugin):
    """The fake plugin (for validate) and every installed first-party plugin (their packages trusted)."""
    for ep in first_party():
        with contextlib.suppress(Exception):  # posttune records a plugin that fails to load; so does this
            register_plugin(ep.load(), name=ep.name, distribution=ep.dist.name, version=ep.dist.version)


#: modules whose functions start programs, touch files or run code, and what a config would call in them
DANGER = {"os": ("system", "popen", "execv", "spawnv", "remove", "unlink", "rmdir", "rename", "kill"),
          "posix": ("system", "remove"), "subprocess": ("run", "Popen", "check_output", "check_call", "call"),
          "shutil": ("rmtree", "move", "copyfile", "which"), "builtins": ("exec", "eval", "open", "compile"),
          "pty": ("spawn",), "sys": ("exit",), "pathlib": ("Path",)}
RE_EXPORTED = {*DANGER, "nt", "posixpath", "genericpath", "io", "_io", "tempfile", "signal", "socket", "runpy",
               "importlib", "pickle", "_pickle", "ctypes", "glob", "webbrowser", "multiprocessing"}
#: names in a function's code that mean it wraps a program or a file change (torch.utils.collect_env.run: Popen)
WRAPS = {"subprocess", "Popen", "system", "popen", "check_output", "check_call", "getoutput", "execv", "execvp",
         "spawnv", "rmtree", "unlink", "remove", "rmdir", "write_text", "write_bytes", "urlopen", "run_path"}


def _names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


@functools.cache
def dangerous_paths() -> tuple[str, ...]:
    """Public dotted paths in torch, torchao, posttune and the first-party plugins' loaded modules that name a
    function of ``RE_EXPORTED`` modules, a function whose code mentions ``WRAPS``, or ``DANGER`` through a
    re-exported module (``torch.os.system``). Module dicts are read, not getattr'd: nothing lazy runs."""
    import importlib
    import pkgutil

    import torch.utils.collect_env  # noqa: F401 - the probe's module

    tops = {"torch", "torchao", "posttune", *(ep.value.split(":")[0].split(".")[0] for ep in first_party())}
    for package in sorted(tops - {"torch", "torchao"}):  # every module of posttune and of its plugins
        with contextlib.suppress(Exception):  # a plugin that fails to load is not trusted either
            root = importlib.import_module(package)
            for info in pkgutil.walk_packages(root.__path__, f"{package}.", onerror=lambda _: None):
                with contextlib.suppress(Exception):  # an optional dependency missing
                    importlib.import_module(info.name)
    with contextlib.suppress(ImportError):
        importlib.import_module("torchao.optim")
    found = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases warn when touched
        for module_name, module in list(sys.modules.items()):
            found |= _dangerous_in(module_name, module, tops)
    return tuple(sorted(found))


def _dangerous_in(module_name: str, module: object, tops: set[str]) -> set[str]:
    if module_name.split(".")[0] not in tops or not _public(module_name) or not isinstance(module, types.ModuleType):
        return set()
    found = set()
    for name, value in list(vars(module).items()):
        if name.startswith("_") or not name.isidentifier():  # pytest's rewritten modules hold `@py_builtins`
            continue
        if isinstance(value, types.ModuleType) and value.__name__ in DANGER:
            found |= {f"{module_name}.{name}.{f}" for f in DANGER[value.__name__] if hasattr(value, f)}
        elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)) and (
                getattr(value, "__module__", None) in RE_EXPORTED):
            found.add(f"{module_name}.{name}")
        elif isinstance(value, types.FunctionType) and value.__module__ == module_name and (
                _names(value.__code__) & WRAPS):
            found.add(f"{module_name}.{name}")
    return found


def first_party():
    from importlib import metadata

    return [ep for ep in metadata.entry_points(group="posttune")
            if ep.dist is not None and ep.dist.name.startswith("posttune-")]


def test_the_fuzz_targets_are_found():
    paths = dangerous_paths()
    assert "torch.utils.collect_env.run" in paths and "torch.os.system" in paths
    assert any(path.startswith("posttune.") and path.split(".")[-2] not in DANGER and not path.endswith(".Path")
               for path in paths)  # posttune's own helpers that write or delete files
    assert len(paths) > 100


#: audit events of a started program or a changed file (the hook stays for the process; it records only when asked)
EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.kill",
          "os.remove", "os.rmdir", "os.rename", "os.truncate", "shutil.rmtree", "shutil.move", "shutil.copyfile",
          "pty.spawn", "os.startfile")
AUDITED: list[tuple[str, tuple]] = []
_recording = [False]


def _audit(event: str, args: tuple) -> None:
    if not _recording[0]:
        return
    writes = event == "open" and len(args) > 1 and isinstance(args[1], str) and set(args[1]) & set("wax+")
    if event in EVENTS or writes:
        AUDITED.append((event, args))


@contextlib.contextmanager
def recording():
    if not getattr(sys, "_posttune_gate_audit", False):
        sys.addaudithook(_audit)
        sys._posttune_gate_audit = True
    AUDITED.clear()
    _recording[0] = True
    try:
        yield AUDITED
    finally:
        _recording[0] = False


#: where a config may hold a _component_ (free-form settings included); the first two must be components
FIELDS = ["train.optimizer", "train.scheduler", "train.optimizer.x", "train.scheduler.x", "method.x",
          "model.build_overrides.x", "models.reference.build_overrides.x", "models.teacher.build_overrides.x",
          "parallel.options.fsdp.x", "memory_options.ckpt.x", "logging_options.tb.x"]
KEYS = st.sampled_from(["momentum", "betas", "params", "lr_lambda", "schedulers", "x", "hook", "command", "a"])
PLAIN = st.none() | st.integers() | st.text(max_size=4) | st.lists(st.integers(), max_size=2)
WRAPPERS = ["torch.optim.SGD", "torch.optim.AdamW", "torch.optim.lr_scheduler.StepLR"]
BASE = {"model": {"family": "fam", "size": "tiny"}, "method": {"name": "fsft"},
        "data": {"train": {"path": "d.jsonl", "format": "chat"}},
        "train": {"optimizer": {COMPONENT: "torch.optim.SGD"},
                  "scheduler": {COMPONENT: "torch.optim.lr_scheduler.ConstantLR"}},  # both bind as they are
        "models": {"reference": {"family": "fam", "size": "tiny"}, "teacher": {"path": "t"}}}


@st.composite
def nested(draw, target: str, marker: str) -> tuple[object, str]:
    """The dangerous component inside layers of mappings, lists and allowed components; and its path from the top."""
    node: object = {COMPONENT: target, "command": f"touch {marker}", "path": marker}
    suffix = ""
    for layer in draw(st.lists(st.sampled_from(["mapping", "list", "component"]), max_size=4)):
        key = draw(KEYS)
        if layer == "list":
            before, after = draw(st.lists(PLAIN, max_size=2)), draw(st.lists(PLAIN, max_size=2))
            node, suffix = [*before, node, *after], f"[{len(before)}]{suffix}"
            continue
        siblings = draw(st.dictionaries(st.sampled_from(["lr", "y", "z"]), PLAIN, max_size=2))
        outer = {COMPONENT: draw(st.sampled_from(WRAPPERS))} if layer == "component" else {}
        node, suffix = {**outer, **siblings, key: node}, f".{key}{suffix}"
    return node, suffix


def place(raw: dict, field: str, node: object) -> None:
    *parents, last = field.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    raw[last] = node


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_a_dangerous_component_is_refused_at_any_depth_under_any_field(first_party_and_fake, tmp_path, data):
    marker = tmp_path / "ran"
    target = data.draw(st.sampled_from(dangerous_paths()), label="target")
    node, suffix = data.draw(nested(target, str(marker)), label="node")
    field = data.draw(st.sampled_from(FIELDS), label="field")
    if field in ("train.optimizer", "train.scheduler") and not (isinstance(node, dict) and COMPONENT in node):
        key = data.draw(KEYS, label="key")
        node, suffix = {COMPONENT: data.draw(st.sampled_from(WRAPPERS)), key: node}, f".{key}{suffix}"
    raw = copy.deepcopy(BASE)
    place(raw, field, node)
    with recording() as audited, pytest.raises(ConfigError) as error:
        check_components(validate(raw))
    assert str(error.value).startswith(f"config: {field}{suffix}._component_: refusing '{target}'")
    assert str(error.value).endswith(OPT_IN) and "\n" not in str(error.value)
    assert audited == [] and not marker.exists()

