"""``plan``: which precision setup of a training step fits on which chips, from the programs the
target's compiler builds (``compiled``), one compile per setup; ``jmp-lite plan`` prints it.

Each setup is the same step, ``value_and_grad`` of the loss and the optimizer's update, with the
parameters and the optimizer state donated, compiled for the target with abstract inputs:

- ``float32``: the loss as written;
- ``bf16``: ``autocast(loss, policy)`` (the policy's compute dtype, float32 parameters and state);
- ``fp8``: the same with ``fp8=`` (E4M3/E5M2 weight contractions, ``jmp_lite.fp8``);
- ``int8-state``: ``bf16`` with ``low_precision_state(optimizer, "int8")`` (8-bit Adam moments);
- ``fsdp``: ``bf16`` with the parameters and optimizer state sharded over every device of the target
  (``autocast(..., mesh=, fsdp_axis=)``), the others replicated (data parallel);
- ``fsdp-float32``: the same sharding under the float32 policy (FSDP's float32 baseline);
- ``bf16-recompute``: ``bf16`` with ``recompute="wide_contractions"`` (an MLP's up-projection rebuilt in
  the backward pass instead of kept);
- ``bf16-cast``: the parameters cast to the compute dtype by hand (``policy.cast_to_compute``, jmp's
  recipe) before the float32 loss, for comparison.

On more than one device the batch is split along its first dimension (data parallel).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_lite._src.base import validate
from jmp_lite._src.tools.compiled import CompiledReport, CompilerOutOfMemory, compiled
from jmp_lite._src.tools.memory import format_bytes
from jmp_lite._src.tools.targets import Target, compile_only_target

__all__ = ["Plan", "VARIANTS", "Workload", "main", "plan"]

VARIANTS = ("float32", "bf16", "fp8", "int8-state", "fsdp", "fsdp-float32", "bf16-cast", "bf16-recompute")
DEFAULT_VARIANTS = ("float32", "bf16", "fp8", "int8-state", "fsdp")
_DATA = "data"


class Workload(NamedTuple):
    """A training step to plan: ``loss(params, *batch) -> scalar``, the parameters and the batch
    (arrays or ``jax.ShapeDtypeStruct``: only shapes and dtypes are read), the optimizer (``None``:
    ``optax.adam(1e-4)``), and how the loss runs under a policy: ``under_policy(policy, **options)``
    returns that loss (``options``: ``fp8=``, ``mesh=``, ``fsdp_axis=``, ``recompute=``), e.g. through
    a Flax model's own front-end, ``lambda policy, **o: make_loss(jmp_lite.flax.linen.apply_policy(model,
    policy, **o))``; ``None``: ``jmp_lite.autocast(loss, policy, **options)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.memory import Workload
        >>> w = Workload(lambda p, x: jnp.sum(x @ p), jax.ShapeDtypeStruct((4, 4), jnp.float32),
        ...              (jax.ShapeDtypeStruct((2, 4), jnp.float32),))
        >>> w.optimizer is None
        True
    """

    loss: Callable[..., Any]
    params: Any
    batch: tuple[Any, ...]
    optimizer: Any = None
    under_policy: Callable[..., Callable[..., Any]] | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """``plan``'s result: one ``CompiledReport`` per setup on one target (``skipped``: setups that do
    not apply there, with why; ``does_not_fit``: setups the target's compiler refused for want of
    memory, with its words: XLA:TPU checks while it compiles).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.memory import plan
        >>> p = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
        >>> x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
        >>> result = plan(lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2), p, x, target=None,
        ...               variants=("float32", "bf16"))
        >>> sorted(result.reports), result.skipped, result.does_not_fit
        (['bf16', 'float32'], {}, {})
    """

    target: str
    device_kind: str
    devices: int
    memory_bytes: int | None
    reports: dict[str, CompiledReport]
    skipped: dict[str, str]
    does_not_fit: dict[str, str] = dataclasses.field(default_factory=dict)

    def table(self) -> str:
        """A table, one row per setup: per-device peak and its parts, fits or not, float32
        contractions, bytes on the wire."""
        base = self.reports.get("float32")
        memory = "memory unknown" if self.memory_bytes is None else f"{format_bytes(self.memory_bytes)} each"
        moved = {}
        for name, r in self.reports.items():
            moved[name] = collections.Counter()
            for key, n in r.collective_bytes().items():
                moved[name][key.split(" ")[0]] += n
        # a column for neighbour exchanges only where a setup has them (fsdp's reduce_scatter="ring")
        permute = any(m["collective_permute"] for m in moved.values())
        extra = " collective-permute |" if permute else ""
        lines = [
            f"{self.target}: {self.devices} x {self.device_kind} ({memory})",
            "| setup | peak / device | vs float32 | fits | arguments | temporaries | f32 x f32 dots "
            f"| all-gather | reduce-scatter | all-reduce |{extra} compile s |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * permute + "---:|",
        ]
        for name, r in self.reports.items():
            m = moved[name]
            ratio = f"{r.peak_bytes / base.peak_bytes:.2f}x" if base is not None and base.peak_bytes else ""
            fits = {None: "?", True: "yes", False: "NO"}[r.fits]
            permuted = f" {format_bytes(m['collective_permute'])} |" if permute else ""
            lines.append(
                f"| {name} | {format_bytes(r.peak_bytes)} | {ratio} | {fits} "
                f"| {format_bytes(r.argument_bytes)} | {format_bytes(r.temp_bytes)} "
                f"| {len(r.float32_contractions())} | {format_bytes(m['all_gather'])} "
                f"| {format_bytes(m['reduce_scatter'])} | {format_bytes(m['all_reduce'])} |{permuted}"
                f" {r.compile_seconds:.0f} |"
            )
        blanks = " |" * (7 + permute)
        for name, why in self.does_not_fit.items():
            lines.append(f"| {name} | does not fit: {why} | | NO |{blanks}")
        for name, why in self.skipped.items():
            lines.append(f"| {name} | skipped: {why} | | |{blanks}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "target": self.target,
            "device_kind": self.device_kind,
            "devices": self.devices,
            "memory_bytes": self.memory_bytes,
            "reports": {k: r.to_dict() for k, r in self.reports.items()},
            "skipped": dict(self.skipped),
            "does_not_fit": dict(self.does_not_fit),
        }


def _abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x, tree
    )


def _placed(tree: Any, sharding: Callable[[Any], Any]) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)) if hasattr(x, "dtype") else x,
        tree,
    )


def _state_for(tx: Any, params: Any, mesh: Any) -> Any:
    """The optimizer state of ``params`` as abstract arrays placed as ``tx.init`` on the placed
    parameters places them: a state array of a parameter's shape (a moment) shards like it, the rest
    (step counts, scales) is replicated on ``mesh``."""
    like = {}
    for x in jax.tree_util.tree_leaves(params):
        like.setdefault((x.shape, x.dtype), x.sharding)
    replicated = NamedSharding(mesh, P())

    def place(s: Any) -> Any:
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=like.get((s.shape, s.dtype), replicated))

    return jax.tree_util.tree_map(place, jax.eval_shape(tx.init, params))


def _step(loss: Callable[..., Any], tx: Any) -> Callable[..., Any]:
    import optax

    def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def _variant(
    name: str, loss: Callable[..., Any], under_policy: Any, optimizer: Any, policy: Any, fp8: str, mesh: Any
) -> tuple[Callable[..., Any], Any, bool]:
    """``(loss, optimizer, fsdp)`` of one setup."""
    from jmp_lite._src.frontends.autocast import autocast
    from jmp_lite._src.optim.low_precision import low_precision_state

    if under_policy is None:
        under_policy = functools.partial(autocast, loss)
    if name == "float32":
        return loss, optimizer, False
    if name == "bf16":
        return under_policy(policy), optimizer, False
    if name == "fp8":
        return under_policy(policy, fp8=fp8), optimizer, False
    if name == "int8-state":
        return under_policy(policy), low_precision_state(optimizer, "int8"), False
    if name == "fsdp":
        return under_policy(policy, mesh=mesh, fsdp_axis=_DATA), optimizer, True
    if name == "fsdp-float32":
        return under_policy("p=f32,c=f32,o=f32", mesh=mesh, fsdp_axis=_DATA), optimizer, True
    if name == "bf16-recompute":
        return under_policy(policy, recompute="wide_contractions"), optimizer, False
    if name == "bf16-cast":
        cast = policy.cast_to_compute
        return (lambda p, *batch: loss(cast(p), *batch)), optimizer, False
    raise ValueError(f"plan: unknown setup {name!r}; choose from {', '.join(VARIANTS)}")


def plan(
    loss: Callable[..., Any],
    params: Any,
    *batch: Any,
    target: str | Target | None,
    optimizer: Any = None,
    under_policy: Callable[..., Callable[..., Any]] | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    policy: Any = "p=f32,c=bf16,o=f32",
    fp8: str = "hybrid,current",
    compiler_options: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    peak_values: bool = False,
) -> Plan:
    """Compile one training step of ``loss`` per setup (``variants``, module docstring) for ``target``
    and report each (``Plan``): per-device peak memory, whether it fits, float32 islands, collectives.

    ``params`` and ``batch`` are arrays or ``jax.ShapeDtypeStruct`` (``jax.eval_shape(model.init, ...)``):
    nothing is allocated. ``optimizer`` is an optax transformation (``None``: ``optax.adam(1e-4)``).
    ``under_policy(policy, **options)`` makes the loss under a policy (``Workload``; ``None``:
    ``jmp_lite.autocast(loss, policy, **options)``).
    ``target``: a name (``"h100"``, ``"v5e:2x2"``: ``compile_only_target``), a ``Target``, or ``None``
    for this machine's devices. ``progress(message)`` is called before each compile. ``peak_values``:
    each report also says what holds its temporaries at their peak (``compiled``'s option).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.memory import plan
        >>> p = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
        >>> x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
        >>> loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
        >>> result = plan(loss, p, x, target=None, variants=("float32", "bf16"))
        >>> result.reports["bf16"].argument_bytes == result.reports["float32"].argument_bytes  # float32 state
        True
        >>> print(plan(loss, p, x, target="h100"))  # doctest: +SKIP
    """
    import optax

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(
            f"plan: unknown setups {unknown or '(none given)'}; choose from {', '.join(VARIANTS)}"
        )
    validate.function(loss, "plan: loss")
    policy = validate.policy(policy, "plan: policy")
    if optimizer is not None:
        optimizer = validate.gradient_transformation(optimizer, "plan: optimizer")
    if target is not None and not isinstance(target, Target):
        target = compile_only_target(target)
    devices = tuple(target.devices) if target is not None else tuple(jax.devices())
    optimizer = optax.adam(1e-4) if optimizer is None else optimizer
    mesh = jax.sharding.Mesh(np.array(devices), (_DATA,))
    replicated = NamedSharding(mesh, P())
    split = lambda x: NamedSharding(mesh, P(_DATA) if x.ndim and x.shape[0] % len(devices) == 0 else P())  # noqa: E731
    abstract_params = _abstract(params)
    placed_batch = _placed(_abstract(batch), split)
    reports, skipped, does_not_fit = {}, {}, {}
    for name in variants:
        if name.startswith("fsdp") and len(devices) == 1:
            skipped[name] = "one device: nothing to shard (name a topology of several, e.g. 'h100:1x1x8')"
            continue
        uneven = [
            x.shape
            for x in jax.tree_util.tree_leaves(placed_batch)
            if x.shape[:1] != () and x.shape[0] % len(devices)
        ]
        if name.startswith("fsdp") and uneven:
            skipped[name] = (
                f"the batch {uneven[0]} does not split over {len(devices)} devices along its first axis"
            )
            continue
        fun, tx, fsdp = _variant(name, loss, under_policy, optimizer, policy, fp8, mesh)
        if fsdp:
            from jmp_lite._src.parallel.fsdp import shard_params

            placed_params = shard_params(abstract_params, mesh, _DATA)
        else:
            placed_params = _placed(abstract_params, lambda x: replicated)
        if progress is not None:
            progress(f"compiling {name} for {target.name if target is not None else devices[0].platform}")
        state = _state_for(tx, placed_params, mesh)
        try:
            reports[name] = compiled(
                _step(fun, tx),
                placed_params,
                state,
                *placed_batch,
                target=target,
                donate_argnums=(0, 1),
                compiler_options=compiler_options,
                peak_values=peak_values,
            )
        except CompilerOutOfMemory as error:
            does_not_fit[name] = error.detail
    return Plan(
        target=target.name if target is not None else devices[0].platform,
        device_kind=devices[0].device_kind,
        devices=len(devices),
        memory_bytes=target.memory_bytes if target is not None else None,
        reports=reports,
        skipped=skipped,
        does_not_fit=does_not_fit,
    )


# --- jmp-lite plan ----------------------------------------------------------------------------------

_DESCRIPTION = """\
Compiles one training step (value_and_grad of the loss and an Adam update, parameters and optimizer
state donated) for each precision setup and each target, without the hardware, and prints per device
the peak memory the compiler plans and whether it fits: float32, the bf16 policy (jmp_lite.autocast),
fp8, 8-bit Adam moments, and fully sharded (FSDP) on targets of several devices. Targets: NVIDIA GPUs
(h100, h200, b200, a100; 'h100:1x1x8' for 8 on one host) and TPU slices by libtpu's names (v5e:2x2,
v5p:2x2x1, v6e:2x2, v4:2x2x1, v5e:16x16, ...). Needs the aot extra: pip install 'jmp-lite[aot]'.

Without --model it plans a GPT-2-style Flax Linen decoder (sizes from --layers, --width, --heads,
--context, --vocab, --batch; GPT-2 small by default). With --model package.module:function it plans
function(), which returns a jmp_lite.memory.Workload(loss, params, batch, optimizer): params and batch
as jax.ShapeDtypeStruct (jax.eval_shape(model.init, ...)) or arrays.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jmp-lite plan", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", action="append", metavar="NAME", help="a target (repeat for several)")
    parser.add_argument("--model", metavar="MODULE:FUNCTION", help="plan FUNCTION() of MODULE (a Workload)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--policy", default="p=f32,c=bf16,o=f32", help="the 16-bit policy")
    parser.add_argument("--fp8", default="hybrid,current", help="the fp8 recipe of the fp8 setup")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (all devices together)")
    parser.add_argument("--json", type=Path, help="also write the plans as JSON to this file")
    return parser


def _workload(
    args: argparse.Namespace, default_model: Callable[..., Workload] | None
) -> tuple[Workload, str]:
    if args.model:
        from jmp_lite._src.tools.doctor import load_target

        made = load_target(args.model, "plan", "--model")()
        if not isinstance(made, Workload):
            raise SystemExit(
                f"jmp-lite plan: {args.model}() must return a jmp_lite.memory.Workload(loss, params, batch, "
                f"optimizer), got {type(made).__name__}"
            )
        return made, args.model
    for flag in ("layers", "width", "heads", "context", "vocab", "batch"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"jmp-lite plan: --{flag} must be at least 1")
    if args.width % args.heads:
        raise SystemExit(f"jmp-lite plan: --width {args.width} must be a multiple of --heads {args.heads}")
    if default_model is None:
        raise SystemExit("jmp-lite plan: give --model MODULE:FUNCTION (a function returning a Workload)")
    made = default_model(args.layers, args.width, args.heads, args.context, args.vocab, args.batch)
    return made, (
        f"GPT ({args.layers} layers, width {args.width}, {args.heads} heads, vocab {args.vocab}), "
        f"batch {args.batch} x {args.context} tokens, Adam"
    )


class _Progress:
    """``[i/n] message ...`` on stderr, one line per compile (the table comes on stdout)."""

    def __init__(self, total: int) -> None:
        self.done, self.total = 0, total

    def __call__(self, message: str) -> None:
        self.done += 1
        print(f"  [{self.done}/{self.total}] {message} ...", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, default_model: Callable[..., Workload] | None = None) -> int:
    """``jmp-lite plan``: prints, per target, a table of the setups' compiled memory (``plan``).

    ``default_model(layers, width, heads, context, vocab, batch)`` builds the ``Workload`` planned without
    ``--model`` (the command line gives its GPT).

    Example:
        >>> from jmp_lite._src.tools.plan import main
        >>> main(["--variants", "float32,fp16"])
        Traceback (most recent call last):
        SystemExit: jmp-lite plan: unknown setups ['fp16']; choose from float32, bf16, fp8, ...
    """
    args = _parser().parse_args(argv)
    if "JAX_PLATFORMS" not in os.environ:
        # tracing needs only the CPU; the targets are compile-only devices, so no accelerator backend
        # is started (a TPU or GPU plugin without its hardware would log its failure)
        jax.config.update("jax_platforms", "cpu")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SystemExit(f"jmp-lite plan: unknown setups {unknown}; choose from {', '.join(VARIANTS)}")
    targets = args.target or ["h100"]
    resolved = []
    for name in targets:
        try:
            resolved.append(compile_only_target(name))
        except (ValueError, TypeError, ImportError) as error:
            raise SystemExit(f"jmp-lite plan: {error}") from None
    workload, what = _workload(args, default_model)
    import optax  # noqa: F401 - the default optimizer

    params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(workload.params))
    print(f"jmp-lite plan: {what}; {params / 1e6:.1f}M parameters; policy {args.policy}, fp8 {args.fp8}")
    plans = []
    for target in resolved:
        progress = _Progress(len(variants))

        result = plan(
            workload.loss,
            workload.params,
            *workload.batch,
            target=target,
            optimizer=workload.optimizer,
            under_policy=workload.under_policy,
            variants=variants,
            policy=args.policy,
            fp8=args.fp8,
            progress=progress,
        )
        plans.append(result)
        print()
        print(result.table())
    print(
        "\npeak / device: the most memory the compiled step holds on one device (XLA:TPU's own peak; on "
        "GPUs arguments + outputs + temporaries, donated buffers reused); fits: peak <= the chip's memory."
    )
    if args.json:
        args.json.write_text(json.dumps({"workload": what, "plans": [p.to_dict() for p in plans]}, indent=1))
        print(f"plans: {args.json}")
    return 0
