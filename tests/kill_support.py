"""Kill a `posttune train` run at a chosen moment (for exact-resume tests), and read its losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

#: Runs `posttune train CONFIG` after arranging for this very process to be SIGKILLed at a chosen
#: moment, so the kill lands at the same place every time (a timer could miss a 20-step run).
KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from posttune.cli.main import main
    import posttune.training.trainer as trainer

    mode, at = sys.argv[1], int(sys.argv[2])
    step = trainer._optimizer_step

    def kill_after_step(session, window, log, *rest):
        tokens = step(session, window, log, *rest)
        if session.step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return tokens

    real_save = torch.save
    saves = []

    def kill_while_saving(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        if str(path).endswith("optimizer.pt"):
            saves.append(path)
            if len(saves) == at:
                os.kill(os.getpid(), signal.SIGKILL)

    if mode == "step":
        trainer._optimizer_step = kill_after_step
    else:
        torch.save = kill_while_saving
    sys.exit(main(["train", *sys.argv[3:]]))
""")


def run(*args: str, killer: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    if killer is None:
        command = [sys.executable, "-m", "posttune.cli.main", "train", *args]
    else:
        command = [sys.executable, "-c", KILLER, killer[0], str(killer[1]), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**REPRODUCIBLE, **os.environ})


#: what two fresh CPU processes need to round alike (tox sets them too): a fixed thread count for
#: torch's BLAS (Intel MKL) and its conditional-reproducibility mode, which keeps its rounding
#: independent of the operands' memory alignment (different in every process)
REPRODUCIBLE = {"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE", "MKL_CBWR": "AUTO,STRICT"}


def losses(output_dir: Path) -> list[tuple[int, float]]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def together(*calls: Callable[[], T]) -> list[T]:
    """The results of independent ``calls`` (each starting its own `posttune train` process, e.g. an
    uninterrupted run and the one to kill), run at the same time: on a 2-core machine the second
    core trains too. What a run computes does not depend on what else runs (REPRODUCIBLE: fixed
    thread counts and rounding), and a killer lands at a step, not at a time."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def killed_and_resumed(tmp_path: Path, config_for: Callable[[Path], dict], keys: tuple[str, ...]) -> list[tuple]:
    """An uninterrupted run beside the same run SIGKILLed at step 5 (``config_for(folder)`` saves checkpoints
    before it), then the killed one resumed with ``checkpoint.resume=latest``: the uninterrupted run's
    per-step (step, *keys), after checking that the resumed run logged exactly those."""
    import yaml

    paths = {}
    for name in ("straight", "killed"):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config_for(tmp_path / name)))
    straight, killed = together(lambda: run(str(paths["straight"])),
                                lambda: run(str(paths["killed"]), killer=("step", 5)))
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -9
    resumed = run(str(paths["killed"]), "checkpoint.resume=latest")
    assert resumed.returncode == 0, resumed.stderr

    def curve(name: str) -> list[tuple]:
        records = map(json.loads, (tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], *(r[key] for key in keys)) for r in records]

    expected, killed_curve = curve("straight"), curve("killed")
    assert killed_curve[:4] == expected[:4], ("two fresh runs differed before the kill: this machine does not round "
                                             "alike run to run (docs/training.md, resume), not a resume defect")
    assert killed_curve == expected
    return expected
