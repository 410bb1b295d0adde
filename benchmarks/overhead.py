"""Per-step overhead of loss scaling + skipping, jmp_lite vs the peers.

Variants (all float32 compute, Adam, the same model and data):
  plain          optax.adam alone (the baseline)
  jmp_lite       jmp_lite.loss_scaling(adam, DynamicLossScale), default skip ("auto": cond on CPU)
  jmp_lite_sel   the same with skip="select"
  jmp_lite_rec   jmp_lite with record_nonfinite=True (per-leaf flags of the last skipped step)
  jmp            jmp 0.0.4 recipe: DynamicLossScale + all_finite + select_tree(params, opt_state)
  flax_ds        flax DynamicScale.value_and_grad + jnp.where over params and opt_state
  apply_if_fin   optax.apply_if_finite(adam) (skips, but has no loss scaling)

Protocol (benchmarks/README.md): steps jitted with donated state and compiled
ahead; 5 warm-up steps; rounds of K steps with variants interleaved in a
shuffled order and one block_until_ready per round; per-round ratio to
"plain" in the same round; median ratio with a 95% bootstrap interval.
Run with MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296.

    python benchmarks/overhead.py --rounds 30 --json out/overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale

import jmp_lite

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

# --- models -----------------------------------------------------------------


def mlp(sizes: tuple[int, ...]) -> tuple[Callable, Callable]:
    def init(key):
        return [
            {"w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) * a**-0.5, "b": jnp.zeros(b)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))
        ]

    def apply(params, x):
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return h

    return init, apply


def cnn() -> tuple[Callable, Callable]:
    chans = [(3, 32), (32, 64), (64, 64)]

    def init(key):
        convs = [
            {
                "w": jax.random.normal(jax.random.fold_in(key, i), (3, 3, a, b)) * (9 * a) ** -0.5,
                "b": jnp.zeros(b),
            }
            for i, (a, b) in enumerate(chans)
        ]
        head = {
            "w": jax.random.normal(jax.random.fold_in(key, 9), (64 * 4 * 4, 10)) * 0.03,
            "b": jnp.zeros(10),
        }
        return {"convs": convs, "head": head}

    def apply(params, x):
        h = x
        for layer in params["convs"]:
            h = jax.lax.conv_general_dilated(
                h, layer["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            h = jax.nn.relu(h + layer["b"])
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        h = h.reshape(h.shape[0], -1)
        return h @ params["head"]["w"] + params["head"]["b"]

    return init, apply


# --- variants ---------------------------------------------------------------


def variants(init: Callable, apply: Callable) -> dict[str, tuple[Callable, Callable]]:
    """name -> (make_state(params), step(state, batch) -> state)."""

    def loss(params, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    adam = optax.adam(1e-4)
    out = {}

    def plain_step(state, batch):
        p, s = state
        u, s = adam.update(jax.grad(loss)(p, batch), s, p)
        return optax.apply_updates(p, u), s

    out["plain"] = (lambda p: (p, adam.init(p)), plain_step)

    for name, skip, record in (
        ("jmp_lite", "auto", False),
        ("jmp_lite_sel", "select", False),
        ("jmp_lite_rec", "auto", True),
    ):
        tx = jmp_lite.loss_scaling(
            adam, jmp_lite.DynamicLossScale(2.0**15), skip=skip, record_nonfinite=record
        )

        def ours_step(state, batch, tx=tx):
            p, s = state
            ls = jmp_lite.get_loss_scale(s)
            g = jax.grad(lambda q: ls.scale(loss(q, batch)))(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        out[name] = (lambda p, tx=tx: (p, tx.init(p)), ours_step)

    def jmp_step(state, batch):
        # jmp's state cannot pass through .lower() (it validates on unflatten),
        # so its two arrays travel bare and the object is rebuilt in the step.
        p, s, (scale, counter) = state
        ls = jmp.DynamicLossScale(scale, counter)
        g = jax.grad(lambda q: ls.scale(loss(q, batch)))(p)
        g = ls.unscale(g)
        finite = jmp.all_finite(g)
        ls = ls.adjust(finite)
        u, new_s = adam.update(g, s, p)
        new_p = optax.apply_updates(p, u)
        new_p, new_s = jmp.select_tree(finite, new_p, p), jmp.select_tree(finite, new_s, s)
        return new_p, new_s, (ls.loss_scale, ls.counter)

    out["jmp"] = (lambda p: (p, adam.init(p), (jnp.float32(2.0**15), jnp.zeros([], jnp.int32))), jmp_step)

    def flax_step(state, batch):
        p, s, ds = state
        ds, finite, _, g = ds.value_and_grad(loss)(p, batch)
        u, new_s = adam.update(g, s, p)
        new_p = optax.apply_updates(p, u)
        where = lambda a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(finite, x, y), a, b)
        return where(new_p, p), where(new_s, s), ds

    def flax_state(p):
        ds = DynamicScale(scale=jnp.float32(2.0**15))
        ds = ds.replace(fin_steps=jnp.zeros([], jnp.int32))  # arrays, so jit traces once
        return p, adam.init(p), ds

    out["flax_ds"] = (flax_state, flax_step)

    aif = optax.apply_if_finite(adam, max_consecutive_errors=10)

    def aif_step(state, batch):
        p, s = state
        u, s = aif.update(jax.grad(loss)(p, batch), s, p)
        return optax.apply_updates(p, u), s

    out["apply_if_fin"] = (lambda p: (p, aif.init(p)), aif_step)
    return out


# --- timing -----------------------------------------------------------------


def copies(compiled) -> int:
    return len(re.findall(r"= \S+ copy\(", compiled.as_text()))


def bench(model: str, batch_size: int, rounds: int, k: int, seed: int = 0) -> dict:
    if model == "mlp":
        init, apply = mlp((784, 1024, 1024, 1024, 10))
        x = jax.random.normal(jax.random.key(1), (batch_size, 784))
    else:
        init, apply = cnn()
        x = jax.random.normal(jax.random.key(1), (batch_size, 32, 32, 3))
    y = jax.random.randint(jax.random.key(2), (batch_size,), 0, 10)
    batch = (x, y)
    params = init(jax.random.key(0))
    n_params = sum(a.size for a in jax.tree_util.tree_leaves(params))
    compiled, states, info = {}, {}, {}
    for name, (make_state, step) in variants(init, apply).items():
        state = make_state(jax.tree_util.tree_map(jnp.array, params))
        t0 = time.perf_counter()
        c = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
        info[name] = {"compile_s": time.perf_counter() - t0, "copies": copies(c)}
        for _ in range(5):
            state = c(state, batch)
        jax.block_until_ready(state)
        compiled[name], states[name] = c, state
    names = list(compiled)
    rng = np.random.default_rng(seed)
    times = {n: [] for n in names}
    for _ in range(rounds):
        for n in rng.permutation(names):
            c, s = compiled[n], states[n]
            t0 = time.perf_counter()
            for _ in range(k):
                s = c(s, batch)
            jax.block_until_ready(s)
            times[n].append((time.perf_counter() - t0) / k)
            states[n] = s
    base = np.array(times["plain"])
    for n in names:
        t = np.array(times[n])
        ratios = t / base
        boot = np.median(rng.choice(ratios, (2000, len(ratios))), axis=1)
        info[n].update(
            median_ms=1e3 * float(np.median(t)),
            ratio=float(np.median(ratios)),
            ci_lo=float(np.percentile(boot, 2.5)),
            ci_hi=float(np.percentile(boot, 97.5)),
        )
    return {
        "model": model,
        "batch": batch_size,
        "params": int(n_params),
        "rounds": rounds,
        "k": k,
        "variants": info,
    }


def environment() -> dict:
    return {**_timing.environment(), "jmp": jmp.__version__}


def table(result: dict) -> str:
    head = (
        f"**{result['model'].upper()}**, {result['params'] / 1e6:.2f}M params, batch {result['batch']} "
        f"({result['rounds']} rounds x {result['k']} steps)\n\n"
        "| variant | median step (ms) | ratio to plain | 95% CI | copy ops in HLO | compile (s) |\n"
        "|---|---:|---:|---|---:|---:|\n"
    )
    rows = [
        f"| {n} | {v['median_ms']:.2f} | {v['ratio']:.3f} | [{v['ci_lo']:.3f}, {v['ci_hi']:.3f}] "
        f"| {v['copies']} | {v['compile_s']:.2f} |"
        for n, v in result["variants"].items()
    ]
    return head + "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--configs", default="mlp:1024:2,mlp:128:10,cnn:128:5", help="model:batch:K,...")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    env = environment()
    print(json.dumps(env))
    results = []
    for cfg in args.configs.split(","):
        model, batch, k = cfg.split(":")
        r = bench(model, int(batch), args.rounds, int(k))
        results.append(r)
        print(table(r), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
