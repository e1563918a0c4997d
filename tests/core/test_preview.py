"""`posttune preview`: the first batch as the run reads it, trained tokens marked; no model built.

On the demo's rows ("Reverse: ABC" -> "CBA") the marked text of every row is exactly the reversed word and the
end-of-turn token: the response and its end train, the prompt and the header do not. DPO's rejected response is
shown after the prompt it shares; GRPO's rows are the prompts the policy samples from."""

from __future__ import annotations

import re

import pytest
import yaml
from run_support import dpo_config, grpo_config

import posttune_dpo
import posttune_generate
import posttune_grpo
import posttune_llama
import posttune_sft


@pytest.fixture
def plugins(register_plugin):
    for module in (posttune_llama, posttune_sft, posttune_dpo, posttune_grpo, posttune_generate):
        register_plugin(module, distribution=module.__name__.replace("_", "-"), version="0.1.0")


def write(tmp_path, config):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_demo_rows_train_on_the_reversed_word_and_its_end_token_only(plugins, posttune_cli):
    result = posttune_cli("preview", "llama-demo-reverse", "--rows", "4", "--marks", "brackets")
    assert result.exit_code == 0, result.stderr
    rows = result.stdout.split("== row ")[1:]
    assert len(rows) == 4
    for row in rows:
        word = re.search(r"Reverse: ([A-Z]+)<\|eot_id\|>", row).group(1)
        assert re.findall(r"\[\[(.*?)\]\]", row, re.S) == [f"{word[::-1]}<|eot_id|>"]
        assert re.match(r"\d+: \d+ tokens, \d+ trained \(marked by double brackets\) ==\n", row)


def test_packed_rows_are_shown_as_their_samples_without_the_padding(plugins, posttune_cli):
    """With packing and fixed-length rows the batch is said to hold its samples end to end, and a row's padding to
    max_seq_len is not shown as a row of 0 trained tokens (axolotl trial)."""
    result = posttune_cli("preview", "llama-demo-reverse", "--rows", "40", "--marks", "brackets",
                          "method.packing=true", "method.padding_free=false")
    assert result.exit_code == 0, result.stderr
    head, *rows = result.stdout.split("== row ")
    assert re.fullmatch(r"== the batch: 32 row\(s\) of 64 tokens, holding (\d+) samples end to end \(attention stays "
                        r"within each\); each sample is shown below as a row ==\n", head)
    assert len(rows) == int(re.search(r"holding (\d+) samples", head).group(1)) and " 0 trained" not in result.stdout
    # fewer samples than --rows asked for: said, not silent
    assert rows[-1].endswith(f"== the first batch holds {len(rows)} samples (--rows 40 asks for more): "
                             "train.batch_size sets how many; posttune train's banner and summary count the whole "
                             "dataset ==\n")


def test_dpo_shows_the_rejected_response_after_the_shared_prompt(plugins, posttune_cli, tmp_path):
    result = posttune_cli("preview", write(tmp_path, dpo_config(tmp_path)), "--rows", "2", "--marks", "brackets")
    assert result.exit_code == 0, result.stderr
    first, second = result.stdout.split("== row ")[1:3]
    assert "Reverse: " in first and "Reverse: " not in second
    assert "after the prompt shown above (computed once)" in second
    assert len(re.findall(r"\[\[", first)) == len(re.findall(r"\[\[", second)) == 1  # one response each


def test_grpo_shows_the_prompts(plugins, posttune_cli, tmp_path):
    result = posttune_cli("preview", write(tmp_path, grpo_config(tmp_path)), "--rows", "2")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("(the completions are sampled as the run trains)") == 2
    assert result.stdout.count("Reverse: ") == 2 and "[[" not in result.stdout


def test_overrides_may_follow_the_options(plugins, posttune_cli, tmp_path):
    """``preview CONFIG --rows 1 k=v`` (argparse alone refuses an override after an option); an option-like stray
    word is still refused."""
    override = "data.train.system_prompt=Answer in capitals"
    before = posttune_cli("preview", "llama-demo-reverse", override, "--rows", "1")
    after = posttune_cli("preview", "llama-demo-reverse", "--rows", "1", override)
    assert before.exit_code == after.exit_code == 0, after.stderr
    assert before.stdout == after.stdout and "Answer in capitals" in after.stdout
    refused = posttune_cli("preview", "llama-demo-reverse", "--rows", "1", override, "--nope")
    assert refused.exit_code == 2 and "unrecognized arguments: " in refused.stderr and "--nope" in refused.stderr


@pytest.mark.parametrize(("argv", "error"), [
    (("--rows", "0"), "posttune: error: preview: --rows must be at least 1, got 0\n"),
    (("~data.validation", "--split", "validation"),
     "posttune: error: preview: --split validation: the config has no data.validation\n"),
])
def test_bad_arguments_are_one_line(plugins, posttune_cli, argv, error):
    result = posttune_cli("preview", "llama-demo-reverse", *argv)
    assert (result.exit_code, result.stderr) == (2, error)


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(("marks", "tty", "no_color", "colored"), [
    ("auto", True, None, True), ("auto", False, None, False),
    ("auto", True, "1", False), ("auto", True, "", True),  # NO_COLOR counts when present and not empty
    ("color", True, "1", True), ("color", False, None, True),  # an explicit option wins over NO_COLOR
    ("brackets", True, None, False),
])
def test_marks_are_green_on_a_terminal_unless_no_color_is_set(monkeypatch, marks, tty, no_color, colored):
    from posttune.cli.preview import use_color

    monkeypatch.delenv("NO_COLOR", raising=False)
    if no_color is not None:
        monkeypatch.setenv("NO_COLOR", no_color)
    assert use_color(marks, _Stream(tty)) is colored


def test_no_color_keeps_escape_codes_off_a_terminal(tmp_path):
    """The user's check: `NO_COLOR=1 posttune preview ...` on a terminal (a pseudo-terminal here) prints no ANSI
    colour, and marks the trained tokens by brackets instead."""
    import os
    import pty
    import subprocess
    import sys

    leader, follower = pty.openpty()
    env = {**os.environ, "NO_COLOR": "1"}
    with subprocess.Popen([sys.executable, "-m", "posttune", "preview", "llama-demo-reverse", "--rows", "1"],
                          stdout=follower, stderr=subprocess.PIPE, cwd=tmp_path, env=env) as process:
        os.close(follower)
        shown = b""
        while chunk := _read(leader):
            shown += chunk
        assert process.wait() == 0, process.stderr.read()
    os.close(leader)
    assert b"\x1b[" not in shown and b"[[" in shown


def _read(fd: int) -> bytes:
    import os

    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the child closed the terminal
        return b""
