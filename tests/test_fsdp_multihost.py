"""FSDP over two processes (4 CPU devices each, one mesh axis of 8) against one process with 8 devices."""

import jax
import numpy as np
import pytest
from _processes import run_workers
from test_fsdp import BF16, batch, fsdp_training, mlp_params

from jmp_lite.distributed import shard_params

pytestmark = pytest.mark.e2e

TIMEOUT_S = 120


def test_two_processes_train_as_one_process_with_eight_devices(tmp_path):
    run_workers("_fsdp_worker.py", tmp_path, TIMEOUT_S)

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
