"""Train the demo model under one precision configuration and measure what the table reports."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

import jmp_lite
from jmp_lite._demo.corpus import pairs
from jmp_lite._demo.model import ContextMatcher
from jmp_lite.flax import TrainState, apply_policy


@dataclass(frozen=True)
class Config:
    name: str
    policy: str
    loss_scale: str  # "none", "static" or "dynamic"


CONFIGS = (
    Config("fp32", "f32", "none"),
    Config("bf16", "p=f32,c=bf16,o=f32", "none"),
    Config("f16, no loss scaling", "p=f32,c=f16,o=f32", "none"),
    Config("f16, static scale", "p=f32,c=f16,o=f32", "static"),
    Config("f16, dynamic scale", "p=f32,c=f16,o=f32", "dynamic"),
)


@dataclass(frozen=True)
class Setup:
    """Everything a run shares with the other configurations."""

    train: np.ndarray
    test: np.ndarray
    steps: int
    batch: int
    context: int
    depth: int
    width: int
    lr: float
    diag_every: int
    test_positions: int
    out_dir: Path
    optimizer: str = "adam"  # or "sgd" (momentum 0.9)
    ahead: int = 8  # bytes of continuation to match
    candidates: int = 256  # continuations each test context is matched against


def _info_nce(logits: jax.Array) -> jax.Array:
    # Row i's right answer is column i; the mean over rows is what divides each gradient by N.
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(logits.shape[0])).mean()


def _activation_grads(model: Any, params: Any, x: jax.Array, y: jax.Array) -> Any:
    """d(mean loss)/d(activations and logits) of the float32 model: what the backward pass carries."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), x, y)["perturbations"]
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def loss(perturbations: Any) -> jax.Array:
        return _info_nce(model.apply({"params": params, "perturbations": perturbations}, x, y))

    return jax.grad(loss)(zeros)


def _batch(setup: Setup, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    starts = rng.integers(setup.context, len(setup.train) - setup.ahead, setup.batch)
    return pairs(setup.train, starts, setup.context, setup.ahead)


def static_scale(setup: Setup, seed: int) -> float:
    """The static scale: what ``gradient_diagnostics`` recommends for float16 at initialisation.

    Computed over every gradient the backward pass produces, activations and weights:
    weight gradients sum over the batch and are the largest values, so they set the
    overflow limit.
    """
    model = apply_policy(ContextMatcher(setup.depth, setup.width), "f32")
    x, y = _batch(setup, np.random.default_rng(seed))
    variables = model.init(jax.random.key(seed), x, y)

    def loss(params: Any, perturbations: Any) -> jax.Array:
        return _info_nce(model.apply({"params": params, "perturbations": perturbations}, x, y))

    @jax.jit
    def recommend(params: Any, perturbations: Any) -> jax.Array:
        grads = jax.grad(loss, argnums=(0, 1))(params, perturbations)
        return jmp_lite.gradient_diagnostics(grads, jnp.float16).recommended_scale

    return float(recommend(variables["params"], variables["perturbations"]))


def test_starts(setup: Setup) -> np.ndarray:
    """Held-out positions in a fixed shuffled order, in whole groups of ``setup.candidates``."""
    every = np.arange(setup.context, len(setup.test) - setup.ahead)
    count = max(1, setup.test_positions // setup.candidates) * setup.candidates
    if count > len(every):
        raise ValueError(f"--test-positions {count} needs more held-out bytes than {len(every)}")
    return np.random.default_rng(1234).permutation(every)[:count]


def run(config: Config, setup: Setup, seed: int, scale: float, progress: Callable[[int], None]) -> dict:
    """Train ``config`` for ``setup.steps`` steps; return the row's measurements and histories."""
    policy = jmp_lite.get_policy(config.policy)
    model = apply_policy(ContextMatcher(setup.depth, setup.width), policy)
    reference = apply_policy(ContextMatcher(setup.depth, setup.width), "f32")
    rng = np.random.default_rng(seed)  # the same batches for every configuration
    x0, y0 = pairs(setup.train, np.arange(setup.context, setup.context + 2), setup.context, setup.ahead)
    variables = model.init(jax.random.key(seed), x0, y0)
    loss_scale = {
        "none": jmp_lite.NoOpLossScale(),
        "static": jmp_lite.StaticLossScale(scale),
        "dynamic": jmp_lite.DynamicLossScale(2.0**15),
    }[config.loss_scale]
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, setup.lr, setup.steps // 20 + 1, setup.steps, setup.lr / 20
    )
    optimizer = optax.adam(schedule) if setup.optimizer == "adam" else optax.sgd(schedule, momentum=0.9)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=jmp_lite.loss_scaling(optimizer, loss_scale),
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: TrainState, x: jax.Array, y: jax.Array) -> tuple[TrainState, tuple]:
        def loss_fn(params: Any) -> tuple[jax.Array, jax.Array]:
            loss = _info_nce(model.apply({"params": params}, x, y))  # no perturbations: the plain model
            return state.loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
        params, opt_state, finite = jmp_lite.apply_scaled_gradients(
            state.tx, grads, state.opt_state, state.params
        )
        state = state.replace(step=state.step + finite, params=params, opt_state=opt_state)
        info = jmp_lite.get_loss_scaling_state(opt_state)
        # Separate outputs: the state's own buffers are donated to the next step.
        return state, (loss, info.loss_scale.loss_scale * 1.0, finite)

    @jax.jit
    def diagnose(params: Any, scale: jax.Array, x: jax.Array, y: jax.Array) -> jmp_lite.GradientReport:
        grads = _activation_grads(reference, params, x, y)
        return jmp_lite.gradient_diagnostics(grads, policy.compute, scale, log2_range=(-64, 8))

    @jax.jit
    def evaluate(params: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = model.apply({"params": params}, x, y).astype(jnp.float32)
        # Right if the chosen continuation has the right bytes: code repeats itself ("    " ...).
        hits = jnp.all(y[jnp.argmax(logits, -1)] == y, axis=-1)
        return jnp.sum(hits), _info_nce(logits) * x.shape[0]

    losses, scales, finite, reports = [], [], [], []
    step_times = []
    for i in range(setup.steps):
        x, y = _batch(setup, rng)
        if i % setup.diag_every == 0 or i == setup.steps - 1:
            reports.append(
                diagnose(state.params, scales[-1] if scales else state.loss_scale.loss_scale, x, y)
            )
        timed = i % 10 == 5  # every tenth step, away from the diagnostics of the steps before
        if timed:
            jax.block_until_ready(losses[-1])  # an empty queue, so only this step is timed
        t0 = time.perf_counter()
        state, (loss, scale_now, finite_now) = step(state, x, y)
        if timed:
            jax.block_until_ready(loss)
            step_times.append(time.perf_counter() - t0)
        losses.append(loss)
        scales.append(scale_now)
        finite.append(finite_now)
        progress(1)
    losses = np.asarray(jax.device_get(losses), np.float64)
    skipped = np.cumsum(~np.asarray(jax.device_get(finite), bool))
    starts = test_starts(setup)
    hits, nll = 0, 0.0
    for group in starts.reshape(-1, setup.candidates):
        h, n = evaluate(state.params, *pairs(setup.test, group, setup.context, setup.ahead))
        hits, nll = hits + int(h), nll + float(n)
    checkpoint = setup.out_dir / f"model_{config.name.replace(', ', '_').replace(' ', '_')}.msgpack"
    exported = policy.cast_to_compute(state.params)  # what you would ship for inference
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_bytes(serialization.to_bytes(exported))
    underflow = [float(r.underflow) for r in reports]
    return {
        "config": config.name,
        "policy": config.policy,
        "seed": seed,
        "test_accuracy": 100.0 * hits / len(starts),
        "final_loss": float(np.mean(losses[-max(1, setup.steps // 20) :])),
        "test_loss": nll / len(starts),
        "diverged": bool(not np.all(np.isfinite(losses[-10:]))),
        "skipped_steps": int(skipped[-1]),
        "skipped_history": skipped.tolist(),
        "final_loss_scale": float(jax.device_get(scales[-1])),
        "underflow_fraction": float(np.mean(underflow)),
        "underflow_history": underflow,
        "subnormal_fraction": float(np.mean([float(r.subnormal) for r in reports])),
        "step_seconds": float(np.median(step_times)) if step_times else float("nan"),
        "param_bytes": int(sum(a.nbytes for a in jax.tree_util.tree_leaves(state.params))),
        "checkpoint_bytes": checkpoint.stat().st_size,
        "loss_history": losses.tolist(),
        "scale_history": np.asarray(jax.device_get(scales), np.float64).tolist(),
        "histogram": np.asarray(reports[-1].histogram).tolist(),
        "log2_bins": np.asarray(reports[-1].log2_bins).tolist(),
        "zeros_fraction": float(reports[-1].zeros),
    }
