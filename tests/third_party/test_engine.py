"""A third-party generation engine (``recorder``, posttune_thirdparty/engine.py) chosen by name in the
method's config: GRPO and on-policy KD generate with it (the same numbers as the core's own engine,
which it wraps), bring it to each step's weights before generating, and close it when the run ends;
an unknown name is refused before launch with a suggestion."""

from __future__ import annotations

import json
from pathlib import Path

import posttune_grpo
import posttune_kd
import posttune_llama
import posttune_generate
import posttune_lora
import pytest
import yaml
from posttune.plugin import hookimpl
from posttune_thirdparty import engine
from run_support import grpo_config, kd_config, save_hf_teacher

TIMING = ("_s", "_per_s", "peak_memory_mib")
VOWELS = {"name": "format", "options": {"pattern": ".*[AEIOU].*"}}


class EnginePlugin:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_generation_engines(self, register):
        engine.register_generation_engines(register)


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    register_plugin(posttune_kd, distribution="posttune-kd", version="0.1.0")
    register_plugin(EnginePlugin(), name="thirdparty", distribution="posttune-thirdparty", version="0.1.0")


def train(posttune_cli, config: dict, name: str) -> list[dict]:
    path = Path(config["checkpoint"]["output_dir"]).parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    lines = (Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.endswith(TIMING)} for line in lines]


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_grpo_generates_with_the_engine_its_config_names_and_closes_it(plugins, posttune_cli, tmp_path):
    def config(directory: Path, **method) -> dict:
        made = grpo_config(directory, method={"rewards": [VOWELS], **method}, train={"max_steps": 3, "lr": 5e-3,
                                                                                        "eval_every": 3})
        made["data"]["validation"] = dict(made["data"]["train"])
        return made

    log = tmp_path / "engine.jsonl"
    # tis_cap: null, as any engine but builtin gets the importance-weight correction (test_grpo_engine_tis.py)
    ours = train(posttune_cli, config(tmp_path / "recorder", engine="recorder", engine_options={"log": str(log)},
                                      tis_cap=None), "recorder")
    assert ours == train(posttune_cli, config(tmp_path / "builtin"), "builtin")  # it wraps builtin: same numbers
    seen = events(log)
    assert [e["event"] for e in seen if e["event"] in ("start", "close")] == ["start", "close"]
    assert seen[0] == {**seen[0], "event": "start", "live": True} and seen[-1]["event"] == "close"
    rollouts = [e for e in seen if e["event"] == "generate" and e["seeded"]]
    assert [(e["version"], e["temperature"], e["rows"]) for e in rollouts] == [(0, 1.0, 8), (1, 1.0, 8), (2, 1.0, 8)]
    validation = [e for e in seen if e["event"] == "generate" and not e["seeded"]]
    assert validation and all(e["temperature"] == 0.0 and e["version"] == 3 for e in validation)  # greedy, step 3
    # brought to each new step's weights before it generated again (the live policy: no state dict sent)
    assert [(e["version"], e["weights"]) for e in seen if e["event"] == "update"] == [(1, False), (2, False),
                                                                                    (3, False)]


def test_on_policy_kd_samples_with_the_named_engine_and_closes_it(plugins, posttune_cli, tmp_path):
    teacher = save_hf_teacher(tmp_path / "teacher")
    log = tmp_path / "engine.jsonl"
    config = kd_config(tmp_path / "run", teacher, method={"on_policy_fraction": 1.0, "max_new_tokens": 4,
                                                          "engine": "recorder", "engine_options": {"log": str(log)}},
                       train={"max_steps": 2})
    train(posttune_cli, config, "kd")
    seen = [(e["event"], e["version"]) for e in events(log)]
    assert seen == [("start", 0), ("generate", 0), ("update", 1), ("generate", 1), ("close", 1)]


@pytest.mark.parametrize(("method", "message"), [
    ({"engine": "recordr"}, "config: method.engine: no generation engine 'recordr' is installed (installed: builtin, "
                            "recorder) (did you mean 'recorder'?)"),
    ({"engine": "recorder"}, "config: method.engine_options.log: "),
    ({"engine_options": {"log": "x"}},
     "config: method.engine_options: generation engine 'builtin' (posttune-generate "),
])
def test_an_unknown_engine_or_bad_options_are_refused_before_launch(plugins, posttune_cli, tmp_path, method,
                                                                     message):
    for name, made in (("grpo", grpo_config(tmp_path / "grpo", method=method)),
                       ("kd", kd_config(tmp_path / "kd", tmp_path / "teacher", method=method))):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(made))
        result = posttune_cli("validate", str(path))
        assert result.exit_code == 2 and result.stderr.startswith(f"posttune: error: {message}"), (name, result.stderr)
        assert len(result.stderr.splitlines()) == 1


def test_posttune_ls_engines_lists_each_engine_with_its_distribution(plugins, posttune_cli):
    result = posttune_cli("ls", "engines")
    assert result.exit_code == 0
    assert [line.split()[:2] for line in result.stdout.splitlines()] == [["builtin", "posttune-generate"],
                                                                         ["recorder", "posttune-thirdparty"]]
