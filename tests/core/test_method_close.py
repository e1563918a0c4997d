"""Method.close: what a method opened is closed by the core once, on every way out of a run that
reached the method's setup -- success, an error in a step, a bug, Ctrl-C, SIGTERM (preemption) and
a setup that raised -- and a close that fails is a warning, not the run's outcome.

The method is SFT with a close that records the step it was called at, and a loss that fails at
a chosen step the way each exit needs."""

from __future__ import annotations

import dataclasses
import os
import signal

import posttune_llama
import posttune_generate
import posttune_lora
import posttune_sft
import pytest
import yaml
from posttune.plugin import PosttuneError, hookimpl
from run_support import sft_config

CLOSED: list[int] = []  # the step each close was called at
FAULT: dict = {}  # {"kind": ..., "step": N}: the loss of step N fails that way (once)


def faulty(loss):
    def call(session, batch):
        if FAULT.get("step") == session.step + 1:
            kind = FAULT.pop("kind")
            FAULT.clear()
            if kind == "error":
                raise PosttuneError("a step failed")
            if kind == "bug":
                raise RuntimeError("a bug in a step")
            if kind == "interrupt":
                raise KeyboardInterrupt
            if kind == "float":  # not a LossOutput: the plugin's error, named
                return 0.5
            if kind == "text_metric":  # a metric that is no number
                out = loss(session, batch)
                return dataclasses.replace(out, metrics={**out.metrics, "x": "text"})
            os.kill(os.getpid(), signal.SIGTERM)  # the step completes, then the run saves and stops
        return loss(session, batch)

    return call


def data(session, dataset, split):
    return 42 if FAULT.get("data") else DATA[0](session, dataset, split)


DATA: list = []  # SFT's data


def setup(session):
    if FAULT.pop("setup", False):
        raise PosttuneError("setup failed half-way")


def close(session):
    CLOSED.append(session.step)
    if FAULT.pop("close", False):
        raise RuntimeError("the engine would not stop")


class ClosingSFT:
    POSTTUNE_PLUGIN_API = 2

    @hookimpl
    def posttune_register_methods(self, register):
        found = []
        posttune_sft.posttune_register_methods(found.append)
        sft = found[0]
        DATA[:] = [sft.data]
        register(dataclasses.replace(sft, name="closing_sft", loss=faulty(sft.loss), setup=setup, close=close,
                                     data=data))


@pytest.fixture
def run(register_plugin, posttune_cli, tmp_path):
    register_plugin(posttune_llama, distribution="posttune-llama", version="0.1.0")
    register_plugin(posttune_lora, distribution="posttune-lora", version="0.1.0")
    register_plugin(posttune_generate, distribution="posttune-generate", version="0.1.0")
    register_plugin(posttune_sft, distribution="posttune-sft", version="0.1.0")
    register_plugin(ClosingSFT(), name="closing", distribution="closing-sft", version="1")
    CLOSED.clear()
    FAULT.clear()

    def train(**fault):
        FAULT.update(fault)
        config = sft_config(tmp_path, method={"name": "closing_sft"}, train={"max_steps": 3})
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        return posttune_cli("train", str(path))

    yield train
    FAULT.clear()


def test_a_finished_run_closes_the_method_once(run):
    assert run().exit_code == 0
    assert CLOSED == [3]


@pytest.mark.parametrize(("kind", "exit_code"), [("error", 2), ("interrupt", 130), ("sigterm", 143)])
def test_a_run_that_stops_early_closes_the_method_once(run, kind, exit_code):
    result = run(kind=kind, step=2)
    assert result.exit_code == exit_code, result.stderr
    assert CLOSED == [2 if kind == "sigterm" else 1]  # preempted after step 2 completes; the others in step 2
    if kind == "interrupt":  # what Ctrl-C kept, and how to stop with a checkpoint instead
        assert ("posttune: Ctrl-C at step 1 saves nothing, and the run has no checkpoint yet (checkpoint.save_every "
                "sets how often one is written); SIGTERM (kill PID) stops after the current step with a checkpoint\n"
                "posttune: interrupted\n") in result.stderr


def test_a_loss_that_is_not_a_loss_output_is_one_line_naming_the_method(run):
    result = run(kind="float", step=2)
    assert result.exit_code == 2
    assert result.stderr.endswith("posttune: error: method 'closing_sft' (closing-sft 1): loss returned float, not a "
                                  "LossOutput(loss_sum, normaliser, ...)\n")
    assert CLOSED == [1]


def test_a_metric_that_is_no_number_is_one_line_naming_the_method_and_metric(run):
    result = run(kind="text_metric", step=2)
    assert result.exit_code == 2
    assert result.stderr.endswith("posttune: error: method 'closing_sft' (closing-sft 1): loss's metric 'x' is "
                                  "'text', not a number, a scalar tensor or a (total, count) pair of them\n")


def test_data_that_is_no_loader_is_one_line_naming_the_method(run):
    """It said ``train.max_steps: required: method ... makes its batches as it goes`` (42 has no len)."""
    result = run(data=True)
    assert result.exit_code == 2
    assert result.stderr.endswith("posttune: error: method 'closing_sft' (closing-sft 1): data returned int for "
                                  "train, not an iterable of batches (a loader)\n")


def test_a_bug_in_a_step_still_closes_the_method(run):
    with pytest.raises(RuntimeError, match="a bug in a step"):
        run(kind="bug", step=2)
    assert CLOSED == [1]


def test_a_setup_that_raised_is_closed_too(run):
    result = run(setup=True)
    assert result.exit_code == 2 and result.stderr.endswith("posttune: error: setup failed half-way\n")
    assert CLOSED == [0]


def test_a_close_that_fails_is_a_warning_and_the_run_succeeds(run):
    result = run(close=True)
    assert result.exit_code == 0
    assert CLOSED == [3]
    assert "posttune: warning: method 'closing_sft' failed to close: RuntimeError: the engine would not stop" \
        in result.stderr
