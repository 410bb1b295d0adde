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
from jmp_lite._demo.corpus import windows
from jmp_lite._demo.model import ByteMLP
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


def _activation_grads(model: Any, params: Any, perturbations: Any, x: jax.Array, y: jax.Array) -> Any:
    """d(mean loss)/d(activations) of the float32 model: what the backward pass carries."""

    def loss(perturbations: Any) -> jax.Array:
        logits = model.apply({"params": params, "perturbations": perturbations}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    return jax.grad(loss)(perturbations)


def static_scale(setup: Setup, seed: int) -> float:
    """The static scale: what ``gradient_diagnostics`` recommends for float16 at initialisation.

    Computed over every gradient the backward pass produces, activations and weights:
    weight gradients sum over the batch and are the largest values, so they set the
    overflow limit.
    """
    model = apply_policy(ByteMLP(setup.depth, setup.width), "f32")
    x, y = windows(setup.train, np.arange(setup.context, setup.context + setup.batch), setup.context)
    variables = model.init(jax.random.key(seed), x)

    def loss(params: Any, perturbations: Any) -> jax.Array:
        logits = model.apply({"params": params, "perturbations": perturbations}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grads = jax.grad(loss, argnums=(0, 1))(variables["params"], variables["perturbations"])
    return float(jmp_lite.gradient_diagnostics(grads, jnp.float16).recommended_scale)


def run(config: Config, setup: Setup, seed: int, scale: float, progress: Callable[[int], None]) -> dict:
    """Train ``config`` for ``setup.steps`` steps; return the row's measurements and histories."""
    policy = jmp_lite.get_policy(config.policy)
    model = apply_policy(ByteMLP(setup.depth, setup.width), policy)
    reference = apply_policy(ByteMLP(setup.depth, setup.width), "f32")
    rng = np.random.default_rng(seed)  # the same batches for every configuration
    x0, _ = windows(setup.train, np.arange(setup.context, setup.context + 2), setup.context)
    variables = model.init(jax.random.key(seed), x0)
    perturbations = variables["perturbations"]
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
            logits = model.apply({"params": params}, x)  # no perturbations: the plain model
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return state.loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        info = jmp_lite.get_loss_scaling_state(state.opt_state)
        finite = jnp.array(True) if info.last_grads_finite is None else info.last_grads_finite
        # Separate outputs: the state's own buffers are donated to the next step.
        return state, (loss, info.loss_scale.loss_scale * 1.0, finite)

    @jax.jit
    def diagnose(params: Any, scale: jax.Array, x: jax.Array, y: jax.Array) -> jmp_lite.GradientReport:
        zeros = jax.tree_util.tree_map(
            lambda p: jnp.zeros((x.shape[0], *p.shape[1:]), jnp.float32), perturbations
        )
        grads = _activation_grads(reference, params, zeros, x, y)
        return jmp_lite.gradient_diagnostics(grads, policy.compute, scale, log2_range=(-64, 8))

    @jax.jit
    def evaluate(params: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(jnp.argmax(logits, -1) == y), jnp.sum(nll)

    losses, scales, finite, reports = [], [], [], []
    step_times = []
    for i in range(setup.steps):
        starts = rng.integers(setup.context, len(setup.train), setup.batch)
        x, y = windows(setup.train, starts, setup.context)
        if i % setup.diag_every == 0 or i == setup.steps - 1:
            reports.append(
                diagnose(state.params, scales[-1] if scales else state.loss_scale.loss_scale, x, y)
            )
        timed = i > 0 and i % setup.diag_every == setup.diag_every // 2  # a few steps, not every one
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
    starts = np.linspace(setup.context, len(setup.test) - 1, setup.test_positions).astype(int)
    hits, nll = 0, 0.0
    for chunk in np.array_split(starts, max(1, setup.test_positions // 4096)):
        h, n = evaluate(state.params, *windows(setup.test, chunk, setup.context))
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
