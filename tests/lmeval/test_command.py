"""`posttune eval`: its help teaches, and a mistake in its arguments is one line, found before any
model or task is loaded."""

from __future__ import annotations

import shlex
import subprocess
import sys

import posttune_lmeval
import pytest
from posttune.cli.main import build_parser


@pytest.fixture
def eval_cli(register_plugin, posttune_cli):
    register_plugin(posttune_lmeval, distribution="posttune-lmeval", version=posttune_lmeval.__version__)
    return lambda *args: posttune_cli("eval", *args)


def test_help_shows_the_defaults_and_two_examples_that_parse(register_plugin, capsys):
    register_plugin(posttune_lmeval, distribution="posttune-lmeval")
    parser = build_parser()
    from posttune.plugin import lookup

    command = lookup("command", "eval")
    assert len(command.examples) == 2
    for example in command.examples:
        words = shlex.split(example, comments=True)
        assert parser.parse_args(words[1:]).command == "eval"
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--help"])
    shown = capsys.readouterr().out
    assert "examples:" in shown and all(example in shown for example in command.examples)
    assert "(default 8)" in shown and "(default auto)" in shown


def test_help_imports_neither_torch_nor_lm_eval():
    code = ("import sys\nfrom posttune.cli.main import main\ntry:\n    main(['eval', '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('torch' in sys.modules, 'lm_eval' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.stdout.strip().splitlines()[-1] == "False False", done.stderr[-2000:]


@pytest.mark.parametrize(("args", "expected"), [
    (["--tasks", "x"], "give --model, or --adapter"),
    (["--model", "m", "--tasks", " , "], "--tasks: name at least one task"),
    (["--model", "m", "--tasks", "x", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--model", "m", "--tasks", "x", "--limit", "0"], "--limit must be a whole number"),
    (["--model", "m", "--tasks", "x", "--limit", "2.5"], "--limit must be a whole number"),
    (["--model", "m", "--tasks", "x", "--num-fewshot", "-1"], "--num-fewshot must be >= 0"),
    (["--model", "m", "--tasks", "x", "--max-length", "1"], "--max-length must be >= 2"),
    (["--model", "m", "--tasks", "x", "--device", "tpu"], "--device must be one of auto, cpu, cuda"),
    (["--model", "m", "--tasks", "x", "--include-path", "/no/such/dir"], "--include-path /no/such/dir: no such"),
    (["--model", "m", "--tasks", "x", "--output", "/no/such/dir/r.json"], "--output /no/such/dir/r.json"),
    (["--adapter", "/no/such/adapter", "--tasks", "x"], "--adapter /no/such/adapter: no such directory"),
])
def test_a_bad_argument_is_one_line(eval_cli, args, expected):
    result = eval_cli(*args)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


def test_an_adapter_without_its_config_is_one_line(eval_cli, tmp_path):
    result = eval_cli("--adapter", str(tmp_path), "--tasks", "x")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "cannot read adapter_config.json" in result.stderr


@pytest.mark.slow  # indexes lm-eval's ~15k task YAMLs
def test_an_unknown_task_is_one_line_with_a_suggestion_before_the_model_loads(eval_cli, task_dir, tmp_path):
    result = eval_cli("--model", str(tmp_path / "not-loaded"), "--tasks", "tiny_mc,tiny_mcq",
                      "--include-path", str(task_dir))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--tasks: no task 'tiny_mcq' (did you mean 'tiny_mc'?)" in result.stderr
