"""The exploding-step judge (training/nonfinite.py's `Probation`): a step whose loss or gradient norm is over 100x
the median of the run's recent good steps sets the checkpoint it ran on aside. The medians here are worked by
hand: losses from a floor of 0.1 up (GRPO's sit near 0), gradient norms over the positive ones (a zero-advantage
step has none), the resumed run's history counted, an exploding step never counted."""

from __future__ import annotations

from types import SimpleNamespace

from posttune.training.nonfinite import Probation

FRESH = SimpleNamespace(resume_from=None)


def history(*pairs: tuple[float, float]) -> list[dict]:
    return [{"loss": loss, "grad_norm": norm} for loss, norm in pairs]


def test_losses_near_zero_are_judged_from_the_floor():
    """GRPO-like losses of ~2e-4: a step of 0.05 is under 100 x max(median, 0.1) = 10, not exploding."""
    judge = Probation(FRESH, records=history(*[(1e-4 * (i % 3 + 1), 1.0) for i in range(20)]))
    assert judge.exploding(0.05, 1.0) is None
    assert judge.exploding(10.5, 1.0) == "loss 10.5, over 100x the run's median 0.1"


def test_steps_without_a_gradient_leave_the_norms_median_alone():
    """Six zero norms (groups whose rewards all tie) and four of 0.5: the median is 0.5's, so 0.6 is normal."""
    judge = Probation(FRESH, records=history(*[(0.0, 0.0)] * 6, *[(0.0, 0.5)] * 4))
    assert judge.exploding(0.0, 0.6) is None
    assert judge.exploding(0.0, 51.0) == "grad norm 51, over 100x the run's median 0.5"


def test_a_resumed_run_judges_its_first_step_by_the_history_before_it():
    judge = Probation(FRESH, records=history(*[(1.0, 1.0)] * 10))
    assert judge.exploding(1.0, 500.0) == "grad norm 500, over 100x the run's median 1"


def test_exploding_steps_never_join_the_history_they_are_judged_by():
    """Six spikes in a row would otherwise become the median, and the seventh pass as normal."""
    judge = Probation(FRESH, records=history(*[(1.0, 1.0)] * 5))
    judge.main = False  # nothing on disk to rename or prune
    notes = []
    for _ in range(6):
        judge.judge(SimpleNamespace(), 1.0, 1000.0, notes.append)
    assert judge.exploding(1.0, 1000.0) == "grad norm 1e+03, over 100x the run's median 1"
    judge.judge(SimpleNamespace(), 1.0, 2.0, notes.append)  # a good step joins it
    assert list(judge.grad_norms) == [1.0] * 5 + [2.0]
