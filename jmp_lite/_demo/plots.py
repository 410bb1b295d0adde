"""The demo's figures (matplotlib, the optional ``plots`` extra): loss, loss scale, gradient histogram."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

F16_TINY_LOG2 = -14  # smallest normal float16: 2^-14
F16_SUBNORMAL_LOG2 = -24  # smallest subnormal float16: 2^-24
F16_MAX_LOG2 = 16  # float16 max is 65504, just under 2^16
BF16_TINY_LOG2 = -126  # float32's and bfloat16's smallest normal (XLA flushes below it)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def available() -> bool:
    return _pyplot() is not None


def _smooth(values: list[float], window: int) -> np.ndarray:
    v = np.asarray(values, np.float64)
    if len(v) < window:
        return v
    kernel = np.ones(window) / window
    return np.convolve(np.where(np.isfinite(v), v, np.nan), kernel, mode="valid")


def loss_curves(results: dict[str, list[dict]]) -> Any:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, runs in results.items():
        curve = _smooth(runs[0]["loss_history"], 10)
        ax.plot(np.arange(len(curve)) + 10, curve, label=name)
    ax.set(
        title="Training loss (seed 0, 10-step moving average)",
        xlabel="step",
        ylabel="InfoNCE loss (nats; chance = ln batch size)",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def loss_scale_curves(results: dict[str, list[dict]]) -> Any:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, runs in results.items():
        scales = np.asarray(runs[0]["scale_history"])
        top.plot(np.arange(len(scales)), scales, label=name)
        skipped = np.asarray(runs[0]["skipped_history"])
        bottom.plot(np.arange(len(skipped)), skipped, label=name)
    top.set(title="Loss scale (seed 0)", ylabel="loss scale", yscale="log")
    bottom.set(
        title="Skipped steps (non-finite gradients), cumulative", xlabel="step", ylabel="steps skipped"
    )
    for ax in (top, bottom):
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def gradient_histogram(result: dict, title: str) -> Any:
    """Share of activation-gradient values per power of two, the float16/bfloat16 ranges shaded."""
    plt = _pyplot()
    bins = np.asarray(result["log2_bins"])
    counts = np.asarray(result["histogram"], np.float64)
    total = counts.sum() / (1.0 - result["zeros_fraction"]) if counts.sum() else 1.0
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.bar(
        bins, 100 * counts / total, width=0.9, color="tab:blue", label="activation gradients (float32 run)"
    )
    ax.axvspan(F16_TINY_LOG2, F16_MAX_LOG2, color="tab:green", alpha=0.12, label="float16 normal range")
    ax.axvspan(
        F16_SUBNORMAL_LOG2 - 1, F16_TINY_LOG2, color="tab:orange", alpha=0.15, label="float16 subnormal"
    )
    ax.axvspan(
        bins[0] - 0.5, F16_SUBNORMAL_LOG2 - 1, color="tab:red", alpha=0.10, label="becomes 0 in float16"
    )
    ax.axvline(
        max(BF16_TINY_LOG2, bins[0] - 0.5), color="tab:purple", ls="--", label="bfloat16 range continues"
    )
    ax.set(
        title=title,
        xlabel="log2 |gradient|",
        ylabel="% of all values (log scale)",
        yscale="log",
        xlim=(bins[0] - 0.5, bins[-1] + 0.5),
    )
    ax.text(
        0.01,
        0.97,
        f"zeros: {100 * result['zeros_fraction']:.1f}% of values",
        transform=ax.transAxes,
        va="top",
    )
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_all(results: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    """Write the three PNGs; returns their paths (empty when matplotlib is missing)."""
    plt = _pyplot()
    if plt is None:
        return []
    figures = {
        "loss.png": loss_curves(results),
        "loss_scale.png": loss_scale_curves(results),
        "gradient_histogram.png": gradient_histogram(
            results["fp32"][0] if "fp32" in results else next(iter(results.values()))[0],
            "Activation and logit gradients, end of float32 training\n"
            "(cf. Micikevicius et al., 2018, Mixed Precision Training, Figure 2)",
        ),
    }
    paths = []
    for name, fig in figures.items():
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
