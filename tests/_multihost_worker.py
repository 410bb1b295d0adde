"""One process of the 2-process test (tests/test_multihost.py); not a test module.

usage: python _multihost_worker.py PROCESS_ID PORT OUT_DIR
Trains a few steps data-parallel over 2 processes x 2 CPU devices, with sharded
jit and with pmap; process 1 feeds an inf at step 2. Saves what it ends with.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _models import batches, mlp_loss, mlp_params  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402

STEPS, LOCAL = 5, 8  # examples per process per step
xs, ys = batches(jax.random.key(1), STEPS, batch=2 * LOCAL)
xs, ys = (
    np.array(xs[:, pid * LOCAL : (pid + 1) * LOCAL]),
    np.array(ys[:, pid * LOCAL : (pid + 1) * LOCAL]),
)
if pid == 1:
    xs[2, 0, 0] = np.inf  # only this process overflows, at step 2


def tx_for(**kw):
    return jmp_lite.loss_scaling(optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**15, period=2), **kw)


def grads(p, s, b):
    ls = jmp_lite.get_loss_scale(s)
    return jax.grad(lambda q: ls.scale(mlp_loss(q, b)))(p)


def save(name, tree):
    leaves = [np.asarray(x.addressable_shards[0].data) for x in jax.tree_util.tree_leaves(tree)]
    np.savez(os.path.join(out_dir, f"{name}_{pid}.npz"), *leaves)


# sharded jit over the global mesh: no axis_name
mesh = Mesh(np.array(jax.devices()), ("d",))
rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
tx = tx_for()


def jit_step(p, s, b):
    u, s = tx.update(grads(p, s, b), s, p)
    return optax.apply_updates(p, u), s


step = jax.jit(jit_step, out_shardings=(rep, rep))
params = mlp_params(jax.random.key(0))
p = jax.tree_util.tree_map(lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)), params)
s = jax.tree_util.tree_map(
    lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)), tx.init(params)
)
for i in range(STEPS):
    batch = tuple(jax.make_array_from_process_local_data(split, a[i]) for a in (xs, ys))
    p, s = step(p, s, batch)
save("jit", (p, s))

# pmap over all 4 devices of both processes, with axis_name
ptx = tx_for(axis_name="d", reduce="mean")


def pmap_step(p, s, b):
    u, s = ptx.update(grads(p, s, b), s, p)
    return optax.apply_updates(p, u), s


pstep = jax.pmap(pmap_step, axis_name="d")
n = jax.local_device_count()
stack = lambda t: jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), t)  # noqa: E731
p, s = stack(params), stack(ptx.init(params))
for i in range(STEPS):
    p, s = pstep(p, s, (xs[i].reshape(n, -1, xs.shape[-1]), ys[i].reshape(n, -1)))
save("pmap", (p, s))

# pmap with axis_name but no gradient reduction: params differ per process, but the
# skip decision (a pmin of the finiteness flags) and so the loss-scale state must not.
ftx = tx_for(axis_name="d")


def flag_step(p, s, b):
    u, s = ftx.update(grads(p, s, b), s, p)
    return optax.apply_updates(p, u), s


fstep = jax.pmap(flag_step, axis_name="d")
p, s = stack(params), stack(ftx.init(params))
for i in range(STEPS):
    p, s = fstep(p, s, (xs[i].reshape(n, -1, xs.shape[-1]), ys[i].reshape(n, -1)))
save("flag", (s.loss_scale, s.skipped_total, s.consecutive_skips, s.last_grads_finite, s.skip_limit_reached))
jax.distributed.shutdown()
