"""A broken plugin never stops the CLI: it is named wherever plugins are listed, and only a command
that needs it fails (exit 2, one line naming it).

Each case installs fake distributions (a ``.dist-info`` with a ``posttune`` entry point on
``sys.path``) and runs the CLI as a fresh process would: plugins are discovered and imported inside
the call. One test runs the installed console script in a subprocess, where the bug was seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from posttune import __version__
from posttune.cli.commands import LS_KINDS
from posttune.testing import run_cli

METHOD = """
from posttune import hookimpl
from posttune.descriptors import Method
POSTTUNE_PLUGIN_API = 2

def noop(*_):
    return None

@hookimpl
def posttune_register_methods(register):
    {body}
"""

COMMAND = """
from posttune import hookimpl
from posttune.descriptors import Command
POSTTUNE_PLUGIN_API = 2

def configure(parser):
    {configure}

@hookimpl
def posttune_register_commands(cli):
    cli(Command("{name}", "a plugin's command", configure, lambda args: print("ran") or 0))
"""


def method_plugin(*names: str, then: str = "pass") -> str:
    """A plugin registering methods ``names``, then running ``then`` inside its registration hook."""
    body = "\n    ".join([*(f"register(Method({n!r}, dict, 'sft', data=noop, loss=noop))" for n in names), then])
    return METHOD.format(body=body)


@dataclass(frozen=True)
class Case:
    dists: dict[str, str]  # distribution -> its module's source (module acme_<dist suffix>)
    problem: str  # the one line `plugins`, `ls` and `--help` name it with
    method: str  # a method the broken plugin provides: a config naming it cannot run
    refusal: str  # what the one-line error of that config says
    kind: str | None = None  # the `ls` kind the problem is about; None: any (a plugin that failed may provide any)

    def install(self, fake_distribution) -> None:
        for dist, source in self.dists.items():
            fake_distribution(dist, dist.replace("-", "_"), source)


def failed(error: str, source: str) -> Case:
    """acme-broken (``source``) fails with ``error``; it would have registered method acme_rl."""
    return Case({"acme-broken": source}, f"plugin acme_broken from acme-broken 1.0 failed to load: {error}",
                "acme_rl", f"installed plugins that failed to load, which may provide it: acme-broken ({error})")


DUPLICATE = ("method 'twin' is registered by both acme-one 1.0 and acme-two 1.0; "
             "uninstall one, or pick one with POSTTUNE_DISABLE_PLUGINS")
BROKEN = {
    "ImportError at import": failed("ImportError: needs acme-kernels", "raise ImportError('needs acme-kernels')"),
    "sys.exit(7) at import": failed("SystemExit: 7", "import sys\nsys.exit(7)"),
    "custom BaseException at import": failed(
        "PluginPanic: gave up", "class PluginPanic(BaseException):\n    pass\n\nraise PluginPanic('gave up')"),
    "GeneratorExit at import": failed("GeneratorExit: odd", "raise GeneratorExit('odd')"),
    "SystemExit in a registration hook": failed("SystemExit in posttune_register_methods: 3",
                                                method_plugin("acme_rl", then="raise SystemExit(3)")),
    # pluggy reads every attribute dir() names while it checks the hooks: this one exits there
    "SystemExit while pluggy checks the hooks": failed(
        "SystemExit in registration: 5",
        "POSTTUNE_PLUGIN_API = 2\n\ndef __dir__():\n    return ['posttune_register_methods']\n\n"
        "def __getattr__(name):\n    raise SystemExit(5)"),
    "two plugins register method twin": Case(
        {"acme-one": method_plugin("twin", "solo"), "acme-two": method_plugin("twin")}, DUPLICATE, "twin", DUPLICATE,
        "methods"),
}


@pytest.fixture
def cli(monkeypatch):
    """``cli(*argv)``: the CLI in this process, loading the installed plugins afresh each call."""
    import posttune.plugins as plugins_module

    monkeypatch.setattr(plugins_module, "_current", None)

    def run(*argv: str):
        plugins_module._current = None
        for name in [m for m in sys.modules if m.startswith("acme_")]:
            del sys.modules[name]  # so each call imports them again, as a new process would
        return run_cli(*argv)

    return run


@pytest.fixture(params=list(BROKEN), ids=list(BROKEN))
def case(request, fake_distribution, monkeypatch) -> Case:
    case = BROKEN[request.param]
    case.install(fake_distribution)
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", ",".join(case.dists))
    monkeypatch.delenv("POSTTUNE_DISABLE_PLUGINS", raising=False)
    return case


def test_version_and_help_still_work(case, cli):
    version = cli("--version")
    assert (version.exit_code, version.stdout, version.stderr) == (0, f"posttune {__version__}\n", "")
    shown = cli("--help")
    assert shown.exit_code == 0
    assert shown.stdout.startswith("usage: posttune") and "plugins" in shown.stdout
    assert shown.stderr == f"posttune: warning: {case.problem}\n"


def test_plugins_lists_the_problem_and_exits_0(case, cli):
    listed = cli("plugins")
    assert listed.exit_code == 0
    assert f"\nproblem: {case.problem}\n" in listed.stdout
    report = cli("plugins", "--json")
    assert report.exit_code == 0
    assert json.loads(report.stdout)["problems"] == [case.problem]


def test_ls_of_every_kind_exits_0_and_warns(case, cli):
    for kind in LS_KINDS:
        warned = f"posttune: warning: {case.problem}\n" if case.kind in (None, kind) else ""
        for argv in (("ls", kind), ("ls", kind, "--json")):
            listed = cli(*argv)
            assert (listed.exit_code, listed.stderr) == (0, warned), argv
        json.loads(listed.stdout)


def test_ls_of_an_empty_kind_says_so_and_why(case, cli):
    listed = cli("ls", "methods")
    expected = "solo  acme-one 1.0\n" if "acme-one" in case.dists else "(no method installed)\n"
    assert (listed.exit_code, listed.stdout, listed.stderr) == (0, expected, f"posttune: warning: {case.problem}\n")
    everything = cli("ls")
    assert everything.exit_code == 0 and everything.stderr == f"posttune: warning: {case.problem}\n"


def test_a_config_that_needs_the_broken_plugin_exits_2_naming_it(case, cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS",
                       ",".join([*case.dists, "posttune-llama", "posttune-sft", "posttune-generate"]))
    refused = cli("validate", "llama-demo-reverse", f"method.name={case.method}")
    assert refused.exit_code == 2
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("posttune: error: ")
    assert case.refusal in refused.stderr
    assert cli("validate", "llama-demo-reverse").exit_code == 0  # a config that does not need it runs


def test_a_command_a_broken_plugin_would_provide_names_it(fake_distribution, cli, monkeypatch):
    fake_distribution("acme-cmd", "acme_cmd", "import sys\nsys.exit(7)")
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", "acme-cmd")
    refused = cli("acme")
    assert refused.exit_code == 2
    assert refused.stderr.startswith("posttune: error: no command 'acme' is installed (installed: ")
    assert refused.stderr.endswith("; installed plugins that failed to load, which may provide it: "
                                   "acme-cmd (SystemExit: 7)\n")


def test_a_plugin_command_whose_arguments_fail_costs_only_that_command(fake_distribution, cli, monkeypatch):
    fake_distribution("acme-cmd", "acme_cmd", COMMAND.format(name="acme", configure="raise SystemExit(4)"))
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", "acme-cmd")
    why = "command 'acme' of plugin acme_cmd from acme-cmd 1.0 failed to set up its arguments: SystemExit: 4"
    refused = cli("acme")
    assert (refused.exit_code, refused.stderr) == (2, f"posttune: error: {why}\n")
    assert cli("ls", "methods").exit_code == 0
    shown = cli("--help")
    assert shown.exit_code == 0 and shown.stderr == f"posttune: warning: {why}\n"


def test_a_plugin_command_named_like_a_core_one_does_not_displace_it(fake_distribution, cli, monkeypatch):
    fake_distribution("acme-cmd", "acme_cmd", COMMAND.format(name="ls", configure="pass"))
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", "acme-cmd")
    clash = ("command 'ls' is registered by both acme-cmd 1.0 and posttune " + __version__
             + "; posttune's own is the one run: acme-cmd 1.0 must name its command otherwise")
    listed = cli("ls", "datasets")  # the core's ls, not the plugin's (which would print "ran")
    assert (listed.exit_code, listed.stdout.split()[0]) == (0, "alpaca")
    report = cli("plugins", "--json")
    assert json.loads(report.stdout)["problems"] == [clash]
    assert cli("--help").stderr == f"posttune: warning: {clash}\n"


def test_two_distributions_with_one_entry_point_name_are_both_named(fake_distribution, cli, monkeypatch):
    fake_distribution("acme-one", "acme_one", method_plugin("solo"), entry="acme")
    fake_distribution("acme-two", "acme_two", method_plugin("other"), entry="acme")
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", "acme-one,acme-two")
    problems = json.loads(cli("plugins", "--json").stdout)["problems"]
    assert len(problems) == 1 and problems[0].startswith("plugin acme from acme-")
    assert "failed to load: entry point name 'acme' is already taken by acme-" in problems[0]


def test_what_a_plugin_prints_at_import_goes_to_stderr_not_into_json(fake_distribution, cli, monkeypatch):
    fake_distribution("acme-loud", "acme_loud", "print('hello from acme at import')\n"
                      + method_plugin("loud", then="print('hello from acme registering')"))
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", "acme-loud")
    for argv in (("plugins", "--json"), ("ls", "--json"), ("ls", "methods", "--json")):
        result = cli(*argv)
        json.loads(result.stdout)  # a print on stdout would make this raise
        assert "hello from acme at import\nhello from acme registering\n" in result.stderr
    assert cli("ls", "methods").stdout == "loud  acme-loud 1.0\n"


def test_ctrl_c_while_a_plugin_imports_still_interrupts(fake_distribution, cli, monkeypatch):
    """KeyboardInterrupt is the one exception a plugin's import may pass on: Ctrl-C is how a user
    stops a plugin that hangs at import, and it must stop the command, not skip the plugin."""
    fake_distribution("acme-slow", "acme_slow", "raise KeyboardInterrupt")
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", "acme-slow")
    interrupted = cli("ls")
    assert (interrupted.exit_code, interrupted.stderr) == (130, "posttune: interrupted\n")
    assert cli("--version").exit_code == 0  # no plugin is loaded for it


def test_version_loads_no_plugin(cli, monkeypatch):
    import posttune.plugins as plugins_module

    monkeypatch.setattr(plugins_module, "get_plugins", lambda: pytest.fail("--version loaded the plugins"))
    for argv in (["--version"], ["--debug", "--version"], ["--vers"]):
        assert cli(*argv).stdout == f"posttune {__version__}\n"


def test_the_installed_console_script_survives_a_plugin_that_exits(tmp_path):
    """The probe's case, end to end: a real entry point on PYTHONPATH, the real `posttune` script."""
    site = tmp_path / "site"
    plugins = {"acme-exit": "import sys\nsys.exit(7)\n",
               "acme-loud": "print('hello from acme at import')\n" + method_plugin("loud")}
    for dist, source in plugins.items():
        module = dist.replace("-", "_")
        info = site / f"{module}-1.0.dist-info"
        info.mkdir(parents=True)
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[posttune]\n{module} = {module}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "POSTTUNE_LOAD_PLUGINS": "acme-exit,acme-loud,posttune-llama,posttune-sft", "HF_HUB_OFFLINE": "1"}
    env.pop("POSTTUNE_DISABLE_PLUGINS", None)
    posttune = str(Path(sys.executable).with_name("posttune"))

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([posttune, *argv], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, check=False)

    warning = "posttune: warning: plugin acme_exit from acme-exit 1.0 failed to load: SystemExit: 7\n"
    version = run("--version")
    assert (version.returncode, version.stdout) == (0, f"posttune {__version__}\n")
    shown = run("--help")
    assert (shown.returncode, shown.stderr.endswith(warning)) == (0, True), shown.stderr
    report = run("plugins", "--json")
    assert report.returncode == 0
    assert json.loads(report.stdout)["problems"] == [warning.removeprefix("posttune: warning: ").strip()]
    listed = run("ls", "methods")
    assert listed.returncode == 0 and "loud  acme-loud 1.0" in listed.stdout.splitlines()
    assert listed.stderr == "hello from acme at import\n" + warning
    trained = run("train", "llama-demo-reverse", "method.name=acme_rl")
    assert trained.returncode == 2
    loud, error = trained.stderr.splitlines()  # acme-loud's own print, then posttune's one line
    assert (loud, error.startswith("posttune: error: config: method.name: ")) == ("hello from acme at import", True)
    assert trained.stderr.endswith("failed to load, which may provide it: acme-exit (SystemExit: 7)\n")


def test_a_name_whose_installed_distribution_the_selection_leaves_out_says_so(cli, monkeypatch, tmp_path):
    """Not "pip install posttune-llama": it is installed, and POSTTUNE_LOAD_PLUGINS left it out."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTUNE_LOAD_PLUGINS", "posttune-sft")
    monkeypatch.delenv("POSTTUNE_DISABLE_PLUGINS", raising=False)
    (tmp_path / "run.yaml").write_text("model: {family: llama, size: tiny}\nmethod: sft\n"
                                       "data: {train: {path: d.jsonl, format: chat}}\n")
    refused = cli("validate", "run.yaml")
    assert refused.exit_code == 2
    assert refused.stderr == ("posttune: error: config: model.family: no model family 'llama' is installed (installed: "
                              "none); posttune-llama is installed but not loaded: POSTTUNE_LOAD_PLUGINS or "
                              "POSTTUNE_DISABLE_PLUGINS leaves it out\n")
