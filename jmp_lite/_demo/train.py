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

from jmp_lite import memory
from jmp_lite._demo.corpus import pairs
from jmp_lite._demo.model import ContextMatcher
from jmp_lite.diagnostics import GradientReport, gradient_diagnostics
from jmp_lite.doctor import PrecisionReport, precision_report
from jmp_lite.flax import TrainState
from jmp_lite.flax.linen import apply_policy
from jmp_lite.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jmp_lite.optax_transform import loss_scaling
from jmp_lite.policy import get_policy


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


@functools.lru_cache(maxsize=16)
def backward_bytes(policy: str, depth: int, width: int, batch: int, context: int, ahead: int) -> int:
    """Bytes the training step keeps for its backward pass under ``policy`` (``jmp_lite.memory``).

    Counted once per precision and shape by tracing the step's loss with abstract inputs; no
    step runs, so the demo's timing is unchanged.
    """
    model = apply_policy(ContextMatcher(depth, width), policy)
    x = jax.ShapeDtypeStruct((batch, context), jnp.int32)  # the corpus holds bytes as int32
    y = jax.ShapeDtypeStruct((batch, ahead), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), x, y)["params"]

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return _info_nce(model.apply({"params": p}, x, y))

    return memory.residual_bytes(loss, params, x, y, argnums=0).total


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
        return gradient_diagnostics(grads, jnp.float16).recommended_scale

    return float(recommend(variables["params"], variables["perturbations"]))


def _keys(data: np.ndarray, starts: np.ndarray, ahead: int) -> np.ndarray:
    """Each continuation's ``ahead`` bytes as one integer, so equal continuations compare equal."""
    after = data[starts[:, None] + np.arange(ahead)].astype(np.uint64)
    return (after << (8 * np.arange(ahead, dtype=np.uint64))).sum(-1, dtype=np.uint64)


def test_starts(setup: Setup) -> np.ndarray:
    """Held-out positions in groups of ``setup.candidates`` whose continuations are all different.

    With random groups, common continuations (eight spaces) repeat inside a group and a
    guess that ignores the context scores well above ``1 / candidates``. With distinct
    candidates every context-free guess scores exactly ``1 / candidates``, so the
    accuracy measures what the model read from the context.
    """
    every = np.arange(setup.context, len(setup.test) - setup.ahead)
    order = np.random.default_rng(1234).permutation(every)
    keys = _keys(setup.test, order, setup.ahead)
    want = max(1, setup.test_positions // setup.candidates)
    groups: list[list[int]] = []
    deferred: list[int] = []  # positions whose continuation was already in the group being filled
    taken = 0
    while len(groups) < want:
        group: list[int] = []
        seen: set[int] = set()
        rest = []
        for i in deferred:
            if len(group) < setup.candidates and keys[i] not in seen:
                seen.add(keys[i])
                group.append(i)
            else:
                rest.append(i)
        deferred = rest
        while len(group) < setup.candidates and taken < len(order):
            i, taken = taken, taken + 1
            (deferred.append(i) if keys[i] in seen else (seen.add(keys[i]), group.append(i)))
        if len(group) < setup.candidates:
            raise ValueError(
                f"--test-positions {want * setup.candidates} needs more held-out bytes than "
                f"{len(every)} (groups of {setup.candidates} distinct continuations)"
            )
        groups.append(group)
    return order[np.concatenate(groups)]


def baselines(setup: Setup) -> dict[str, dict[str, float]]:
    """Test accuracy of two guesses that ignore the context, on the same groups as the models.

    ``uniform pick``: any candidate at random (expected accuracy; a candidate with the
    same bytes as the truth counts as right). ``most frequent continuation``: the
    candidate whose bytes follow most often in the training data.
    """
    starts = test_starts(setup).reshape(-1, setup.candidates)
    train_keys, counts = np.unique(
        _keys(setup.train, np.arange(len(setup.train) - setup.ahead), setup.ahead), return_counts=True
    )
    uniform, frequent = 0.0, 0
    for group in starts:
        keys = _keys(setup.test, group, setup.ahead)
        same = keys[:, None] == keys[None, :]
        uniform += float(same.mean(-1).sum())
        where = np.clip(np.searchsorted(train_keys, keys), 0, len(train_keys) - 1)
        freq = np.where(train_keys[where] == keys, counts[where], 0)
        frequent += int((keys == keys[np.argmax(freq)]).sum())
    n = starts.size
    return {
        "uniform pick": {"test_accuracy": 100.0 * uniform / n, "test_loss": float(np.log(setup.candidates))},
        "most frequent continuation": {"test_accuracy": 100.0 * frequent / n},
    }


def run(
    config: Config, setup: Setup, seed: int, scale: float, progress: Callable[[int], None]
) -> tuple[dict, Callable[[int], float]]:
    """Train ``config`` for ``setup.steps`` steps; return the row's measurements and histories.

    Also returns ``timed_round(k)``: seconds per step over ``k`` more steps of the trained
    state, for ``interleaved_step_times``.
    """
    policy = get_policy(config.policy)
    model = apply_policy(ContextMatcher(setup.depth, setup.width), policy)
    reference = apply_policy(ContextMatcher(setup.depth, setup.width), "f32")
    rng = np.random.default_rng(seed)  # the same batches for every configuration
    x0, y0 = pairs(setup.train, np.arange(setup.context, setup.context + 2), setup.context, setup.ahead)
    variables = model.init(jax.random.key(seed), x0, y0)
    loss_scale = {
        "none": NoOpLossScale(),
        "static": StaticLossScale(scale),
        "dynamic": DynamicLossScale(2.0**15),
    }[config.loss_scale]
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, setup.lr, setup.steps // 20 + 1, setup.steps, setup.lr / 20
    )
    optimizer = optax.adam(schedule) if setup.optimizer == "adam" else optax.sgd(schedule, momentum=0.9)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=loss_scaling(optimizer, loss_scale),
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: TrainState, x: jax.Array, y: jax.Array) -> tuple[TrainState, tuple]:
        def loss_fn(params: Any) -> tuple[jax.Array, jax.Array]:
            loss = _info_nce(model.apply({"params": params}, x, y))  # no perturbations: the plain model
            return state.loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        # Separate outputs: the state's own buffers are donated to the next step.
        return state, (loss, state.loss_scale.loss_scale * 1.0, state.last_step_applied)

    @jax.jit
    def diagnose(params: Any, scale: jax.Array, x: jax.Array, y: jax.Array) -> GradientReport:
        grads = _activation_grads(reference, params, x, y)
        return gradient_diagnostics(grads, policy.compute, scale, log2_range=(-64, 8))

    @jax.jit
    def evaluate(params: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = model.apply({"params": params}, x, y).astype(jnp.float32)
        # Right if the chosen continuation has the right bytes: code repeats itself ("    " ...).
        hits = jnp.all(y[jnp.argmax(logits, -1)] == y, axis=-1)
        return jnp.sum(hits), _info_nce(logits) * x.shape[0]

    losses, scales, finite, reports = [], [], [], []
    for i in range(setup.steps):
        x, y = _batch(setup, rng)
        if i % setup.diag_every == 0 or i == setup.steps - 1:
            reports.append(
                diagnose(state.params, scales[-1] if scales else state.loss_scale.loss_scale, x, y)
            )
        state, (loss, scale_now, finite_now) = step(state, x, y)
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
    result = {
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
        "param_bytes": int(sum(a.nbytes for a in jax.tree_util.tree_leaves(state.params))),
        # parameters and optimizer state between steps, per parameter (memory.state_bytes)
        "state_bytes_per_param": memory.state_bytes(state.params, state.opt_state).bytes_per_parameter,
        "backward_bytes": backward_bytes(
            config.policy, setup.depth, setup.width, setup.batch, setup.context, setup.ahead
        ),
        "checkpoint_bytes": checkpoint.stat().st_size,
        "loss_history": losses.tolist(),
        "scale_history": np.asarray(jax.device_get(scales), np.float64).tolist(),
        "histogram": np.asarray(reports[-1].histogram).tolist(),
        "log2_bins": np.asarray(reports[-1].log2_bins).tolist(),
        "zeros_fraction": float(reports[-1].zeros),
    }
    timing = {"state": state}

    def timed_round(k: int) -> float:
        # After the measurements above: these extra steps change nothing that is reported.
        jax.block_until_ready(timing["state"])
        t0 = time.perf_counter()
        for _ in range(k):
            timing["state"], (loss, _, _) = step(timing["state"], x, y)
        jax.block_until_ready(loss)  # one wait per round, as in benchmarks/README.md
        return (time.perf_counter() - t0) / k

    return result, timed_round


def interleaved_step_times(
    rounds: dict[str, Callable[[int], float]], count: int, k: int
) -> dict[str, list[float]]:
    """Seconds per step of each configuration, in ``count`` interleaved rounds of ``k`` steps.

    One warm-up round each first; the order rotates every round so that no configuration
    always runs first (or right after the same one) while the machine's load drifts.
    """
    names = list(rounds)
    for name in names:
        rounds[name](k)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(count):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(rounds[name](k))
    return times


def demo_precision_report(
    policy: str, batch: int, seed: int = 0, loss_scale: float | None = None, setup: Setup | None = None
) -> PrecisionReport:
    """``jmp_lite.precision_report`` of the demo's loss at initialization, on the first batch of a run
    (``jmp-lite doctor``, and the demo's per-layer underflow lines); no ``setup``: the demo's defaults."""
    if setup is None:
        from jmp_lite._demo.corpus import stdlib_bytes

        data = stdlib_bytes(1_000_000)
        split = int(0.9 * len(data))  # as the demo splits it
        defaults = {"steps": 1, "context": 16, "depth": 2, "width": 64, "lr": 1e-2, "diag_every": 1}
        setup = Setup(
            data[:split], data[split:], batch=batch, test_positions=256, out_dir=Path("."), **defaults
        )
    model = apply_policy(ContextMatcher(setup.depth, setup.width), policy)
    x, y = _batch(setup, np.random.default_rng(seed))
    params = model.init(jax.random.key(seed), x, y)["params"]
    report = precision_report(model.apply, loss=_info_nce, loss_scale=loss_scale)
    return report({"params": params}, x, y)
