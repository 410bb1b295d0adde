"""``compiled``: what the compiler of the target builds from a step, read from the compiled program.

Memory per device (arguments, outputs, temporaries, peak), every contraction with its operand and
result dtypes and precision, every collective with its dtype and bytes, and the library calls
(cuDNN fused attention, cuBLAS(Lt) GEMMs). A step compiles for a TPU slice or an NVIDIA GPU on any
machine (``compile_only_target``, the ``aot`` extra) from abstract inputs: nothing is allocated.

Where the traced measures (``residual_bytes``, ``lowered_collectives``) count what JAX hands the
compiler, this reads what the compiler made of it: XLA fuses and recomputes elementwise chains, so a
float32 program needs far less than its traced residuals, and a lowered reduce-scatter can compile
into an all-reduce.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jmp_lite._src.base import compat
from jmp_lite._src.engine import engine
from jmp_lite._src.tools import hlo_text
from jmp_lite._src.tools.collectives import Collective
from jmp_lite._src.tools.live_buffers import LiveValue, by_operation, live_at_peak
from jmp_lite._src.tools.memory import format_bytes
from jmp_lite._src.tools.targets import Target, compile_only_target

__all__ = ["CompiledReport", "CompilerOutOfMemory", "Contraction", "compiled", "report_of"]


class CompilerOutOfMemory(RuntimeError):
    """The target's compiler refused the program for want of memory (XLA:TPU checks its temporaries
    against the chip's HBM while it compiles; XLA:GPU does not, and reports ``fits=False`` instead).

    Attributes:
        target: the target's name.
        detail: the compiler's words (``"... HLO temporaries (19.25G) exceeds available HBM (15.75G)"``).
    """

    def __init__(self, target: str, detail: str):
        super().__init__(f"the program does not fit on {target}: the compiler says {detail!r}")
        self.target, self.detail = target, detail


_COLLECTIVES = {
    "all-gather": "all_gather",
    "all-gather-start": "all_gather",
    "all-reduce": "all_reduce",
    "all-reduce-start": "all_reduce",
    "reduce-scatter": "reduce_scatter",
    "reduce-scatter-start": "reduce_scatter",
    "all-to-all-start": "all_to_all",
    "all-to-all": "all_to_all",
    "ragged-all-to-all": "all_to_all",
    "collective-permute": "collective_permute",
    "collective-permute-start": "collective_permute",
}
# custom calls that are contractions, and which operands are the two factors
_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_DTYPE_NAMES = {"f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "bf16": "bfloat16", "f16": "float16",
                "f32": "float32", "f64": "float64"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Contraction:
    """One contraction of the compiled program (a ``dot``, a ``convolution``, a cuBLAS call).

    Attributes:
        op: ``"dot"``, ``"convolution"`` or the library call's name (``"__cublas$lt$matmul$f8"``).
        lhs, rhs, result: XLA's dtype names (``"bf16"``, ``"f32"``, ``"f8e4m3fn"``).
        precision: ``"default"``, ``"high"`` or ``"highest"`` (the higher of the two operands').
        result_shape: the result's dimensions.
        where: the JAX operation it came from (its ``op_name``, with the named scopes).
    """

    op: str
    lhs: str
    rhs: str
    result: str
    precision: str
    result_shape: tuple[int, ...]
    where: str

    @property
    def kind(self) -> str:
        """``"lhs x rhs -> result"``, with the precision when not the default."""
        text = f"{self.lhs} x {self.rhs} -> {self.result}"
        return text if self.precision == "default" else f"{text} @{self.precision}"


def _precision(inst: hlo_text.Instruction) -> str:
    text = (inst.attribute("operand_precision") or "").lower()
    config = inst.attribute("backend_config") or ""
    if not text and "operand_precision" in config:
        text = config.split('"operand_precision":', 1)[1].split("]", 1)[0].lower()
    order = ("highest", "high", "default")
    return next((p for p in order if p in text), "default")


@dataclasses.dataclass(frozen=True)
class CompiledReport:
    """The compiled program of one step on one target, per device.

    Attributes:
        target: the target's name (``"v5e:2x2"``, ``"h100"``) or the platform it compiled for.
        device_kind: the chip.
        devices: how many devices the program runs on.
        argument_bytes, output_bytes, alias_bytes, temp_bytes: XLA's ``memory_analysis()`` per device
            (``alias_bytes``: outputs that reuse a donated argument's buffer).
        peak_bytes: the most memory (HBM) a device holds while the step runs: XLA:TPU's own peak on
            TPUs (its temporaries may sit in on-chip memory), else arguments + outputs - aliased +
            temporaries.
        memory_bytes: the device's memory (HBM), ``None`` if unknown.
        contractions: every contraction, in program order.
        collectives: every collective (``jmp_lite``'s ``Collective``: op, dtype, shape, bytes).
        custom_calls: library calls by name (``"__cudnn$fmhaSoftmax"``: cuDNN fused attention).
        compile_seconds: the time the compile took here.
        peak_values: the temporaries live where XLA's heap of temporaries peaks, largest first, each
            with the JAX operation that made it (``LiveValue``); empty unless ``compiled(...,
            peak_values=True)``. ``peak_table()`` groups them by operation.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.memory import compiled
        >>> x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
        >>> f = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
        >>> report = compiled(f, x, x.update(shape=(256, 64)), target=None)  # this machine's backend
        >>> [c.kind for c in report.contractions]
        ['bf16 x bf16 -> f32']
    """

    target: str
    device_kind: str
    devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    memory_bytes: int | None
    contractions: tuple[Contraction, ...]
    collectives: tuple[Collective, ...]
    custom_calls: dict[str, int]
    compile_seconds: float = 0.0
    peak_values: tuple[LiveValue, ...] = ()

    @property
    def fits(self) -> bool | None:
        """Whether ``peak_bytes`` fits in the device's memory (``None`` where that is unknown)."""
        return None if self.memory_bytes is None else self.peak_bytes <= self.memory_bytes

    def contraction_counts(self) -> dict[str, int]:
        """How many contractions of each kind (``"bf16 x bf16 -> f32": 291``)."""
        return dict(collections.Counter(c.kind for c in self.contractions))

    def float32_contractions(self) -> list[Contraction]:
        """The contractions with two float32 (or float64) operands: the float32 islands of a 16-bit
        program, each with where it came from."""
        return [c for c in self.contractions if c.lhs in ("f32", "f64") and c.rhs in ("f32", "f64")]

    def collective_bytes(self) -> dict[str, int]:
        """Bytes per device by collective and dtype (``"all_gather bf16": ...``)."""
        out: dict[str, int] = collections.defaultdict(int)
        for c in self.collectives:
            out[f"{c.op} {c.dtype}"] += c.bytes
        return dict(out)

    def table(self) -> str:
        """The report as text, as ``str(report)`` prints it."""
        fits = {None: "", True: " (fits)", False: " (DOES NOT FIT)"}[self.fits]
        memory = "" if self.memory_bytes is None else f" of {format_bytes(self.memory_bytes)}"
        lines = [
            f"{self.target}: {self.devices} x {self.device_kind}; per device:",
            f"  peak {format_bytes(self.peak_bytes)}{memory}{fits}",
            f"  arguments {format_bytes(self.argument_bytes)}, outputs {format_bytes(self.output_bytes)} "
            f"({format_bytes(self.alias_bytes)} in donated buffers), "
            f"temporaries {format_bytes(self.temp_bytes)}",
            "  contractions: "
            + (", ".join(f"{k}: {n}" for k, n in self.contraction_counts().items()) or "none"),
        ]
        islands = collections.Counter(c.where or "(unnamed)" for c in self.float32_contractions())
        for where, n in islands.most_common(5):
            lines.append(f"    float32 x float32: {n} x {where}")
        if self.collectives:
            lines.append(
                "  collectives: "
                + ", ".join(f"{k} {format_bytes(b)}" for k, b in sorted(self.collective_bytes().items()))
            )
        if self.custom_calls:
            lines.append(
                "  library calls: " + ", ".join(f"{k}: {n}" for k, n in sorted(self.custom_calls.items()))
            )
        return "\n".join(lines)

    def peak_table(self, rows: int = 10) -> str:
        """What holds the temporaries at their peak: ``peak_values`` grouped by shape and operation (a
        model's layers on one line), largest first, ``rows`` lines."""
        if not self.peak_values:
            return "  (no peak values: compiled(..., peak_values=True) reads them)"
        total = sum(v.bytes for v in self.peak_values)
        n = len(self.peak_values)
        lines = [f"  live at the peak of the temporaries: {format_bytes(total)} in {n} value{'s' * (n != 1)}"]
        for size, count, shape, where in by_operation(self.peak_values)[:rows]:
            times = f"{count} x " if count > 1 else ""
            lines.append(f"    {format_bytes(size):>10}  {times}{shape}  {where or '(made by XLA)'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): every field, contractions and collectives as dicts."""
        out = dataclasses.asdict(self)
        out["collectives"] = [
            {"op": c.op, "dtype": c.dtype, "shape": list(c.shape), "bytes": c.bytes} for c in self.collectives
        ]
        out["fits"] = self.fits
        out["contraction_counts"] = self.contraction_counts()
        out["collective_bytes"] = self.collective_bytes()
        out["peak_values"] = [
            {"bytes": v.bytes, "shape": v.shape, "where": v.where, "name": v.name} for v in self.peak_values
        ]
        return json.loads(json.dumps(out))


def report_of(executable: Any, target: Target | None = None, compile_seconds: float = 0.0) -> CompiledReport:
    """The ``CompiledReport`` of a compiled program (``jax.jit(f).lower(...).compile()``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.memory import report_of
        >>> c = jax.jit(lambda x: x @ x).lower(jax.ShapeDtypeStruct((8, 8), jnp.float32)).compile()
        >>> report_of(c).contraction_counts()
        {'f32 x f32 -> f32': 1}
    """
    text = executable.as_text()
    stats = executable.memory_analysis()
    arguments, outputs = int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes)
    alias, temp = int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)
    device = _first_device(executable)
    platform = target.platform if target is not None else getattr(device, "platform", "")
    # XLA:TPU plans every memory space and reports the peak of HBM (its temporaries may live in
    # on-chip memory); XLA:GPU reports none and XLA:CPU one without temporaries
    reported = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    peak = reported if platform == "tpu" and reported > 0 else arguments + outputs - alias + temp
    shapes: dict[str, tuple[hlo_text.Shape, ...]] = {}
    contractions, collectives, calls = [], [], collections.Counter()
    chains: set[tuple[str, str]] = set()
    for inst in hlo_text.instructions(text):
        shapes[inst.name] = inst.shapes
        operand = functools.partial(_operand, shapes, inst)
        if inst.opcode in ("dot", "convolution") and len(inst.operands) >= 2:
            lhs, rhs = operand(0), operand(1)
            if lhs and rhs and inst.shapes:
                contractions.append(
                    Contraction(
                        inst.opcode,
                        lhs[0].dtype,
                        rhs[0].dtype,
                        inst.shapes[0].dtype,
                        _precision(inst),
                        inst.shapes[0].dims,
                        inst.op_name,
                    )  # fmt: skip
                )
        elif inst.opcode == "custom-call":
            name = inst.attribute("custom_call_target") or "?"
            calls[name] += 1
            if name in _GEMM_CALLS and len(inst.operands) >= 2 and operand(0) and operand(1) and inst.shapes:
                contractions.append(
                    Contraction(
                        name,
                        operand(0)[0].dtype,
                        operand(1)[0].dtype,
                        inst.shapes[0].dtype,
                        _precision(inst),
                        inst.shapes[0].dims,
                        inst.op_name,
                    )  # fmt: skip
                )
        elif inst.opcode in _COLLECTIVES and inst.operands:
            # XLA:TPU runs an asynchronous collective as a chain of steps, fusions that each name the
            # whole collective and carry its partial result on: one collective, counted once
            chain = re.search(r'chain_id="([^"]+)"', inst.attributes)
            if chain is not None:
                if (inst.opcode, chain.group(1)) in chains:
                    continue
                chains.add((inst.opcode, chain.group(1)))
            # one entry per operand: XLA combines many parameters' collectives into one instruction
            ins = [operand(i)[0] if operand(i) else None for i in range(len(inst.operands))]
            outs = inst.shapes
            if inst.opcode.endswith("-start") and len(outs) >= 2 * len(ins):  # (operands, results, [context])
                outs = outs[len(ins) : 2 * len(ins)]
            for i, shape in enumerate(ins):
                if shape is None:
                    continue
                out = outs[i] if i < len(outs) else shape
                moved = max(shape.bytes, out.bytes)
                collectives.append(Collective(_COLLECTIVES[inst.opcode], shape.dtype, shape.dims, moved))
    return CompiledReport(
        target=target.name if target is not None else (device.platform if device is not None else "?"),
        device_kind=target.device_kind if target is not None else (device.device_kind if device else "?"),
        devices=len(target.devices) if target is not None else _device_count(executable),
        argument_bytes=arguments,
        output_bytes=outputs,
        alias_bytes=alias,
        temp_bytes=temp,
        peak_bytes=peak,
        memory_bytes=target.memory_bytes if target is not None else None,
        contractions=tuple(contractions),
        collectives=tuple(collectives),
        custom_calls=dict(sorted(calls.items())),
        compile_seconds=compile_seconds,
    )


def _operand(shapes: dict[str, tuple[hlo_text.Shape, ...]], inst: hlo_text.Instruction, i: int) -> tuple:
    """The arrays of ``inst``'s ``i``-th operand (from the instruction that made it)."""
    return shapes.get(inst.operands[i], ()) if i < len(inst.operands) else ()


def _first_device(executable: Any) -> Any:
    try:
        shardings = executable.input_shardings[0] or executable.output_shardings
        return next(iter(jax.tree_util.tree_leaves(shardings)[0].device_set))
    except (AttributeError, IndexError, StopIteration, TypeError):
        return None


def _device_count(executable: Any) -> int:
    try:
        return len(jax.tree_util.tree_leaves(executable.input_shardings[0])[0].device_set)
    except (AttributeError, IndexError, TypeError):
        return 1


def _abstract(x: Any, fallback: Any) -> Any:
    """``x`` as a ``jax.ShapeDtypeStruct``, placed by ``fallback`` when it carries no sharding of its own."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and fallback is not None:
        sharding = None  # an array here lives on this machine's devices, not the target's
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding if sharding is not None else fallback)


def compiled(
    fun: Callable[..., Any],
    *args: Any,
    target: str | Target | None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    compiler_options: dict[str, Any] | None = None,
    peak_values: bool = False,
    **kwargs: Any,
) -> CompiledReport:
    """Compile ``fun(*args, **kwargs)`` for ``target`` and report the program (``CompiledReport``).

    ``args`` are abstract (``jax.ShapeDtypeStruct``, ``jax.eval_shape``'s output) or arrays, of which
    only shapes and dtypes are read: nothing is allocated or run. A leaf that carries a sharding on the
    target's devices keeps it (``NamedSharding(target.mesh(), spec)``: FSDP, data parallelism); every
    other leaf is replicated on all of the target's devices. ``target`` is a name (``"h100"``,
    ``"v5e:2x2"``, ``compile_only_target``), a ``Target``, or ``None`` for the devices the arguments'
    shardings name (this machine's by default). ``donate_argnums`` donates as ``jax.jit`` does (a
    training step donates its parameters and optimizer state, so its updates reuse their buffers);
    ``compiler_options`` go to XLA (``{"xla_gpu_enable_triton_gemm": False}`` gives cuBLAS GEMMs on
    NVIDIA targets). ``peak_values=True`` also reads what holds the temporaries where they peak
    (``CompiledReport.peak_values``, from XLA's buffer assignment, dumped into a temporary directory
    that is removed after the compile: a large model's dump takes tens of MB while it lasts). Where
    the target's compiler refuses the program for want of memory (XLA:TPU does, for temporaries
    beyond the chip's HBM), ``CompilerOutOfMemory`` names the target and quotes it.
    ``fun`` is traced for the target's platform: under a policy, attention on an NVIDIA target runs
    as cuDNN's fused attention, as it would on that GPU (``jmp_lite.attention.choose_implementation``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.memory import compiled
        >>> w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
        >>> step = lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        >>> report = compiled(step, w, w, target=None, donate_argnums=0)
        >>> report.alias_bytes == 512 * 512 * 4
        True
        >>> report = compiled(step, w, w, target="v5e:2x2")  # doctest: +SKIP
    """
    if target is not None and not isinstance(target, Target):
        target = compile_only_target(target)
    fallback = None
    if target is not None:
        fallback = jax.sharding.NamedSharding(target.mesh(("_all",)), jax.sharding.PartitionSpec())
        on_target = set(target.devices)
        for leaf in jax.tree_util.tree_leaves((args, kwargs)):
            sharding = getattr(leaf, "sharding", None)
            if (
                sharding is not None
                and not isinstance(leaf, jax.Array)
                and not sharding.device_set <= on_target
            ):
                where = sorted(str(d) for d in sharding.device_set)[:2]
                raise ValueError(
                    f"compiled: an argument of shape {leaf.shape} is placed on {where}..., not on the "
                    f"devices of {target.name!r}; place it on target.mesh() (or leave its sharding out: "
                    "it is then replicated on every device of the target)"
                )
    abstract_args, abstract_kwargs = jax.tree_util.tree_map(lambda x: _abstract(x, fallback), (args, kwargs))

    def program(*args: Any, **kwargs: Any) -> Any:
        return fun(*args, **kwargs)

    # A new function each time, traced for this target's platform: JAX's cache of traces would otherwise
    # hand one target the program traced for another (their abstract arguments can be equal)
    jitted = jax.jit(program, donate_argnums=donate_argnums, static_argnums=static_argnums)
    platform = None if target is None else {"gpu": "cuda"}.get(target.platform, target.platform)
    # JAX's persistent cache cannot load programs of compile-only devices back: keep them out of it;
    # and a program loaded from it is not compiled, so XLA would write no buffer assignment to read
    cacheable = not peak_values and (target is None or target.platform == "cpu")
    try:
        start = time.perf_counter()
        with engine.entering(platform=platform):  # e.g. cuDNN's attention for an NVIDIA GPU
            lowered = jitted.lower(*abstract_args, **abstract_kwargs)
        cache = contextlib.nullcontext() if cacheable else compat.persistent_cache_off()
        dumped = tempfile.TemporaryDirectory(prefix="jmp_lite_") if peak_values else contextlib.nullcontext()
        with cache, dumped as dump:
            options = {**(compiler_options or {}), **({"xla_dump_to": dump} if dump else {})}
            executable = lowered.compile(compiler_options=options or None)
            seconds = time.perf_counter() - start
            values = live_at_peak(dump) if dump else ()
    except jax.errors.JaxRuntimeError as error:
        text = str(error)
        if not text.startswith("RESOURCE_EXHAUSTED"):
            raise
        name = target.name if target is not None else jax.devices()[0].platform
        raise CompilerOutOfMemory(name, text.removeprefix("RESOURCE_EXHAUSTED:").strip()) from error
    return dataclasses.replace(report_of(executable, target, seconds), peak_values=values)
