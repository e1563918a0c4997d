"""The bundled CPU example, in full (slow): train the tiny teacher, then distil it into the smaller
student, off-policy and on-policy: the last validation divergence is at most the fraction of the
first that the config states, and the student answers unseen strings right."""

from __future__ import annotations

import json

import posttune_kd
import pytest
from run_support import run_python, stated_number

pytestmark = [pytest.mark.slow, pytest.mark.example]
CONFIG = posttune_kd.CONFIGS / "kd-tiny-reverse.yaml"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    out = tmp_path_factory.mktemp("kd-example") / "teacher"
    run_python("-m", "posttune_kd.example", "prepare-teacher", "--out", str(out), timeout=900)
    return out


@pytest.mark.parametrize("on_policy_fraction", [0.0, 0.5], ids=["off_policy", "on_policy"])
def test_the_cpu_example_distils_the_teacher(teacher, tmp_path, on_policy_fraction):
    out = tmp_path / "run"
    run_python("-m", "posttune.cli.main", "train", "kd-tiny-reverse", f"teacher.path={teacher}",
               f"checkpoint.output_dir={out}", f"method.on_policy_fraction={on_policy_fraction}", timeout=1800)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    divergences = [r["val_divergence"] for r in records if "val_divergence" in r]
    assert len(divergences) >= 4
    assert divergences[-1] <= stated_number(CONFIG, "divergence fall") * divergences[0], divergences
    check = run_python("-m", "posttune_llama.demo.check", str(out / "model"), timeout=600)
    assert json.loads(check.stdout[check.stdout.index("{"):])["exact_match"] >= 0.8
