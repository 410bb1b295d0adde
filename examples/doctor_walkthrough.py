"""The two float16 failures of docs/doctor.md, run end to end: the failure, the report, the rules, the fix.

    python examples/doctor_walkthrough.py            # 20 steps per training run, about a minute on 2 cores
    python examples/doctor_walkthrough.py --steps 5 --case b

The models and data are those of tests/test_report.py (tests/_precision_cases.py), so this runs from a
clone of the repository. The numbers in docs/doctor.md are this script's output.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
from _precision_cases import F16, ResidualMLP, SensorTransformer, data, train, xent  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite.flax.linen import apply_policy  # noqa: E402


def _compare(steps: int, reference: list[float], fixed: list[float], skipped: int | None) -> None:
    change = 100 * (fixed[-1] / reference[-1] - 1)
    print(
        f"after {steps} steps: float32 {reference[-1]:.4f}, float16 with the suggested rules {fixed[-1]:.4f} "
        f"({change:+.2f}%), skipped {skipped}; loss at step 1: {reference[0]:.4f}"
    )


def _middle(suggestion: jmp_lite.RuleSuggestion) -> jmp_lite.StaticLossScale:
    low, high = suggestion.loss_scale
    return jmp_lite.StaticLossScale(math.sqrt(low * high))  # the middle of the suggested range


def case_a(steps: int) -> None:
    """A post-norm transformer over raw readings, its softmax taken in float16 as written by hand."""
    print("=== case (a): SensorTransformer, softmax in float16 (rules={'exp': 'follow'})")
    model = SensorTransformer()
    x, y = data((256, 8, 16))
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return xent(model.apply({"params": params}, x), y)

    default = jmp_lite.precision_report(loss, F16)(params, x, y)
    logits = default.names.index("SensorTransformer/PostNormBlock_0/MultiHeadDotProductAttention_0 [logits]")
    print(
        f"default rules: the logits run in {default.groups[logits].dtypes}, "
        f"non-finite fraction {float(default.activations.nonfinite.max()):g}"
    )
    hand = {"exp": "follow"}
    losses, skipped = train(
        jmp_lite.autocast(loss, F16, rules=hand), params, x, y, steps, jmp_lite.DynamicLossScale(2.0**15)
    )
    print(f"float16 softmax: losses {losses[:3]} ..., skipped {skipped} of {steps}")
    report = jmp_lite.precision_report(loss, F16, rules=hand, loss_scale=2.0**15)(params, x, y)
    print(report.table(top=8))
    suggestion = jmp_lite.suggest_rules(report)
    print(suggestion)
    reference, _ = train(jmp_lite.autocast(loss, "f32"), params, x, y, steps)
    fixed, skipped = train(
        jmp_lite.autocast(loss, F16, rules=suggestion.rules), params, x, y, steps, _middle(suggestion)
    )
    _compare(steps, reference, fixed, skipped)


def case_b(steps: int) -> None:
    """A residual GLU MLP whose first block overflows float16 in the forward pass."""
    print("=== case (b): ResidualMLP, apply_policy(module, 'p=f32,c=f16,o=f32')")
    module = ResidualMLP()
    x, y = data((256, 16))
    params = apply_policy(module, "f32").init(jax.random.key(0), x)["params"]
    model = apply_policy(module, F16)

    def loss_of(m: object) -> Callable[..., jax.Array]:
        return lambda p, x, y: xent(m.apply({"params": p}, x), y)

    scales = (
        jmp_lite.DynamicLossScale(2.0**15),
        jmp_lite.StaticLossScale(2.0**8),
        jmp_lite.StaticLossScale(1.0),
    )
    for scale in scales:
        losses, skipped = train(loss_of(model), params, x, y, 5, scale)
        print(
            f"{type(scale).__name__}({float(scale.loss_scale):g}): losses {losses[:2]} ..., "
            f"skipped {skipped} of 5"
        )
    report = jmp_lite.precision_report(model.apply, loss=lambda out: xent(out, y))({"params": params}, x)
    print(report.table(top=8))
    suggestion = jmp_lite.suggest_rules(report)
    print(suggestion)
    reference, _ = train(loss_of(apply_policy(module, "f32")), params, x, y, steps)
    fixed, skipped = train(
        loss_of(apply_policy(module, F16, suggestion.rules)), params, x, y, steps, _middle(suggestion)
    )
    _compare(steps, reference, fixed, skipped)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="Adam steps of each training run")
    parser.add_argument("--case", choices=["a", "b", "both"], default="both", help="which failure to run")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("doctor_walkthrough: --steps must be at least 1")
    if args.case in ("a", "both"):
        case_a(args.steps)
    if args.case in ("b", "both"):
        case_b(args.steps)


if __name__ == "__main__":
    main()
