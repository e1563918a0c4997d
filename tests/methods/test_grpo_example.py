"""The bundled CPU example, in full (slow): prepare the warm start, then GRPO -- sync, and async on Ray
-- raises the mean reward: the last 20 steps' mean beats the first 20's by the margin the config states."""

from __future__ import annotations

import pytest
from run_support import check_grpo_example_rises, prepare_grpo_example

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    return prepare_grpo_example(tmp_path_factory.mktemp("grpo-example") / "start")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_cpu_example_raises_the_mean_reward(warm_start, tmp_path, mode):
    if mode == "async":
        pytest.importorskip("ray", reason="async mode needs pip install 'posttune-grpo[ray]'")
    check_grpo_example_rises(warm_start, tmp_path / "run", f"method.mode={mode}")
