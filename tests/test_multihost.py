"""Two processes (2 CPU devices each) train together; one overflows; both must agree."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # two processes over jax.distributed

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_end_identical(tmp_path):
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_multihost_worker.py"), str(i), port, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2-process run did not finish within {TIMEOUT_S} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]

    for mode in ("jit", "pmap"):
        a = np.load(tmp_path / f"{mode}_0.npz")
        b = np.load(tmp_path / f"{mode}_1.npz")
        assert a.files == b.files and len(a.files) > 10
        for k in a.files:
            np.testing.assert_array_equal(
                np.atleast_1d(a[k]).view(np.uint8), np.atleast_1d(b[k]).view(np.uint8)
            )
        # Scalars in leaf order: scale, counter, Adam's count, skipped_total, consecutive_skips,
        # last_grads_finite, skip_limit_reached. 2**15 grows to 2**16 after two finite steps
        # (period=2), halves at the overflow of step 2 and grows back after steps 3 and 4.
        scalars = [a[k].item() for k in a.files if a[k].size == 1]  # pmap shards keep a length-1 axis
        assert scalars == [2.0**16, 0, 4, 1, 0, True, False], (mode, scalars)

    # No gradient reduction: only the shared finiteness flag keeps the loss-scale state equal.
    a, b = np.load(tmp_path / "flag_0.npz"), np.load(tmp_path / "flag_1.npz")
    values = [(a[k].item(), b[k].item()) for k in a.files]
    assert all(x == y for x, y in values), values
    assert [x for x, _ in values] == [2.0**16, 0, 1, 0, True, False], values  # process 0 skipped too
