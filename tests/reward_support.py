"""Rewards that misbehave in worker processes, for the tests of isolated rewards.

A worker receives a reward function by its importable name, so these live at module level in a
module without heavy imports (a worker imports it on its first call).
"""

from __future__ import annotations

import os
import signal
import time

from posttune.plugin import RewardFunction, hookimpl

class RewardPlugin:
    """A plugin object registering the given reward functions."""

    POSTTUNE_PLUGIN_API = 2

    def __init__(self, *rewards: RewardFunction):
        self.rewards = rewards

    @hookimpl
    def posttune_register_reward_functions(self, register):
        for reward in self.rewards:
            register(reward)


#: completions that keep math-verify (sympy) busy far beyond any sane limit
ADVERSARIAL_LATEX = ["\\boxed{9^{9^{9}}}", "\\boxed{10^{10^{10}}}", "\\boxed{(9^{9})!}", "\\boxed{9^{9^{9}} + 1}"]


def sleeps(prompts, completions, **_):
    """Sleeps as many seconds as the completion says, then scores 1 (a hang a signal can interrupt)."""
    for text in completions:
        time.sleep(float(text))
    return [1.0 for _ in completions]


def hangs(prompts, completions, **_):
    """Never finishes in time (a minute per completion, which a signal interrupts)."""
    time.sleep(60)
    return [1.0 for _ in completions]


def deaf(prompts, completions, **_):
    """Sleeps with SIGALRM blocked, as C code that never checks for signals would: only a kill ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    for text in completions:
        time.sleep(float(text))
    return [1.0 for _ in completions]


def raises_on_bad(prompts, completions, **_):
    if "bad" in completions:
        raise ValueError("cannot read 'bad'\nsecond line")
    return [1.0 for _ in completions]


def dies_on_bad(prompts, completions, **_):
    if "bad" in completions:
        os._exit(3)
    return [1.0 for _ in completions]


def returns_two(prompts, completions, **_):
    return [1.0, 1.0]


def worker_pid(prompts, completions, **_):
    return [float(os.getpid()) for _ in completions]


def broken_warm_up():
    """A worker's warm-up that fails, as an import missing in the workers' environment would."""
    raise RuntimeError("no sympy here\nsecond line")


ISOLATED = tuple(RewardFunction(fn.__name__, fn, f"{fn.__name__} (test)", isolated=True)
                 for fn in (sleeps, hangs, deaf, raises_on_bad, dies_on_bad, returns_two, worker_pid))
