"""Pass torchrun's arguments through to ``torch.distributed.run``, PyTorch's own launcher."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from posttune.errors import PosttuneError, RetryableError

#: set for the workers of `posttune train`'s launch: the launcher prints a user error, once
REPORTS = "POSTTUNE_LAUNCHER_REPORTS"

def _count(low: int, high: int | None = None, words: tuple[str, ...] = ()) -> Any:
    """An argparse type: an integer in [low, high] (or one of ``words``), kept as the text torchrun reads, so
    that a typo is refused when the command is read, not in a traceback from torchrun (`validate` too)."""

    def read(text: str) -> str:
        if text in words or (text.isdigit() and low <= int(text) <= (high if high is not None else int(text))):
            return text
        bound = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
        raise argparse.ArgumentTypeError(f"expected {bound}{''.join(f' or {w}' for w in words)}, got {text!r}")

    return read


def _nodes(text: str) -> str:
    """``--nnodes``: M, or MIN:MAX for an elastic job."""
    low, colon, high = text.partition(":")
    if low.isdigit() and int(low) >= 1 and (not colon or (high.isdigit() and int(high) >= int(low))):
        return text
    raise argparse.ArgumentTypeError(f"expected a number of nodes >= 1, or MIN:MAX, got {text!r}")


#: torchrun options `posttune train` accepts, with the argparse settings for each.
TORCHRUN_OPTIONS: dict[str, dict] = {
    "--nproc-per-node": {"metavar": "N", "help": "processes per node (torchrun)",
                         "type": _count(1, words=("auto", "cpu", "gpu", "xpu"))},
    "--nnodes": {"metavar": "M or MIN:MAX", "help": "number of nodes (torchrun)", "type": _nodes},
    "--node-rank": {"metavar": "R", "help": "this node's rank, for static rendezvous (torchrun; c10d assigns ranks)",
                    "type": _count(0)},
    "--rdzv-endpoint": {"metavar": "HOST:PORT", "help": "rendezvous endpoint (torchrun)"},
    "--rdzv-backend": {"metavar": "NAME", "help": "rendezvous backend, e.g. c10d (torchrun)"},
    "--rdzv-id": {"metavar": "ID", "help": "rendezvous job id (torchrun)"},
    "--rdzv-conf": {"metavar": "KEY=VALUE,...", "help": "rendezvous settings, e.g. join_timeout=120: how long "
                                                        "nodes wait for the others to join (torchrun; default 600)"},
    "--master-addr": {"metavar": "HOST", "help": "master address for static rendezvous (torchrun)"},
    "--master-port": {"metavar": "PORT", "help": "master port for static rendezvous (torchrun)",
                      "type": _count(1, 65535)},
    "--max-restarts": {"metavar": "K", "help": "worker group restarts on failure (torchrun)", "type": _count(0)},
}


def add_torchrun_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distributed launch (passed to torchrun)")
    for flag, settings in TORCHRUN_OPTIONS.items():
        spellings = dict.fromkeys([flag, flag.replace("-", "_").replace("__", "--")])  # --nnodes: once
        group.add_argument(*spellings, default=None, **settings)
    group.add_argument("--standalone", action="store_true", help="single-node rendezvous (torchrun)")


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The torchrun flags the user gave, in torchrun's spelling."""
    out: list[str] = []
    for flag in TORCHRUN_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    if args.standalone:
        out.append("--standalone")
    return out


def world_size(args: argparse.Namespace) -> int | None:
    """Processes the launch will start, or None when elastic (``--nnodes 1:4``) or unparseable."""
    try:
        nproc = int(args.nproc_per_node or 1)
        nnodes = int(args.nnodes or 1)
    except ValueError:
        return None
    return nproc * nnodes


def check_slurm_tasks(args: argparse.Namespace) -> None:
    """Refuse `srun -n N posttune train` with fewer nodes launched than SLURM tasks: each task would train the whole
    run alone (N copies; on one output directory all but one stop with status 75, which a requeue script
    retries). posttune launches the processes itself: one SLURM task per node (docs/parallel.md)."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")  # srun's step, not the batch script (its SLURM_NTASKS)
    if "WORLD_SIZE" in os.environ or not tasks.isdigit() or int(tasks) <= 1:
        return
    nodes = args.nnodes or "1"
    if nodes.isdigit() and int(nodes) < int(tasks):
        raise PosttuneError(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) and this launch spans {nodes} "
                            "node(s): each task would train the whole run alone; start one task per node (srun "
                            "--ntasks-per-node 1) and give posttune --nproc-per-node, with --nnodes and --rdzv-* "
                            "across nodes")


def leave_to_launcher(exc: BaseException, line: str, show: bool = True) -> None:
    """How a worker says why it ended: in its torchrun error file, which the launcher reads for its one line, and
    on stderr (when ``show``) only where no posttune launcher reports the job (torchrun started the worker itself).
    Outside torchrun the error file is not set and only the line is printed."""
    import sys

    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(exc)
    if show and not os.environ.get(REPORTS):
        print(line, file=sys.stderr)


def run_torchrun(args: argparse.Namespace, module: str, module_args: list[str], output: Path | None = None) -> int:
    """Start ``python -m module module_args`` on every rank through torchrun.

    When a rank fails, torchrun stops the others; the first failure is reported in one line, and
    written as the job's status in ``output``'s run.json (rank 0, stopped by torchrun's SIGTERM,
    may have recorded "preempted" there). Preempted workers (exit status 143, docs/training.md)
    make the launcher exit with 143 too; so does a SIGTERM to the launcher itself, which torchrun
    forwards to the workers.
    """
    import sys

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from posttune.training.output_dir import record_job_failure
    from posttune.training.preemption import PREEMPTED, StoppedInSetup

    quiet = _quiet_agent()
    os.environ[REPORTS] = "1"  # the workers leave a user error to this process's one line
    try:
        torchrun.main([*torchrun_args(args), "-m", module, *module_args])
    except SignalException as exc:
        print(f"posttune: stopped by {exc.sigval.name}: the workers saved a checkpoint at their current step if "
              "they finished it within TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds", file=sys.stderr)
        return PREEMPTED
    except ChildFailedError as exc:
        rank, failure = first_failure(exc.failures)
        if failure.exitcode == PREEMPTED:  # the workers printed where they saved; stopped in setup, they recorded it
            if (note := reported(failure.message)).startswith(f"{StoppedInSetup.__name__}: "):
                print(f"posttune: {note.partition(': ')[2]}", file=sys.stderr)
            return PREEMPTED
        # killed by a signal (the OOM killer, a lost node): the machine's failure, worth a retry; any other exit is
        # the worker's own error, said by it
        kind = RetryableError if failure.exitcode < 0 else PosttuneError
        error = f"rank {rank} failed (exit code {failure.exitcode}): {reported(failure.message)}"
        if output is not None:
            record_job_failure(output, error, {each.pid for each in exc.failures.values()})
        raise kind(error) from None
    finally:
        os.environ.pop(REPORTS, None)
        for logger, level in quiet.items():
            logger.setLevel(level)
    return 0


#: what a rank's collective raises when another rank's process is gone (gloo, NCCL): a symptom, not a cause
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure to report: the earliest of the ranks that ended on their own. A rank killed by a signal
    (negative exit code) is usually one torchrun stopped after another rank failed, even when it had recorded the
    same error first; it is reported only when every rank died that way (a lost node, the OOM killer) or the
    others failed only because it was gone (their collectives' ``LOST_PEER`` errors)."""
    def rank(item: tuple[int, Any]) -> tuple[int, float]:
        failure = item[1]
        lost_peer = failure.exitcode >= 0 and any(text in reported(failure.message) for text in LOST_PEER)
        return 2 if lost_peer else int(failure.exitcode < 0), failure.timestamp

    return min(failures.items(), key=rank)


def reported(message: Any) -> str:
    """A failed rank's error in one line: what its worker recorded (torch keeps ``{"message": "ConfigError:
    ...", "extraInfo": {traceback}}``), posttune's own error class left out, or torch's text for a rank that
    died without a Python error (a signal)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip()
    line = text.splitlines()[-1] if text else "no message"
    name, _, rest = line.partition(": ")
    own = {PosttuneError.__name__, *(cls.__name__ for cls in PosttuneError.__subclasses__())}
    return rest if name in own and rest else line


def _quiet_agent() -> dict[logging.Logger, int]:
    """torchrun's agent logs each failure again (``E1204 ... failed (exitcode: 2)``, ``no error file defined
    for parent``) around the one line posttune prints; silenced unless ``LOGLEVEL`` asks for its logs.
    Returns the levels to restore."""
    if "LOGLEVEL" in os.environ:
        return {}
    loggers = [logger for name, logger in logging.root.manager.loggerDict.items()
               if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger)]
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    return levels
