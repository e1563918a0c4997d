"""`python -m posttune.training.worker CONFIG [overrides]`: what torchrun starts on each rank.

A failure on any rank is recorded in torchrun's error file (``record``), so the launcher's
``posttune train`` ends the whole job and reports that rank's error in one line (the workers it
started print none of their own), and the other ranks are stopped instead of waiting forever in a
collective.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from posttune.cli.launch import leave_to_launcher
from posttune.cli.main import main
from posttune.errors import PosttuneError, one_line
from posttune.training.distributed import exit_process


@record
def run(argv: list[str]) -> int:
    try:
        return main(["--debug", "train", *argv])  # --debug: a user error reaches this function
    except PosttuneError as exc:
        leave_to_launcher(exc, f"posttune: error: {one_line(str(exc))}")
        return 2


if __name__ == "__main__":
    exit_process(run(sys.argv[1:]))  # an exception (re-raised by record) leaves through the interpreter as usual
