"""Training: the trainer loop arrives with the SFT issue; launching is wired here already."""

from __future__ import annotations

from posttune.errors import PosttuneError

#: torchrun runs this module on every rank: it re-enters `posttune train` there.
WORKER_MODULE = "posttune.training.worker"


def run(plan) -> int:
    raise PosttuneError(
        "the trainer loop is not in this release yet; the config is valid — "
        "`posttune plan` shows what would run"
    )
