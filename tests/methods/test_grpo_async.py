"""Async GRPO on Ray with 2 local actors: the run completes, the learner does not wait when rollouts are
ready, no rollout older than max_staleness is trained on (from the logged versions), and killing an
actor mid-run does not stop training (it is restarted and given the current weights). When the run
ends, the method's close leaves no Ray actor, Ray process or reward worker behind."""

from __future__ import annotations

import contextlib
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
    import posttune_grpo.method as method
    from posttune.cli.main import main

    on_step_end = method.on_step_end

    def kill_at_step_3(session, record):
        on_step_end(session, record)
        if session.step == 3:
            ray.kill(session.method_state.source.pool.actors[0], no_restart=False)

    method.on_step_end = kill_at_step_3
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



def test_async_grpo_closes_its_actors_ray_and_reward_workers(register_plugin, posttune_cli, tmp_path, monkeypatch):
    """In this process: every process the run started (Ray's, the actors', their reward workers), as seen
    just before the method's close, is gone once `posttune train` returns, and Ray is shut down."""
    import posttune_grpo
    import posttune_grpo.method as method
    import posttune_llama
    import psutil
    import ray

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    config = grpo_config(tmp_path, method={"rewards": [ANY_VOWEL], "mode": "async", "async_options": {"actors": 2}},
                         train={"max_steps": 3})
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(config))
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    started: dict[psutil.Process, str] = {}  # every process the run started -> its command line
    close = method.close

    def seen_then_closed(session):
        for child in me.children(recursive=True):
            if child.pid not in before:
                with contextlib.suppress(psutil.Error):
                    started[child] = " ".join(child.cmdline())
        close(session)

    monkeypatch.setattr(method, "close", seen_then_closed)
    assert not ray.is_initialized()
    result = posttune_cli("train", str(path))
    assert result.exit_code == 0, result.stderr
    assert not ray.is_initialized()
    workers = [child for child, command in started.items() if "reward_workers" in command]
    assert len(workers) >= 2 and len(started) > len(workers)  # each actor scored in workers; Ray ran processes
    _, alive = psutil.wait_procs(list(started), timeout=30)
    assert not alive, [started[child][:200] for child in alive]
