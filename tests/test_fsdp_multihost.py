"""FSDP over two processes (4 CPU devices each, one mesh axis of 8) against one process with 8 devices."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from test_fsdp import BF16, batch, fsdp_training, mlp_params

from jmp_lite.distributed import shard_params

pytestmark = pytest.mark.slow  # two processes over jax.distributed

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_as_one_process_with_eight_devices(tmp_path):
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_fsdp_worker.py"), str(i), port, str(tmp_path)],
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
        pytest.fail(f"the 2-process FSDP run did not finish within {TIMEOUT_S} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]

    mesh = jax.make_mesh((8,), ("data",))
    params, (x, y) = mlp_params(), batch()
    final, losses = fsdp_training(mesh, shard_params(params, mesh, "data"), x, y, BF16)
    expected = [np.asarray(a) for a in jax.tree.leaves(final)]
    for pid in range(2):
        saved = np.load(tmp_path / f"fsdp_{pid}.npz")
        # not bitwise: the loss's mean over devices sums in another order across processes (measured:
        # 1.4e-7 relative)
        np.testing.assert_allclose(saved["losses"], losses, rtol=1e-6)
        got = [saved[f"arr_{i}"] for i in range(len(expected))]
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
