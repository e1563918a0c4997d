"""The best checkpoint by an evaluation metric, and stopping when that metric stops improving.

``checkpoint.best_metric`` (transformers' ``metric_for_best_model``) names a metric the evaluation
logs (``val_loss``; a method's own, e.g. GRPO's ``val_reward``). Pruning to ``keep_last`` never
deletes the best checkpoint, and the summary names it. ``train.early_stopping_patience`` ends the
run, as a finished one, after that many evaluations in a row without a strictly better value
(transformers' ``EarlyStoppingCallback``). The values come from the evaluations themselves, read back
from ``metrics.jsonl`` on resume, so nothing else is stored and a resumed run judges as the
uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttune.errors import ConfigError


@dataclass
class Best:
    """``checkpoint.best_metric``'s value at each evaluation of the run, and the judgements drawn from them."""

    metric: str | None
    greater: bool = False
    patience: int | None = None
    scores: dict[int, float] = field(default_factory=dict)  # step -> the metric's value at each evaluation

    @classmethod
    def of(cls, config: Any, records: Iterable[Mapping[str, Any]] = ()) -> Best:
        """For a run's config, with the evaluations of the run it resumes (metrics.jsonl's records)."""
        metric = config.checkpoint.best_metric
        greater = config.checkpoint.greater_is_better
        best = cls(metric, (not str(metric).endswith("loss")) if greater is None else greater,
                   config.train.early_stopping_patience)
        for record in records:
            if metric is not None and isinstance(record.get(metric), (int, float)):
                best.scores[int(record["step"])] = float(record[metric])
        return best

    def evaluated(self, step: int, results: Mapping[str, Any]) -> None:
        if self.metric is None:
            return
        if self.metric not in results:
            raise ConfigError("checkpoint.best_metric", f"the evaluation logs no '{self.metric}' (it logs: "
                                                        f"{', '.join(sorted(results))})")
        self.scores[step] = float(results[self.metric])

    def best_step(self, steps: Iterable[int] | None = None) -> int | None:
        """The scored step with the best value among ``steps`` (all evaluations by default); the earliest of equals."""
        scored = sorted(s for s in (self.scores if steps is None else steps) if s in self.scores)
        best = None
        for step in scored:
            if best is None or self._better(self.scores[step], self.scores[best]):
                best = step
        return best

    def best_checkpoint(self, checkpoints: Iterable[Path]) -> Path | None:
        """The best scored of ``checkpoints`` (``step-N`` folders), or None."""
        from posttune.training.output_dir import STEP_DIR

        by_step = {int(match.group(1)): path for path in checkpoints if (match := STEP_DIR.match(path.name))}
        step = self.best_step(by_step)
        return by_step[step] if step is not None else None

    def stop_reason(self) -> str | None:
        """Why the run stops early now, or None: ``patience`` evaluations since the best, none better."""
        best = self.best_step()
        if self.patience is None or best is None:
            return None
        since = sum(1 for step in self.scores if step > best)
        if since < self.patience:
            return None
        return (f"{self.metric} has not improved for {since} evaluations (best {self.scores[best]:.6g} at step "
                f"{best}; train.early_stopping_patience: {self.patience})")

    def _better(self, value: float, than: float) -> bool:
        return value > than if self.greater else value < than
