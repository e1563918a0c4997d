"""`posttune eval`: its help teaches, and a mistake in its arguments is one line, found before any
model or task is loaded."""

from __future__ import annotations

import shlex
import subprocess
import sys

import posttune_lmeval
import posttune_generate
import posttune_lora
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
    (["--model", "m", "--tasks", "x", "--fewshot-as-multiturn"], "--fewshot-as-multiturn needs --apply-chat-template"),
    (["--model", "m", "--tasks", "x", "--apply-chat-template", ""], "--apply-chat-template: give a template name"),
    (["--model", "m", "--tasks", "x", "--system-instruction", " "], "--system-instruction: the text is empty"),
])
def test_a_bad_argument_is_one_line(eval_cli, args, expected):
    result = eval_cli(*args)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


def test_a_model_folder_that_is_not_there_is_named_as_the_model(eval_cli, tmp_path):
    """Not as the tokenizer folder it is read from first (with a chat template, before the tasks)."""
    result = eval_cli("--model", str(tmp_path / "gone"), "--tasks", "x", "--apply-chat-template")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"eval: --model {tmp_path / 'gone'}: no such checkpoint directory" in result.stderr


def test_a_folder_that_is_no_language_model_is_one_line_naming_what_it_is(eval_cli, tmp_path):
    """An adapter or a run's output folder given as --model, and a reward model (a sequence classifier), are named
    at once, before any tokenizer, task or weight is read (the folders hold no more than what says what they are)."""
    from posttune.testing.tiny import tiny_llama_config

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (tmp_path / "run" / "model").mkdir(parents=True)
    tiny_llama_config().save_pretrained(tmp_path / "run" / "model")
    reward = tmp_path / "reward"
    tiny_llama_config(architectures=["LlamaForSequenceClassification"], num_labels=1).save_pretrained(reward)
    for folder, expected in [(adapter, "is a PEFT adapter (adapter_config.json); pass it as --adapter"),
                             (tmp_path / "run", f"is a run's output folder; its model is {tmp_path / 'run' / 'model'}"),
                             (reward, "is a sequence classifier (a reward or value model)")]:
        result = eval_cli("--model", str(folder), "--tasks", "no_such_task")
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert f"eval: --model {folder} {expected}" in result.stderr


def test_an_adapter_without_its_config_is_one_line(eval_cli, tmp_path):
    result = eval_cli("--adapter", str(tmp_path), "--tasks", "x")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "no adapter_config.json there" in result.stderr


@pytest.mark.slow  # indexes lm-eval's ~15k task YAMLs
def test_an_unknown_task_is_one_line_with_a_suggestion_before_the_model_loads(eval_cli, task_dir, tmp_path):
    result = eval_cli("--model", str(tmp_path / "not-loaded"), "--tasks", "tiny_mc,tiny_mcq",
                      "--include-path", str(task_dir))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--tasks: no task 'tiny_mcq' (did you mean 'tiny_mc'?)" in result.stderr


@pytest.mark.parametrize(("args", "expected"), [
    ([], {"apply_chat_template": False, "system_instruction": None, "fewshot_as_multiturn": False}),
    (["--system-instruction", "Be brief."],
     {"apply_chat_template": False, "system_instruction": "Be brief.", "fewshot_as_multiturn": False}),
    (["--apply-chat-template"],
     {"apply_chat_template": True, "system_instruction": None, "fewshot_as_multiturn": True}),
    (["--apply-chat-template", "--no-fewshot-as-multiturn"],
     {"apply_chat_template": True, "system_instruction": None, "fewshot_as_multiturn": False}),
    (["--apply-chat-template", "tool_use", "--fewshot-as-multiturn"],
     {"apply_chat_template": "tool_use", "system_instruction": None, "fewshot_as_multiturn": True}),
])
def test_chat_options_become_lm_evals_arguments_with_its_defaults(register_plugin, args, expected):
    """lm-eval 0.4's rule: few-shot examples are chat turns whenever a template is applied."""
    from posttune_lmeval.command import prompt_options

    register_plugin(posttune_lmeval, distribution="posttune-lmeval")
    parsed = build_parser().parse_args(["eval", "--model", "m", "--tasks", "x", *args])
    assert prompt_options(parsed) == expected


def test_a_checkpoint_without_a_chat_template_is_one_line_before_tasks_and_weights(eval_cli, tmp_path):
    """The folder holds a tokenizer and config.json only (no weights, no task indexed): the template is checked
    first."""
    from posttune.testing.tiny import tiny_llama_config
    from posttune.tiny_tokenizer import save_tiny_tokenizer

    folder = save_tiny_tokenizer(tmp_path / "plain-model", template=None)
    tiny_llama_config().save_pretrained(folder)
    result = eval_cli("--model", str(folder), "--tasks", "no_such_task", "--apply-chat-template")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"eval: --apply-chat-template: {folder} has no chat template" in result.stderr


@pytest.mark.slow  # indexes lm-eval's ~15k task YAMLs
def test_a_hub_task_whose_data_is_not_cached_is_one_line(eval_cli, register_plugin, tiny_checkpoint, monkeypatch):
    """Offline (as these tests run), arc_easy's data cannot be fetched: lm-eval's ~40-line traceback and exit 1
    before; one line and exit 2 now."""
    import posttune_llama

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = eval_cli("--model", str(tiny_checkpoint), "--tasks", "arc_easy", "--limit", "2")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("posttune: error: eval: a task's dataset could not be read (")
    assert result.stderr.endswith("a local task (--include-path) needs neither\n")
