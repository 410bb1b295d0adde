"""Tracing cost of jmp_lite.autocast on a GPT-2-small-sized program.

Measures, for a decoder of GPT-2 small's shape (12 layers, d=768, 12 heads,
seq 1024, vocabulary 50257; layers unrolled in Python so the jaxpr is large,
or under lax.scan with --scan), the time to

  plain     trace the loss (jax.make_jaxpr)
  autocast  trace + rewrite the same loss with a fresh autocast (cache cold)
  grad      the same two for jax.value_and_grad of the loss

Arguments are jax.ShapeDtypeStruct, so nothing is allocated or compiled.
Protocol: 1 warm-up of each, then --repeats rounds with the variants
interleaved; the median and min/max of each, and the median of per-round
ratios autocast/plain.

    python benchmarks/autocast_trace.py --repeats 7

``--linen-step`` instead times one training step (forward, backward, Adam) of a
Linen MLP (4 x Dense(width) + LayerNorm) run as ``autocast(model.apply)`` and as
``jmp_lite.flax.linen.apply_policy(model).apply``: both compiled ahead, 3 warm-up
steps, then --rounds rounds of --k steps each with the two interleaved (order
alternating), median per-round ratio autocast/apply_policy with min/max.

    python benchmarks/autocast_trace.py --linen-step --rounds 20 --k 5

``--analysis`` times only the engine's search for attention chains (``find_attention``) on the
traced loss: its first call in the process, then the median of --repeats more (the causal masks it
evaluates and classifies are cached per mask signature for the process).

    python benchmarks/autocast_trace.py --analysis --repeats 7
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite


def gpt2_shapes(layers: int, d: int, vocab: int) -> dict:
    f = jnp.float32
    layer = {
        "ln1": jax.ShapeDtypeStruct((2, d), f),
        "qkv": jax.ShapeDtypeStruct((d, 3 * d), f),
        "proj": jax.ShapeDtypeStruct((d, d), f),
        "ln2": jax.ShapeDtypeStruct((2, d), f),
        "fc": jax.ShapeDtypeStruct((d, 4 * d), f),
        "out": jax.ShapeDtypeStruct((4 * d, d), f),
    }
    return {
        "wte": jax.ShapeDtypeStruct((vocab, d), f),
        "wpe": jax.ShapeDtypeStruct((1024, d), f),
        "layers": [dict(layer) for _ in range(layers)],
        "lnf": jax.ShapeDtypeStruct((2, d), f),
    }


def _ln(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p[0] + p[1]


def _block(x, p, heads):
    b, t, d = x.shape
    q, k, v = jnp.split(_ln(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    logits = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(d // heads)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    o = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(logits, -1), v).reshape(b, t, d)
    x = x + o @ p["proj"]
    return x + jax.nn.gelu(_ln(x, p["ln2"]) @ p["fc"]) @ p["out"]


def make_loss(heads: int, scan: bool):
    def loss(params, tokens):
        x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
        if scan:
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])
            x, _ = jax.lax.scan(lambda h, p: (_block(h, p, heads), None), x, stacked)
        else:
            for p in params["layers"]:
                x = _block(x, p, heads)
        logits = _ln(x, params["lnf"]) @ params["wte"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return loss


def _count(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for v in e.params.values():
            for item in v if isinstance(v, (tuple, list)) else (v,):
                sub = item if hasattr(item, "eqns") else getattr(item, "jaxpr", None)
                if hasattr(sub, "eqns"):
                    n += _count(sub)
    return n


def linen_step(args) -> None:
    import flax.linen as nn

    import jmp_lite.flax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = nn.LayerNorm()(jax.nn.relu(nn.Dense(args.width)(x)))
            return nn.Dense(10)(x)

    policy = "p=f32,c=bf16,o=f32"
    model = MLP()
    x = jax.random.normal(jax.random.key(0), (args.batch_rows, args.width))
    y = jax.random.randint(jax.random.key(1), (args.batch_rows,), 0, 10)
    params = model.init(jax.random.key(2), x)
    tx = optax.adam(1e-3)
    applies = {"autocast": jmp_lite.autocast(model.apply, policy), "apply_policy": None}
    applies["apply_policy"] = jmp_lite.flax.linen.apply_policy(model, policy).apply

    def make_step(apply):
        def step(p, s):
            def loss(q):
                return optax.softmax_cross_entropy_with_integer_labels(apply(q, x), y).mean()

            grads = jax.grad(loss)(p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        return jax.jit(step, donate_argnums=(0, 1))

    steps, states, ops = {}, {}, {}
    for name, apply in applies.items():
        compiled = make_step(apply).lower(params, tx.init(params)).compile()
        ops[name] = sum(" = " in line for line in compiled.as_text().splitlines())
        steps[name] = compiled
        states[name] = (jax.tree.map(jnp.copy, params), tx.init(params))
        for _ in range(3):
            states[name] = compiled(*states[name])
        jax.block_until_ready(states[name])
    times: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(args.rounds):
        for name in list(steps)[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            for _ in range(args.k):
                states[name] = steps[name](*states[name])
            jax.block_until_ready(states[name])
            times[name].append((time.perf_counter() - t0) / args.k)
    ratios = [a / b for a, b in zip(times["autocast"], times["apply_policy"])]
    for name in steps:
        print(f"{name:<13} HLO ops {ops[name]:>5}  median ms/step {1e3 * statistics.median(times[name]):.2f}")
    print(f"autocast/apply_policy: {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")


def analysis(args, params, tokens) -> None:
    from jmp_lite._src.engine.attention_pattern import find_attention

    closed = jax.make_jaxpr(make_loss(args.heads, args.scan))(params, tokens)
    t0 = time.perf_counter()
    chains = len(find_attention(closed))
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        find_attention(closed)
        times.append(time.perf_counter() - t0)
    print(
        f"find_attention on {_count(closed.jaxpr)} eqns: {chains} attention chains; first call "
        f"{first:.3f} s, then median {statistics.median(times):.3f} s [{min(times):.3f}, {max(times):.3f}]"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scan", action="store_true", help="layers under lax.scan instead of unrolled")
    parser.add_argument("--json", default=None)
    parser.add_argument("--linen-step", action="store_true", help="time a Linen training step instead")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--analysis", action="store_true", help="time the attention search only")
    args = parser.parse_args(argv)
    if args.linen_step:
        linen_step(args)
        return

    params = gpt2_shapes(args.layers, args.d, args.vocab)
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
    if args.analysis:
        analysis(args, params, tokens)
        return
    policy = "p=f32,c=bf16,o=f32"

    def fresh():  # a new function each time: JAX caches traces per function object
        return make_loss(args.heads, args.scan)

    def auto():
        return jmp_lite.autocast(fresh(), policy)

    variants = {
        "plain": lambda: jax.make_jaxpr(fresh())(params, tokens),
        "autocast": lambda: jax.make_jaxpr(auto())(params, tokens),
        "plain_grad": lambda: jax.make_jaxpr(jax.value_and_grad(fresh()))(params, tokens),
        "autocast_grad": lambda: jax.make_jaxpr(jax.value_and_grad(auto()))(params, tokens),
    }
    eqns = {name: _count(fn().jaxpr) for name, fn in variants.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    result = {
        "config": vars(args),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "eqns": eqns,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "min_s": {k: min(v) for k, v in times.items()},
        "max_s": {k: max(v) for k, v in times.items()},
        "ratio": {
            "autocast/plain": statistics.median(a / p for a, p in zip(times["autocast"], times["plain"])),
            "autocast_grad/plain_grad": statistics.median(
                a / p for a, p in zip(times["autocast_grad"], times["plain_grad"])
            ),
        },
    }
    print(f"{'variant':<15}{'eqns':>8}{'median s':>10}{'min':>8}{'max':>8}")
    for k in variants:
        print(
            f"{k:<15}{eqns[k]:>8}{result['median_s'][k]:>10.3f}{result['min_s'][k]:>8.3f}{result['max_s'][k]:>8.3f}"
        )
    for k, v in result["ratio"].items():
        print(f"{k}: {v:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
