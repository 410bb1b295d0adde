"""The timing protocol of benchmarks/README.md, shared by the benchmark scripts."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def environment() -> dict:
    """Machine, versions and allocator settings, printed with every table."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import flax
    import optax

    import jmp_lite

    return {
        "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}",
        "devices": jax.device_count(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "jmp_lite": jmp_lite.__version__,
        "malloc_env": os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset"),
        "date": time.strftime("%Y-%m-%d"),
    }


def compile_ahead(step: Callable, state: Any, batch: Any, **jit_kwargs: Any) -> tuple[Any, float]:
    """``jax.jit(step, donate_argnums=0)`` lowered and compiled; (compiled, seconds)."""
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0, **jit_kwargs).lower(state, batch).compile()
    return compiled, time.perf_counter() - t0


def compiled_bytes(compiled: Any) -> int | None:
    """Arguments + outputs - aliased + temporaries (XLA:CPU's peak estimate ignores temporaries)."""
    try:
        m = compiled.memory_analysis()
        return int(
            m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        )
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None


def compiled_flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])
    except Exception:  # noqa: BLE001
        return None


def interleaved(
    runners: dict[str, Callable[[Any, int], Any]],
    states: dict[str, Any],
    rounds: int,
    k: int,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Seconds per step of each variant: rounds of ``k`` steps, variants in a shuffled order per round.

    ``runners[name](state, i)`` runs one step (``i`` counts the variant's steps, to pick a batch);
    one ``block_until_ready`` per round, never a host read inside it.
    """
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {n: [] for n in runners}
    counts = dict.fromkeys(runners, 0)
    for _ in range(rounds):
        for name in rng.permutation(list(runners)):
            state, run = states[name], runners[name]
            t0 = time.perf_counter()
            for _ in range(k):
                state = run(state, counts[name])
                counts[name] += 1
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - t0) / k)
            states[name] = state
    return {n: np.array(t) for n, t in times.items()}


def paired_ratio(times: np.ndarray, base: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Median of per-round ratios to ``base`` with a 95% bootstrap interval."""
    ratios = times / base
    boot = np.median(np.random.default_rng(seed).choice(ratios, (2000, len(ratios))), axis=1)
    return float(np.median(ratios)), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def peak_flops(dtype: Any = jnp.bfloat16, n: int = 2048, repeats: int = 5) -> float:
    """Calibrated peak: FLOP/s of a large 16-bit matmul accumulating in float32 on this device."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: jax.lax.dot(a, a, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def warm_up(run: Callable[[Any, int], Any], state: Any, steps: int = 5) -> Any:
    for i in range(steps):
        state = run(state, i)
    return jax.block_until_ready(state)
