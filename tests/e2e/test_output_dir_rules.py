"""An output directory must be new, empty, or a run's own (``run.json``): never the filesystem root,
the home directory, a folder of the user's files, or a path that resolves inside another run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_support import tree_digest

USER_CONFIG = "# my settings, with comments that must survive\nmodel: {family: llama, size: tiny}\n"


def refused(result) -> str:
    assert result.exit_code == 2, result.stdout
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("posttune: error: config: checkpoint.output_dir: "), result.stderr
    return result.stderr.strip()


@pytest.fixture
def finished_run(llama_sft, posttune_cli, write_config, tmp_path) -> Path:
    """Another run's output directory: model/, two checkpoints, run.json."""
    path = write_config("other.yaml", train={"max_steps": 2}, checkpoint={"save_every": 1, "keep_last": 5,
                                                                          "output_dir": str(tmp_path / "other")})
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    return tmp_path / "other"


@pytest.mark.parametrize("command", ["validate", "train"])
def test_the_working_directory_holding_the_users_files_is_refused(llama_sft, posttune_cli, write_config, tmp_path,
                                                                   monkeypatch, command):
    path = write_config()
    (tmp_path / "config.yaml").write_text(USER_CONFIG)
    (tmp_path / "summary.json").write_text('{"mine": true}\n')
    monkeypatch.chdir(tmp_path)
    line = refused(posttune_cli(command, str(path), "checkpoint.output_dir=.", "train.max_steps=1"))
    assert line.endswith("holds files that are not a posttune run's (config.yaml, run.yaml, summary.json, "
                         "train.jsonl; no run.json); an output directory must be new, empty, or a run's own: "
                         "choose another")
    assert (tmp_path / "config.yaml").read_text() == USER_CONFIG
    assert (tmp_path / "summary.json").read_text() == '{"mine": true}\n'
    assert not (tmp_path / "run.json").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("command", ["validate", "train"])
def test_the_filesystem_root_and_the_home_directory_are_refused(llama_sft, posttune_cli, write_config, tmp_path,
                                                                  monkeypatch, command):
    path = write_config()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    root = Path("/")
    before = sorted(p.name for p in root.iterdir())
    assert refused(posttune_cli(command, str(path), "checkpoint.output_dir=/")).endswith(
        "/ is the filesystem root; name a folder of its own for the run, e.g. outputs/my-run")
    assert sorted(p.name for p in root.iterdir()) == before
    assert "is your home directory" in refused(posttune_cli(command, str(path), "checkpoint.output_dir=~/"))
    assert list(home.iterdir()) == []


@pytest.mark.parametrize("inside", ["model", "checkpoints", "checkpoints/step-00000001"])
def test_a_symlink_into_another_runs_directory_is_refused(finished_run, posttune_cli, write_config, tmp_path,
                                                           inside):
    before = tree_digest(finished_run)
    link = tmp_path / "link"
    link.symlink_to(finished_run / inside)
    path = write_config()
    for command in ("validate", "train"):
        line = refused(posttune_cli(command, str(path), f"checkpoint.output_dir={link / 'run'}"))
        assert f"inside the output directory of another run ({finished_run})" in line
    assert tree_digest(finished_run) == before


def test_a_path_through_dotdot_into_another_run_is_refused(finished_run, posttune_cli, write_config, tmp_path):
    path = write_config()
    sneaky = tmp_path / "elsewhere" / ".." / "other" / "sub"
    (tmp_path / "elsewhere").mkdir()
    line = refused(posttune_cli("validate", str(path), f"checkpoint.output_dir={sneaky}"))
    assert f"resolves to {finished_run / 'sub'}, inside the output directory of another run" in line


def test_overwrite_through_a_symlink_to_another_run_is_refused(finished_run, posttune_cli, write_config, tmp_path):
    before = tree_digest(finished_run)
    link = tmp_path / "link"
    link.symlink_to(finished_run)
    path = write_config()
    for command in ("validate", "train"):
        line = refused(posttune_cli(command, str(path), f"checkpoint.output_dir={link}", "checkpoint.overwrite=true"))
        assert line.endswith(f"is a symlink to {finished_run}, another run's output directory, and "
                             f"checkpoint.overwrite would remove its results; name {finished_run} itself to start "
                             "afresh there")
    assert tree_digest(finished_run) == before


def test_new_empty_and_own_directories_are_accepted(finished_run, posttune_cli, write_config, tmp_path):
    path = write_config()
    empty = tmp_path / "empty"
    empty.mkdir()
    locked_once = tmp_path / "locked"  # a run killed before it wrote run.json leaves only its lock
    locked_once.mkdir()
    (locked_once / ".posttune.lock").write_text("{}")
    for out in (tmp_path / "new" / "deep", empty, locked_once):
        result = posttune_cli("validate", str(path), f"checkpoint.output_dir={out}")
        assert result.exit_code == 0, result.stderr
    result = posttune_cli("validate", str(path), f"checkpoint.output_dir={finished_run}", "checkpoint.resume=latest")
    assert result.exit_code == 0, result.stderr
    assert json.loads((finished_run / "run.json").read_text())["run_id"]


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_resume_path_that_does_not_exist_is_named_so(finished_run, posttune_cli, write_config, tmp_path, monkeypatch,
                                                        command):
    """`last` for `latest`, or a mistyped path, was reported as "not a posttune checkpoint (no
    trainer_state.json)" (and passed `validate`): it does not exist, and `last` is most likely `latest`."""
    monkeypatch.chdir(tmp_path)
    path = write_config()
    out = f"checkpoint.output_dir={finished_run}"
    typo = posttune_cli(command, str(path), out, "checkpoint.resume=last")
    assert (typo.exit_code, typo.stderr) == (2, "posttune: error: config: checkpoint.resume: last does not exist (did "
                                                "you mean 'latest'?); name a checkpoint directory "
                                                "(OUTPUT_DIR/checkpoints/step-N) or 'latest'\n")
    missing = finished_run / "checkpoints" / "step-00000009"
    gone = posttune_cli(command, str(path), out, f"checkpoint.resume={missing}")
    assert (gone.exit_code, gone.stderr) == (2, f"posttune: error: config: checkpoint.resume: {missing} does not "
                                                "exist; name a checkpoint directory (OUTPUT_DIR/checkpoints/step-N) "
                                                "or 'latest'\n")


def test_overwrite_says_what_it_removes(finished_run, posttune_cli, tmp_path):
    path = tmp_path / "other.yaml"  # the finished run's own config, again, starting afresh
    result = posttune_cli("train", str(path), "checkpoint.overwrite=true", "train.max_steps=1")
    assert result.exit_code == 0, result.stderr
    assert (f"posttune: checkpoint.overwrite: removing the previous run's checkpoints, metrics.jsonl, loss.png, "
            f"summary.json from {finished_run}\n") in result.stdout
    assert [path.name for path in (finished_run / "checkpoints").iterdir()] == ["step-00000001"]


@pytest.mark.parametrize("command", ["validate", "train"])
def test_an_output_dir_inside_a_data_folder_is_refused(llama_sft, posttune_cli, write_config, tmp_path, command):
    """The folder is read whole as data: the run's run.json would be read as rows, now and by every later run."""
    path = write_config()
    folder = tmp_path / "data"
    folder.mkdir()
    (tmp_path / "train.jsonl").rename(folder / "train.jsonl")
    line = refused(posttune_cli(command, str(path), f"data.train.path={folder}",
                                f"checkpoint.output_dir={folder / 'out'}"))
    assert line.endswith(f"{folder / 'out'} is inside data.train.path ({folder}), a folder read whole as data: the "
                         "run's own files would be read as rows; choose a folder outside it")
    assert sorted(p.name for p in folder.iterdir()) == ["train.jsonl"]
