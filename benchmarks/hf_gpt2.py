"""A Hugging Face ``FlaxGPT2LMHeadModel`` trained in four precisions through ``hf.module``.

The model is built from a small ``GPT2Config`` with random weights (nothing is downloaded) and run
unchanged under ``jmp_lite.flax.linen.apply_policy``; every variant trains the same steps on the same
bytes from the same initialization, per seed:

  f32            float32
  bf16           the bf16 policy (float32 params, bfloat16 compute with float32 accumulation)
  f16-dyn-cond   the float16 policy with ``DynamicLossScale`` (skip="cond")
  fp8-delayed    the bf16 policy with fp8 contractions (hybrid: E4M3 forward, E5M2 gradients) and
                 delayed scaling (TransformerEngine's default: history 1024, margin 0); the tied output
                 layer stays bfloat16 through a class rule (``nn.Dense``: GPT-2's projections are
                 ``FlaxConv1D``, its only Dense is the output layer)

Data: Python's standard-library sources as bytes (vocabulary 256, no tokenizer), the first 90% for
training and the last 10% held out, as ``benchmarks/lm.py``. Adam at a peak learning rate of 1e-3
after 50 warm-up steps, cosine-decayed to 0 over the run, so that the loss ends flat; dropout off.

Reported per variant: the held-out loss (nats per byte) after the last step, mean, sample standard
deviation and per seed; the steps float16 skipped; and the bytes the backward pass keeps
(``jmp_lite.memory.residual_bytes`` of the step's gradient with respect to the parameters, by
tracing only). No timing: this measures accuracy and memory (CPU runs share their cores here).

    python benchmarks/hf_gpt2.py --steps 400 --seeds 0,1,2 --json out/hf_gpt2.json
    python benchmarks/hf_gpt2.py --dry-run        # seconds: tiny sizes, 3 steps, one seed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _precisions  # noqa: E402
import _timing  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402

VARIANTS = ("f32", "bf16", "f16-dyn-cond", "fp8-delayed")


def gpt2(layers: int, width: int, heads: int, context: int) -> Any:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(
        vocab_size=256,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return FlaxGPT2LMHeadModel(config, _do_init=False)  # the module only; weights from init below


def model_of(hf: Any, name: str) -> Any:
    v = _precisions.VARIANTS[name]
    rules = {nn.Dense: v.policy} if v.fp8 else None  # the tied output layer stays 16-bit
    return apply_policy(hf.module, v.policy, rules, fp8=v.fp8)


def make_loss(model: Any) -> Any:
    """``loss_fn(params, model_state, batch) -> (loss, model_state)`` as ``_precisions.make_step``
    expects: next-byte cross-entropy; ``model_state`` holds the fp8 states of delayed scaling."""

    def loss_fn(p: Any, model_state: Any, b: jax.Array) -> tuple:
        x = b[:, :-1]
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        logits = model.apply({"params": p, **model_state}, x, jnp.ones_like(x), positions).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean(), model_state

    return loss_fn


def data(context: int, held: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The corpus, ``held`` held-out sequences of ``context + 1`` bytes, and where training ends."""
    from jmp_lite._demo.corpus import stdlib_bytes

    text = stdlib_bytes(4_000_000)
    split = int(0.9 * len(text))
    starts = np.random.default_rng(12345).integers(split, len(text) - context - 1, held)
    return text, text[starts[:, None] + np.arange(context + 1)], split


def run(name: str, hf: Any, seed: int, args: Any, text: np.ndarray, held: np.ndarray, split: int) -> dict:
    v = _precisions.VARIANTS[name]
    model = model_of(hf, name)
    loss_fn = make_loss(model)
    x = jnp.zeros((args.batch, args.context), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.context), x.shape)
    variables = dict(jax.jit(model.init)(jax.random.key(seed), x, x, positions))
    params = variables.pop("params")  # what remains: the fp8 states of delayed scaling, if any
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-3, min(50, args.steps // 4 + 1), args.steps)
    step, tx = _precisions.make_step(loss_fn, v, lr)
    state = (params, variables, tx.init(params))
    step = jax.jit(step, donate_argnums=0)
    evaluate = jax.jit(lambda p, s, b: loss_fn(p, s, b)[0])
    rng = np.random.default_rng(seed)  # the same batches for every variant of a seed
    for _ in range(args.steps):
        starts = rng.integers(0, split - args.context - 1, args.batch)
        state = step(state, jnp.asarray(text[starts[:, None] + np.arange(args.context + 1)]))
    chunks = np.array_split(held, max(1, len(held) // args.batch))
    loss = float(np.mean([float(evaluate(state[0], state[1], jnp.asarray(c))) for c in chunks]))
    skipped = 0
    if v.loss_scale is not None:
        skipped = int(jmp_lite.get_loss_scaling_state(state[2]).skipped_total)
    return {"held_out": loss, "skipped": skipped}


def memory(name: str, hf: Any, args: Any) -> dict:
    """Bytes kept for the backward pass, by tracing with abstract inputs (nothing is allocated)."""
    model = model_of(hf, name)
    x = jax.ShapeDtypeStruct((args.batch, args.context), jnp.int32)
    variables = dict(jax.eval_shape(model.init, jax.random.key(0), x, x, x))
    params = variables.pop("params")
    batch = jax.ShapeDtypeStruct((args.batch, args.context + 1), jnp.int32)
    return _precisions.memory_row(_precisions.VARIANTS[name], make_loss(model), params, variables, batch)


def table(rows: dict, seeds: list[int]) -> str:
    base = rows.get("f32")
    lines = [
        "| variant | held-out loss (nats/byte), mean ± sd | vs f32 | per seed "
        f"({', '.join(map(str, seeds))}) | skipped steps | residual MB | ratio to f32 |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for name, r in rows.items():
        losses = np.array(r["held_out"])
        sd = float(losses.std(ddof=1)) if len(losses) > 1 else 0.0
        vs = (
            ""
            if base is None or name == "f32"
            else f"{100 * (losses.mean() / np.mean(base['held_out']) - 1):+.2f}%"
        )
        ratio = "" if base is None else f"{r['residual_bytes'] / base['residual_bytes']:.3f}"
        lines.append(
            f"| {name} | {losses.mean():.4f} ± {sd:.4f} | {vs} | {', '.join(f'{x:.4f}' for x in losses)} "
            f"| {sum(r['skipped'])} | {r['residual_bytes'] / 1e6:.2f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--held", type=int, default=256, help="held-out sequences")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes, 3 steps, one seed: checks the script"
    )
    args = parser.parse_args()
    if args.dry_run:
        args.seeds, args.steps, args.layers, args.width, args.heads = "0", 3, 1, 32, 2
        args.context, args.batch, args.held = 32, 4, 8
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    import transformers

    env = {**_timing.environment(), "transformers": transformers.__version__}
    print(json.dumps(env), flush=True)
    hf = gpt2(args.layers, args.width, args.heads, args.context)
    text, held, split = data(args.context, args.held)
    rows: dict[str, dict] = {}
    for name in names:
        rows[name] = {"held_out": [], "skipped": [], **memory(name, hf, args)}
        for seed in seeds:
            t0 = time.perf_counter()
            r = run(name, hf, seed, args, text, held, split)
            rows[name]["held_out"].append(r["held_out"])
            rows[name]["skipped"].append(r["skipped"])
            print(
                f"{name} seed {seed}: held-out {r['held_out']:.4f} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    params = rows[names[0]]["params"]
    print(
        f"FlaxGPT2LMHeadModel, random init ({params / 1e6:.2f}M params: {args.layers} layers, width "
        f"{args.width}, {args.heads} heads, byte vocabulary), {args.steps} steps of {args.batch} x "
        f"{args.context} bytes, held-out loss on {args.held} sequences\n"
    )
    print(table(rows, seeds), flush=True)
    sizes = ("steps", "layers", "width", "heads", "context", "batch", "held")
    result = {"config": {k: getattr(args, k) for k in sizes}, "seeds": seeds, "rows": rows}
    _precisions.write_json(args.json, env, result)


if __name__ == "__main__":
    main()
