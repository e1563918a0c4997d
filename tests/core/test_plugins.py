"""The plugin manager: discovery, isolation of broken plugins, API versions, duplicates, filters."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from posttune.descriptors import DatasetFormat, MemoryTechnique, Method, ModelFamily, RewardFunction
from posttune.errors import PluginError, PosttuneError, UnknownNameError
from posttune.plugins import get_plugins, module_plugin, problems
from posttune.testing import run_cli

FAMILY_PLUGIN = """
from posttune import hookimpl
from posttune.descriptors import ModelFamily
POSTTUNE_PLUGIN_API = 2

@hookimpl
def posttune_register_model_families(register):
    register(ModelFamily("{name}", ("{arch}",), dict, dict))
"""


def family(name: str, arch: str = "XForCausalLM") -> ModelFamily:
    return ModelFamily(name, (arch,), from_hf_config=dict, build=dict)


def test_builtins_register_dataset_formats_and_commands(posttune_plugins):
    registry = posttune_plugins.registry
    assert registry.names("dataset_format") == ["alpaca", "chat", "completion", "preference", "preference_text",
                                               "prompt", "text"]
    assert {"plugins", "ls", "cp", "validate", "plan", "train", "download"} <= set(registry.names("command"))
    provenance = registry.lookup("dataset_format", "chat").provenance
    assert provenance.distribution == "posttune"


def test_entry_point_plugin_is_discovered_with_its_distribution(fake_distribution, installed):
    fake_distribution("fake-models", "fake_models", FAMILY_PLUGIN.format(name="fam", arch="FamForCausalLM"),
                      version="2.3")
    registry = installed().registry
    provenance = registry.lookup("model_family", "fam").provenance
    assert (provenance.distribution, provenance.version, provenance.plugin) == ("fake-models", "2.3", "fake_models")


def test_plugin_that_raises_on_import_is_reported_and_skipped(fake_distribution, installed):
    fake_distribution("fake-broken", "fake_broken", "raise RuntimeError('boom at import')")
    fake_distribution("fake-good", "fake_good", FAMILY_PLUGIN.format(name="good", arch="G"))
    installed()
    result = run_cli("plugins", "--json")
    assert result.exit_code == 0
    report = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert report["fake_broken"]["error"] == "RuntimeError: boom at import"
    assert report["fake_broken"]["distribution"] == "fake-broken"
    assert report["fake_good"]["registers"] == {"families": ["good"]}
    text = run_cli("plugins").stdout
    assert "fake-broken 1.0  (fake_broken)\n  FAILED TO LOAD: RuntimeError: boom at import" in text
    assert run_cli("ls", "families").exit_code == 0  # unrelated commands keep working


def test_missing_name_from_a_broken_first_party_plugin_says_why(posttune_plugins, fake_distribution, installed):
    fake_distribution("posttune-qwen", "fake_qwen", "import not_a_module_anywhere", entry="qwen")
    registry = installed().registry
    with pytest.raises(UnknownNameError) as error:
        registry.get("model_family", "qwen2")
    message = str(error.value)
    assert "posttune-qwen is installed but failed to load: ModuleNotFoundError" in message
    assert message.endswith("pip install posttune-qwen")


def test_misspelled_hook_is_refused_naming_the_hook(fake_distribution, installed):
    fake_distribution("fake-typo", "fake_typo", """
        from posttune import hookimpl
        POSTTUNE_PLUGIN_API = 2

        @hookimpl
        def posttune_register_model_familys(register):
            pass
    """)
    info = installed().plugins["fake_typo"]
    assert info.error == ("unknown hook 'posttune_register_model_familys' "
                          "(did you mean 'posttune_register_model_families'?)")
    assert "FAILED TO LOAD: unknown hook 'posttune_register_model_familys'" in run_cli("plugins").stdout


def test_hook_with_wrong_argument_is_refused(register_plugin):
    plugin = module_plugin("wrongarg", posttune_register_methods=lambda registry: None)
    info = register_plugin(plugin, distribution="wrongarg-dist", broken=True)
    assert info.error == ("hook 'posttune_register_methods': Argument(s) {'registry'} are declared in the "
                          "hookimpl but can not be found in the hookspec")


@pytest.mark.parametrize("api, error", [
    (1, "built for plugin API 1; this posttune speaks 2"),
    (3, "built for plugin API 3; this posttune speaks 2"),
    (None, "declares no POSTTUNE_PLUGIN_API; this posttune speaks plugin API 2"),
])
def test_incompatible_plugin_api_is_refused(fake_distribution, installed, api, error):
    line = "" if api is None else f"POSTTUNE_PLUGIN_API = {api}"
    fake_distribution("fake-future", "fake_future", f"{line}\n")
    info = installed().plugins["fake_future"]
    assert info.error == error
    listed = run_cli("plugins").stdout
    assert f"FAILED TO LOAD: {error}" in listed


def test_hook_with_an_argument_the_spec_lacks_gets_pluggys_message(register_plugin):
    plugin = module_plugin("extra_arg", posttune_register_methods=lambda register, extra: None)
    info = register_plugin(plugin, distribution="extra-dist", broken=True)
    assert info.error == ("hook 'posttune_register_methods': Argument(s) {'extra'} are declared in the "
                          "hookimpl but can not be found in the hookspec")


def test_function_named_like_a_hook_without_hookimpl_is_warned_about(register_plugin, posttune_cli):
    plugin = module_plugin("forgot", posttune_register_configs=lambda register: None)
    plugin.posttune_register_methods = lambda register: None  # no @hookimpl: pluggy never calls it
    info = register_plugin(plugin, distribution="forgot-dist")
    assert info.error is None
    assert info.warnings == ["'posttune_register_methods' is named like a hook but lacks @hookimpl, so it is "
                             "never called (a hook of this name exists)"]
    assert "warning: 'posttune_register_methods' is named like a hook" in posttune_cli("plugins").stdout
    report = json.loads(posttune_cli("plugins", "--json").stdout)
    assert [p["warnings"] for p in report["plugins"] if p["name"] == "forgot"] == [info.warnings]


def test_a_plugin_built_for_another_posttune_is_named_by_plugins_and_help(fake_distribution, installed):
    """pip refuses to install it so; ``--no-deps``, or an upgraded core under installed plugins, does not."""
    fake_distribution("acme-old", "acme_old", FAMILY_PLUGIN.format(name="old", arch="O"), version="0.4",
                      requires=("posttune<0.1,>=0.0.1", "torch", "posttune>=9; extra == 'future'"))
    fake_distribution("acme-new", "acme_new", FAMILY_PLUGIN.format(name="new", arch="N"), version="1.0",
                      requires=("posttune>=0.1,<0.2",))
    plugins = installed()
    assert plugins.registry.get("model_family", "old").name == "old"  # it loads: a warning, not a refusal
    warning = ("plugin acme_old from acme-old 0.4 requires posttune<0.1,>=0.0.1, but posttune 0.1.0 is installed: "
               "it may fail; install a version of acme-old that matches")
    assert problems(plugins) == [warning]  # what `posttune plugins` lists, and `ls` and `--help` warn of


def test_unknown_name_mentions_a_third_party_plugin_that_failed_to_load(fake_distribution, installed):
    fake_distribution("acme-methods", "acme_methods", "raise ImportError('needs acme-kernels')\n")
    registry = installed().registry
    with pytest.raises(PosttuneError) as error:
        registry.get("method", "acme_rl")
    assert str(error.value).endswith("; installed plugins that failed to load, which may provide it: acme-methods "
                                     "(ImportError: needs acme-kernels)")


def test_a_name_one_plugin_registers_twice_says_so(fake_distribution, installed):
    twice = FAMILY_PLUGIN.format(name="twin", arch="A") + '    register(ModelFamily("twin", ("B",), dict, dict))\n'
    fake_distribution("fake-one", "fake_one", twice, version="1.0")
    with pytest.raises(PluginError) as caught:
        installed().registry.get("model_family", "twin")
    assert str(caught.value) == ("model family 'twin' is registered twice by fake-one 1.0; its registration hook must "
                                 "register each name once")


def test_duplicate_name_is_an_error_naming_both_distributions(fake_distribution, installed):
    fake_distribution("fake-one", "fake_one", FAMILY_PLUGIN.format(name="twin", arch="A"), version="1.0")
    fake_distribution("fake-two", "fake_two", FAMILY_PLUGIN.format(name="twin", arch="B"), version="2.0")
    registry = installed().registry
    with pytest.raises(PluginError, match="model family 'twin' is registered by both fake-one 1.0 and fake-two 2.0"):
        registry.get("model_family", "twin")
    report = json.loads(run_cli("plugins", "--json").stdout)
    assert report["problems"] == [
        "model family 'twin' is registered by both fake-one 1.0 and fake-two 2.0; "
        "uninstall one, or pick one with POSTTUNE_DISABLE_PLUGINS"
    ]


def test_registration_hook_that_raises_isolates_that_plugin(register_plugin, posttune_plugins):
    def broken(register):
        register(family("half"))
        raise ValueError("bad registration")

    register_plugin(module_plugin("broken", posttune_register_model_families=broken), distribution="broken-dist",
                    broken=True)
    register_plugin(module_plugin("fine", posttune_register_model_families=lambda register: register(family("ok"))))
    registry = posttune_plugins.registry
    assert registry.names("model_family") == ["ok"]  # nothing half-registered
    assert registry.failed["broken"] == ("broken-dist", "ValueError in posttune_register_model_families: bad "
                                                        "registration")


def test_register_object_checks_the_descriptor_type(register_plugin, posttune_plugins):
    wrong = module_plugin("wrong", posttune_register_methods=lambda register: register(family("oops")))
    register_plugin(wrong, distribution="wrong-dist", version="0.3", broken=True)
    assert posttune_plugins.registry.failed["wrong"][1] == (
        "posttune_register_methods: given a ModelFamily; expected a Method")


def _noop(*args, **kwargs):
    return None


@dataclasses.dataclass(frozen=True)
class PathOptions:
    where: pathlib.Path = pathlib.Path(".")  # no config can set a Path


class NotADataclass:
    power: float = 1.0


@pytest.mark.parametrize(("hook", "descriptor", "problem"), [
    ("posttune_register_model_families", lambda: ModelFamily("strarch", "StrArchForCausalLM", dict, dict),
     "ModelFamily 'strarch': architectures: expected a tuple of strings, got 'StrArchForCausalLM' (a 1-tuple needs "
     "its comma: ('x',))"),
    ("posttune_register_methods", lambda: Method("m", dict, "sft", data=None, loss=_noop),
     "Method 'm': data: expected a function, got None"),
    ("posttune_register_methods", lambda: Method("m", dict, "sft", data=_noop, loss=_noop, roles=("reference")),
     "Method 'm': roles: expected a tuple of roles (or a function of the config), got 'reference' (a 1-tuple needs "
     "its comma: ('x',))"),
    ("posttune_register_methods", lambda: Method("m", dict, 42, data=_noop, loss=_noop),
     "Method 'm': dataset_kind: expected a kind's name or a tuple of them, got 42"),
    ("posttune_register_methods", lambda: Method("m", {"beta": 1}, "sft", data=_noop, loss=_noop),
     "Method 'm': config: expected a dataclass (the class itself), got {'beta': 1}"),
    ("posttune_register_reward_functions", lambda: RewardFunction("mine", _noop, config=NotADataclass),
     "RewardFunction 'mine': config: expected a dataclass (the class itself), got "),
    ("posttune_register_reward_functions", lambda: RewardFunction("mine", _noop, config=PathOptions),
     "RewardFunction 'mine': config field where: <class 'pathlib.Path'> cannot be read from a config (use str, int, "
     "float, bool, Literal, list, dict or a dataclass)"),
    ("posttune_register_reward_functions", lambda: RewardFunction("Bad Name!", _noop),
     "RewardFunction 'Bad Name!': name 'Bad Name!': letters, digits, '_', '.' and '-' only"),
    ("posttune_register_reward_functions", lambda: RewardFunction("mine", "not callable"),
     "RewardFunction 'mine': fn: expected a function, got 'not callable'"),
    ("posttune_register_memory_techniques", lambda: MemoryTechnique("mine", "nostage", _noop),  # plan: a KeyError
     "MemoryTechnique 'mine': stage: expected one of 'build', 'adapt', 'quantize', 'parallelize', 'load', "
     "'optimizer', 'loss', got 'nostage'"),
    ("posttune_register_memory_techniques", lambda: MemoryTechnique("mine", "loss", _noop, frozen="bogus"),
     "MemoryTechnique 'mine': frozen: expected one of 'apply', 'skip', 'refuse', got 'bogus'"),
    ("posttune_register_memory_techniques", lambda: MemoryTechnique("mine", "loss", _noop, order="first"),
     "MemoryTechnique 'mine': order: expected an integer, got 'first'"),
])
def test_a_descriptor_with_an_unusable_field_fails_its_plugin_at_registration(register_plugin, posttune_plugins,
                                                                               hook, descriptor, problem):
    """Each of these registered before and failed later, mid-run or with a traceback naming no plugin."""
    register_plugin(module_plugin("broken", **{hook: lambda register: register(descriptor())}), distribution="acme",
                    broken=True)
    error = posttune_plugins.registry.failed["broken"][1]
    assert error.startswith(f"{hook}: {problem}"), error


def test_unknown_name_suggests_and_gives_the_install_line(register_plugin, posttune_plugins):
    register_plugin(module_plugin("fams", posttune_register_model_families=lambda register: register(family("llama"))))
    registry = posttune_plugins.registry
    with pytest.raises(UnknownNameError) as missing:
        registry.get("model_family", "gemma2")
    assert str(missing.value) == ("no model family 'gemma2' is installed (installed: llama)"
                                  " — pip install posttune-gemma")
    with pytest.raises(UnknownNameError, match=r"did you mean 'llama'\?"):
        registry.get("model_family", "lama")
    with pytest.raises(UnknownNameError, match=r"no dataset format 'sharegpt' is installed"):
        registry.get("dataset_format", "sharegpt")


@pytest.mark.parametrize("env, expected", [
    ({"POSTTUNE_LOAD_PLUGINS": "fake-a"}, {"a"}),
    ({"POSTTUNE_LOAD_PLUGINS": ""}, set()),
    ({"POSTTUNE_DISABLE_PLUGINS": "fake_b"}, {"a"}),
    ({"POSTTUNE_LOAD_PLUGINS": "fake-a,fake-b", "POSTTUNE_DISABLE_PLUGINS": "fake-a"}, {"b"}),
    ({}, {"a", "b"}),
])
def test_load_and_disable_environment_variables(fake_distribution, installed, monkeypatch, env, expected):
    monkeypatch.delenv("POSTTUNE_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("POSTTUNE_DISABLE_PLUGINS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fake_distribution("fake-a", "fake_a", FAMILY_PLUGIN.format(name="a", arch="A"))
    fake_distribution("fake-b", "fake_b", FAMILY_PLUGIN.format(name="b", arch="B"))
    assert set(installed().registry.names("model_family")) == expected


def test_entry_points_load_once_per_process(fake_distribution, monkeypatch):
    import posttune.plugins as plugins_module

    fake_distribution("fake-counted", "fake_counted",
                      "import builtins\nbuiltins.LOADS = getattr(builtins, 'LOADS', 0) + 1\nPOSTTUNE_PLUGIN_API = 1\n")
    import builtins

    monkeypatch.setattr(plugins_module, "_current", None)
    monkeypatch.setattr(builtins, "LOADS", 0, raising=False)
    first = get_plugins()
    assert get_plugins() is first
    assert "fake_counted" in first.plugins
    assert builtins.LOADS == 1


def test_dataset_format_registered_by_a_test_plugin_is_listed(register_plugin, posttune_cli):
    def register(register):
        register(DatasetFormat("csvqa", "sft", lambda row: row["q"], ("q",), "questions from a CSV"))

    register_plugin(module_plugin("qa", posttune_register_datasets=register), distribution="qa-dist", version="0.2")
    out = posttune_cli("ls", "datasets").stdout
    assert re.search(r"^csvqa +qa-dist 0.2  questions from a CSV$", out, re.MULTILINE)


def test_reward_functions_are_registered_and_callable(register_plugin, posttune_plugins, posttune_cli):
    from posttune.descriptors import RewardFunction

    def exact(prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    register_plugin(module_plugin("rewards", posttune_register_reward_functions=lambda register: register(
        RewardFunction("exact_answer", exact, "1 when the completion is the answer"))), distribution="rw", version="1")
    reward = posttune_plugins.registry.get("reward_function", "exact_answer")
    assert reward.fn(["q", "q"], [" 4", "5"], answer=["4", "4"]) == [1.0, 0.0]
    assert "exact_answer  rw 1  1 when the completion is the answer" in posttune_cli("ls", "rewards").stdout


def test_a_name_in_another_case_is_suggested_as_written():
    """``method: GRPO`` (as papers and TRL class names spell it): the suggestion is the registered name."""
    from posttune.errors import did_you_mean

    assert did_you_mean("GRPO", ["dpo", "grpo", "sft"]) == " (did you mean 'grpo'?)"
    assert did_you_mean("DPO", ["dpo", "kto"]) == " (did you mean 'dpo'?)"
    assert did_you_mean("zzz", ["dpo", "kto"]) == ""


def test_register_plugin_fails_the_test_on_a_plugin_that_does_not_load(tmp_path):
    """For plugin authors: a hook that raises fails the test that registers it, with the reason, instead of a
    later 'no family' or a silently missing registration; ``broken=True`` keeps it for a test of that failure."""
    (tmp_path / "test_mine.py").write_text(textwrap.dedent('''
        import types
        from posttune.plugin import hookimpl

        def plugin():
            @hookimpl
            def posttune_register_model_families(register):
                raise RuntimeError("forgot an argument")
            return types.SimpleNamespace(POSTTUNE_PLUGIN_API=2, __name__="mine",
                                         posttune_register_model_families=posttune_register_model_families)

        def test_registers(register_plugin):
            register_plugin(plugin(), distribution="posttune-mine")

        def test_broken_on_purpose(register_plugin):
            assert "forgot an argument" in register_plugin(plugin(), broken=True).error
    '''))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in result.stdout, result.stdout
    assert ("plugin mine failed to load: RuntimeError in posttune_register_model_families: forgot an argument"
            in result.stdout)


def test_an_unknown_registry_kind_names_the_kinds(posttune_plugins):
    """``lookup("engines", ...)`` (posttune ls's plural) was a bare KeyError('engines')."""
    from posttune.errors import PluginError

    with pytest.raises(PluginError, match=r"^no registry kind 'engines' \(did you mean 'generation_engine'\?\); "
                                          r"the kinds: model_family, "):
        posttune_plugins.registry.get("engines", "builtin")
    with pytest.raises(PluginError, match=r"^no registry kind 'methd' \(did you mean 'method'\?\)"):
        posttune_plugins.registry.names("methd")
