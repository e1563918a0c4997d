"""posttune-thirdparty installed for subprocesses (torchrun's workers find plugins only through entry points)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent


def install(site: Path) -> dict[str, str]:
    """The environment of a run with posttune-thirdparty installed: the ``.dist-info`` pip writes for an
    editable install (metadata and the entry points of tests/third_party/pyproject.toml) on PYTHONPATH."""
    project = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]
    info = site / f"posttune_thirdparty-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    points = "".join(f"{name} = {target}\n" for name, target in project["entry-points"]["posttune"].items())
    (info / "entry_points.txt").write_text(f"[posttune]\n{points}")
    path = os.pathsep.join([str(site), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}
