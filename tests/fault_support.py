"""Run `posttune train` in a subprocess with one fault injected at a chosen moment (run-safety tests):
SIGTERM after a step, a NaN loss, an infinite gradient or a NaN weight at a step, a failed write at the Nth save
(an injected OSError, or a real short write under a file size limit)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

#: ``python -c FAULTS MODE AT CONFIG [overrides]``: arranges the fault, then runs `posttune train`.
FAULTS = textwrap.dedent("""
    import errno, os, signal, sys, time
    import torch
    from posttune.cli.main import main
    import posttune.checkpoint.hf_save as hf_save
    import posttune.training.preemption as preemption
    import posttune.training.state as state
    import posttune.training.trainer as trainer

    mode, at = sys.argv[1], int(sys.argv[2])
    step = trainer._optimizer_step

    def faulty_step(session, window, log, *rest):
        if session.step + 1 == at or (mode == "inf_grad_twice" and session.step + 1 == at + 1):
            if mode == "nan_loss":
                reduce = window.reduce
                window.reduce = lambda s, *extra: {**reduce(s, *extra), "loss": float("nan")}
            elif mode.startswith("inf_grad"):
                for param in session.model.parameters():
                    if param.grad is not None:
                        param.grad.fill_(float("inf"))
            elif mode == "nan_weight":  # what an overflowing update leaves behind; loss and grads are fine
                next(p for p in session.model.parameters() if p.requires_grad).data[0] = float("nan")
        tokens = step(session, window, log, *rest)
        if mode.startswith("term") and session.step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return tokens

    trainer._optimizer_step = faulty_step
    if mode == "term2":  # a second SIGTERM, well after the first, while the checkpoint is written
        save = state.save_checkpoint

        def save_after_second_signal(session):
            time.sleep(preemption.DUPLICATE_S + 0.5)
            os.kill(os.getpid(), signal.SIGTERM)
            return save(session)

        state.save_checkpoint = save_after_second_signal

    code = {"enospc": errno.ENOSPC, "eacces": errno.EACCES}
    real_save, saves = torch.save, []

    def failing_save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            saves.append(path)
            if len(saves) == at and mode == "fsize":  # a real short write: torch's own error, as on a full disk
                import resource

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
                try:
                    return real_save(obj, path, *args, **kwargs)
                finally:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            if len(saves) == at:
                raise OSError(code[mode], os.strerror(code[mode]), str(path))
        return real_save(obj, path, *args, **kwargs)

    real_write = hf_save.write_file

    def failing_final_write(path, *args, **kwargs):
        if "checkpoints" not in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, *args, **kwargs)

    if mode in code or mode == "fsize":
        torch.save = failing_save
    elif mode == "final_enospc":
        hf_save.write_file = failing_final_write
    elif mode == "final_term":  # SIGTERM as the final model's first file is written
        real_final = hf_save.write_file

        def signalled_write(path, *args, **kwargs):
            if "checkpoints" not in str(path):
                os.kill(os.getpid(), signal.SIGTERM)
            return real_final(path, *args, **kwargs)

        hf_save.write_file = signalled_write
    sys.exit(main(["train", *sys.argv[3:]]))
""")


def train(*args: str, fault: tuple[str, int] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`posttune train ARGS` in a fresh process, with ``fault`` = (mode, step or save number) injected."""
    if fault is None:
        command = [sys.executable, "-m", "posttune.cli.main", "train", *args]
    else:
        command = [sys.executable, "-c", FAULTS, fault[0], str(fault[1]), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a failed run printed on stderr (progress bars and notes aside); asserts there is one."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("posttune:")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def tree_digest(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path: equal digests, byte-identical trees."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}
