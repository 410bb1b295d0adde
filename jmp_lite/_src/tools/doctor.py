"""``jmp-lite doctor``: a precision report and the rules it calls for, on the demo's model or on yours."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

_DESCRIPTION = """\
Runs jmp_lite.precision_report: the model forward and backward in float32 and under the policy, in one
compiled program, and prints per module (or named scope) the largest values and their headroom, the
fractions that overflow, underflow and turn subnormal in the dtype each operation ran in, non-finite
values and the relative error against float32, worst first; then jmp_lite.suggest_rules: the modules
to keep in float32 and a loss scale range, each with the measurement behind it.

Without --target it checks the demo's model (jmp-lite demo) at initialization. With --target
package.module:function it checks function(batch), which must return a scalar loss (its parameters
closed over), on a random batch of --shape and --dtype, run as jmp_lite.autocast runs it. The arrays
it closes over are measured as arguments (rows [closed over]), so the loss scale range covers the
parameters' gradients; where one cannot be (inside a loop, branch or custom-derivative body) no range
is suggested: pass the parameters as arguments (jmp_lite.precision_report) instead.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jmp-lite doctor", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", default="p=f32,c=f16,o=f32", help="the policy to check")
    parser.add_argument("--loss-scale", type=float, default=1.0, help="gradients are measured times this")
    parser.add_argument("--top", type=int, default=15, help="rows of the table (0: all)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    parser.add_argument("--target", metavar="MODULE:FUNCTION", help="check FUNCTION(batch) of MODULE")
    parser.add_argument("--shape", help="the batch's shape, e.g. 32,16 (with --target)")
    parser.add_argument("--dtype", default="float32", help="the batch's dtype (with --target)")
    parser.add_argument("--high", type=int, default=256, help="integer batches are drawn from [0, high)")
    parser.add_argument("--seed", type=int, default=0, help="the random batch's (and the demo model's) seed")
    parser.add_argument(
        "--batch-size", type=int, default=4096, help="the demo model's batch (without --target)"
    )
    return parser


def _shape(text: str | None) -> tuple[int, ...]:
    if not text:
        raise SystemExit("jmp-lite doctor: --target needs --shape, e.g. --shape 32,16")
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        raise SystemExit(
            f"jmp-lite doctor: --shape must be whole numbers separated by commas, got {text!r}"
        ) from None
    if not shape or min(shape) < 1:
        raise SystemExit(f"jmp-lite doctor: --shape must be positive whole numbers, got {text!r}")
    return shape


def load_target(spec: str, command: str = "doctor", flag: str = "--target") -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (the current directory is importable); errors
    name the ``jmp-lite`` command and the flag that gave ``spec``."""
    where = f"jmp-lite {command}"
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"{where}: {flag} must be MODULE:FUNCTION, got {spec!r}")
    # The directory itself, not ".": a finder cached for "." can hold the listing of an earlier directory
    # (same mtime), and the module written since is then not found.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"{where}: cannot import {module_name!r}: {e}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise SystemExit(f"{where}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise SystemExit(f"{where}: {spec} is not callable")
    return target


def _sample(shape: tuple[int, ...], dtype_name: str, high: int, seed: int) -> Any:
    import jax
    import jax.numpy as jnp

    try:
        dtype = jnp.dtype(dtype_name)
    except TypeError:
        raise SystemExit(
            f"jmp-lite doctor: --dtype {dtype_name!r} is not a dtype (float32, int32, ...)"
        ) from None
    key = jax.random.key(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(key, shape, 0, high, dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise SystemExit(f"jmp-lite doctor: --dtype must be a floating or integer dtype, got {dtype_name!r}")
    return jax.random.normal(key, shape, dtype)


def _report(args: argparse.Namespace, default_report: Callable[..., Any] | None) -> Any:
    from jmp_lite._src.tools.precision_report import precision_report

    scale = None if args.loss_scale == 1.0 else args.loss_scale
    if args.target:
        fun = load_target(args.target)
        batch = _sample(_shape(args.shape), args.dtype, args.high, args.seed)
        print(
            f"jmp-lite doctor: {args.target} on a {batch.dtype} batch of shape {batch.shape}, {args.policy}"
        )
        return precision_report(fun, args.policy, loss_scale=scale)(batch)
    if default_report is None:
        raise SystemExit(
            "jmp-lite doctor: give --target MODULE:FUNCTION (with --shape); the command line checks the "
            "demo's model without it"
        )
    print(
        f"jmp-lite doctor: the demo's model at initialization, {args.batch_size} pairs, policy {args.policy}"
    )
    return default_report(args.policy, args.batch_size, args.seed, scale)


def main(argv: Sequence[str] | None = None, default_report: Callable[..., Any] | None = None) -> int:
    """``jmp-lite doctor``: prints the ranked precision report and the suggested rules.

    ``argv`` are the command's arguments (``None``: ``sys.argv[1:]``): ``--target module:function``
    with ``--shape`` (and ``--dtype``) checks ``function(batch)``, which returns a scalar loss;
    without it, ``default_report(policy, batch_size, seed, loss_scale)`` (the command line gives the
    demo's model). Returns 0; bad arguments exit with a message.

    Example:
        >>> from jmp_lite.doctor import main
        >>> main(["--target", "nowhere"])
        Traceback (most recent call last):
        SystemExit: jmp-lite doctor: --target must be MODULE:FUNCTION, got 'nowhere'
    """
    args = _parser().parse_args(argv)
    if args.top < 0:
        raise SystemExit("jmp-lite doctor: --top must be at least 0")
    if not args.loss_scale > 0:
        raise SystemExit("jmp-lite doctor: --loss-scale must be positive")
    if args.target and ":" not in args.target:
        raise SystemExit(f"jmp-lite doctor: --target must be MODULE:FUNCTION, got {args.target!r}")
    from jmp_lite._src.tools.rule_suggestions import suggest_rules

    report = _report(args, default_report)
    report.show(top=args.top or None)
    print()
    print(suggest_rules(report))
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=1))
        print(f"report: {args.json}")
    return 0
