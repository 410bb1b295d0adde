"""One process of the 2-process FSDP test (tests/test_fsdp_multihost.py); not a test module.

usage: python _fsdp_worker.py PROCESS_ID PORT OUT_DIR
Trains tests/test_fsdp.py's MLP for a few Adam steps with jmp_lite.distributed.fsdp over 2 processes x 4
CPU devices (one mesh axis of 8) under a bfloat16 policy, and saves the final parameters, gathered.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from test_fsdp import BF16, batch, fsdp_training, mlp_params  # noqa: E402

from jmp_lite.distributed import fsdp_layout  # noqa: E402

mesh = jax.make_mesh((8,), ("data",))
params, (x, y) = mlp_params(), batch()


def global_array(full, spec):
    full = np.asarray(full)
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec), lambda index: full[index])


layout = fsdp_layout(params, mesh, "data")
specs = jax.tree.map(
    lambda lay: P() if lay.dim is None else P(*([None] * lay.dim), "data"),
    layout,
    is_leaf=lambda v: hasattr(v, "dim"),
)
sharded = jax.tree.map(global_array, params, specs)
xs, ys = global_array(x, P("data")), global_array(y, P("data"))
final, losses = fsdp_training(mesh, sharded, xs, ys, BF16)
gathered = multihost_utils.process_allgather(final, tiled=True)
arrays = {f"arr_{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(gathered))}
np.savez(os.path.join(out_dir, f"fsdp_{pid}.npz"), losses=np.asarray(losses), **arrays)
jax.distributed.shutdown()
