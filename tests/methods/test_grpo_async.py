"""Async GRPO on Ray with 2 local actors: the run completes, the learner does not wait when rollouts are
ready, no rollout older than max_staleness is trained on (from the logged versions), and killing an
actor mid-run does not stop training (it is restarted and given the current weights)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml
from run_support import grpo_config

pytest.importorskip("ray", reason="async GRPO needs the optional extra: pip install 'posttune-grpo[ray]'")
pytestmark = pytest.mark.slow

ANY_VOWEL = {"name": "format", "options": {"pattern": ".*[AEIOU].*"}}
MAX_STALENESS = 1

#: `posttune train` in this process, killing actor 0 with Ray right after optimizer step 3
KILL_AN_ACTOR = textwrap.dedent("""
    import sys
    import ray
    import posttune_grpo.async_ray as async_ray
    from posttune.cli.main import main

    after_step = async_ray.after_step

    def kill_at_step_3(session, record):
        after_step(session, record)
        if session.step == 3:
            ray.kill(session.method_state.pool.actors[0], no_restart=False)

    async_ray.after_step = kill_at_step_3
    sys.exit(main(["train", sys.argv[1]]))
""")


def test_async_grpo_on_two_actors_survives_a_killed_actor(tmp_path):
    config = grpo_config(tmp_path, rows=32,
                         method={"rewards": [ANY_VOWEL], "mode": "async",
                                 "async_options": {"actors": 2, "queue_size": 2, "max_staleness": MAX_STALENESS}},
                         train={"max_steps": 10, "lr": 1e-3})
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-c", KILL_AN_ACTOR, str(path)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, 11))
    for record in steps:
        # trained only on rollouts at most max_staleness versions behind the weights it updated
        assert (record["step"] - 1) - record["rollout_version_min"] <= MAX_STALENESS
        assert record["staleness_max"] <= MAX_STALENESS
        if record["rollouts_ready"] > 0:  # rollouts were waiting: the learner took one at once
            assert record["rollout_wait_s"] < 0.05, record
    assert steps[-1]["actor_restarts"] >= 1  # the killed actor came back and training went on
    assert steps[-1]["policy_version"] == 10
    assert (tmp_path / "out" / "model" / "config.json").is_file()
