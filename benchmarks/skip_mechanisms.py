"""Counts XLA copy ops for each way of skipping an optimizer step (docs/optax.md).

Compiles one Adam train step of a 784-1024-1024-1024-10 MLP (donated state) per
skip mechanism and counts `copy` instructions in the optimized HLO, then times
the finiteness reductions over the MLP's 2.9M gradient values.

    python benchmarks/skip_mechanisms.py
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

COPY = re.compile(r"= \S+ copy\(")
SIZES = (784, 1024, 1024, 1024, 10)
tx = optax.adam(1e-3)


def init(key):
    return [
        {"w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) * 0.02, "b": jnp.zeros(b)}
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))
    ]


def loss(p, x, y):
    h = x
    for layer in p[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p[-1]["w"] + p[-1]["b"], y).mean()


def finite(g):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(g)]))


def where(f, a, b):
    return jax.tree_util.tree_map(lambda x, y: jnp.where(f, x, y), a, b)


def blend_bits(f, n, o):
    it = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[n.dtype.itemsize]
    if not jnp.issubdtype(n.dtype, jnp.floating):
        return jnp.where(f, n, o)
    m = -(f.astype(it))
    nb, ob = jax.lax.bitcast_convert_type(n, it), jax.lax.bitcast_convert_type(o, it)
    return jax.lax.bitcast_convert_type((nb & m) | (ob & ~m), n.dtype)


def step_with(skip):
    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        f = finite(g)
        return skip(p, s, g, f)

    return step


def plain(p, s, g, f):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s


def select_all(p, s, g, f):
    u, ns = tx.update(g, s, p)
    return where(f, optax.apply_updates(p, u), p), where(f, ns, s)


def select_state(p, s, g, f):
    u, ns = tx.update(g, s, p)
    u = jax.tree_util.tree_map(lambda a: jnp.where(f, a, 0), u)
    return optax.apply_updates(p, u), where(f, ns, s)


def bits(p, s, g, f):
    u, ns = tx.update(g, s, p)
    u = jax.tree_util.tree_map(lambda a: jnp.where(f, a, 0), u)
    return optax.apply_updates(p, u), jax.tree_util.tree_map(lambda a, b: blend_bits(f, a, b), ns, s)


def arith(p, s, g, f):
    u, ns = tx.update(g, s, p)
    ff = f.astype(jnp.float32)
    u = jax.tree_util.tree_map(lambda a: a * ff, u)
    ns = jax.tree_util.tree_map(lambda a, b: b + (a - b) * ff.astype(a.dtype), ns, s)
    return optax.apply_updates(p, u), ns


def barrier(p, s, g, f):
    u, ns = tx.update(g, s, p)
    ns, s2 = jax.lax.optimization_barrier((ns, s))
    u = jax.tree_util.tree_map(lambda a: jnp.where(f, a, 0), u)
    return optax.apply_updates(p, u), where(f, ns, s2)


def cond_state(p, s, g, f):
    u, ns = tx.update(where(f, g, jax.tree_util.tree_map(jnp.zeros_like, g)), s, p)
    ns = jax.lax.cond(f, lambda: ns, lambda: s)
    u = jax.tree_util.tree_map(lambda a: jnp.where(f, a, 0), u)
    return optax.apply_updates(p, u), ns


def sum0_finite(g):
    return jnp.isfinite(sum(jnp.sum(a * 0) for a in jax.tree_util.tree_leaves(g)))


def cond_all_sum0(p, s, g, f):
    return cond_all(p, s, g, sum0_finite(g))


def cond_all(p, s, g, f):
    u, ns = jax.lax.cond(
        f, lambda: tx.update(g, s, p), lambda: (jax.tree_util.tree_map(jnp.zeros_like, g), s)
    )
    return optax.apply_updates(p, u), ns


MECHANISMS = {
    "plain Adam, no skip": plain,
    "jnp.where over params and state (jmp, Flax)": select_all,
    "jnp.where over the state, zeroed updates": select_state,
    "bitwise blend via integer bitcasts": bits,
    "old + f * (new - old) arithmetic blend": arith,
    "optimization_barrier before the select": barrier,
    "lax.cond over the state only": cond_state,
    "lax.cond around the whole inner update": cond_all,
}


def main() -> None:
    p = init(jax.random.key(0))
    s = tx.init(p)
    x, y = jnp.ones((128, 784)), jnp.zeros(128, jnp.int32)
    print(f"jax {jax.__version__}, {len(jax.tree_util.tree_leaves((p, s)))} param+state leaves\n")
    print("| skip mechanism | copies in the step |\n|---|---:|")
    for name, fn in MECHANISMS.items():
        text = jax.jit(step_with(fn), donate_argnums=(0, 1)).lower(p, s, x, y).compile().as_text()
        n_copies = len(COPY.findall(text))
        print(f"| {name} | {n_copies} |")

    g = jax.grad(loss)(p, x, y)
    reductions = {
        "all(isfinite(g))": lambda g: jnp.stack(
            [jnp.isfinite(a).all() for a in jax.tree_util.tree_leaves(g)]
        ).all(),
        "isfinite(sum(g * 0))": lambda g: jnp.isfinite(
            sum(jnp.sum(a * 0) for a in jax.tree_util.tree_leaves(g))
        ),
    }
    print("\n| finiteness reduction over 2.9M float32 | median ms |\n|---|---:|")
    for name, fn in reductions.items():
        c = jax.jit(fn)
        c(g).block_until_ready()
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            for _ in range(10):
                r = c(g)
            r.block_until_ready()
            ts.append((time.perf_counter() - t0) / 10)
        print(f"| {name} | {1e3 * np.median(ts):.2f} |")

    # The same two reductions inside the whole cond-skipped train step.
    steps = {"plain": plain, "cond + all(isfinite)": cond_all, "cond + isfinite(sum(g * 0))": cond_all_sum0}
    compiled, states, times = {}, {}, {n: [] for n in steps}
    for name, fn in steps.items():
        c = jax.jit(step_with(fn), donate_argnums=(0, 1)).lower(p, s, x, y).compile()
        st = (jax.tree_util.tree_map(jnp.array, p), tx.init(p))
        for _ in range(3):
            st = c(*st, x, y)
        compiled[name], states[name] = c, st
    rng = np.random.default_rng(0)
    for _ in range(25):
        for name in rng.permutation(list(steps)):
            st = states[name]
            t0 = time.perf_counter()
            for _ in range(8):
                st = compiled[name](*st, x, y)
            jax.block_until_ready(st)
            times[name].append((time.perf_counter() - t0) / 8)
            states[name] = st
    base = np.array(times["plain"])
    print("\n| Adam step, batch 128 | median ms | ratio to plain (median of rounds) |\n|---|---:|---:|")
    for name in steps:
        t = np.array(times[name])
        print(f"| {name} | {1e3 * np.median(t):.2f} | {np.median(t / base):.3f} |")


if __name__ == "__main__":
    main()
