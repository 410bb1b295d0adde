"""Two processes (2 CPU devices each) train together; one overflows; both must agree."""

import numpy as np
import pytest
from _processes import run_workers

pytestmark = pytest.mark.e2e

TIMEOUT_S = 100


def test_two_processes_end_identical(tmp_path):
    run_workers("_multihost_worker.py", tmp_path, TIMEOUT_S)

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
