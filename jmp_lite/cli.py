"""The ``jmp-lite`` command line. ``jmp-lite demo`` (or ``python -m jmp_lite demo``) runs the demo;
``jmp-lite doctor`` prints a per-module precision report (``jmp_lite.doctor.main``); ``jmp-lite plan`` the
memory of a training step per precision setup, compiled for TPUs and NVIDIA GPUs (``jmp_lite.memory.plan``).

The demo trains one Flax model (two MLP encoders that learn, contrastively,
which 8 bytes follow 16 bytes of Python's own standard-library sources,
available offline on every machine) under five precision configurations
with the same seeds and batches, and
prints a table like those of Micikevicius et al., 2018, "Mixed Precision
Training": accuracy (next to two baselines that ignore the context), loss,
skipped steps, loss
scale, the fraction of gradient values that underflow in the compute dtype,
step time relative to float32, parameter and checkpoint sizes, and, under the table, the layers whose
gradients underflow in the float16 run without loss scaling (``jmp_lite.precision_report``). Results go to
``<out>/results.json`` and, with matplotlib installed, three PNGs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jmp-lite", description="jmp_lite: mixed-precision training")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train one model in fp32, bf16 and three float16 setups and print the comparison",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--steps", type=int, default=120, help="training steps per run")
    demo.add_argument("--seeds", type=int, default=1, help="runs per configuration; >1 adds mean ± spread")
    demo.add_argument("--batch-size", type=int, default=4096, help="pairs per step (mean loss over all)")
    demo.add_argument("--depth", type=int, default=2, help="hidden layers of each encoder")
    demo.add_argument("--width", type=int, default=64, help="units per hidden layer")
    demo.add_argument("--lr", type=float, default=1e-2, help="peak Adam learning rate")
    demo.add_argument("--data-bytes", type=int, default=1_000_000, help="bytes of stdlib sources to use")
    demo.add_argument("--test-positions", type=int, default=16384, help="held-out positions (groups of 256)")
    demo.add_argument("--diag-every", type=int, default=60, help="steps between gradient diagnostics")
    demo.add_argument("--time-rounds", type=int, default=5, help="interleaved timing rounds of 2 steps")
    demo.add_argument("--configs", nargs="+", metavar="NAME", help="a subset of the configurations, by name")
    demo.add_argument("--out", type=Path, default=Path("jmp_lite_demo"), help="output directory")
    demo.add_argument("--no-plots", action="store_true", help="skip the PNGs even if matplotlib is installed")
    sub.add_parser(
        "doctor",
        help="per-module precision report and suggested rules (the demo's model, or --target mod:fun)",
        add_help=False,  # its own parser: jmp_lite.doctor.main
    )
    sub.add_parser(
        "plan",
        help="per-chip memory of a training step in float32, bf16, fp8, FSDP and 8-bit state, compiled for "
        "TPUs and NVIDIA GPUs without them (--target v5e:2x2 --target h100)",
        add_help=False,  # its own parser: jmp_lite._src.tools.plan.main
    )
    return parser


def _check(args: argparse.Namespace, names: list[str]) -> None:
    flags = ("steps", "seeds", "batch_size", "depth", "width", "test_positions", "diag_every", "time_rounds")
    for flag in flags:
        if getattr(args, flag) < 1:
            raise SystemExit(f"jmp-lite demo: --{flag.replace('_', '-')} must be at least 1")
    if args.batch_size < 2:
        raise SystemExit("jmp-lite demo: --batch-size must be at least 2 (each pair needs a negative)")
    if args.test_positions < 256:
        raise SystemExit("jmp-lite demo: --test-positions must be at least 256 (one group of candidates)")
    if args.data_bytes < 100_000:
        raise SystemExit("jmp-lite demo: --data-bytes must be at least 100000")
    unknown = [c for c in args.configs or () if c not in names]
    if unknown:
        raise SystemExit(f"jmp-lite demo: unknown configuration(s) {unknown}; choose from {names}")


def _require_demo_extras() -> None:
    # flax and rich are the `demo` extra, not core dependencies; matplotlib is optional (plots).
    missing = []
    for name in ("flax", "rich"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(
            f"jmp-lite demo needs the demo extras, missing: {', '.join(missing)}; "
            "install them with: pip install 'jmp-lite[demo]' (or pip install -e \".[demo]\" in a clone)"
        )


def demo(args: argparse.Namespace) -> dict:
    _require_demo_extras()
    # Imports here so that `jmp-lite --help` is instant.
    import jax
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    import jmp_lite
    from jmp_lite._demo import plots
    from jmp_lite._demo.corpus import stdlib_bytes
    from jmp_lite._demo.report import table, underflow_lines
    from jmp_lite._demo.train import (
        CONFIGS,
        Setup,
        baselines,
        demo_precision_report,
        interleaved_step_times,
        run,
        static_scale,
    )

    names = [c.name for c in CONFIGS]
    _check(args, names)
    configs = [c for c in CONFIGS if not args.configs or c.name in args.configs]
    data = stdlib_bytes(args.data_bytes)
    split = int(0.9 * len(data))
    args.out.mkdir(parents=True, exist_ok=True)
    setup = Setup(
        train=data[:split],
        test=data[split:],
        steps=args.steps,
        batch=args.batch_size,
        context=16,
        depth=args.depth,
        width=args.width,
        lr=args.lr,
        diag_every=args.diag_every,
        test_positions=args.test_positions,
        out_dir=args.out,
    )
    print(
        f"jmp-lite demo: matching 16 bytes to the 8 that follow, on {len(data):,} bytes of "
        f"Python {platform.python_version()} "
        f"stdlib sources; {args.depth}-layer encoders, {args.steps} steps of {args.batch_size} pairs, "
        f"{args.seeds} seed(s), on {jax.devices()[0].platform}"
    )
    results: dict[str, list[dict]] = {c.name: [] for c in configs}
    start = time.perf_counter()
    with Progress(
        TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        transient=True,
    ) as progress:  # fmt: skip
        for seed in range(args.seeds):
            timers = {}
            scale = static_scale(setup, seed)
            for config in configs:
                task = progress.add_task(f"{config.name} (seed {seed})", total=args.steps)
                advance = functools.partial(progress.advance, task)
                result, timers[config.name] = run(config, setup, seed, scale, advance)
                results[config.name].append(result)
                progress.remove_task(task)
            task = progress.add_task(f"step times (seed {seed})", total=None)
            for name, rounds in interleaved_step_times(timers, args.time_rounds, 2).items():
                results[name][-1]["round_seconds"] = rounds
                results[name][-1]["step_seconds"] = statistics.median(rounds)
            progress.remove_task(task)
    guesses = baselines(setup)
    print(table(results, guesses))
    unscaled = [
        c
        for c in configs
        if c.loss_scale == "none" and jmp_lite.get_policy(c.policy).compute == jax.numpy.float16
    ]
    if unscaled:  # where the float16 run without loss scaling loses its gradients
        print(underflow_lines(demo_precision_report(unscaled[0].policy, args.batch_size, 0, None, setup)))
    payload = {
        "command": "jmp-lite demo " + " ".join(sys.argv[2:]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": time.perf_counter() - start,
        "environment": {
            "platform": jax.devices()[0].platform,
            "device": jax.devices()[0].device_kind,
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jmp_lite": jmp_lite.__version__,
            "machine": platform.machine(),
        },
        "baselines": guesses,
        "results": results,
    }
    (args.out / "results.json").write_text(json.dumps(payload, indent=1))
    written = [] if args.no_plots else plots.write_all(results, args.out)
    if not args.no_plots and not plots.available():
        print("(plots skipped: pip install 'jmp-lite[plots]' for matplotlib)")
    print(f"results: {args.out / 'results.json'}" + "".join(f", {p}" for p in written))
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jmp-lite`` console script.

    Example:
        >>> from jmp_lite.cli import main
        >>> main(["demo", "--steps", "0"])
        Traceback (most recent call last):
        SystemExit: jmp-lite demo: --steps must be at least 1
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        from jmp_lite._demo.train import demo_precision_report
        from jmp_lite.doctor import main as doctor

        return doctor(argv[1:], default_report=demo_precision_report)
    if argv[:1] == ["plan"]:
        from jmp_lite._demo.gpt import gpt_workload
        from jmp_lite._src.tools.plan import main as plan

        return plan(argv[1:], default_model=gpt_workload)
    args = _parser().parse_args(argv)
    if args.command == "demo":
        demo(args)
    return 0
