"""Sync GRPO with an engine other than ``builtin`` (vLLM: another copy of the policy, in its own dtype) weights
each token by the truncated importance weight ``min(pi_old / pi_behaviour, tis_cap)``, as the Ray modes do.

The engine here is the builtin one reporting its log-probs ``shift`` nats lower than they are: the learner
then finds every sampled token ``exp(shift)`` times likelier than the sampler did, so on the first step (one
pass: ratio 1, no clipping) the gradient is the builtin run's times that weight, capped at
``tis_cap`` or masked to 0 above it (``tis_mode``). ``tis_cap: null`` makes the same run as builtin's."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import posttune_grpo
import posttune_llama
import posttune_generate
import posttune_lora
import pytest
import yaml
from posttune.plugin import GenerationEngine, hookimpl, lookup
from run_support import grpo_config

pytestmark = pytest.mark.slow

VOWELS = {"name": "format", "options": {"pattern": ".*[AEIOU].*"}}  # rewards that differ within a group


@dataclass(frozen=True)
class ShiftOptions:
    shift: float  # nats taken off every behaviour log-prob the engine reports


class Shifted:
    """The builtin engine, misreporting its log-probs: a sampler whose numbers differ from the learner's."""

    def __init__(self, policy):
        self.shift = policy.options.shift
        self.inner = lookup("generation_engine", "builtin").start(dataclasses.replace(policy, options=None))

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts, sampling, seeds=None):
        made = self.inner.generate(prompts, sampling, seeds)
        return dataclasses.replace(made, logprobs=made.logprobs - self.shift * made.mask)

    def update_weights(self, weights, version):
        self.inner.update_weights(weights, version)

    def close(self):
        self.inner.close()


class ShiftedEnginePlugin:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_generation_engines(self, register):
        register(GenerationEngine("shifted", Shifted, config=ShiftOptions, description="builtin, log-probs shifted"))


@pytest.fixture
def plugins(register_plugin):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    register_plugin(ShiftedEnginePlugin(), name="shifted", distribution="posttune-shifted", version="0.1.0")


def first_step(posttune_cli, directory: Path, **method) -> dict:
    config = grpo_config(directory, method={"rewards": [VOWELS], **method}, train={"max_steps": 1})
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    return json.loads((Path(config["checkpoint"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()[0])


def test_a_non_builtin_engine_s_samples_are_weighted_by_the_truncated_ratio(plugins, posttune_cli, tmp_path):
    builtin = first_step(posttune_cli, tmp_path / "builtin")
    assert builtin["grad_norm"] > 0.01  # the rewards differ: there is a gradient (the loss itself is ~0: the
    # group-normalised advantages sum to 0 and the first pass's ratio is 1)

    def shifted(name: str, shift: float, **method) -> dict:
        return first_step(posttune_cli, tmp_path / name, engine="shifted", engine_options={"shift": shift}, **method)

    for record, weight in ((shifted("below_cap", math.log(1.5)), 1.5),                      # default cap 2
                           (shifted("capped", math.log(3.0)), 2.0),                         # min(3, 2)
                           (shifted("cap_4", math.log(3.0), tis_cap=4.0), 3.0)):
        assert record["grad_norm"] == pytest.approx(weight * builtin["grad_norm"], rel=1e-4)
    masked = shifted("masked", math.log(3.0), tis_mode="token_mask")  # every token above the cap: left out
    assert masked["grad_norm"] == 0 and masked["loss"] == 0 and masked["reward"] == builtin["reward"]
    off = shifted("off", math.log(3.0), tis_cap=None)  # no correction: the builtin run, number for number
    assert {k: v for k, v in off.items() if not k.endswith(("_s", "_per_s", "peak_memory_mib"))} == \
        {k: v for k, v in builtin.items() if not k.endswith(("_s", "_per_s", "peak_memory_mib"))}


def test_ppo_weights_its_policy_loss_the_same_way(plugins, register_plugin, posttune_cli, tmp_path):
    """PPO's policy loss (advantages not whitened, so that its first micro-batch's loss is not ~0) carries the
    same weight; its value loss does not."""
    import posttune_ppo

    register_plugin(posttune_ppo, distribution="posttune-ppo", version="0.1.0")

    def first(name: str, **method) -> dict:
        settings = {"name": "ppo", "max_new_tokens": 6, "rewards": [VOWELS], "whiten_advantages": False, **method}
        return first_step(posttune_cli, tmp_path / name, **settings)

    builtin = first("builtin")
    assert abs(builtin["policy_loss"]) > 1e-3
    for record, weight in ((first("below_cap", engine="shifted", engine_options={"shift": math.log(1.5)}), 1.5),
                           (first("capped", engine="shifted", engine_options={"shift": math.log(3.0)}), 2.0)):
        assert record["policy_loss"] == pytest.approx(weight * builtin["policy_loss"], rel=1e-4)
        assert record["value_loss"] == pytest.approx(builtin["value_loss"], rel=1e-5)
    off = first("off", engine="shifted", engine_options={"shift": math.log(3.0)}, tis_cap=None)
    assert off["policy_loss"] == builtin["policy_loss"]
