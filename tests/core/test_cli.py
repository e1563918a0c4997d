"""The `posttune` command line: every subcommand, one-line user errors, exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttune import __version__
from posttune.descriptors import BundledConfig, Command
from posttune.plugins import module_plugin

CONFIG = """\
model: {family: fam, size: tiny}
tokenizer: {path: org/tiny-tokenizer}  # a hub id: read when a run starts, which these tests never reach
method: fsft
data:
  train: {path: d.jsonl, format: chat}
train: {lr: 1e-4}
"""


@pytest.fixture
def fake(fake_plugin):
    return fake_plugin


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def test_version(posttune_cli):
    result = posttune_cli("--version")
    assert (result.exit_code, result.stdout.strip()) == (0, f"posttune {__version__}")


def test_python_dash_m_posttune_is_the_command():
    """For an environment whose scripts are not on PATH: the same command, its exit status passed on."""
    shown = subprocess.run([sys.executable, "-m", "posttune", "--version"], capture_output=True, text=True)
    assert (shown.returncode, shown.stdout.strip()) == (0, f"posttune {__version__}")
    wrong = subprocess.run([sys.executable, "-m", "posttune", "validate", "no-such.yaml"], capture_output=True,
                           text=True)
    assert wrong.returncode == 2 and wrong.stderr.startswith("posttune: error: ")


def test_no_command_prints_help_and_exits_2(posttune_cli):
    result = posttune_cli()
    assert result.exit_code == 2 and "COMMAND" in result.stdout


def test_plugins_json_describes_each_plugin(fake, posttune_cli):
    report = json.loads(posttune_cli("plugins", "--json").stdout)
    fake_entry = next(p for p in report["plugins"] if p["name"] == "fake")
    assert fake_entry["distribution"] == "posttune-fake" and fake_entry["version"] == "9.9"
    assert fake_entry["registers"]["families"] == ["fam"]
    assert fake_entry["registers"]["plans"] == ["fsdp", "lossp", "tensor"]
    assert "posttune_register_parallel_plans" in fake_entry["hooks"]
    assert fake_entry["error"] is None
    assert report["problems"] == []


@pytest.mark.parametrize("kind, expected", [
    ("families", "fam"), ("methods", "fdpo"), ("plans", "tensor"), ("memory", "opt_bwd"),
    ("datasets", "alpaca"), ("converters", "fam:hf"),
])
def test_ls_lists_each_kind_with_its_provider(fake, posttune_cli, kind, expected):
    result = posttune_cli("ls", kind)
    assert result.exit_code == 0
    assert any(line.split()[0] == expected for line in result.stdout.splitlines())


def test_ls_without_kind_lists_all_sections(fake, posttune_cli):
    out = posttune_cli("ls").stdout
    for section in ("families:", "methods:", "plans:", "memory:", "datasets:", "configs:"):
        assert section in out


def test_ls_json_gives_each_name_with_its_distribution(fake, posttune_cli):
    import json

    listing = json.loads(posttune_cli("ls", "--json").stdout)
    assert listing["methods"]["fdpo"] == {"distribution": "posttune-fake", "version": "9.9", "description": ""}
    assert listing["datasets"]["preference"]["distribution"] == "posttune"
    assert set(listing) == {"families", "converters", "quantized", "methods", "plans", "memory", "adapters",
                            "datasets", "rewards", "engines", "loggers", "configs"}
    assert "builtin" not in listing["engines"]  # the core has no engine of its own: posttune-generate's is a plugin
    only = json.loads(posttune_cli("ls", "methods", "--json").stdout)
    assert set(only) == {"methods"} and set(only["methods"]) == {"fdpo", "fsft"}


def test_ls_help_and_the_readme_name_every_kind_it_lists(capsys):
    from posttune.cli.commands import LS_KINDS
    from posttune.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["ls", "--help"])
    summary = capsys.readouterr().out.split("\n\n")[1]
    assert summary.strip().endswith(f": {', '.join(LS_KINDS)}"), summary
    assert {"engines", "loggers", "quantized"} <= set(LS_KINDS)
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    entry = " ".join(readme.partition("    posttune ls ")[2].partition("\n    posttune cp")[0].split())
    assert entry.endswith(f": {', '.join(LS_KINDS)}"), entry


def test_ls_says_when_nothing_is_installed(posttune_cli):
    assert posttune_cli("ls", "families").stdout.strip() == "(no model family installed)"


def test_cp_copies_a_bundled_config_and_refuses_to_overwrite(register_plugin, posttune_cli, tmp_path, config_file):
    register_plugin(module_plugin("cfgs", posttune_register_configs=lambda register: register(
        BundledConfig("fam-sft", config_file, "fam sft"))))
    dest = tmp_path / "out"
    dest.mkdir()
    assert posttune_cli("cp", "fam-sft", str(dest)).exit_code == 0
    assert (dest / "run.yaml").read_text() == CONFIG
    again = posttune_cli("cp", "fam-sft", str(dest))
    assert (again.exit_code, again.stderr) == (2, f"posttune: error: {dest / 'run.yaml'} exists; pass --force to "
                                                  "overwrite it\n")
    assert posttune_cli("cp", "fam-sft", str(dest), "--force").exit_code == 0
    missing = posttune_cli("cp", "fam-sf", str(dest))
    assert missing.stderr == ("posttune: error: no bundled config 'fam-sf' (did you mean 'fam-sft'?) "
                              "(see `posttune ls configs`)\n")
    assert posttune_cli("cp", "fam-sft", f"{tmp_path / 'new' / 'dir'}/").exit_code == 0  # a trailing /: a folder
    assert (tmp_path / "new" / "dir" / "run.yaml").read_text() == CONFIG


def test_cp_that_cannot_write_its_destination_is_one_line_naming_it(register_plugin, posttune_cli, tmp_path,
                                                                    config_file):
    """A destination under a file, or on a file system that refuses it: one line, not an OSError's traceback."""
    register_plugin(module_plugin("cfgs", posttune_register_configs=lambda register: register(
        BundledConfig("fam-sft", config_file, "fam sft"))))
    (tmp_path / "base.yaml").write_text("")
    under_a_file = tmp_path / "base.yaml" / "x.yaml"
    result = posttune_cli("cp", "fam-sft", str(under_a_file))
    assert (result.exit_code, result.stderr) == (2, f"posttune: error: cannot write {under_a_file}: Not a directory\n")


def _metrics(run: Path) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 2.0 / step, "labelled_tokens": 4})
                                               + "\n" for step in (1, 2, 3)))
    return run


@pytest.mark.parametrize("option", ["-o", "--output", "--out"])
@pytest.mark.parametrize("given, written", [("curve", "curve.png"), ("curve.svg", "curve.svg"),
                                            ("adir", "adir/loss.png"), ("curve.v2", "curve.v2.png"),
                                            ("plots/", "plots/loss.png")])  # a trailing /: a folder, made
def test_plot_prints_the_file_it_wrote(posttune_cli, tmp_path, monkeypatch, option, given, written):
    """matplotlib adds .png to a name without an image suffix, and would write adir.png beside a directory: what
    `plot` prints is the file that is there. -o/--output as every command spells it; --out, its first spelling."""
    pytest.importorskip("matplotlib", reason="posttune plot needs the optional matplotlib extra")
    monkeypatch.chdir(tmp_path)
    _metrics(tmp_path / "run")
    (tmp_path / "adir").mkdir()
    result = posttune_cli("plot", "run", option, given)
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"{Path(written)}\n", "")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        ["run/metrics.jsonl", written])


def test_plot_that_cannot_write_is_one_line_naming_the_file(posttune_cli, tmp_path):
    pytest.importorskip("matplotlib", reason="posttune plot needs the optional matplotlib extra")
    run = _metrics(tmp_path / "run")
    (tmp_path / "afile").write_text("")
    for out, why in ((tmp_path / "missing" / "x.png", "No such file or directory"),
                     (tmp_path / "afile" / "x.png", "Not a directory")):
        result = posttune_cli("plot", str(run), "-o", str(out))
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"posttune: error: cannot write {out}: "
                                                                           f"{why}\n")


def test_validate_accepts_a_good_config_with_overrides(fake, posttune_cli, config_file):
    result = posttune_cli("validate", str(config_file), "train.batch_size=2", "~train.lr")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{config_file}: valid (fsft on fam, 1 process(es))\n"


def test_validate_refuses_a_size_built_model_without_a_tokenizer(fake, posttune_cli, config_file):
    """The run would stop at compose for want of a tokenizer: validate says so first, naming the field.
    A plan (what the run would build and hold in memory) needs no tokenizer and still prints."""
    result = posttune_cli("validate", str(config_file), "~tokenizer")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == ("posttune: error: config: tokenizer.path: required when the model is built from a "
                             "size (no model.path)\n")
    planned = posttune_cli("plan", str(config_file), "~tokenizer", "--no-estimate")
    assert planned.exit_code == 0 and "method" in planned.stdout, planned.stderr


def test_validate_by_bundled_name(register_plugin, fake, posttune_cli, config_file):
    register_plugin(module_plugin("cfgs", posttune_register_configs=lambda register: register(
        BundledConfig("fam-sft", config_file))))
    assert posttune_cli("validate", "fam-sft").exit_code == 0
    unknown = posttune_cli("validate", "fam-sfft")
    assert unknown.stderr == ("posttune: error: no config file or bundled config named 'fam-sfft' "
                              "(did you mean 'fam-sft'?) (see `posttune ls configs`)\n")


@pytest.mark.parametrize("overrides, message", [
    (["train.lr=fast"], "config: train.lr: expected a number, got 'fast'"),
    (["train.lrr=1"], "config: train.lrr: unknown key (did you mean 'lr'?)"),
    (["method=sftt"], "config: method: no method 'sftt' is installed (installed: fdpo, fsft) "
                      "(did you mean 'sft'?) — pip install posttune-sft"),
    (["--nproc-per-node", "2"], "config: parallel.plans: 2 processes launched but no parallel plan owns a "
                                "mesh dimension; add one, e.g. fsdp2 (pip install posttune-fsdp2)"),
    (["memory=[opt_bwd]", "train.grad_accum_steps=2"],
     "config: train.grad_accum_steps: opt_bwd cannot accumulate gradients; set it to 1"),
    (["train.device=gpu"], "config: train.device 'gpu' is not a device (auto, cpu, cuda, cuda:1 ...)"),
    (["train.device=meta"], "config: train.device meta holds no weights; use auto, cpu or cuda"),
])
def test_user_errors_are_one_line_with_exit_status_2(fake, posttune_cli, config_file, overrides, message):
    result = posttune_cli("validate", str(config_file), *overrides)
    assert result.exit_code == 2
    assert result.stderr == f"posttune: error: {message}\n"
    assert result.stdout == ""


def test_plan_prints_stages_in_order_with_providers(fake, posttune_cli, config_file):
    result = posttune_cli("plan", str(config_file), "parallel.plans=[fsdp,tensor]", "parallel.dims.tp=2",
                          "--nproc-per-node", "2", "--nnodes", "2", "--no-estimate")  # the fake family builds no model
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["distributed", "4", "process(es),"]
    assert [line.split()[0] for line in lines] == ["distributed", "build", "parallelize", "parallelize", "load",
                                                   "data", "optimizer", "method", "train"]
    assert lines[1].endswith("[posttune-fake 9.9]")


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_one_process_says_when_the_config_sizes_a_larger_launch(fake, posttune_cli, config_file, command):
    """A config written for 2 TP ranks planned or validated without --nproc-per-node is checked for one process
    (its plans' own checks, cp's included, not run), and says so."""
    options = ["--no-estimate"] if command == "plan" else []
    result = posttune_cli(command, str(config_file), "parallel.plans=[fsdp,tensor]", "parallel.dims.tp=2", *options)
    assert result.exit_code == 0, result.stderr
    if command == "plan":
        assert result.stdout.split()[:2] == ["distributed", "1"]
    assert result.stderr == (f"posttune: warning: parallel.dims asks for 2 processes; this {command} is for 1 (its "
                             f"parallel plans inactive and unchecked): posttune {command} --nproc-per-node 2 ... "
                             "checks that launch\n")
    launched = posttune_cli(command, str(config_file), "parallel.plans=[fsdp,tensor]", "parallel.dims.tp=2",
                            "--nproc-per-node", "2", *options)
    assert launched.exit_code == 0 and "warning" not in launched.stderr


def test_train_validates_before_anything_else(fake, posttune_cli, config_file):
    result = posttune_cli("train", str(config_file), "train.lr=fast")
    assert result.stderr == "posttune: error: config: train.lr: expected a number, got 'fast'\n"


def test_train_passes_torchrun_arguments_through(fake, posttune_cli, config_file, monkeypatch):
    import torch.distributed.run as torchrun

    calls = []
    monkeypatch.setattr(torchrun, "main", calls.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = posttune_cli("train", str(config_file), "train.seed=3", "parallel.plans=[fsdp]", "--nproc-per-node", "2",
                          "--rdzv-endpoint", "host:29400", "--nnodes", "2", "--rdzv-backend", "c10d",
                          "--rdzv-conf", "join_timeout=120")
    assert result.exit_code == 0, result.stderr
    assert calls == [["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "host:29400",
                      "--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=120", "-m", "posttune.training.worker",
                      str(config_file), "train.seed=3", "parallel.plans=[fsdp]"]]


def test_train_launch_checks_mesh_against_the_world_before_launching(fake, posttune_cli, config_file, monkeypatch):
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "main", lambda args: pytest.fail("launched an impossible plan"))
    result = posttune_cli("train", str(config_file), "parallel.plans=[tensor]", "parallel.dims.tp=4",
                          "--nproc_per_node", "2")
    assert result.stderr == "posttune: error: config: parallel.dims: tp=4 does not fit the 2 processes launched\n"


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("--nproc-per-node", "abc", "expected an integer >= 1 or auto or cpu or gpu or xpu, got 'abc'"),
    ("--nproc-per-node", "0", "expected an integer >= 1 or auto or cpu or gpu or xpu, got '0'"),
    ("--nnodes", "x", "expected a number of nodes >= 1, or MIN:MAX, got 'x'"),
    ("--nnodes", "4:2", "expected a number of nodes >= 1, or MIN:MAX, got '4:2'"),
    ("--master-port", "99999999", "expected an integer from 1 to 65535, got '99999999'"),
    ("--node-rank", "-1", "expected an integer >= 0, got '-1'"),
])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_launch_option_torchrun_cannot_read_is_refused_as_the_command_is_read(
        fake, posttune_cli, config_file, monkeypatch, command, option, value, expected):
    """validate said valid and train died in a traceback from torchrun (``Unsupported nproc_per_node value``)."""
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "main", lambda args: pytest.fail("launched"))
    result = posttune_cli(command, str(config_file), f"{option}={value}")
    assert result.exit_code == 2
    underscored = "--" + option[2:].replace("-", "_")
    named = option if underscored == option else f"{option}/{underscored}"
    assert result.stderr.splitlines()[-1] == f"posttune {command}: error: argument {named}: {expected}", result.stderr
    assert posttune_cli("validate", str(config_file), "--nnodes", "1:2", "--nproc-per-node", "auto").exit_code == 0


@pytest.mark.parametrize(("tasks", "launch", "refused"), [
    ("8", [], True), ("2", ["--nproc-per-node", "4", "--standalone"], True), ("1", [], False),
    ("2", ["--nnodes", "2", "--nproc-per-node", "4"], False), ("4", ["--nnodes", "2:4"], False),
])
def test_an_srun_step_of_more_tasks_than_nodes_is_refused(fake, posttune_cli, config_file, monkeypatch, tasks,
                                                          launch, refused):
    """`srun -n 8 posttune train`: eight copies of the run, each alone (on one output directory all but one exit
    75, which a requeue script retries). One task per node, each launching its processes, is what works."""
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "main", lambda args: None)
    for key in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", tasks)
    result = posttune_cli("train", str(config_file), "train.max_steps=1", "parallel.plans=[fsdp]", *launch)
    if refused:
        assert result.exit_code == 2 and result.stderr.startswith(f"posttune: error: srun started {tasks} tasks "
                                                                  "(SLURM_STEP_NUM_TASKS) and this launch spans ")
    else:
        assert "SLURM_STEP_NUM_TASKS" not in result.stderr, result.stderr


def test_download_fetches_weights_config_and_tokenizer_only(posttune_cli, monkeypatch, tmp_path):
    import huggingface_hub

    seen = {}

    def fake_snapshot(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    result = posttune_cli("download", "org/model", "--output", str(tmp_path))
    assert result.stdout.strip() == str(tmp_path)
    assert seen["repo_id"] == "org/model" and seen["local_dir"] == str(tmp_path)
    assert "*.safetensors" in seen["allow_patterns"] and "*.json" in seen["allow_patterns"]
    assert "original/*" in seen["ignore_patterns"] and "*.bin" in seen["ignore_patterns"]


def test_download_failure_is_one_line(posttune_cli, monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise OSError("We couldn't connect to the hub.\nCheck your connection.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    result = posttune_cli("download", "org/model")
    assert result.exit_code == 2
    assert result.stderr == "posttune: error: download of org/model failed: OSError: We couldn't connect to the hub.\n"


def test_plugin_command_is_available(register_plugin, posttune_cli):
    def configure(parser):
        parser.add_argument("--name", default="world")

    def run(args):
        print(f"hello {args.name}")
        return 0

    register_plugin(module_plugin("greet", posttune_register_commands=lambda cli: cli(
        Command("hello", "say hello", configure, run))))
    result = posttune_cli("hello", "--name", "posttune")
    assert (result.exit_code, result.stdout) == (0, "hello posttune\n")


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 512000000000000 bytes. Error code 12 (Cannot allocate memory)"),
    type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB"),  # torch's
    MemoryError()])
def test_running_out_of_memory_is_one_line_pointing_to_the_estimate(register_plugin, posttune_cli, error):
    """A model or batch too large for the machine: a size to change, not a traceback to read."""
    def run(args):
        raise error

    register_plugin(module_plugin("big", posttune_register_commands=lambda cli: cli(
        Command("big", "allocate too much", lambda parser: None, run))))
    result = posttune_cli("big")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("posttune: error: out of memory: ")
    assert result.stderr.endswith("(`posttune plan` estimates a run's peak, docs/memory.md says what lowers it; "
                                  "--debug: the traceback)\n")
    assert "can't allocate memory" in result.stderr or "CUDA out of memory" in result.stderr or \
        "MemoryError" in result.stderr
    with pytest.raises(type(error)):
        posttune_cli("--debug", "big")


def test_a_command_not_installed_is_one_line_naming_what_provides_it(register_plugin, posttune_cli):
    """`posttune eval` without posttune-lmeval names the distribution; a misspelt command gets the one meant;
    neither is argparse's usage message."""
    result = posttune_cli("eval", "--tasks", "hellaswag")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("posttune: error: no command 'eval' is installed (installed: config, cp, ")
    assert result.stderr.endswith(" — pip install posttune-lmeval\n") and result.stderr.count("\n") == 1

    register_plugin(module_plugin("greet", posttune_register_commands=lambda cli: cli(
        Command("hello", "say hello", lambda parser: None, lambda args: 0))))
    result = posttune_cli("helo")
    assert result.exit_code == 2 and "usage:" not in result.stderr
    assert result.stderr.endswith("(did you mean 'hello'?)\n") and "pip install" not in result.stderr


def test_console_script_prints_one_line_and_no_traceback(tmp_path):
    """The installed entry point, in a fresh process: user error -> one stderr line, exit 2."""
    config = tmp_path / "bad.yaml"
    config.write_text("model: {family: x, size: y}\nmethod: sft\ntrain: {lr: fast}\n")
    run = subprocess.run([sys.executable, "-m", "posttune.cli.main", "validate", str(config)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr == "posttune: error: config: train.lr: expected a number, got 'fast'\n"
    debug = subprocess.run([sys.executable, "-m", "posttune.cli.main", "--debug", "validate", str(config)],
                           capture_output=True, text=True, timeout=120)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_plugins_command_does_not_import_torch(tmp_path):
    code = textwrap.dedent("""
        import sys
        from posttune.testing import run_cli
        from posttune.plugins import new_plugin_set, set_plugins
        set_plugins(new_plugin_set())
        assert run_cli("plugins").exit_code == 0
        print("torch" in sys.modules)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "False", run.stderr
