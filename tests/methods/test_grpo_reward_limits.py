"""Isolated rewards (math_answer, format, a plugin's with ``isolated=True``): each completion is scored
in a worker process under ``timeout_s``, each batch under ``budget_s``, wherever the caller runs (the
main thread, a thread, a Ray actor); a completion past either is a failure of that reward and a
timeout, and normal completions of the same batch keep their scores. A worker that cannot be
interrupted is killed and replaced; closing the pool, or killing its caller, leaves no worker.

A timed test starts the workers first: their start-up (imports, math-verify's warm-up) takes half
a second on an idle machine and several on a loaded one, and is not charged to a batch's budget.
Bounds are asserted with seconds of margin.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import posttune_grpo
import posttune_generate
import posttune_lora
import pytest
import reward_support
import yaml
from posttune.plugin import ConfigError, PosttuneError
from posttune_grpo import reward_workers
from posttune_grpo.reward_workers import KILL_GRACE_S, Call, WorkerPool
from posttune_grpo.rewards import REWARDS
from posttune_grpo.scoring import RewardSpec, resolve_rewards, score
from reward_support import ADVERSARIAL_LATEX, RewardPlugin
from run_support import grpo_config

CONTINUE = "set method.reward_errors: zero to score such completions 0 and count them"


@pytest.fixture
def rewards(register_plugin):
    """posttune-grpo's rewards and the misbehaving isolated ones of tests/reward_support.py."""
    register_plugin(RewardPlugin(*REWARDS), name="grpo", distribution="posttune-grpo", version="0.1.0")
    register_plugin(RewardPlugin(*reward_support.ISOLATED), name="hangs", distribution="test-rewards", version="1")


def in_a_thread(fn, *args, limit: float = 120.0, **kwargs):
    """``fn(*args, **kwargs)`` in another thread; fails (instead of hanging) if it is not back within ``limit``."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still running after {limit} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - started


def start_workers(reward) -> None:
    """Every worker of the pool up and warm: what a test times is scoring, not start-up."""
    size = reward_workers.shared_pool().size
    score([reward], ["q"] * size, ["\\boxed{1}"] * size, {"answer": ["1"] * size})


# ---------------------------------------------------------------------------------------------
# math_answer on completions that make sympy hang
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("caller", ["main thread", "thread"])
def test_adversarial_latex_scores_zero_within_the_limit_and_normal_completions_keep_their_scores(rewards, caller):
    (math_answer,) = resolve_rewards([RewardSpec("math_answer", timeout_s=1, budget_s=60)])
    completions = [text for pair in zip(ADVERSARIAL_LATEX, ["\\boxed{72}", "71", "so 72", "<answer>72</answer>"])
                   for text in pair]
    args = ([math_answer], ["q"] * 8, completions, {"answer": ["#### 72"] * 8})
    run = in_a_thread if caller == "thread" else (lambda fn, *a, **k: fn(*a, **k))
    start_workers(math_answer)
    result, seconds = timed(run, score, *args, on_error="zero")
    assert result.per_reward["math_answer"] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert result.failures == {"math_answer": 4} and result.timeouts == {"math_answer": 4}
    # 4 completions x 1 s over at least one worker: before the fix, 4 x 5.4 s on the main thread, or hours
    assert seconds < 4 * (1 + KILL_GRACE_S) + 5


@pytest.mark.parametrize("caller", ["main thread", "thread"])
def test_sixteen_adversarial_completions_end_within_the_batch_budget(rewards, caller):
    (math_answer,) = resolve_rewards([RewardSpec("math_answer", timeout_s=1, budget_s=4)])
    completions = ADVERSARIAL_LATEX * 4
    run = in_a_thread if caller == "thread" else (lambda fn, *a, **k: fn(*a, **k))
    start_workers(math_answer)
    result, seconds = timed(run, score, [math_answer], ["q"] * 16, completions, {"answer": ["72"] * 16},
                            on_error="zero")
    assert result.per_reward["math_answer"] == [0.0] * 16
    assert result.failures == {"math_answer": 16} and result.timeouts == {"math_answer": 16}
    assert seconds < 4 + KILL_GRACE_S + 5  # the budget, a kill's grace, and margin: before the fix, 16 x 5.4 s


def test_a_timeout_is_a_one_line_reward_error_by_default(rewards):
    (math_answer,) = resolve_rewards([RewardSpec("math_answer", timeout_s=1)])
    with pytest.raises(PosttuneError) as exc:
        score([math_answer], ["q"] * 2, ["\\boxed{72}", ADVERSARIAL_LATEX[0]], {"answer": ["72"] * 2})
    message = str(exc.value)
    assert "\n" not in message
    assert message == (f"reward 'math_answer' ({math_answer.provider}) took longer than timeout_s (1 s) for "
                       f"completion 1 (1 of 2 in this batch); {CONTINUE}")


def test_the_budget_cuts_what_is_left_and_says_so(rewards):
    (sleeps,) = resolve_rewards([RewardSpec("sleeps", timeout_s=2.5, budget_s=2.5)])
    workers = reward_workers.shared_pool().size
    texts = ["0"] + ["1"] * (5 * workers)  # 1 s each: five rounds of every worker, where the budget allows two
    n = len(texts)
    with pytest.raises(PosttuneError, match=rf"ran out of budget_s \(2\.5 s for the batch\) for completion \d+ "
                                            rf"\(\d+ of {n} in this batch\)"):
        score([sleeps], ["q"] * n, texts, {})
    # the cut killed the busy workers: their replacements start before the budget's clock does
    result, seconds = timed(score, [sleeps], ["q"] * n, texts, {}, on_error="zero")
    assert result.per_reward["sleeps"][0] == 1.0  # scored first, long before the budget ran out
    assert 2 * workers <= result.timeouts["sleeps"] == result.failures["sleeps"] < n
    assert seconds < 2.5 + KILL_GRACE_S + 6


# ---------------------------------------------------------------------------------------------
# what a worker does wrong stays with its completion
# ---------------------------------------------------------------------------------------------


def test_a_reward_that_cannot_be_interrupted_is_killed_and_its_worker_replaced(rewards):
    (deaf,) = resolve_rewards([RewardSpec("deaf", timeout_s=1)])
    pool = reward_workers.shared_pool()
    score([deaf], ["q"] * pool.size, ["0"] * pool.size, {})  # every worker the pool may have is up
    before, started = set(pool.pids()), pool.started
    result, seconds = timed(score, [deaf], ["q"] * 2, ["30", "0"], {}, on_error="zero")
    assert result.per_reward["deaf"] == [0.0, 1.0] and result.timeouts == {"deaf": 1}
    assert seconds < 1 + KILL_GRACE_S + 10
    gone = before - set(pool.pids())
    assert len(gone) == 1 and not _running(gone.pop())
    # the next call works, on a full pool again: a fresh worker took the killed one's place
    assert score([deaf], ["q"] * pool.size, ["0"] * pool.size, {}).per_reward["deaf"] == [1.0] * pool.size
    assert pool.started == started + 1 and len(pool.pids()) == pool.size


def test_an_exception_in_a_worker_fails_only_its_completion(rewards):
    (raises,) = resolve_rewards([RewardSpec("raises_on_bad")])
    result = score([raises], ["q"] * 3, ["a", "bad", "c"], {}, on_error="zero")
    assert result.per_reward["raises_on_bad"] == [1.0, 0.0, 1.0]
    assert result.failures == {"raises_on_bad": 1} and result.timeouts == {"raises_on_bad": 0}
    with pytest.raises(PosttuneError) as exc:
        score([raises], ["q"] * 3, ["a", "bad", "c"], {})
    assert str(exc.value) == (f"reward 'raises_on_bad' ({raises.provider}) raised ValueError: cannot read 'bad', "
                              f"for completion 1 (1 of 3 in this batch); {CONTINUE}")
    assert isinstance(exc.value.__cause__, ValueError)


def test_a_worker_that_dies_fails_its_completion_and_is_replaced(rewards):
    (dies,) = resolve_rewards([RewardSpec("dies_on_bad")])
    result = score([dies], ["q"] * 3, ["a", "bad", "c"], {}, on_error="zero")
    assert result.per_reward["dies_on_bad"] == [1.0, 0.0, 1.0] and result.failures == {"dies_on_bad": 1}
    with pytest.raises(PosttuneError, match=r"raised WorkerDied: the worker process died \(exit status 3\), for "
                                            r"completion 0 \(1 of 1 in this batch\)"):
        score([dies], ["q"], ["bad"], {})
    assert score([dies], ["q"], ["a"], {}).per_reward["dies_on_bad"] == [1.0]


def test_a_worker_interrupts_its_own_overrun_and_scores_on(monkeypatch):
    """A reward a signal can interrupt is stopped by the worker's own timer at timeout_s, and that worker scores
    the next completion: a kill and a fresh worker (math-verify's warm-up again) are for code deaf to the timer
    only, even after an earlier call left SIGALRM blocked (as `deaf` does). The caller's kill is put a minute
    off, so only the worker's own timer can end the hang in time."""
    monkeypatch.setattr(reward_workers, "KILL_GRACE_S", 60.0)
    pool = WorkerPool(1)
    try:
        calls = [Call(reward_support.deaf, (["q"], ["0"])), Call(reward_support.sleeps, (["q"], ["600"])),
                 Call(len, ("abc",))]
        outcomes = pool.run(calls, timeout_s=1, budget_s=300)
        assert [(o.kind, o.value) for o in outcomes] == [("ok", [1.0]), ("timeout", None), ("ok", 3)]
        assert pool.started == 1 and len(pool.pids()) == 1  # the same worker throughout
    finally:
        pool.close()


def test_a_worker_killed_while_idle_is_replaced_and_the_completion_sent_to_it_scored():
    """A worker that died between batches (the OOM killer, a stray kill) is found dead when handed a completion:
    the completion goes to its replacement, not reported as out of budget."""
    pool = WorkerPool(1)
    try:
        pool.run([Call(len, ("a",))], timeout_s=5, budget_s=60)
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)
        assert not _running(pid)
        outcomes = pool.run([Call(len, ("abc",))], timeout_s=5, budget_s=60)
        assert [(o.kind, o.value) for o in outcomes] == [("ok", 3)]
        assert pool.started == 2 and pid not in pool.pids()
    finally:
        pool.close()


def test_a_result_of_the_wrong_length_is_refused_in_a_worker_too(rewards):
    (two,) = resolve_rewards([RewardSpec("returns_two")])
    with pytest.raises(PosttuneError, match=r"returned 2 values for 1 completion; a reward function returns one"):
        score([two], ["q"], ["a"], {}, on_error="zero")


def test_completions_are_scored_in_parallel_by_several_workers(rewards):
    size = reward_workers.shared_pool().size
    if size < 2:
        pytest.skip("one CPU: one worker")
    sleeps, pid = resolve_rewards([RewardSpec("sleeps", timeout_s=5), RewardSpec("worker_pid")])
    score([sleeps], ["q"] * size, ["0"] * size, {})  # start them
    result, seconds = timed(score, [sleeps], ["q"] * size, ["1"] * size, {})
    assert result.per_reward["sleeps"] == [1.0] * size
    assert seconds < size * 1.0 - 0.3  # side by side, not one after the other
    pids = set(score([pid], ["q"] * 4 * size, ["a"] * 4 * size, {}).per_reward["worker_pid"])
    assert len(pids) > 1 and os.getpid() not in pids


# ---------------------------------------------------------------------------------------------
# a run: a timeout stops it in one line, or is scored 0 and logged
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_stops_on_a_timeout_in_one_line_or_logs_the_timeouts_per_step(register_plugin, posttune_cli, tmp_path):
    import posttune_llama
    import posttune_sft

    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(posttune_grpo, distribution="posttune-grpo", version="0.1.0")
    register_plugin(RewardPlugin(*reward_support.ISOLATED), name="hangs", distribution="test-rewards", version="1")
    method = {"rewards": [{"name": "exact_answer"}, {"name": "hangs", "timeout_s": 0.5}]}
    config = grpo_config(tmp_path, method=method, train={"max_steps": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = posttune_cli("train", str(path))
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if "posttune: error:" in line]
    assert errors == ["posttune: error: reward 'hangs' (test-rewards 1) took longer than timeout_s (0.5 s) for "
                      f"completion 0 (8 of 8 in this batch); {CONTINUE}"]
    config["method"]["reward_errors"] = "zero"
    path.write_text(yaml.safe_dump(config))
    assert posttune_cli("train", str(path)).exit_code == 0
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for step in steps:
        assert step["reward_timeouts/hangs"] == step["reward_failures/hangs"] == 8 and step["reward/hangs"] == 0.0
        assert "reward_timeouts/exact_answer" not in step  # it runs in-process: it has no limit
    assert len(steps) == 2


# ---------------------------------------------------------------------------------------------
# the pool's lifetime: no worker outlives it
# ---------------------------------------------------------------------------------------------


def test_closing_the_pool_leaves_no_worker_process():
    pool = WorkerPool(2)
    assert [o.value for o in pool.run([Call(len, ("ab",)), Call(len, ("abc",))], timeout_s=5, budget_s=60)] == [2, 3]
    pids = pool.pids()
    assert len(pids) == 2 and all(_running(pid) for pid in pids)
    pool.close()
    assert pool.pids() == []
    assert not any(_running(pid) for pid in pids)
    for pid in pids:  # and reaped: no zombie child is left either
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_worker_that_cannot_start_is_a_one_line_error():
    pool = WorkerPool(1, warm_up=(reward_support.broken_warm_up,))
    try:
        with pytest.raises(PosttuneError) as exc:
            pool.run([Call(len, ("a",))], timeout_s=5, budget_s=60)
    finally:
        pool.close()
    assert str(exc.value) == "reward workers: a worker process could not start: RuntimeError: no sympy here"
    assert pool.pids() == []


#: the process's pool in a child process, one worker idle and one busy in code that ignores SIGALRM; the
#: child prints their pids, then waits to be stopped
ORPHAN = textwrap.dedent("""
    import json, sys, threading, time
    sys.path[:0] = json.loads(sys.argv[1])
    import reward_support
    from posttune_grpo.reward_workers import Call, shared_pool

    pool = shared_pool()
    pool.run([Call(len, ("a",)), Call(len, ("b",))], timeout_s=5, budget_s=60)
    threading.Thread(target=pool.run, args=([Call(reward_support.deaf, (["q"], ["600"]))],),
                     kwargs=dict(timeout_s=600, budget_s=600), daemon=True).start()
    time.sleep(1)
    print(json.dumps(pool.pids()), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_no_worker_outlives_its_caller(stop):
    """Ctrl-C: the pool is killed at exit (atexit). SIGKILL: no cleanup runs; the idle worker reads
    end-of-file, the busy one (deaf to its own timer) is killed by the kernel with its parent."""
    child = subprocess.Popen([sys.executable, "-c", ORPHAN, json.dumps(sys.path)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, preexec_fn=_ctrl_c_on)
    try:
        pids = json.loads(child.stdout.readline())
        assert len(pids) == min(2, reward_workers.default_size()) and all(_running(pid) for pid in pids)
    finally:
        child.send_signal(stop)
        child.wait(timeout=60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # gone meanwhile; or no /proc (not Linux), where os.kill's answer stands
        return not Path("/proc").is_dir()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---------------------------------------------------------------------------------------------
# the limits are settings, checked before launch
# ---------------------------------------------------------------------------------------------


def test_isolated_rewards_default_to_five_seconds_a_completion_and_thirty_a_batch(rewards):
    math_answer, fmt, length = resolve_rewards([RewardSpec("math_answer"), RewardSpec("format"),
                                                RewardSpec("length")])
    assert (math_answer.isolated, math_answer.timeout_s, math_answer.budget_s) == (True, 5.0, 30.0)
    assert (fmt.isolated, fmt.timeout_s, fmt.budget_s) == (True, 5.0, 30.0)
    assert not length.isolated
    (short,) = resolve_rewards([RewardSpec("math_answer", timeout_s=2)])
    assert (short.timeout_s, short.budget_s) == (2.0, 12.0)  # the budget follows the limit


def test_the_ranks_of_a_node_share_its_cpus_among_their_workers(monkeypatch):
    """Each torchrun rank starts its own pool: together they use the CPUs one process may, not that many each
    (8 ranks of a 16-core node would start 64 workers), at most MAX_WORKERS and at least one per rank."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    for ranks in (1, 2, 4, 8, 32):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        assert reward_workers.default_size() == max(1, min(reward_workers.MAX_WORKERS, 16 // ranks))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")  # read as one rank
    assert reward_workers.default_size() == min(reward_workers.MAX_WORKERS, 16)


@pytest.mark.parametrize(("spec", "message"), [
    ({"timeout_s": 0}, "method.rewards[0].timeout_s: expected a positive number of seconds, got 0"),
    ({"timeout_s": -1.5}, "method.rewards[0].timeout_s: expected a positive number of seconds, got -1.5"),
    ({"timeout_s": math.inf}, "method.rewards[0].timeout_s: expected a positive number of seconds, got inf"),
    ({"budget_s": math.nan}, "method.rewards[0].budget_s: expected a positive number of seconds, got nan"),
    ({"timeout_s": True}, "method.rewards[0].timeout_s: expected a positive number of seconds, got True"),
    ({"timeout_s": 10, "budget_s": 5}, "method.rewards[0].budget_s: must be at least timeout_s (10), got 5"),
])
def test_bad_limits_are_refused_in_one_line(rewards, spec, message):
    with pytest.raises(ConfigError) as exc:
        resolve_rewards([RewardSpec("math_answer", **spec)])
    assert str(exc.value) == f"config: {message}"


def test_a_limit_on_a_reward_that_runs_in_process_is_refused(rewards):
    with pytest.raises(ConfigError) as exc:
        resolve_rewards([RewardSpec("math_answer"), RewardSpec("length", timeout_s=5)])
    assert str(exc.value) == ("config: method.rewards[1].timeout_s: reward 'length' (posttune-grpo 0.1.0) runs in "
                              "the training process (its plugin does not isolate it), so it has no time limit to set")


def test_an_isolated_reward_that_cannot_reach_a_worker_is_refused_before_launch(register_plugin):
    from posttune.plugin import RewardFunction

    def local(prompts, completions, **_):
        return [1.0 for _ in completions]

    register_plugin(RewardPlugin(RewardFunction("local", local, isolated=True)), name="local",
                    distribution="local-rewards", version="1")
    with pytest.raises(ConfigError) as exc:
        resolve_rewards([RewardSpec("local")])
    message = str(exc.value)
    assert message.startswith("config: method.rewards[0].name: reward 'local' (local-rewards 1) is isolated, but "
                              "its function cannot be sent to a worker process (")
    assert message.endswith("); its plugin must define it at module level") and "\n" not in message


# ---------------------------------------------------------------------------------------------
# in a Ray actor (async GRPO scores there)
# ---------------------------------------------------------------------------------------------

#: score adversarial and normal completions in a Ray actor; print (per-completion values, timeouts, seconds)
IN_A_RAY_ACTOR = textwrap.dedent("""
    import json, sys, time
    sys.path[:0] = json.loads(sys.argv[1])
    import ray

    @ray.remote(num_cpus=0)
    class Scorer:
        def score(self, completions):
            from posttune_grpo.scoring import RewardSpec, resolve_rewards, score
            rewards = resolve_rewards([RewardSpec("math_answer", timeout_s=1)])
            started = time.perf_counter()
            result = score(rewards, ["q"] * len(completions), completions, {"answer": ["72"] * len(completions)},
                           on_error="zero")
            return result.per_reward["math_answer"], result.timeouts["math_answer"], time.perf_counter() - started

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    scorer = Scorer.remote()
    print(json.dumps(ray.get(scorer.score.remote(json.loads(sys.argv[2])))), flush=True)
    ray.shutdown()
""")


@pytest.mark.slow
def test_adversarial_latex_is_bounded_in_a_ray_actor_too():
    pytest.importorskip("ray", reason="async GRPO needs the optional extra: pip install 'posttune-grpo[ray]'")
    completions = ["\\boxed{72}", *ADVERSARIAL_LATEX, "so 72"]
    result = subprocess.run([sys.executable, "-c", IN_A_RAY_ACTOR, json.dumps(sys.path), json.dumps(completions)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-3000:]
    values, timeouts, seconds = json.loads(result.stdout.strip().splitlines()[-1])
    assert values == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0] and timeouts == 4
    # each timeout and its kill's grace, in sequence, plus a margin for an actor on a loaded machine (a CI run
    # beside others took 23.1 s); an unbounded parse takes minutes
    assert seconds < 4 * (1 + KILL_GRACE_S) + 30


def _ctrl_c_on() -> None:
    """In the child before exec: SIGINT back to its default, so that Python makes it KeyboardInterrupt even when
    this test runs in a background job (a shell starts those with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ---------------------------------------------------------------------------------------------
# what another method relies on (docs/plugins.md, "Scoring rewards in a method of your own")
# ---------------------------------------------------------------------------------------------


def test_close_shared_pool_from_another_methods_close_leaves_no_worker(rewards):
    (slow,) = resolve_rewards([RewardSpec("deaf", timeout_s=5)])
    pool = reward_workers.shared_pool()
    assert score([slow], ["q"] * 2, ["0", "0"], {}).per_reward["deaf"] == [1.0, 1.0]
    workers = pool.pids()
    assert workers and all(_running(pid) for pid in workers)
    reward_workers.close_shared_pool()
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers)
    # a later run in the same process scores again, on new workers
    assert score([slow], ["q"], ["0"], {}).per_reward["deaf"] == [1.0]
    assert reward_workers.shared_pool() is not pool


def test_the_model_reward_is_marked_for_the_method_and_left_out_of_score(register_plugin):
    """``reward_model`` resolves with ``in_learner`` set, and ``score`` does not call it: a method without a reward
    role must refuse it in its validate, as the docs tell a method author."""
    register_plugin(RewardPlugin(*REWARDS, posttune_grpo.MODEL_REWARD_FUNCTION), name="grpo",
                    distribution="posttune-grpo", version="0.1.0")
    model, exact = resolve_rewards([RewardSpec("reward_model"), RewardSpec("exact_answer")])
    assert model.in_learner and not exact.in_learner
    scored = score([model, exact], ["q", "q"], ["a", "b"], {"answer": ["a", "a"]})
    assert scored.per_reward == {"exact_answer": [1.0, 0.0]} and scored.total == [1.0, 0.0]
