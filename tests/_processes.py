"""Runs the processes of a multi-process test (a worker script per process over ``jax.distributed`` on
127.0.0.1); not a test module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_device_flags() -> str:
    """The suite's ``XLA_FLAGS`` (set by conftest.py) less its device count: a spawned example or demo
    runs on one CPU device, as a user's does, and compiles as the rest of the suite."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)


def run_workers(worker: str, out_dir: Path, timeout_s: float, processes: int = 2) -> list[str]:
    """``python tests/<worker> PROCESS_ID PORT OUT_DIR`` for each process, all at once; fails the test
    (with the output) when one exits non-zero or all do not end within ``timeout_s``, killing the rest.
    The workers set their own device count: ``XLA_FLAGS`` is not passed on."""
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / worker), str(i), port, str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {processes}-process run of {worker} did not finish within {timeout_s} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    return outputs
