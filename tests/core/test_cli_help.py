"""Every subcommand's --help teaches: a description and two examples that parse as written."""

from __future__ import annotations

import shlex

import pytest
from posttune.cli.main import build_parser
from posttune.plugins import get_registry

COMMANDS = ["plugins", "ls", "cp", "config", "validate", "plan", "train", "generate", "plot", "download"]


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_shows_two_examples_that_parse(name, capsys):
    command = get_registry().get("command", name)
    assert command.help and len(command.examples) == 2
    parser = build_parser()
    for example in command.examples:
        words = shlex.split(example, comments=True)
        assert words[:2] == ["posttune", name]
        args = parser.parse_args(words[1:])  # SystemExit here would mean the example does not parse
        assert args.command == name
    with pytest.raises(SystemExit):
        parser.parse_args([name, "--help"])
    shown = capsys.readouterr().out
    assert "examples:" in shown and all(example in shown for example in command.examples)


@pytest.mark.parametrize("action", ["keys", "show"])
def test_config_keys_and_show_show_two_examples_that_parse(action, capsys):
    """docs/config.md: every command's --help ends with two examples; `config`'s actions have their own --help."""
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["config", action, "--help"])
    shown = capsys.readouterr().out
    examples = shown.partition("\nexamples:\n")[2].splitlines()
    assert len(examples) == 2, shown
    for example in examples:
        words = shlex.split(example)
        assert words[:3] == ["posttune", "config", action]
        assert parser.parse_args(words[1:]).config_action == action


def test_torchrun_flags_appear_once_each(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    shown = capsys.readouterr().out
    assert shown.count("--nnodes M or MIN:MAX") == 2  # the usage line and the option's own line
    assert "distributed launch (passed to torchrun)" in shown


@pytest.mark.parametrize("args", [["--help"], ["ls"], ["validate", "llama-demo-reverse", "checkpoint.overwrite=true"]])
def test_answering_commands_do_not_import_torch(args):
    """What keeps `--help`, `ls` and `validate` under a second (benchmarks/cli_start.py times them)."""
    import subprocess
    import sys

    code = ("import sys\nfrom posttune.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr[-2000:]


def test_train_without_arguments_asks_for_the_config_only(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("the following arguments are required: config")  # overrides are optional
