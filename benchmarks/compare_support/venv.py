"""torchtune's own virtual environment for compare.py, and measured children run with another python.

torchtune 0.6.1 wants torchao and torchdata beside torch, none of which the dev env has: the venv
keeps them away from it. It is created only when a torchtune mode is asked for, and reused when
its python already imports the pinned versions. torch is pinned by the repository's
``constraints.txt`` (the CPU wheel on the machine; a bare ``torch`` could pull a CUDA build).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TORCHTUNE = "0.6.1"
#: what ``pip install`` is given (with ``-c constraints.txt``); tokenizers and jinja2 (the workload's
#: tokenizer and chat template) come with torchtune's own requirements (datasets, tokenizers, ...)
REQUIREMENTS = ["torch==2.13.0", f"torchtune=={TORCHTUNE}", "torchao==0.13.*", "torchdata==0.11.*", "tokenizers",
                "jinja2", "pyyaml"]
PROBE = ("import json, torch, torchtune, torchao, torchdata, tokenizers, jinja2, yaml, omegaconf; "
         "from importlib.metadata import version as v; "
         "print(json.dumps({n: v(n) for n in ('torch', 'torchtune', 'torchao', 'torchdata')}))")


def python_of(venv: Path) -> Path:
    """The venv's interpreter."""
    return venv / "bin" / "python"


def probe(venv: Path) -> dict[str, str] | None:
    """The venv's torch/torchtune/torchao/torchdata versions, or None when it is missing or broken."""
    python = python_of(venv)
    if not python.exists():
        return None
    run = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, check=False)
    return json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None


def ensure_torchtune_venv(venv: Path, constraints: Path) -> dict[str, str]:
    """Create (``python -m venv`` + ``pip install -c constraints``) or reuse the torchtune venv; its versions."""
    versions = probe(venv)
    if versions and versions["torchtune"].split("+")[0] == TORCHTUNE:
        return versions
    print(f"compare.py: installing torchtune {TORCHTUNE} into {venv} (once)", file=sys.stderr)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run([str(python_of(venv)), "-m", "pip", "install", "--quiet", "-c", str(constraints),
                              *REQUIREMENTS], capture_output=True, text=True, check=False)
    if install.returncode != 0:
        raise SystemExit(f"compare.py: pip could not install torchtune into {venv}:\n{install.stderr[-3000:]}")
    versions = probe(venv)
    if not versions:
        raise SystemExit(f"compare.py: {venv} was installed but torchtune does not import there")
    return versions


def run_child_with(python: Path | str, code: str, spec: dict, *, env: dict | None = None) -> dict:
    """As ``child.run_child``, with the given interpreter: its last stdout line, parsed."""
    run = subprocess.run([str(python), "-c", code, json.dumps(spec)], capture_output=True, text=True, check=False,
                         env=env)
    if run.returncode != 0:
        raise SystemExit(f"benchmark child ({python}) failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])
