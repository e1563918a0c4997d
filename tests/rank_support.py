"""Programs run as gloo ranks without torchrun, so that each rank's stdout stays its own."""

from __future__ import annotations

import json
import socket
import subprocess
import sys


def run_ranks(program: str, *args: str, env: dict[str, str], world: int = 2, timeout: float = 300) -> list:
    """Run ``python -c program *args`` as ``world`` ranks on a free local port; each must exit 0. Returns each
    rank's last line of stdout, read as JSON, in rank order (a rank left running is killed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    ranks = [subprocess.Popen([sys.executable, "-c", program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    results = []
    try:
        for process in ranks:
            stdout, stderr = process.communicate(timeout=timeout)
            assert process.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    return results
