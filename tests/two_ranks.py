"""Run a script as ranks 0 and 1 of a 2-process job, each its own interpreter started and ended as a user's
script is (for what happens at interpreter exit, which ``shardline.testing.run_distributed``'s ranks skip)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_two_ranks(script: Path, *args: str, timeout: float = 100) -> list[tuple[int, str]]:
    """``python script RANK *args`` for ranks 0 and 1 at once; each one's exit code and output (stdout and stderr).

    Both are killed if they have not ended after ``timeout`` seconds (the wait then raises ``TimeoutExpired``).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "env": env, "cwd": ROOT}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), *args], **out) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, output) for p, output in zip(procs, outputs, strict=True)]
