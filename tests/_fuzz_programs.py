"""Random JAX programs for the engine's differential fuzzer (tests/test_engine_fuzz.py, issue 27).

``programs()`` is a hypothesis strategy that draws a program as plain data: a ``Program`` holds a
``Block``, a list of ``Op`` over a pool of arrays whose shapes are known when the op is drawn (the
block's inputs first, then one new array per op). Ops that run code of their own (``vmap``, ``scan``,
``fori_loop``, ``while_loop``, ``cond``/``switch``, ``jax.checkpoint``, nested ``jit``,
``custom_jvp``/``custom_vjp``) hold nested blocks. ``build(program)`` turns it into
``f(params, data) -> (loss, outputs)`` written with ``jax``, ``jnp`` and ``lax`` calls, and
``inputs(program)`` gives its arguments.

Every float argument is drawn on the bfloat16 grid (and away from float16's subnormals), so the
casts that a native 16-bit run starts with are exact: the three runs a test compares (the float32
program, the same program on 16-bit inputs, the program under an autocast policy) see the same
numbers. Arrays marked ``exact`` in the pool hold bitwise the same values in all three runs (the
inputs, moved, indexed or compared); the data-dependent discrete choices (argmax, argsort, masks
that select between different values, counts, branch indices) read only those, so a float rounding
can never flip one and turn a continuous error into a jump.

``KNOWN_BROKEN`` names the known engine bugs, the generator features that reach them and the
properties they break; the tests draw programs without those features for those properties until the
bug is fixed (then the entry is removed). Every feature that can be switched off is in ``FEATURES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from jax import lax

import jmp_lite

# Known engine bugs: bug -> (the generator features left out, the properties they are left out of, what
# fails); no features: the properties fail whatever the program, and are marked xfail (not strict).
# Properties (tests/test_engine_fuzz.py): "f32" (float32 policy, bitwise; "f32_eager" without jit),
# "bf16", "f16" (16-bit policies against the native yardstick; "bf16" also checks every primitive has a
# rule), "eager16" (the bfloat16 policy without jit), "identity" (identity ops erased, bitwise), "remat"
# (remat_float32 changes no value), "highest" (all-highest programs bitwise under 16-bit policies, with
# fp8 too), "fp8" (the bfloat16 policy with fp8 contractions against a native fp8 yardstick).
# Remove an entry once its bug is fixed; the report of issue 27 has a standalone reproduction of each.
ALL_PROPERTIES = ("f32", "f32_eager", "bf16", "f16", "eager16", "identity", "remat", "highest", "fp8")
KNOWN_BROKEN: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {}

# Every feature the generator can leave out (op kinds, and variants of them).
FEATURES = frozenset(
    {
        # op kinds
        "unary", "binary", "scalar", "dot", "linear", "conv", "layernorm", "softmax", "logsumexp",
        "var_offset", "reduce", "cumulative", "reshape", "transpose", "slice", "pad", "concat", "flip",
        "roll", "broadcast", "dynamic_slice", "dynamic_update_slice", "take", "at_get", "scatter",
        "segment", "bincount", "sort", "top_k", "argsort_gather", "argmax_take", "mask_where",
        "int_math", "vmap", "scan", "fori", "while", "cond", "switch", "remat", "jit", "custom_jvp",
        "custom_vjp", "name", "shard", "attention", "inner_autocast",
        # variants
        "custom_jvp_closure", "precision_highest", "scatter_add", "scatter_set", "scatter_max", "scatter_mul",
        "shard_8", "jit_shardings", "remat_names", "tile", "unary_exp", "attention_mask_padding",
        "attention_fully_masked", "attention_finite_fill", "attention_soft_fill", "attention_lookalike",
        "attention_jax_nn", "attention_gqa", "attention_bias",
    }
)  # fmt: skip

MAX_SIZE = 256  # elements per array: compiles stay cheap
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)


def fuzz_settings(count: int, seed: int | None = None) -> Any:
    """A decorator giving a property test ``count`` examples: derandomized (the same programs every run)
    without ``seed``, else drawn with it. ``JMP_LITE_FUZZ_EXAMPLES`` and ``JMP_LITE_FUZZ_SEED`` are read by
    the callers (the two fuzzers scale their counts differently)."""

    def wrap(test: Any) -> Any:
        test = settings(
            max_examples=count,
            deadline=None,
            database=None,
            derandomize=seed is None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(test)
        return hypothesis_seed(seed)(test) if seed is not None else test

    return wrap


# --- the program as data -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """``pool.append(kind(pool[args...], **attrs, blocks...))``."""

    kind: str
    args: tuple[int, ...]
    attrs: tuple[tuple[str, Any], ...] = ()
    blocks: tuple[Block, ...] = ()

    def __getitem__(self, key: str) -> Any:
        return dict(self.attrs)[key]

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)


@dataclass(frozen=True)
class Block:
    """A straight-line program: ``n_in`` inputs, then one array per op; returns ``pool[out]`` reshaped
    (flattened, repeated or cut, reshaped: ``fit``) to ``target`` when one is given."""

    n_in: int
    ops: tuple[Op, ...]
    out: int
    target: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Program:
    params: tuple[tuple[str, tuple[int, ...], float], ...]  # name, shape, standard deviation
    floats: tuple[tuple[str, tuple[int, ...]], ...]  # float data (no gradient)
    ints: tuple[tuple[str, tuple[int, ...]], ...]  # int data (values in int_values)
    int_values: tuple[tuple[int, ...], ...]
    inputs: tuple[tuple[str, str], ...]  # the body's inputs: ("param" | "float", name)
    body: Block
    outputs: tuple[int, ...]  # pool indices of the body returned (and summed into the loss)
    seed: int
    features: frozenset = field(default_factory=frozenset)  # features the program uses

    def __repr__(self) -> str:
        lines = [f"Program(seed={self.seed}, features={sorted(self.features)})"]
        lines += [f"  param {n}: {s} std {std:g}" for n, s, std in self.params]
        lines += [f"  float {n}: {s}" for n, s in self.floats]
        lines += [f"  int {n}: {s} = {list(v)}" for (n, s), v in zip(self.ints, self.int_values)]
        lines += [f"  %{i} = {kind} {name}" for i, (kind, name) in enumerate(self.inputs)]
        lines += _block_lines(self.body, "  ", len(self.inputs))
        lines.append(f"  loss and outputs: {['%' + str(i) for i in self.outputs]}")
        return "\n".join(lines)


def _block_lines(block: Block, indent: str, first: int) -> list[str]:
    lines = []
    for i, op in enumerate(block.ops):
        attrs = ", ".join(f"{k}={v!r}" for k, v in op.attrs)
        args = ", ".join(f"%{a}" for a in op.args)
        lines.append(f"{indent}%{first + i} = {op.kind}({args}{', ' if attrs and args else ''}{attrs})")
        for j, sub in enumerate(op.blocks):
            lines.append(f"{indent}    block {j} (inputs %0..%{sub.n_in - 1}, returns %{sub.out}"
                         f"{f' fit to {sub.target}' if sub.target else ''}):")  # fmt: skip
            lines += _block_lines(sub, indent + "      ", sub.n_in)
    return lines


class Slot(NamedTuple):
    shape: tuple[int, ...]
    exact: bool = False  # bitwise the same value in the float32, native 16-bit and autocast runs


# --- drawing -------------------------------------------------------------------------------------------


class _NoClosure(Exception):
    """Raised by an op that reads a program argument where a block may not close over one."""


class _Gen:
    """Drawing state: the parameters and data made so far, the features left out, the depth, and
    whether the block being drawn may read program arguments (close over them)."""

    def __init__(self, draw: Any, off: frozenset, depth: int, closure: bool | str = True) -> None:
        self.draw, self.off, self.depth, self.closure = draw, off, depth, closure
        self.params: list[tuple[str, tuple[int, ...], float]] = []
        self.ints: list[tuple[str, tuple[int, ...]]] = []
        self.int_values: list[tuple[int, ...]] = []
        self.used: set[str] = set()
        self.names = 0  # checkpoint names handed out
        self.meshes: list[str] | None = None  # the meshes left to a sharding constraint
        self.highest = False  # every contraction asks precision="highest" (see programs)
        self.focus: tuple = ()  # op kinds drawn first (see programs)
        self.sprinkle: tuple = ()

    def on(self, feature: str) -> bool:
        return feature not in self.off

    def flag(self, feature: str) -> bool:
        """A drawn boolean for an optional feature (always False when the feature is off)."""
        return self.on(feature) and self.draw(st.booleans())

    def precision(self) -> str | None:
        """A contraction's ``precision``: ``"highest"`` always in an all-highest program, else sometimes."""
        if self.highest or (self.flag("precision_highest") and self.draw(st.booleans())):
            self.used.add("precision_highest")
            return "highest"
        return None

    def one_of(self, options: list | tuple) -> Any:
        return self.draw(st.sampled_from(list(options)))

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def dim(self, hi: int = 8) -> int:
        return self.draw(st.integers(1, hi))

    def seed(self) -> int:
        return self.draw(st.integers(0, 2**16))

    def param(self, shape: tuple[int, ...], std: float = 1.0) -> str:
        if self.closure is not True:  # False, or "data": the block may read integer data only
            raise _NoClosure
        name = f"w{len(self.params)}"
        self.params.append((name, tuple(shape), float(std)))
        return name

    def int_data(self, shape: tuple[int, ...], lo: int, hi: int) -> str:
        if not self.closure:
            raise _NoClosure
        n = math.prod(shape)
        values = self.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
        name = f"i{len(self.ints)}"
        self.ints.append((name, tuple(shape)))
        self.int_values.append(tuple(values))
        return name

    def pick(self, pool: list[Slot], pred: Any = None) -> int | None:
        """A pool index (shrinks towards the newest array) whose slot satisfies ``pred``."""
        ok = [i for i in reversed(range(len(pool))) if pred is None or pred(pool[i])]
        if not ok:
            return None
        return ok[self.draw(st.integers(0, len(ok) - 1))]

    def shape(self, rank_lo: int = 1, rank_hi: int = 3, hi: int = 8) -> tuple[int, ...]:
        rank = self.integer(rank_lo, rank_hi)
        shape = tuple(self.dim(hi) for _ in range(rank))
        while math.prod(shape) > MAX_SIZE:
            shape = shape[1:]
        return shape

    def block(
        self, inputs: list[Slot], target: Any, lo: int = 1, hi: int = 3, closure: bool | str = True
    ) -> Block:
        """A nested block; ``closure=False``: its ops read no program argument (parameters, data);
        ``"data"``: integer data only, no parameter."""
        narrowest = min((self.closure, closure), key=lambda c: {False: 0, "data": 1, True: 2}[c])
        sub = _Gen(self.draw, self.off, self.depth + 1, narrowest)
        sub.params, sub.ints, sub.int_values, sub.used = self.params, self.ints, self.int_values, self.used
        sub.names, sub.meshes, sub.focus, sub.sprinkle = self.names, self.meshes, self.focus, self.sprinkle
        sub.highest = self.highest
        ops, pool = _draw_ops(sub, list(inputs), self.integer(lo, hi))
        self.names, self.meshes = sub.names, sub.meshes
        out = self.pick(pool, None)
        return Block(len(inputs), tuple(ops), out, target)


def _size_ok(shape: tuple[int, ...]) -> bool:
    return 0 < math.prod(shape) <= MAX_SIZE


# Each drawer returns (Op, Slot) or None (not applicable to this pool).


def _d_unary(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    fn = g.one_of([f for f in UNARY if g.on("unary_exp") or f not in UNARY_EXP])
    if fn in UNARY_EXP:
        g.used.add("unary_exp")
    exact = pool[i].exact and fn in ("neg", "abs", "relu")
    return Op("unary", (i,), (("fn", fn),)), Slot(pool[i].shape, exact)


def _d_binary(g: _Gen, pool: list[Slot]) -> Any:
    i, j = g.pick(pool), g.pick(pool)
    fn = g.one_of(BINARY)
    trailing = g.draw(st.booleans())  # b fitted to a's trailing axes (implicit broadcasting) or to all
    k = g.integer(0, len(pool[i].shape)) if trailing else 0
    exact = pool[i].exact and pool[j].exact and fn in ("max", "min", "where_gt")
    return Op("binary", (i, j), (("fn", fn), ("from_axis", k))), Slot(pool[i].shape, exact)


def _d_scalar(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    fn = g.one_of(["mul", "add", "div", "rsub", "offset_300"])
    c = g.one_of([0.5, 2.0, 3.0, -1.5, 0.125])
    return Op("scalar", (i,), (("fn", fn), ("c", c))), Slot(pool[i].shape)


def _dot_partner(pool: list[Slot], j: int, sizes: list[int]) -> list[int] | None:
    """Axes of pool[j] with the given sizes, each used once (None: it has no such axes)."""
    free = list(range(len(pool[j].shape)))
    found = []
    for n in sizes:
        axis = next((a for a in free if pool[j].shape[a] == n), None)
        if axis is None:
            return None
        free.remove(axis)
        found.append(axis)
    return found


def _d_dot(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    a = pool[i].shape
    perm = list(g.draw(st.permutations(range(len(a)))))
    nc = g.integer(1, min(2, len(a)))
    nb = g.integer(0, min(1, len(a) - nc))
    ca, ba = perm[:nc], perm[nc : nc + nb]
    sizes = [a[x] for x in ca + ba]
    partner = None
    if g.draw(st.booleans()):
        for j in reversed(range(len(pool))):
            axes = _dot_partner(pool, j, sizes) if j != i else None
            if axes is not None:
                partner = (j, axes)
                break
    if partner is None:
        extra = [g.dim() for _ in range(g.integer(0, 2))]
        order = list(g.draw(st.permutations(range(len(sizes) + len(extra)))))
        bshape = [0] * len(order)
        for k, n in enumerate(sizes + extra):
            bshape[order[k]] = n
        name = g.param(tuple(bshape), 1 / math.sqrt(math.prod(a[x] for x in ca)))
        j, axes, new = None, order[: len(sizes)], name
    else:
        (j, axes), new = partner, None
        bshape = list(pool[j].shape)
    cb, bb = axes[:nc], axes[nc:]
    free_a = [x for x in range(len(a)) if x not in ca + ba]
    free_b = [x for x in range(len(bshape)) if x not in cb + bb]
    out = tuple([a[x] for x in ba] + [a[x] for x in free_a] + [bshape[x] for x in free_b])
    if not _size_ok(out) or not out:
        return None
    impl = g.one_of(["lax", "einsum", "einsum_permuted"] + (["tensordot"] if not ba else []))
    out_perm = tuple(g.draw(st.permutations(range(len(out))))) if impl == "einsum_permuted" else None
    precision = g.precision()
    attrs = (("dims", ((tuple(ca), tuple(cb)), (tuple(ba), tuple(bb)))), ("impl", impl),
             ("precision", precision), ("param", new), ("out_perm", out_perm),
             ("scale", 1.0 if new else 1 / math.sqrt(math.prod(sizes[:nc]))))  # fmt: skip
    if out_perm is not None:
        out = tuple(out[p] for p in out_perm)
    args = (i,) if j is None else (i, j)
    return Op("dot", args, attrs), Slot(out)


def _d_linear(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    a = pool[i].shape
    n = g.dim()
    out = (*a[:-1], n)
    if not _size_ok(out):
        return None
    w = g.param((a[-1], n), 1 / math.sqrt(a[-1]))
    b = g.param((n,), 0.1) if g.draw(st.booleans()) else None
    how = g.one_of(["matmul", "at", "dot"])
    return Op("linear", (i,), (("w", w), ("b", b), ("how", how), ("precision", g.precision()))), Slot(out)


def _d_conv(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    n, w, c = g.integer(1, 3), g.dim(), g.integer(1, 4)
    k, o = g.integer(1, 3), g.integer(1, 4)
    stride, dilation = g.integer(1, 2), g.integer(1, 2)
    padding = g.one_of(["SAME", "VALID"])
    if padding == "VALID" and (k - 1) * dilation + 1 > w:
        padding = "SAME"
    kernel = g.param((k, c, o), 1 / math.sqrt(k * c))
    out = jax.eval_shape(
        lambda x, y: lax.conv_general_dilated(
            x, y, (stride,), padding, rhs_dilation=(dilation,), dimension_numbers=("NWC", "WIO", "NWC")
        ),
        jax.ShapeDtypeStruct((n, w, c), F32),
        jax.ShapeDtypeStruct((k, c, o), F32),
    ).shape
    attrs = (("shape", (n, w, c)), ("kernel", kernel), ("stride", stride), ("dilation", dilation),
             ("padding", padding), ("precision", g.precision()))  # fmt: skip
    return Op("conv", (i,), attrs), Slot(tuple(out))


def _d_layernorm(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    d = pool[i].shape[-1]
    kind = g.one_of(["layer", "rms", "layer_nojnp"])
    scale = g.param((d,), 0.2) if g.draw(st.booleans()) else None
    return Op("layernorm", (i,), (("kind", kind), ("scale", scale))), Slot(pool[i].shape)


def _d_softmax(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    axis = g.integer(0, len(pool[i].shape) - 1)
    fn = g.one_of(["softmax", "log_softmax", "manual", "sigmoid_norm"])
    return Op("softmax", (i,), (("fn", fn), ("axis", axis))), Slot(pool[i].shape)


def _d_logsumexp(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool, lambda s: len(s.shape) >= 2)
    if i is None:
        return None
    axis = g.integer(0, len(pool[i].shape) - 1)
    out = tuple(n for k, n in enumerate(pool[i].shape) if k != axis)
    return Op("logsumexp", (i,), (("axis", axis),)), Slot(out)


def _d_var_offset(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    offset = g.one_of([0.0, 300.0, -40.0])
    fn = g.one_of(["var", "std"])
    axis = g.integer(0, len(pool[i].shape) - 1)
    shape = list(pool[i].shape)
    shape[axis] = 1
    return Op("var_offset", (i,), (("offset", offset), ("fn", fn), ("axis", axis))), Slot(tuple(shape))


def _d_reduce(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool, lambda s: len(s.shape) >= 2)
    if i is None:
        return None
    fn = g.one_of(["sum", "mean", "max", "min", "prod", "norm"])
    axis = g.integer(0, len(pool[i].shape) - 1)
    keep = g.draw(st.booleans())
    shape = list(pool[i].shape)
    if keep:
        shape[axis] = 1
    else:
        del shape[axis]
    exact = pool[i].exact and fn in ("max", "min")
    return Op("reduce", (i,), (("fn", fn), ("axis", axis), ("keepdims", keep))), Slot(tuple(shape), exact)


def _d_cumulative(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    fn = g.one_of(["cumsum", "cumprod", "cummax", "cumlogsumexp", "cumsum_jnp"])
    axis = g.integer(0, len(pool[i].shape) - 1)
    reverse = g.draw(st.booleans())
    exact = pool[i].exact and fn == "cummax"
    return Op("cumulative", (i,), (("fn", fn), ("axis", axis), ("reverse", reverse))), Slot(
        pool[i].shape, exact
    )


def _d_reshape(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = list(pool[i].shape)
    how = g.one_of(["merge", "split", "unit"])
    if how == "merge" and len(s) >= 2:
        k = g.integer(0, len(s) - 2)
        out = s[:k] + [s[k] * s[k + 1]] + s[k + 2 :]
    elif how == "split":
        k = g.integer(0, len(s) - 1)
        f = next((d for d in (2, 3) if s[k] % d == 0), None)
        if f is None or len(s) >= 4:
            return None
        out = s[:k] + [f, s[k] // f] + s[k + 1 :]
    else:
        if len(s) >= 4:
            return None
        k = g.integer(0, len(s))
        out = s[:k] + [1] + s[k:]
    return Op("reshape", (i,), (("shape", tuple(out)),)), Slot(tuple(out), pool[i].exact)


def _d_transpose(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool, lambda s: len(s.shape) >= 2)
    if i is None:
        return None
    perm = tuple(g.draw(st.permutations(range(len(pool[i].shape)))))
    how = g.one_of(["transpose", "swapaxes", "moveaxis", "T"])
    shape = tuple(pool[i].shape[p] for p in perm)
    if how != "transpose":  # these choose their own permutation
        r = len(pool[i].shape)
        perm = {"swapaxes": (r - 1, r - 2), "moveaxis": (0, r - 1), "T": ()}[how]
        fake = np.empty(pool[i].shape, np.int8)
        shape = {"swapaxes": np.swapaxes(fake, r - 1, r - 2), "moveaxis": np.moveaxis(fake, 0, r - 1),
                 "T": fake.T}[how].shape  # fmt: skip
    return Op("transpose", (i,), (("how", how), ("perm", perm))), Slot(tuple(shape), pool[i].exact)


def _d_slice(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool, lambda s: max(s.shape) >= 2)
    if i is None:
        return None
    s = pool[i].shape
    axis = g.pick([Slot((n,)) for n in s], lambda t: t.shape[0] >= 2)
    n = s[axis]
    start = g.integer(0, n - 1)
    stop = g.integer(start + 1, n)
    step = g.integer(1, 2)
    out = list(s)
    out[axis] = len(range(start, stop, step))
    return Op("slice", (i,), (("axis", axis), ("start", start), ("stop", stop), ("step", step))), Slot(
        tuple(out), pool[i].exact
    )


def _d_pad(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = pool[i].shape
    axis = g.integer(0, len(s) - 1)
    lo, hi = g.integer(0, 2), g.integer(0, 2)
    mode = g.one_of(["constant", "edge", "lax_interior"])
    out = list(s)
    out[axis] += lo + hi + (s[axis] - 1 if mode == "lax_interior" else 0)
    if not _size_ok(tuple(out)):
        return None
    return Op("pad", (i,), (("axis", axis), ("lo", lo), ("hi", hi), ("mode", mode))), Slot(
        tuple(out), pool[i].exact
    )


def _d_concat(g: _Gen, pool: list[Slot]) -> Any:
    i, j = g.pick(pool), g.pick(pool)
    s = pool[i].shape
    axis = g.integer(0, len(s) - 1)
    n = g.dim(4)
    out = list(s)
    out[axis] += n
    if not _size_ok(tuple(out)):
        return None
    how = g.one_of(["concatenate", "stack_like"])
    return Op("concat", (i, j), (("axis", axis), ("n", n), ("how", how))), Slot(tuple(out))


def _d_flip(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    axis = g.integer(0, len(pool[i].shape) - 1)
    return Op("flip", (i,), (("axis", axis),)), Slot(pool[i].shape, pool[i].exact)


def _d_roll(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    axis = g.integer(0, len(pool[i].shape) - 1)
    return Op("roll", (i,), (("axis", axis), ("shift", g.integer(-3, 3)))), Slot(pool[i].shape, pool[i].exact)


def _d_broadcast(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool, lambda s: len(s.shape) <= 3)
    if i is None:
        return None
    k = g.integer(0, len(pool[i].shape))
    n = g.dim(4)
    out = pool[i].shape[:k] + (n,) + pool[i].shape[k:]
    if not _size_ok(out):
        return None
    how = g.one_of(["broadcast_to", "expand_mul", "repeat"] + (["tile"] if g.on("tile") else []))
    if how == "tile":
        g.used.add("tile")
    return Op("broadcast", (i,), (("axis", k), ("n", n), ("how", how))), Slot(out, pool[i].exact)


def _d_dynamic_slice(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = pool[i].shape
    sizes = tuple(g.integer(1, n) for n in s)
    starts = g.int_data((len(s),), -2, 9)  # clamped into range by lax
    return Op("dynamic_slice", (i,), (("sizes", sizes), ("starts", starts))), Slot(sizes, pool[i].exact)


def _d_dynamic_update_slice(g: _Gen, pool: list[Slot]) -> Any:
    i, j = g.pick(pool), g.pick(pool)
    s = pool[i].shape
    sizes = tuple(g.integer(1, n) for n in s)
    starts = g.int_data((len(s),), -2, 9)
    exact = pool[i].exact and pool[j].exact
    return Op("dynamic_update_slice", (i, j), (("sizes", sizes), ("starts", starts))), Slot(s, exact)


def _index_source(g: _Gen, pool: list[Slot], n: int, count: int) -> tuple:
    """Where integer indices into an axis of size ``n`` come from (``count`` of them)."""
    how = g.one_of(["data", "iota_math", "argmax", "argsort", "constant"])
    if how == "data":
        return ("data", g.int_data((count,), 0, n - 1))
    if how == "constant":
        return ("constant", tuple(g.integer(-n, n - 1) for _ in range(count)))
    if how == "iota_math":
        return ("iota_math", g.integer(1, 5), g.integer(0, 7))
    j = g.pick(pool, lambda s: s.exact)
    if j is None:
        return ("iota_math", 3, 1)
    return (how, j)


def _d_take(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = pool[i].shape
    axis = g.integer(0, len(s) - 1)
    count = g.dim(6)
    src = _index_source(g, pool, s[axis], count)
    how = g.one_of(["take", "index", "take_clip", "take_fill"])
    out = s[:axis] + (count,) + s[axis + 1 :]
    if not _size_ok(out):
        return None
    args = (i,) + ((src[1],) if src[0] in ("argmax", "argsort") else ())
    return Op("take", args, (("axis", axis), ("count", count), ("src", src), ("how", how))), Slot(
        out, pool[i].exact
    )


def _d_at_get(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = pool[i].shape
    count = g.dim(6)
    idx = tuple(g.integer(-s[0] - 1, s[0] + 1) for _ in range(count))  # some out of bounds
    mode = g.one_of(["fill", "clip", "drop"])
    return Op("at_get", (i,), (("idx", idx), ("mode", mode))), Slot((count, *s[1:]), pool[i].exact)


def _d_scatter(g: _Gen, pool: list[Slot]) -> Any:
    modes = [m for m in ("add", "set", "max", "mul") if g.on("scatter_" + m)]
    if not modes:
        return None
    i, j = g.pick(pool), g.pick(pool)
    s = pool[i].shape
    mode = g.one_of(modes)
    g.used.add("scatter_" + mode)
    count = g.dim(6)
    if mode in ("set", "mul"):  # distinct indices (a duplicated set is unordered; JAX differentiates
        # a multiplying scatter with unique indices only)
        count = min(count, s[0])
        idx = tuple(g.draw(st.permutations(range(s[0]))))[:count]
    else:
        idx = tuple(g.integer(0, s[0] - 1) for _ in range(count))
    from_data = g.draw(st.booleans())
    unique = mode in ("set", "mul")
    src = ("data", g.int_data((count,), 0, s[0] - 1)) if from_data and not unique else ("constant", idx)
    return Op("scatter", (i, j), (("mode", mode), ("count", count), ("src", src))), Slot(s)


def _d_segment(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = pool[i].shape
    segments = g.dim(5)
    fn = g.one_of(["sum", "max", "min"])
    ids = g.int_data((s[0],), 0, segments)  # segments: out of range ids are dropped
    sorted_ = g.draw(st.booleans())
    attrs = (("fn", fn), ("ids", ids), ("num", segments), ("sorted", sorted_))
    return Op("segment", (i,), attrs), Slot((segments, *s[1:]))


def _d_bincount(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    n = math.prod(pool[i].shape)
    length = g.dim()
    ids = g.int_data((n,), 0, length - 1)
    return Op("bincount", (i,), (("ids", ids), ("length", length))), Slot((length,))


def _d_sort(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    axis = g.integer(0, len(pool[i].shape) - 1)
    how = g.one_of(["sort", "sort_descending", "lax_sort"])
    return Op("sort", (i,), (("axis", axis), ("how", how))), Slot(pool[i].shape, pool[i].exact)


def _d_top_k(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = pool[i].shape
    k = g.integer(1, s[-1])
    return Op("top_k", (i,), (("k", k),)), Slot((*s[:-1], k), pool[i].exact)


def _d_argsort_gather(g: _Gen, pool: list[Slot]) -> Any:
    key = g.pick(pool, lambda s: s.exact)
    if key is None:
        return None
    i = g.pick(pool, lambda s: s.shape == pool[key].shape)
    axis = g.integer(0, len(pool[key].shape) - 1)
    return Op("argsort_gather", (i, key), (("axis", axis),)), Slot(pool[i].shape, pool[i].exact)


def _d_argmax_take(g: _Gen, pool: list[Slot]) -> Any:
    key = g.pick(pool, lambda s: s.exact and len(s.shape) >= 2)
    if key is None:
        return None
    i = g.pick(pool, lambda s: s.shape == pool[key].shape)
    axis = g.integer(0, len(pool[key].shape) - 1)
    fn = g.one_of(["argmax", "argmin"])
    shape = pool[key].shape[:axis] + pool[key].shape[axis + 1 :]
    return Op("argmax_take", (i, key), (("axis", axis), ("fn", fn))), Slot(shape, pool[i].exact)


def _d_mask_where(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    exact_key = g.pick(pool, lambda s: s.exact)
    # continuous: where(x > 0, x, c * x) and masks from iotas; a mask from an exact value may select
    # between different values
    how = g.one_of(["leaky", "iota_mask", "exact_mask", "logic"])
    if how == "exact_mask" and exact_key is None:
        how = "leaky"
    args = (i, exact_key) if how in ("exact_mask", "logic") and exact_key is not None else (i,)
    if how == "logic" and exact_key is None:
        how = "iota_mask"
    attrs = (("how", how), ("k", g.integer(0, 7)), ("c", g.one_of([0.0, 0.1, -0.5])))
    return Op("mask_where", args, attrs), Slot(pool[i].shape)


def _d_int_math(g: _Gen, pool: list[Slot]) -> Any:
    key = g.pick(pool, lambda s: s.exact)
    if key is None:
        return None
    i = g.pick(pool)
    how = g.one_of(["count", "floor_mod", "int_pow", "bool_float", "clip_int"])
    return Op("int_math", (i, key), (("how", how), ("m", g.integer(2, 5)))), Slot(pool[i].shape)


def _d_name(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    name = f"n{g.names % 2}"
    g.names += 1
    return Op("name", (i,), (("name", name),)), Slot(pool[i].shape, pool[i].exact)


def _d_shard(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    s = pool[i].shape
    meshes = ["mesh1"] + (["mesh8", "mesh2x4"] if g.on("shard_8") and len(jax.devices()) >= 8 else [])
    if g.meshes is not None:  # one program uses one set of devices
        meshes = g.meshes
    mesh = g.one_of(meshes)
    g.meshes = [mesh]  # JAX refuses two meshes over the same devices in one program
    axes = {"mesh1": {"d": 1}, "mesh8": {"d": 8}, "mesh2x4": {"a": 2, "b": 4}}[mesh]
    spec: list = []
    free = dict(axes)
    for n in s:
        fits = [a for a, size in free.items() if n % size == 0]
        choice = g.one_of([None, *fits]) if fits else None
        if choice is not None:
            del free[choice]
        spec.append(choice)
    if mesh != "mesh1":
        g.used.add("shard_8")
    return Op("shard", (i,), (("mesh", mesh), ("spec", tuple(spec)))), Slot(s, pool[i].exact)


# --- ops with nested blocks ---


def _nested_ok(g: _Gen) -> bool:
    return g.depth < 2


def _d_vmap(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    i = g.pick(pool)
    s = pool[i].shape
    axis = g.integer(0, len(s) - 1)
    inner = s[:axis] + s[axis + 1 :] or (1,)  # a scalar slice enters the block as shape (1,)
    j = g.pick(pool) if g.draw(st.booleans()) else None  # an unmapped operand
    ins = [Slot(inner)] + ([pool[j]] if j is not None else [])
    target = g.shape(1, 2, 6)
    block = g.block(ins, target)
    out_axis = g.integer(0, len(target))
    out = target[:out_axis] + (s[axis],) + target[out_axis:]
    if not _size_ok(out):
        return None
    args = (i,) if j is None else (i, j)
    return Op("vmap", args, (("axis", axis), ("out_axis", out_axis)), (block,)), Slot(out)


def _d_scan(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    i = g.pick(pool)  # xs: scanned over its leading axis
    c = g.pick(pool)  # initial carry
    s, carry = pool[i].shape, pool[c].shape
    x_t = s[1:] or (1,)
    block = g.block([Slot(carry), Slot(x_t)], carry)
    ys = g.draw(st.booleans())
    attrs = (("reverse", g.draw(st.booleans())), ("unroll", g.one_of([1, 2])), ("ys", ys))
    out = (s[0], *carry) if ys else carry
    if not _size_ok(out):
        return None
    return Op("scan", (i, c), attrs, (block,)), Slot(out)


def _d_fori(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    c = g.pick(pool)
    i = g.pick(pool)  # indexed with the loop counter
    carry = pool[c].shape
    row = pool[i].shape[1:] or (1,)
    block = g.block([Slot(carry), Slot(row)], carry)
    return Op("fori", (c, i), (("n", g.integer(1, 4)),), (block,)), Slot(carry)


def _d_while(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    c = g.pick(pool)
    i = g.pick(pool)
    carry = pool[c].shape
    # reverse mode refuses a while loop whose body closes over a differentiated value
    block = g.block([Slot(carry)], carry, closure=False)
    return Op("while", (c, i), (("n", g.integer(0, 3)),), (block,)), Slot(pool[i].shape)


def _d_cond(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    key = g.pick(pool, lambda s: s.exact)
    i = g.pick(pool)
    j = g.pick(pool)
    target = pool[i].shape
    ins = [pool[i], pool[j]]
    blocks = (g.block(ins, target, 1, 2), g.block(ins, target, 0, 2))
    args = (i, j) if key is None else (i, j, key)
    attrs = (("pred", "exact" if key is not None else "data"), ("data", g.int_data((1,), 0, 1)))
    return Op("cond", args, attrs, blocks), Slot(target)


def _d_switch(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    key = g.pick(pool, lambda s: s.exact)
    if key is None:
        return None
    i = g.pick(pool)
    target = g.shape(1, 2, 6)
    blocks = tuple(g.block([pool[i]], target, 0, 2) for _ in range(3))
    return Op("switch", (i, key), (), blocks), Slot(target)


def _d_remat(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    i, j = g.pick(pool), g.pick(pool)
    policies = ["none", "dots_saveable", "nothing_saveable", "everything_saveable", "dots_with_no_batch_dims"]
    if g.on("remat_names"):
        policies += ["save_names", "save_names", "offload_names_none"]
    policy = g.one_of(policies)
    if "names" in policy:
        g.used.add("remat_names")
    target = pool[i].shape
    block = g.block([pool[i], pool[j]], target, 1, 3)
    prevent_cse, how = g.draw(st.booleans()), g.one_of(["checkpoint", "remat"])
    attrs = (("policy", policy), ("prevent_cse", prevent_cse), ("how", how))
    return Op("remat", (i, j), attrs, (block,)), Slot(target)


def _d_jit(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    i, j = g.pick(pool), g.pick(pool)
    target = pool[i].shape
    block = g.block([pool[i], pool[j]], target, 1, 3)
    sharded = None  # or a mesh: the jit's outputs replicated over it (out_shardings)
    if g.on("jit_shardings") and g.draw(st.booleans()):
        sharded = g.one_of(
            g.meshes or ["mesh1"] + (["mesh8"] if g.on("shard_8") and len(jax.devices()) >= 8 else [])
        )
        g.meshes = [sharded]
        g.used.add("jit_shardings")
    attrs = (("inline", g.draw(st.booleans())), ("out_shardings", sharded))
    return Op("jit", (i, j), attrs, (block,)), Slot(target)


def _d_inner_autocast(g: _Gen, pool: list[Slot]) -> Any:
    if not _nested_ok(g):
        return None
    i, j = g.pick(pool), g.pick(pool)
    target = pool[i].shape
    block = g.block([pool[i], pool[j]], target, 1, 3)
    policy = g.one_of(["p=f32,c=bf16,o=f32", "f32", "p=f32,c=f16,o=bf16"])
    return Op("inner_autocast", (i, j), (("policy", policy),), (block,)), Slot(target)


def _d_custom_jvp(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    how = g.one_of(["softclip", "block"] if _nested_ok(g) else ["softclip"])
    # the body may read the program's integer data (a traced value it closes over); not its parameters:
    # differentiating a custom_jvp rule that closes over a differentiated value fails in JAX itself
    closure = "data" if g.on("custom_jvp_closure") else False
    before = len(g.params) + len(g.ints)
    blocks = (g.block([pool[i]], pool[i].shape, 1, 2, closure),) if how == "block" else ()
    if len(g.params) + len(g.ints) > before:
        g.used.add("custom_jvp_closure")
    factor = g.one_of([1.0, 0.5])  # the rule's tangent, scaled: the user's rule is the reference
    return Op("custom_jvp", (i,), (("how", how), ("factor", factor)), blocks), Slot(pool[i].shape)


def _d_custom_vjp(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    how = g.one_of(["grad_scale", "clip_grad", "block"] if _nested_ok(g) else ["grad_scale", "clip_grad"])
    # JAX's custom_vjp refuses to close over differentiated values: the body reads only its operand
    blocks = (g.block([pool[i]], pool[i].shape, 1, 2, closure=False),) if how == "block" else ()
    factor = g.one_of([1.0, 0.5, -2.0])
    return Op("custom_vjp", (i,), (("how", how), ("factor", factor)), blocks), Slot(pool[i].shape)


# --- attention ---

LAYOUTS = ("bqhd", "bhqd", "bhkq", "gqa", "flat", "jax_nn")
FILLS = {"-inf": -math.inf, "-1e9": -1e9, "finfo_min": None, "-1e4": -1e4, "-30000": -30000.0, "-10": -10.0}


def _d_attention(g: _Gen, pool: list[Slot]) -> Any:
    i = g.pick(pool)
    b, tq, m = g.integer(1, 2), g.integer(1, 12), g.integer(1, 8)
    cross = g.draw(st.booleans())
    j = g.pick(pool) if cross else None
    tk = g.integer(1, 12) if cross else tq
    layouts = [x for x in LAYOUTS if g.on({"gqa": "attention_gqa", "jax_nn": "attention_jax_nn"}.get(x, x))]
    if g.highest:  # jax.nn.dot_product_attention takes no precision
        layouts = [x for x in layouts if x != "jax_nn"]
    layout = g.one_of(layouts)
    heads = 1 if layout == "flat" else g.one_of([1, 2, 4])
    kv_heads = heads
    if layout in ("gqa", "jax_nn") and heads > 1 and g.on("attention_gqa"):
        kv_heads = g.one_of([h for h in (1, 2, 4) if heads % h == 0])
    if kv_heads != heads:
        g.used.add("attention_gqa")
    d = g.integer(1, 8)
    masks = ["none", "causal_tril", "causal_iota", "random_constant"]
    if g.on("attention_mask_padding"):
        masks += ["padding", "padding_causal"]
    mask = g.one_of(masks)
    lengths = None
    if "padding" in mask:
        g.used.add("attention_mask_padding")
        lo = 0 if g.on("attention_fully_masked") else 1
        lengths = g.int_data((b,), lo, tk)
    if mask != "none":
        fills = ["-inf", "finfo_min"]
        if g.on("attention_finite_fill"):
            fills += ["-1e9", "-1e4", "-30000"]
        if g.on("attention_soft_fill"):
            fills += ["-10"]
        fill = g.one_of(fills)
        if fill not in ("-inf", "finfo_min"):
            g.used.add("attention_soft_fill" if fill == "-10" else "attention_finite_fill")
        apply = g.one_of(["where", "additive"])
    else:
        fill, apply = None, None
    if layout == "jax_nn":
        apply = "jax_nn"
        g.used.add("attention_jax_nn")
    if mask == "causal_iota" and tq != tk and not g.on("attention_fully_masked"):
        mask = "causal_tril"  # bottom-right aligned causal masks leave rows with no key when tq > tk
    scale_how = g.one_of(["mul", "div", "pre_q", "none"])
    bias = g.param((heads, tq, tk), 0.5) if g.flag("attention_bias") and layout != "flat" else None
    if bias:
        g.used.add("attention_bias")
    softmax = g.one_of(["jax_nn", "manual", "manual_no_max"])
    precision = g.precision()
    lookalike = "real"
    if g.on("attention_lookalike") and layout not in ("jax_nn",):
        lookalike = g.one_of(["real", "real", "query_axis", "reuse", "wrong_contract", "no_norm"])
        if lookalike != "real":
            g.used.add("attention_lookalike")
    if lookalike == "wrong_contract" and tq != tk:
        lookalike = "query_axis"
    constant_mask = None
    if mask == "random_constant":
        constant_mask = tuple(g.draw(st.booleans()) for _ in range(tq * tk))
    wq = g.param((m, heads, d), 1 / math.sqrt(m))
    wk = g.param((m, kv_heads, d), 1 / math.sqrt(m))
    wv = g.param((m, kv_heads, d), 1 / math.sqrt(m))
    wo = g.param((heads, d, m), 1 / math.sqrt(heads * d))
    attrs = (("layout", layout), ("b", b), ("tq", tq), ("tk", tk), ("m", m), ("heads", heads),
             ("kv_heads", kv_heads), ("d", d), ("mask", mask), ("lengths", lengths), ("fill", fill),
             ("apply", apply), ("scale", scale_how), ("bias", bias), ("softmax", softmax),
             ("precision", precision), ("lookalike", lookalike), ("w", (wq, wk, wv, wo)),
             ("constant_mask", constant_mask), ("all_highest", g.highest))  # fmt: skip
    args = (i,) if j is None else (i, j)
    return Op("attention", args, attrs), Slot((b, tq, m))


DRAWERS = {
    "unary": _d_unary, "binary": _d_binary, "scalar": _d_scalar, "dot": _d_dot, "linear": _d_linear,
    "conv": _d_conv, "layernorm": _d_layernorm, "softmax": _d_softmax, "logsumexp": _d_logsumexp,
    "var_offset": _d_var_offset, "reduce": _d_reduce, "cumulative": _d_cumulative, "reshape": _d_reshape,
    "transpose": _d_transpose, "slice": _d_slice, "pad": _d_pad, "concat": _d_concat, "flip": _d_flip,
    "roll": _d_roll, "broadcast": _d_broadcast, "dynamic_slice": _d_dynamic_slice,
    "dynamic_update_slice": _d_dynamic_update_slice, "take": _d_take, "at_get": _d_at_get,
    "scatter": _d_scatter, "segment": _d_segment, "bincount": _d_bincount, "sort": _d_sort,
    "top_k": _d_top_k, "argsort_gather": _d_argsort_gather, "argmax_take": _d_argmax_take,
    "mask_where": _d_mask_where, "int_math": _d_int_math, "vmap": _d_vmap, "scan": _d_scan,
    "fori": _d_fori, "while": _d_while, "cond": _d_cond, "switch": _d_switch, "remat": _d_remat,
    "jit": _d_jit, "inner_autocast": _d_inner_autocast, "custom_jvp": _d_custom_jvp,
    "custom_vjp": _d_custom_vjp, "name": _d_name, "shard": _d_shard, "attention": _d_attention,
}  # fmt: skip
NESTING = frozenset({"vmap", "scan", "fori", "while", "cond", "switch", "remat", "jit", "inner_autocast"})


# The order kinds are drawn in: hypothesis draws the first ones of a list more often (and shrinks towards
# them), so contractions, attention and the float32 ops around them come first.
KIND_ORDER = (
    "dot", "linear", "attention", "unary", "layernorm", "softmax", "binary", "conv", "scan", "vmap",
    "remat", "scatter", "take", "var_offset", "custom_jvp", "custom_vjp", "cond", "shard", "name",
    "logsumexp", "reduce", "cumulative", "sort", "top_k", "segment", "bincount", "mask_where", "int_math",
    "argmax_take", "argsort_gather", "at_get", "fori", "while", "switch", "jit", "inner_autocast", "scalar",
    "reshape",
    "transpose", "slice", "pad", "concat", "flip", "roll", "broadcast", "dynamic_slice",
    "dynamic_update_slice",
)  # fmt: skip


def _draw_ops(g: _Gen, pool: list[Slot], n: int) -> tuple[list[Op], list[Slot]]:
    order = [k for k in g.focus if k in DRAWERS] + [k for k in KIND_ORDER if k not in g.focus]
    kinds = [k for k in order if g.on(k) and (g.depth < 2 or k not in NESTING)]
    if g.depth > 0:
        kinds = [k for k in kinds if k != "attention"]
    sprinkle = [k for k in g.sprinkle if g.on(k)]
    ops: list[Op] = []
    tries = 0
    while len(ops) < n and tries < 4 * n:
        tries += 1
        follow = sprinkle and g.draw(st.integers(0, 3)) > 0  # an identity op after three ops in four
        for kind in [g.one_of(kinds)] + ([g.one_of(sprinkle)] if follow else []):
            try:
                found = DRAWERS[kind](g, pool)
            except _NoClosure:
                continue
            if found is not None:
                ops.append(found[0])
                pool.append(found[1])
                g.used.add(kind)
    return ops, pool


@st.composite
def programs(
    draw: Any,
    off: frozenset = frozenset(),
    max_ops: int = 6,
    focus: tuple = (),
    sprinkle: tuple = (),
    highest: bool = False,
) -> Program:
    """A random program of up to ``max_ops`` top-level ops. ``off``: features left out. ``focus``: op
    kinds drawn first and most often (the first op is one of them), to aim a property at a family.
    ``sprinkle``: op kinds that may follow any op (identity ops between the others). ``highest``: every
    contraction asks ``precision="highest"`` (and the program runs no policy of its own)."""
    g = _Gen(draw, frozenset(off) | ({"inner_autocast"} if highest else set()), 0)
    g.focus, g.sprinkle, g.highest = tuple(focus), tuple(sprinkle), highest
    inputs: list[tuple[str, str]] = []
    floats = []
    pool: list[Slot] = []
    for k in range(draw(st.integers(1, 2))):
        shape = g.shape(1, 3)
        if k == 0 and draw(st.booleans()):
            floats.append((f"x{k}", shape))
            inputs.append(("float", f"x{k}"))
        else:
            inputs.append(("param", g.param(shape, 1.0)))
        pool.append(Slot(shape, exact=True))
    ops: list[Op] = []
    kinds = [k for k in focus if g.on(k)]
    for _ in range(8 if kinds else 0):
        found = DRAWERS[g.one_of(kinds)](g, pool)
        if found is not None:
            ops.append(found[0])
            pool.append(found[1])
            g.used.add(ops[-1].kind)
            break
    more, pool = _draw_ops(g, pool, draw(st.integers(1 if not ops else 0, max_ops - len(ops))))
    ops += more
    n_out = draw(st.integers(1, min(3, len(pool))))
    outputs = tuple(sorted({len(pool) - 1, *(g.pick(pool) for _ in range(n_out - 1))}))
    return Program(
        params=tuple(g.params),
        floats=tuple(floats),
        ints=tuple(g.ints),
        int_values=tuple(g.int_values),
        inputs=tuple(inputs),
        body=Block(len(inputs), tuple(ops), len(pool) - 1),
        outputs=outputs,
        seed=draw(st.integers(0, 2**31 - 1)),
        features=frozenset(g.used),
    )


def program(params: dict, ops: list, seed: int = 0) -> Program:
    """A program written by hand: ``params`` ``{name: shape}`` (the first is the body's input, standard
    deviation 1, the others 0.5), ``ops`` a list of ``(kind, args, attrs)``; returns the last array."""
    names = list(params)
    body = Block(1, tuple(Op(kind, tuple(args), tuple(attrs.items())) for kind, args, attrs in ops), len(ops))
    specs = tuple((n, tuple(params[n]), 1.0 if k == 0 else 0.5) for k, n in enumerate(names))
    features = frozenset(kind for kind, _, _ in ops)
    return Program(specs, (), (), (), (("param", names[0]),), body, (len(ops),), seed, features)


# --- arguments -----------------------------------------------------------------------------------------


def _on_grid(x: np.ndarray) -> np.ndarray:
    """float32 values exactly representable in bfloat16 and in float16 (normal range)."""
    x = np.where(np.abs(x) < 1e-3, np.where(x < 0, -1e-3, 1e-3), x)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def inputs(program: Program) -> tuple[dict, dict]:
    """``(params, data)``: float32 params and float data on the 16-bit grid, int data as drawn."""
    rng = np.random.default_rng(program.seed)
    params = {n: jnp.asarray(_on_grid(rng.normal(size=s) * std)) for n, s, std in program.params}
    data = {n: jnp.asarray(_on_grid(rng.normal(size=s))) for n, s in program.floats}
    for (n, s), v in zip(program.ints, program.int_values):
        data[n] = jnp.asarray(np.asarray(v, np.int32).reshape(s))
    return params, data


def cast_floats(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


# --- running -------------------------------------------------------------------------------------------


class Env(NamedTuple):
    params: dict
    data: dict
    native: Any = None  # the dtype of a native 16-bit run (precision="highest" contractions in float32)
    erase: bool = False  # identity ops (checkpoint_name, with_sharding_constraint) left out
    names: list = []
    fp8: Any = None  # a native fp8 run: the recipe every dot and linear contraction runs under (see build)


def fit(x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` flattened, repeated or cut to ``prod(shape)`` elements, reshaped to ``shape``."""
    n = math.prod(shape)
    flat = jnp.ravel(x)
    if flat.size < n:
        flat = jnp.concatenate([flat] * -(-n // flat.size))
    return flat[:n].reshape(shape)


def _const(values: np.ndarray, like: Any) -> Any:
    return jnp.asarray(values, like.dtype)


def _softclip(x: Any) -> Any:
    return x / (1 + jnp.abs(x))


UNARY = ("tanh", "sin", "cos", "exp_neg_sq", "log1p_sq", "sqrt1", "abs", "square", "cube", "relu", "leaky",
         "gelu", "gelu_exact", "sigmoid", "softplus", "rsqrt1", "recip", "erf", "clip", "neg", "silu",
         "atan", "floor_round")  # fmt: skip


UNARY_EXP = frozenset({"exp_neg_sq", "sigmoid", "softplus", "silu"})  # exp or logistic inside


def _unary(fn: str, x: Any) -> Any:
    if fn == "tanh":
        return jnp.tanh(x)
    if fn == "sin":
        return jnp.sin(x)
    if fn == "cos":
        return jnp.cos(x)
    if fn == "exp_neg_sq":
        return jnp.exp(-jnp.square(x))
    if fn == "log1p_sq":
        return jnp.log1p(x * x)
    if fn == "sqrt1":
        return jnp.sqrt(x * x + 1)
    if fn == "abs":
        return jnp.abs(x)
    if fn == "square":
        return jnp.square(x)
    if fn == "cube":
        return x**3
    if fn == "relu":
        return jax.nn.relu(x)
    if fn == "leaky":
        return jax.nn.leaky_relu(x, 0.1)
    if fn == "gelu":
        return jax.nn.gelu(x)
    if fn == "gelu_exact":
        return jax.nn.gelu(x, approximate=False)
    if fn == "sigmoid":
        return jax.nn.sigmoid(x)
    if fn == "softplus":
        return jax.nn.softplus(x)
    if fn == "rsqrt1":
        return lax.rsqrt(1 + x * x)
    if fn == "recip":
        return 1 / (1 + x * x)
    if fn == "erf":
        return jax.scipy.special.erf(x)
    if fn == "clip":
        return jnp.clip(x, -1.5, 1.0)
    if fn == "neg":
        return -x
    if fn == "silu":
        return jax.nn.silu(x)
    if fn == "atan":
        return jnp.arctan(x)
    if fn == "floor_round":  # piecewise constant plus a smooth part (no jumps across the three runs?)
        return x + 0.0 * jnp.floor(x)
    raise ValueError(fn)


BINARY = ("add", "sub", "mul", "div", "max", "min", "where_gt", "hypot")


def _binary(fn: str, a: Any, b: Any) -> Any:
    if fn == "add":
        return a + b
    if fn == "sub":
        return a - b
    if fn == "mul":
        return a * b
    if fn == "div":
        return a / (1 + b * b)
    if fn == "max":
        return jnp.maximum(a, b)
    if fn == "min":
        return jnp.minimum(a, b)
    if fn == "where_gt":
        return jnp.where(a > b, a, b)
    if fn == "hypot":
        return jnp.sqrt(a * a + b * b + 0.25)
    raise ValueError(fn)


def _meshes() -> dict:
    devices = np.array(jax.devices())
    found = {"mesh1": jax.sharding.Mesh(devices[:1], ("d",))}
    if len(devices) >= 8:
        found["mesh8"] = jax.sharding.Mesh(devices[:8], ("d",))
        found["mesh2x4"] = jax.sharding.Mesh(devices[:8].reshape(2, 4), ("a", "b"))
    return found


def _highest(env: Env, fn: Any, *operands: Any) -> Any:
    """A ``precision="highest"`` contraction: in float32 in a native 16-bit run too (as the program asks)."""
    if env.native is None:
        return fn(*operands)
    return fn(*(x.astype(F32) for x in operands)).astype(env.native)


def _contract(env: Env, op: Op, a: Any, b: Any) -> Any:
    dims, impl, precision = op["dims"], op["impl"], op["precision"]
    if env.fp8 is not None and precision is None:
        out = jmp_lite.fp8.dot_general(a, b, dims, recipe=env.fp8)
        return out if op["out_perm"] is None else jnp.transpose(out, op["out_perm"])
    upcast = precision == "highest" and env.native is not None
    if upcast:  # the program asks for float32 here: the native yardstick runs it in float32 too
        a, b = a.astype(F32), b.astype(F32)
    (ca, cb), (ba, bb) = dims
    if impl == "lax":
        out = lax.dot_general(a, b, dims, precision=precision)
    elif impl == "tensordot":
        out = jnp.tensordot(a, b, axes=(ca, cb), precision=precision)
    else:
        letters = iter("abcdefghijklmnop")
        sa = [next(letters) for _ in a.shape]
        sb = [""] * b.ndim
        for x, y in zip(ca + ba, cb + bb):
            sb[y] = sa[x]
        sb = [c or next(letters) for c in sb]
        free_a = [sa[x] for x in range(a.ndim) if x not in ca + ba]
        free_b = [sb[y] for y in range(b.ndim) if y not in cb + bb]
        out_letters = [sa[x] for x in ba] + free_a + free_b
        if op["out_perm"] is not None:
            out_letters = [out_letters[p] for p in op["out_perm"]]
        spec = f"{''.join(sa)},{''.join(sb)}->{''.join(out_letters)}"
        out = jnp.einsum(spec, a, b, precision=precision)
    if upcast:
        out = out.astype(env.native)
    return out


def _attention(env: Env, op: Op, x: Any, y: Any) -> Any:
    o = dict(op.attrs)
    b, tq, tk, m, h, kh, d = (o[k] for k in ("b", "tq", "tk", "m", "heads", "kv_heads", "d"))
    wq, wk, wv, wo = (env.params[n] for n in o["w"])
    x = fit(x, (b, tq, m))
    y = fit(y, (b, tk, m)) if y is not None else x
    highest = o["precision"] == "highest"
    precision = "highest" if highest else None
    upcast = highest and env.native is not None

    def ein(spec: str, p: Any, q: Any) -> Any:
        if upcast:
            p, q = p.astype(F32), q.astype(F32)
        out = jnp.einsum(spec, p, q, precision=precision)
        return out.astype(env.native) if upcast else out

    project = ein if o.get("all_highest") else jnp.einsum  # the projections too, in an all-highest program
    q = project("btm,mhd->bthd", x, wq)
    k = project("btm,mhd->bthd", y, wk)
    v = project("btm,mhd->bthd", y, wv)
    scale = 1 / math.sqrt(d)
    if o["scale"] == "pre_q":
        q = q * scale
    # the mask as [b or 1, tq, tk], True where a key is attended to
    mask = None
    if o["mask"] == "causal_tril":
        mask = jnp.tril(jnp.ones((tq, tk), bool))[None]
    elif o["mask"] == "causal_iota":
        qi = lax.broadcasted_iota(jnp.int32, (tq, tk), 0)
        ki = lax.broadcasted_iota(jnp.int32, (tq, tk), 1)
        mask = (qi + (tk - tq) >= ki)[None]  # bottom-right aligned
    elif o["mask"] == "random_constant":
        mask = jnp.asarray(np.array(o["constant_mask"], bool).reshape(1, tq, tk))
    elif "padding" in o["mask"]:
        lengths = env.data[o["lengths"]]
        mask = (jnp.arange(tk)[None, :] < lengths[:, None])[:, None, :]
        if o["mask"] == "padding_causal":
            mask = mask & jnp.tril(jnp.ones((tq, tk), bool))[None]
    bias = env.params[o["bias"]] if o["bias"] else None

    if o["layout"] == "jax_nn":
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=None if bias is None else bias[None],
            mask=None if mask is None else mask[:, None],
            scale=1.0 if o["scale"] in ("pre_q", "none") else None,
        )
        return jnp.einsum("bqhd,hdm->bqm", out, wo)

    def reused(w: Any, key_axis: int) -> Any:
        """The weights read a second time: each query's mean key position."""
        pos = jnp.linspace(0.0, 1.0, tk).astype(w.dtype)
        return jnp.sum(jnp.moveaxis(w, key_axis, -1) * pos, axis=-1)

    def finish(logits: Any, axis: int, mask_b: Any, bias_b: Any) -> Any:
        if o["scale"] == "mul":
            logits = logits * scale
        elif o["scale"] == "div":
            logits = logits / math.sqrt(d)
        if bias_b is not None:
            logits = logits + bias_b.astype(logits.dtype)
        if mask_b is not None:
            fill = FILLS[o["fill"]]
            if fill is None:
                fill = jnp.finfo(logits.dtype).min
            if o["apply"] == "where":
                logits = jnp.where(mask_b, logits, fill)
            else:
                logits = logits + jnp.where(mask_b, 0.0, fill).astype(logits.dtype)
        if o["lookalike"] == "no_norm":
            return jnp.exp(logits - jnp.max(logits, axis=axis, keepdims=True))
        if o["softmax"] == "jax_nn":
            return jax.nn.softmax(logits, axis=axis)
        if o["softmax"] == "manual":
            e = jnp.exp(logits - lax.stop_gradient(jnp.max(logits, axis=axis, keepdims=True)))
            return e / jnp.sum(e, axis=axis, keepdims=True)
        e = jnp.exp(logits - 4.0)
        return e / jnp.sum(e, axis=axis, keepdims=True)

    lay = o["layout"]
    look = o["lookalike"]
    extra = None
    if lay in ("bqhd", "bhkq", "bhqd"):
        if lay == "bhqd":
            qt, kt, vt = (jnp.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
            logits = ein("bhqd,bhkd->bhqk", qt, kt)
        elif lay == "bqhd":
            logits = ein("bqhd,bkhd->bhqk", q, k)
        else:
            logits = ein("bqhd,bkhd->bhkq", q, k)
        key_axis = -2 if lay == "bhkq" else -1
        axis = key_axis if look != "query_axis" else (-1 if lay == "bhkq" else -2)
        mask_b = None if mask is None else mask[:, None]
        bias_b = None if bias is None else bias[None]
        if lay == "bhkq":
            mask_b = None if mask_b is None else jnp.swapaxes(mask_b, -1, -2)
            bias_b = None if bias_b is None else jnp.swapaxes(bias_b, -1, -2)
        w = finish(logits, axis, mask_b, bias_b)
        if lay == "bhqd":
            out = ein("bhqk,bhkd->bhqd", w, vt) if look != "wrong_contract" else ein("bhqk,bhqd->bhkd", w, vt)
            out = jnp.transpose(out, (0, 2, 1, 3))
        elif lay == "bqhd":
            out = ein("bhqk,bkhd->bqhd", w, v) if look != "wrong_contract" else ein("bhqk,bqhd->bkhd", w, v)
        else:
            out = ein("bhkq,bkhd->bqhd", w, v) if look != "wrong_contract" else ein("bhkq,bqhd->bkhd", w, v)
        if look == "reuse":
            extra = reused(w, key_axis)
    elif lay == "gqa":
        g_ = h // kh
        qg = q.reshape(b, tq, kh, g_, d)
        logits = ein("bqhgd,bkhd->bhgqk", qg, k)
        mask_b = None if mask is None else mask[:, None, None]
        bias_b = None if bias is None else bias.reshape(kh, g_, tq, tk)[None]
        axis = -1 if look != "query_axis" else -2
        w = finish(logits, axis, mask_b, bias_b)
        if look == "wrong_contract":
            out = ein("bhgqk,bqhd->bkhgd", w, v[:, :, :kh]).reshape(b, tk, h, d)
        else:
            out = ein("bhgqk,bkhd->bqhgd", w, v).reshape(b, tq, h, d)
        if look == "reuse":
            extra = reused(w, -1)
    else:  # flat: one head, matmul with a transposed key
        q2, k2, v2 = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        matmul = lambda p, q: jnp.matmul(p, q, precision=precision)  # noqa: E731
        logits = _highest(env, matmul, q2, jnp.swapaxes(k2, -1, -2)) if highest else matmul(q2, k2.mT)
        axis = -1 if look != "query_axis" else -2
        w = finish(logits, axis, mask, None)
        wt = w if look != "wrong_contract" else jnp.swapaxes(w, -1, -2)
        out = (_highest(env, matmul, wt, v2) if highest else wt @ v2)[:, :, None]
        if look == "reuse":
            extra = reused(w, -1)
    result = project("bqhd,hdm->bqm", out, wo)
    if extra is not None:
        result = result + 0.5 * fit(extra, (b, tq))[..., None]
    return result


def _policy(name: str) -> Any:
    cp = jax.checkpoint_policies
    return {
        "none": None,
        "dots_saveable": cp.dots_saveable,
        "nothing_saveable": cp.nothing_saveable,
        "everything_saveable": cp.everything_saveable,
        "dots_with_no_batch_dims": cp.dots_with_no_batch_dims_saveable,
        "save_names": cp.save_only_these_names("n0", "n1"),
        "offload_names_none": cp.save_any_names_but_these("n1"),
    }[name]


def run_block(env: Env, block: Block, args: list) -> Any:
    pool = list(args)
    for op in block.ops:
        pool.append(run_op(env, op, [pool[i] for i in op.args]))
    out = pool[block.out]
    return fit(out, block.target) if block.target is not None else out


def _blockfn(env: Env, block: Block) -> Any:
    return lambda *xs: run_block(env, block, list(xs))


def _int_index(env: Env, src: tuple, n: int, count: int, vals: list) -> Any:
    kind = src[0]
    if kind == "data":
        return env.data[src[1]]
    if kind == "constant":
        return jnp.asarray(np.array(src[1], np.int32))
    if kind == "iota_math":
        return (jnp.arange(count, dtype=jnp.int32) * src[1] + src[2]) % n
    key = jnp.ravel(vals[1])
    if kind == "argmax":
        return (jnp.argmax(key) + jnp.arange(count)) % n
    return fit(jnp.argsort(key), (count,)) % n


def run_op(env: Env, op: Op, vals: list) -> Any:  # noqa: C901 - one branch per op kind
    k = op.kind
    a = vals[0]
    if k == "unary":
        return _unary(op["fn"], a)
    if k == "binary":
        shape = a.shape[op["from_axis"] :]
        return _binary(op["fn"], a, fit(vals[1], shape))
    if k == "scalar":
        c = op["c"]
        return {"mul": lambda: a * c, "add": lambda: a + c, "div": lambda: a / c, "rsub": lambda: c - a,
                "offset_300": lambda: (a + 300.0) - 300.0}[op["fn"]]()  # fmt: skip
    if k == "dot":
        b = env.params[op["param"]] if op["param"] else vals[1]
        out = _contract(env, op, a, b)
        return out * op["scale"] if op["scale"] != 1.0 else out
    if k == "linear":
        w, precision = env.params[op["w"]], op.get("precision")
        if precision is not None:
            out = _highest(env, lambda x, y: jnp.matmul(x, y, precision=precision), a, w)
        elif env.fp8 is not None:
            out = jmp_lite.fp8.dot_general(a, w, (((a.ndim - 1,), (0,)), ((), ())), recipe=env.fp8)
        elif op["how"] == "matmul":
            out = jnp.matmul(a, w)
        elif op["how"] == "at":
            out = a @ w
        else:
            out = jnp.dot(a, w)
        return out + env.params[op["b"]] if op["b"] else out
    if k == "conv":
        precision = op.get("precision")
        conv = lambda x, y: lax.conv_general_dilated(  # noqa: E731
            x, y, (op["stride"],), op["padding"], rhs_dilation=(op["dilation"],),
            dimension_numbers=("NWC", "WIO", "NWC"), precision=precision,
        )  # fmt: skip
        x, kernel = fit(a, op["shape"]), env.params[op["kernel"]]
        return _highest(env, conv, x, kernel) if precision is not None else conv(x, kernel)
    if k == "layernorm":
        kind = op["kind"]
        if kind == "layer":
            mean = jnp.mean(a, -1, keepdims=True)
            var = jnp.var(a, -1, keepdims=True)
            out = (a - mean) * lax.rsqrt(var + 1e-5)
        elif kind == "rms":
            out = a * lax.rsqrt(jnp.mean(jnp.square(a), -1, keepdims=True) + 1e-6)
        else:
            mean = a.sum(-1, keepdims=True) / a.shape[-1]
            c = a - mean
            out = c / jnp.sqrt((c * c).sum(-1, keepdims=True) / a.shape[-1] + 1e-5)
        return out * (1 + env.params[op["scale"]]) if op["scale"] else out
    if k == "softmax":
        axis, fn = op["axis"], op["fn"]
        if fn == "softmax":
            return jax.nn.softmax(a, axis=axis)
        if fn == "log_softmax":
            return jax.nn.log_softmax(a, axis=axis)
        if fn == "manual":
            e = jnp.exp(a - jnp.max(a, axis=axis, keepdims=True))
            return e / e.sum(axis=axis, keepdims=True)
        s = jax.nn.sigmoid(a)
        return s / s.sum(axis=axis, keepdims=True)
    if k == "logsumexp":
        return jax.nn.logsumexp(a, axis=op["axis"])
    if k == "var_offset":
        shifted = a + op["offset"]
        fn = jnp.var if op["fn"] == "var" else jnp.std
        return fn(shifted, axis=op["axis"], keepdims=True)
    if k == "reduce":
        axis, keep, fn = op["axis"], op["keepdims"], op["fn"]
        if fn == "prod":
            return jnp.prod(1 + 0.1 * jnp.tanh(a), axis=axis, keepdims=keep)
        if fn == "norm":
            return jnp.linalg.norm(a, axis=axis, keepdims=keep)
        return getattr(jnp, fn)(a, axis=axis, keepdims=keep)
    if k == "cumulative":
        axis, reverse, fn = op["axis"], op["reverse"], op["fn"]
        if fn == "cumsum_jnp":
            x = jnp.flip(a, axis) if reverse else a
            out = jnp.cumsum(x, axis=axis)
            return jnp.flip(out, axis) if reverse else out
        if fn == "cumprod":
            return lax.cumprod(1 + 0.1 * jnp.tanh(a), axis=axis, reverse=reverse)
        return getattr(lax, fn)(a, axis=axis, reverse=reverse)
    if k == "reshape":
        return jnp.reshape(a, op["shape"])
    if k == "transpose":
        how, perm = op["how"], op["perm"]
        if how == "transpose":
            return jnp.transpose(a, perm)
        if how == "swapaxes":
            return jnp.swapaxes(a, *perm)
        if how == "moveaxis":
            return jnp.moveaxis(a, *perm)
        return a.T
    if k == "slice":
        index = [slice(None)] * a.ndim
        index[op["axis"]] = slice(op["start"], op["stop"], op["step"])
        return a[tuple(index)]
    if k == "pad":
        axis, lo, hi = op["axis"], op["lo"], op["hi"]
        if op["mode"] == "lax_interior":
            config = [(0, 0, 0)] * a.ndim
            config[axis] = (lo, hi, 1)
            return lax.pad(a, jnp.zeros((), a.dtype), config)
        widths = [(0, 0)] * a.ndim
        widths[axis] = (lo, hi)
        return jnp.pad(a, widths, mode=op["mode"])
    if k == "concat":
        axis, n = op["axis"], op["n"]
        shape = list(a.shape)
        shape[axis] = n
        other = fit(vals[1], tuple(shape))
        if op["how"] == "concatenate":
            return jnp.concatenate([a, other], axis=axis)
        return jnp.concatenate([other, a], axis=axis)
    if k == "flip":
        return jnp.flip(a, op["axis"])
    if k == "roll":
        return jnp.roll(a, op["shift"], axis=op["axis"])
    if k == "broadcast":
        axis, n, how = op["axis"], op["n"], op["how"]
        e = jnp.expand_dims(a, axis)
        shape = a.shape[:axis] + (n,) + a.shape[axis:]
        if how == "broadcast_to":
            return jnp.broadcast_to(e, shape)
        if how == "repeat":
            return jnp.repeat(e, n, axis=axis)
        if how == "tile":
            return jnp.tile(e, tuple(n if d == axis else 1 for d in range(e.ndim)))
        return e * jnp.ones(shape, a.dtype)
    if k == "dynamic_slice":
        starts = env.data[op["starts"]]
        return lax.dynamic_slice(a, tuple(starts[i] for i in range(a.ndim)), op["sizes"])
    if k == "dynamic_update_slice":
        starts = env.data[op["starts"]]
        update = fit(vals[1], op["sizes"]).astype(a.dtype)
        return lax.dynamic_update_slice(a, update, tuple(starts[i] for i in range(a.ndim)))
    if k == "take":
        axis, count, src, how = op["axis"], op["count"], op["src"], op["how"]
        n = a.shape[axis]
        idx = _int_index(env, src, n, count, vals)
        if how == "take":
            return jnp.take(a, idx, axis=axis)
        if how == "take_clip":
            return jnp.take(a, idx + 1, axis=axis, mode="clip")
        if how == "take_fill":
            return jnp.take(a, idx * 2 - 1, axis=axis, mode="fill", fill_value=0.5)
        index = [slice(None)] * a.ndim
        index[axis] = idx
        return a[tuple(index)]
    if k == "at_get":
        idx = jnp.asarray(np.array(op["idx"], np.int32))
        if op["mode"] == "fill":
            return a.at[idx].get(mode="fill", fill_value=-0.25)
        if op["mode"] == "clip":
            return a.at[idx].get(mode="clip")
        return a.at[idx].get(mode="fill", fill_value=0.0)
    if k == "scatter":
        mode, count, src = op["mode"], op["count"], op["src"]
        idx = env.data[src[1]] if src[0] == "data" else jnp.asarray(np.array(src[1], np.int32))
        upd = fit(vals[1], (count, *a.shape[1:]))
        ref = a.at[idx]
        if mode == "add":
            return ref.add(upd)
        if mode == "set":
            return ref.set(upd)
        if mode == "max":
            return ref.max(upd)
        return ref.multiply(1 + 0.1 * jnp.tanh(upd), unique_indices=True)
    if k == "segment":
        ids = env.data[op["ids"]]
        if op["sorted"]:
            ids = jnp.sort(ids)
        fn = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max, "min": jax.ops.segment_min}[op["fn"]]
        out = fn(a, ids, op["num"], indices_are_sorted=op["sorted"])
        if op["fn"] != "sum":  # empty segments hold -inf/inf
            out = jnp.where(jnp.isfinite(out), out, 0.0)
        return out
    if k == "bincount":
        return jnp.bincount(env.data[op["ids"]], weights=jnp.ravel(a), length=op["length"])
    if k == "sort":
        how, axis = op["how"], op["axis"]
        if how == "sort":
            return jnp.sort(a, axis=axis)
        if how == "sort_descending":
            return jnp.sort(a, axis=axis, descending=True)
        return lax.sort(a, dimension=axis % a.ndim)
    if k == "top_k":
        return lax.top_k(a, op["k"])[0]
    if k == "argsort_gather":
        order = jnp.argsort(vals[1], axis=op["axis"], stable=True)
        return jnp.take_along_axis(a, order, axis=op["axis"])
    if k == "argmax_take":
        axis = op["axis"]
        idx = getattr(jnp, op["fn"])(vals[1], axis=axis, keepdims=True)
        return jnp.squeeze(jnp.take_along_axis(a, idx, axis=axis), axis)
    if k == "mask_where":
        how, c = op["how"], op["c"]
        if how == "leaky":
            return jnp.where(a > 0, a, c * a)
        rows = lax.broadcasted_iota(jnp.int32, a.shape, a.ndim - 1)
        iota_mask = (rows * 3 + op["k"]) % 4 != 0
        if how == "iota_mask":
            return jnp.where(iota_mask, a, c * a)
        key = fit(vals[1], a.shape)
        if how == "exact_mask":
            return jnp.where(key > 0, a, jnp.sin(a))
        return jnp.where((key > 0) ^ iota_mask | ~(key < -1), a, c * a)
    if k == "int_math":
        key, how, m = fit(vals[1], a.shape), op["how"], op["m"]
        if how == "count":
            n = jnp.sum(key > 0)  # an int32 count
            return a * (n % m + 1).astype(a.dtype)
        if how == "floor_mod":
            ints = jnp.floor(key * 4).astype(jnp.int32)
            return a * ((ints // 2) % m).astype(a.dtype)
        if how == "int_pow":
            ints = (jnp.abs(key) * 4).astype(jnp.int32) % m
            return a + (ints**2 - ints).astype(a.dtype) * 0.125
        if how == "bool_float":
            return a * (key > 0).astype(a.dtype) + (key <= 0)
        return a * jnp.clip(jnp.round(key).astype(jnp.int32), -1, m).astype(a.dtype)
    if k == "name":
        if env.erase:
            return a
        return jax.ad_checkpoint.checkpoint_name(a, op["name"])
    if k == "shard":
        if env.erase:
            return a
        mesh = _meshes()[op["mesh"]]
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*op["spec"]))
        return lax.with_sharding_constraint(a, sharding)
    if k == "vmap":
        (block,) = op.blocks
        fn = _blockfn(env, block)
        axis = op["axis"]
        if a.ndim == 1:  # a mapped scalar slice enters the block as shape (1,)
            inner = lambda s, *rest: fn(s[None], *rest)  # noqa: E731
        else:
            inner = fn
        in_axes = (axis,) + (None,) * (len(vals) - 1)
        return jax.vmap(inner, in_axes=in_axes, out_axes=op["out_axis"])(*vals)
    if k == "scan":
        (block,) = op.blocks
        fn = _blockfn(env, block)
        xs, init = vals

        def body(carry: Any, x: Any) -> Any:
            x = x.reshape(x.shape or (1,))
            new = 0.5 * carry + jnp.tanh(fn(carry, x)).astype(carry.dtype)
            return new, new

        carry, ys = lax.scan(body, init, xs, reverse=op["reverse"], unroll=op["unroll"])
        return ys if op["ys"] else carry
    if k == "fori":
        (block,) = op.blocks
        fn = _blockfn(env, block)
        init, rows = vals
        rows = rows.reshape(rows.shape[0], *(rows.shape[1:] or (1,)))

        def body(i: Any, carry: Any) -> Any:
            row = lax.dynamic_index_in_dim(rows, i % rows.shape[0], keepdims=False)
            return 0.5 * carry + jnp.tanh(fn(carry, row)).astype(carry.dtype)

        return lax.fori_loop(0, op["n"], body, init)
    if k == "while":
        (block,) = op.blocks
        fn = _blockfn(env, block)
        init, other = vals

        def body(state: Any) -> Any:
            i, c = state
            return i + 1, (0.5 * c + jnp.tanh(fn(c))).astype(c.dtype)

        _, c = lax.while_loop(lambda s: s[0] < op["n"], body, (jnp.int32(0), lax.stop_gradient(init)))
        return other * (1 + 0.25 * jnp.tanh(jnp.mean(c)))
    if k == "cond":
        blocks = op.blocks
        if op["pred"] == "exact":
            pred = jnp.sum(vals[2]) > 0
        else:
            pred = env.data[op["data"]][0] > 0
        return lax.cond(pred, _blockfn(env, blocks[0]), _blockfn(env, blocks[1]), a, vals[1])
    if k == "switch":
        index = jnp.argmax(jnp.ravel(vals[1])) % 3
        return lax.switch(index, [_blockfn(env, b) for b in op.blocks], a)
    if k == "remat":
        (block,) = op.blocks
        wrap = jax.checkpoint if op["how"] == "checkpoint" else jax.remat
        fn = wrap(_blockfn(env, block), policy=_policy(op["policy"]), prevent_cse=op["prevent_cse"])
        return fn(*vals)
    if k == "jit":
        (block,) = op.blocks
        kwargs = {}
        if op["out_shardings"] is not None:
            mesh = _meshes()[op["out_shardings"]]
            kwargs["out_shardings"] = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.jit(_blockfn(env, block), inline=op["inline"], **kwargs)(*vals)
    if k == "inner_autocast":  # the program itself runs a block under a policy
        (block,) = op.blocks
        # in the program's dtype again (a policy's output dtype may differ)
        return jmp_lite.autocast(_blockfn(env, block), op["policy"])(*vals).astype(a.dtype)
    if k == "custom_jvp":
        return _custom_jvp(env, op)(a)
    if k == "custom_vjp":
        return _custom_vjp(env, op)(a)
    if k == "attention":
        return _attention(env, op, a, vals[1] if len(vals) > 1 else None)
    raise ValueError(k)


def _custom_jvp(env: Env, op: Op) -> Any:
    factor = op["factor"]
    if op["how"] == "softclip":
        fn = jax.custom_jvp(_softclip)

        @fn.defjvp
        def _(primals: tuple, tangents: tuple) -> tuple:
            (x,), (t,) = primals, tangents
            return _softclip(x), t * factor / jnp.square(1 + jnp.abs(x))

        return fn
    inner = _blockfn(env, op.blocks[0])
    fn = jax.custom_jvp(inner)

    @fn.defjvp
    def _(primals: tuple, tangents: tuple) -> tuple:
        out, tan = jax.jvp(inner, primals, tangents)
        return out, tan * factor

    return fn


def _custom_vjp(env: Env, op: Op) -> Any:
    factor, how = op["factor"], op["how"]
    if how == "block":
        inner = _blockfn(env, op.blocks[0])
    elif how == "grad_scale":
        inner = lambda x: x * 1.0  # noqa: E731
    else:
        inner = jnp.tanh
    fn = jax.custom_vjp(inner)

    def fwd(x: Any) -> tuple:
        return inner(x), x

    def bwd(x: Any, g: Any) -> tuple:
        _, vjp = jax.vjp(inner, x)
        (gx,) = vjp(g)
        if how == "clip_grad":
            gx = jnp.clip(gx, -0.5, 0.5)
        return (gx * factor,)

    fn.defvjp(fwd, bwd)
    return fn


def build(program: Program, native: Any = None, erase: bool = False, fp8: Any = None) -> Any:
    """``f(params, data) -> (loss, outputs)``. ``native``: the 16-bit dtype of a native run (its
    ``precision="highest"`` contractions run in float32 as the program asks); ``erase``: the program
    with its identity ops (``checkpoint_name``, ``with_sharding_constraint``) left out; ``fp8``: a
    native fp8 run, every ``dot`` and ``linear`` op that asks no precision written as
    ``jmp_lite.fp8.dot_general`` under this recipe (a superset of the contractions an ``fp8=`` policy
    runs in fp8: those with an argument operand)."""
    rng = np.random.default_rng(program.seed + 1)
    weights = {}

    def f(params: dict, data: dict) -> tuple:
        env = Env(params, data, None if native is None else np.dtype(native), erase, fp8=fp8)
        args = [params[n] if kind == "param" else data[n] for kind, n in program.inputs]
        pool = list(args)
        for op in program.body.ops:
            pool.append(run_op(env, op, [pool[i] for i in op.args]))
        outs = tuple(pool[i] for i in program.outputs)
        loss = 0.0
        for i, out in zip(program.outputs, outs):
            if i not in weights:
                weights[i] = rng.uniform(0.5, 1.5, size=out.shape).astype(np.float32)
            # positive terms: the loss is never a cancelling sum, whose relative error would be noise
            loss = loss + jnp.mean(_const(weights[i], out) * jnp.square(out))
        return loss, outs

    return f
