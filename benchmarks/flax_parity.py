"""Does ``apply_policy`` cost anything against threading ``dtype=``/``param_dtype=`` by hand?

For the two Flax examples' models (the Linen CNN and the NNX transformer LM) this
builds the same model twice: once plain and run under ``apply_policy``, once
hand-written with every dtype argument spelled out the way the policy's defaults
promise (norms in float32, output cast to the compute dtype; attention softmax in
float32; 16-bit matmuls and convolutions accumulating in float32). It compiles one
full training step (forward, backward, Adam; state donated) of each ahead of time,
compares the optimized HLO after stripping source metadata, and times both in
interleaved rounds (benchmarks/README.md).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \
        python benchmarks/flax_parity.py --rounds 20 --k 10
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flax_linen_cnn import CNN  # noqa: E402
from flax_nnx_lm import LM  # noqa: E402
from overhead import environment  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite import accumulate  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402
from jmp_lite.flax.nnx import apply_policy as nnx_apply_policy  # noqa: E402
from jmp_lite.flax.nnx import attention  # noqa: E402

F32 = jnp.float32
ACC, ACC_CONV = accumulate.dot_general, accumulate.conv_general_dilated  # what the policy installs


class HandCNN(nn.Module):
    compute: object

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c = self.compute
        x = x.astype(c)
        for features in (32, 64):
            x = nn.Conv(features, (3, 3), dtype=c, param_dtype=F32, conv_general_dilated=ACC_CONV)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=F32, param_dtype=F32)(x)
            x = nn.relu(x.astype(c))
        x = x.mean((1, 2))
        x = nn.relu(nn.Dense(128, dtype=c, param_dtype=F32, dot_general=ACC)(x))
        return nn.Dense(10, dtype=c, param_dtype=F32, dot_general=ACC)(x).astype(F32)


class HandBlock(nnx.Module):
    def __init__(self, width: int, heads: int, c: object, rngs: nnx.Rngs) -> None:
        self.c = c
        self.norm1 = nnx.LayerNorm(width, dtype=F32, param_dtype=F32, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads,
            width,
            decode=False,
            dtype=c,
            param_dtype=F32,
            attention_fn=attention,
            qkv_dot_general=ACC,
            out_dot_general=ACC,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(width, dtype=F32, param_dtype=F32, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, dtype=c, param_dtype=F32, dot_general=ACC, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, dtype=c, param_dtype=F32, dot_general=ACC, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm1(x).astype(self.c)
        x = x + self.attn(h, mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.down(nnx.gelu(self.up(self.norm2(x).astype(self.c))))


class HandLM(nnx.Module):
    def __init__(self, width: int, depth: int, heads: int, context: int, c: object, rngs: nnx.Rngs) -> None:
        self.c = c
        self.embed = nnx.Embed(256, width, dtype=c, param_dtype=F32, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, width)))
        self.blocks = nnx.List([HandBlock(width, heads, c, rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, dtype=F32, param_dtype=F32, rngs=rngs)
        self.head = nnx.Linear(width, 256, dtype=c, param_dtype=F32, dot_general=ACC, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).astype(self.c)).astype(F32)


def linen_step(model: object) -> tuple:
    """A jitted Linen train step and its arguments."""
    x = jnp.asarray(np.random.default_rng(0).random((64, 8, 8, 1), np.float32))
    y = jnp.arange(64) % 10
    variables = model.init(jax.random.key(0), x, train=False)
    tx = optax.adam(1e-3)
    params, stats = variables["params"], variables["batch_stats"]

    def step(state, batch):
        (params, opt_state, stats), (x, y) = state, batch

        def loss_fn(p):
            logits, upd = model.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

        grads, upd = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, upd["batch_stats"]

    return step, (params, tx.init(params), stats), (x, y)


def nnx_step(model: nnx.Module) -> tuple:
    """A jitted NNX train step (on split state, so plain jax.jit compiles it) and its arguments."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (32, 65)), jnp.int32)
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-3)

    def step(state, tokens):
        params, opt_state = state

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1]).astype(F32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params)), tokens


def strip(text: str) -> str:
    """Optimized HLO text without source files, lines and op names (they differ, the program not)."""
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(\d+ .*\n)*", "\n", text)
    text = re.sub(r", (metadata=\{[^}]*\}|stack_frame_id=\d+)", "", text)
    return re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)


def compare(pair: dict, rounds: int, k: int, seed: int = 0) -> dict:
    """Compile both ahead (state donated), check HLO, time interleaved rounds of ``k`` steps."""
    compiled, states, info = {}, {}, {}
    for name, (step, state, batch) in pair.items():
        state = jax.tree_util.tree_map(jnp.array, state)
        t0 = time.perf_counter()
        c = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
        info[name] = {"compile_s": time.perf_counter() - t0, "hlo": strip(c.as_text())}
        for _ in range(5):
            state = c(state, batch)
        jax.block_until_ready(state)
        compiled[name], states[name] = (c, batch), state
    rng = np.random.default_rng(seed)
    times = {n: [] for n in pair}
    for _ in range(rounds):
        for n in rng.permutation(list(pair)):
            (c, batch), s = compiled[n], states[n]
            t0 = time.perf_counter()
            for _ in range(k):
                s = c(s, batch)
            jax.block_until_ready(s)
            times[n].append((time.perf_counter() - t0) / k)
            states[n] = s
    ratios = np.array(times["policy"]) / np.array(times["hand"])
    boot = np.median(rng.choice(ratios, (2000, len(ratios))), axis=1)
    return {
        "same_hlo": info["policy"]["hlo"] == info["hand"]["hlo"],
        "policy_ms": 1e3 * float(np.median(times["policy"])),
        "hand_ms": 1e3 * float(np.median(times["hand"])),
        "ratio": float(np.median(ratios)),
        "ci": (float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))),
        "compile_s": (info["policy"]["compile_s"], info["hand"]["compile_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--k", type=int, default=10, help="steps per timed round")
    args = parser.parse_args()
    env = environment()
    print(", ".join(f"{k} {v}" for k, v in env.items() if k != "jmp"))
    print(
        f"{args.rounds} interleaved rounds x {args.k} steps; ratio = median of per-round policy/hand ratios\n"
    )
    print("| model | compute | optimized HLO | policy ms/step | hand-written ms/step | ratio | 95% CI |")
    print("|---|---|---|---:|---:|---:|---|")
    for name, c in [("bfloat16", jnp.bfloat16), ("float16", jnp.float16)]:
        policy = jmp_lite.Policy(F32, c, F32)
        pairs = {
            "Linen CNN (digits), batch 64": {
                "policy": linen_step(apply_policy(CNN(), policy)),
                "hand": linen_step(HandCNN(c)),
            },
            "NNX transformer LM, 32x64 bytes": {
                "policy": nnx_step(nnx_apply_policy(LM(96, 2, 4, 64, nnx.Rngs(0)), policy)),
                "hand": nnx_step(HandLM(96, 2, 4, 64, c, nnx.Rngs(0))),
            },
        }
        for model, pair in pairs.items():
            r = compare(pair, args.rounds, args.k)
            same = "identical" if r["same_hlo"] else "differs"
            print(
                f"| {model} | {name} | {same} | {r['policy_ms']:.2f} | {r['hand_ms']:.2f} | {r['ratio']:.3f} "
                f"| [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |"
            )


if __name__ == "__main__":
    main()
