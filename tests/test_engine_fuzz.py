"""Differential fuzzing of the engine (issue 27): random JAX programs (tests/_fuzz_programs.py) run as
written and under ``jmp_lite.autocast``.

Properties, for every drawn program ``f(params, data) -> (loss, outputs)``, values and gradients:

* float32 policy: ``autocast(f, "f32")`` gives bitwise ``f``'s loss, outputs and ``jax.grad`` under
  ``jax.jit``; without it (fewer examples) each array is bitwise the eager program's or the jitted one's.
* 16-bit policies (``p=f32,c=bf16,o=f32`` and ``p=f32,c=f16,o=f32``, and bfloat16 on programs that start
  with attention): the error against the float32 program is within a yardstick set by the same program run
  natively in that dtype (every float argument cast to it, the program run as written):
  ``err(policy) <= C * max(err(native), FLOOR[dtype])`` per array (see ``C`` and ``FLOOR`` below), and
  where the native run is finite the policy's is too. Under bfloat16 no primitive runs in float32 for lack
  of a rule (``jmp_lite.explain``). Under ``jax.jit`` and, for bfloat16, without it.
* precision: a program whose every contraction asks ``precision="highest"`` is bitwise the same under both
  16-bit policies (the policy honours the request, the attention kernel included).
* identity ops: erasing the ``checkpoint_name`` and ``with_sharding_constraint`` calls of a program changes
  no bit of its results under a 16-bit policy (when it changes none as written).
* remat: ``remat_float32`` (the ``jax.checkpoint`` that keeps 16-bit residuals) changes no value: the loss
  and outputs of ``value_and_grad`` are those of ``remat_float32=False`` and of the plain call, up to
  ``REMAT_ULPS`` float32 ulps (``jax.checkpoint`` by itself moves values by an ulp); and
  ``recompute="wide_contractions"`` (wide contractions rebuilt in regions of their own) changes no value
  or gradient beyond the same bound.

Each check also runs on a deliberately broken engine (the last tests), where it must fail.

Programs are drawn as data; a failing one is printed twice, as the ``Program(...)`` expression hypothesis
shows (``eval`` it with ``from _fuzz_programs import *`` to rerun it, e.g. ``check_policy(p, BF16)``) and
as a readable listing (``Program.__repr__``). Programs whose float32 values are not finite, or whose
native 16-bit run is not finite, say nothing about the yardstick: they are rejected with
``hypothesis.assume`` (hypothesis fails a test that rejects too many), and ``hypothesis.event`` counts them
and the features drawn (``pytest --hypothesis-show-statistics``).

The properties are ``property`` tests: the fast tier runs them on the same derandomized programs every
time (some 30 programs, half a minute of one core); the system tier runs them again on programs drawn
with seed ``SYSTEM_SEED`` (``test_the_properties_hold_on_programs_of_another_seed``). The tests that break
the engine on purpose are ``unit`` tests of the checks. Environment (CI needs neither):

* ``JMP_LITE_FUZZ_EXAMPLES=<n>``: examples per property (the un-jitted ones run a fifth of that);
  default ``DEFAULT_EXAMPLES`` below.
* ``JMP_LITE_FUZZ_SEED=<s>``: hypothesis seed. Default: derandomized, the same examples on every run.

The nightly tier (``-m nightly``) runs every property again with seed ``SLOW_SEED`` and ``SLOW_EXAMPLES``
examples (``test_the_properties_hold_on_more_programs_with_another_seed``). A larger run:
``JMP_LITE_FUZZ_EXAMPLES=500 JMP_LITE_FUZZ_SEED=1 python -m pytest -n 0 -q -m "not nightly"
tests/test_engine_fuzz.py`` (about a minute per 100 examples of a property, more while shrinking a
failure). Known engine bugs keep the features that reach them out of the properties they break
(``KNOWN_BROKEN`` in tests/_fuzz_programs.py; empty while none is known).
"""

import os
import subprocess
import sys
import warnings

import _fuzz_programs as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from hypothesis import assume, event, given, note

import jmp_lite

pytestmark = pytest.mark.property  # the checks of the checks (broken engines, fixed programs) are unit

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
POLICIES = {BF16: "p=f32,c=bf16,o=f32", F16: "p=f32,c=f16,o=f32"}

# The yardstick, per array: err(policy) <= C * max(err(native), FLOOR[dtype]), err the relative 2-norm error
# against the float32 program. The program's inputs are exact in both runs (drawn on the 16-bit grid) and the
# policy runs every op in the compute dtype or wider, so its error is the native run's or smaller, up to
# chance: err(native) is one sample of the error that 16-bit roundings leave in that array, and where an
# array is a short, cancelling sum of a few rounded terms (a one-query attention, a gradient of a symmetric
# input) two runs' samples differ by several times. FLOOR is for arrays the native run computes exactly or
# nearly (a copy, a max, a sort): the policy still rounds a contraction's operands and result to the compute
# dtype, about one unit roundoff u each (2**-8 bfloat16, 2**-11 float16).
# Measured with this generator (946 programs, 4000 arrays: seeds 14 and 15, 300 programs each, all ops;
# seed 21, 146 programs starting with attention; current engine), the largest err(policy) / max(err(native),
# 2u) was 1.5 (bfloat16), 1.6 (float16), 1.6 (attention); the largest ratio seen in any run, 4.5, is a
# one-query attention (tq=1, tk=4) whose gradient of the value projection cancels. C = 8 keeps a margin of
# about 2 over that; the bugs this property is for (a wrong mask or kernel, an op in a narrower dtype than
# the native run, an overflow) are orders of magnitude outside it.
# A known false positive: with JMP_LITE_FUZZ_SEED=3 (100 examples) the float16 property fails on a
# two-query attention whose softmax runs over the query axis and whose output cancels (0.039 from terms
# near 0.3): loss error 0.0092 against native 0.0008 (11.5x). No op of the policy is less precise than the
# native one (its softmax runs in float32 and is rounded once), yet over 300 neighbouring inputs (each
# float moved by -1, 0 or +1 float16 ulp) its errors have the heavier tail: medians 0.0023 (policy) and
# 0.0019 (native), 95th percentiles 0.0101 and 0.0057, the ratio above 8 on 4.7% of them (loss; 0% on
# the output, the largest 5.2). Why the tail differs is not pinned down. Comparing medians over such
# neighbours would remove it, but would also let a bfloat16 policy whose adds round to float8 (only 16x
# coarser) pass the test below, so the yardstick stays as it is.
C = 8.0
FLOOR = {BF16: 2 * 2.0**-8, F16: 2 * 2.0**-11}
# An array whose norm is below 1% of the largest of its kind (loss and outputs, or gradients) is judged in
# absolute terms, against 1% of the largest norm: a gradient that cancels to nearly zero (a symmetric input)
# keeps the roundings of the terms it cancelled, whose size is set by the larger arrays around it.
RELATIVE_TO_LARGEST = 1e-2

DEFAULT_EXAMPLES = {  # the fast tier's, about 25 s of one core in all (the system tier runs 6 each, seeded)
    "f32": 5,
    "f32_eager": 2,
    "bf16": 4,
    "f16": 3,
    "bf16_attention": 2,
    "eager16": 1,
    "identity": 2,
    "remat": 3,
    "highest": 2,
    "fp8": 3,
}
_N = os.environ.get("JMP_LITE_FUZZ_EXAMPLES")
_SEED = os.environ.get("JMP_LITE_FUZZ_SEED")


def fuzz(prop):
    """hypothesis settings of a property: its example count (or the environment's), one seed."""
    count = DEFAULT_EXAMPLES[prop]
    if _N is not None:
        count = max(1, int(_N) // 5) if prop.endswith("eager") or prop == "eager16" else int(_N)
    return fp.fuzz_settings(count, None if _SEED is None else int(_SEED))


# Op kinds some properties aim at: the 16-bit contractions, and the float32 ops that read their results.
CONTRACTIONS = ("dot", "attention", "linear", "conv")
# (identity ops between a contraction and an elementwise op: a float32 round trip there changes bits)
CONTRACTIONS_AND_ELEMENTWISE = ("linear", "unary", "dot", "binary", "scalar", "attention", "conv")
FLOAT32_OPS = ("var_offset", "layernorm", "softmax", "logsumexp", "scalar", "unary")


def covered(program):
    """Prints the program readably with a failing example; counts its features
    (``pytest --hypothesis-show-statistics``)."""
    note(repr(program))
    for feature in sorted(program.features):
        event(feature)


def reject(why):
    """Rejects the example (``hypothesis.assume``), counted by reason."""
    event(f"rejected: {why}")
    assume(False)


def off(prop):
    """The generator features left out of ``prop`` for known engine bugs (fp.KNOWN_BROKEN)."""
    return frozenset(f for features, props, _ in fp.KNOWN_BROKEN.values() if prop in props for f in features)


def run(f, params, data, jit=True):
    """``((loss, outputs), grads)`` of ``f`` with respect to ``params``."""
    fn = jax.value_and_grad(f, has_aux=True)
    out = (jax.jit(fn) if jit else fn)(params, data)
    return jax.block_until_ready(out)


def call(f, params, data):
    """``[loss, *outputs]`` of the jitted plain call (no ``grad``), as numpy arrays."""
    loss, outs = jax.jit(f)(params, data)
    return [np.asarray(loss), *map(np.asarray, outs)]


def split(out):
    """(values: [loss, *outputs], gradients) as lists of numpy arrays."""
    (loss, outs), grads = out
    values = [np.asarray(loss), *map(np.asarray, outs)]
    return values, [np.asarray(g) for g in jax.tree.leaves(grads)]


def assert_bitwise(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, a.shape, b.dtype, b.shape)
        if a.tobytes() != b.tobytes():
            flat_a, flat_b = a.reshape(-1), b.reshape(-1)
            first = next(k for k in range(a.size) if flat_a[k].tobytes() != flat_b[k].tobytes())
            raise AssertionError(
                f"{what}[{i}] differs bitwise at flat index {first}: got {flat_a[first]!r}, want "
                f"{flat_b[first]!r} (max |diff| {np.max(np.abs(a.astype(np.float64) - b)):.3g})"
            )


def finite(arrays):
    return all(np.isfinite(a.astype(np.float64)).all() for a in arrays)


def errors(got, want):
    """Per array: ``||got - want|| / max(||want||, RELATIVE_TO_LARGEST * largest ||want||)`` (0 if equal)."""
    want64 = [b.astype(np.float64) for b in want]
    norms = [np.linalg.norm(b) for b in want64]
    largest = max(norms, default=0.0)
    out = []
    for a, b, n in zip(got, want64, norms):
        diff = np.linalg.norm(a.astype(np.float64) - b)
        out.append(0.0 if diff == 0 else diff / max(n, RELATIVE_TO_LARGEST * largest, 1e-30))
    return out


def check_yardstick(got, native, want, dtype, what, c=C, floor=None):
    """Per array: ``err(got) <= c * max(err(native), floor)`` (``floor``: ``FLOOR[dtype]``)."""
    floor = FLOOR[dtype] if floor is None else floor
    e_got, e_native = errors(got, want), errors(native, want)
    bad = [(i, g, n) for i, (g, n) in enumerate(zip(e_got, e_native)) if not g <= c * max(n, floor)]
    assert not bad, (
        f"{what}: policy error beyond {c} x max(native error, {floor:.3g}) for (array, policy error, "
        f"native error) {[(i, f'{g:.3g}', f'{n:.3g}') for i, g, n in bad]}"
    )


def references(program, dtype, fp8=None):
    """The float32 program's results and the native ``dtype`` run's (its contractions in fp8 under the
    recipe ``fp8``); rejects programs where either is not finite (the yardstick then says nothing)."""
    params, data = fp.inputs(program)
    want = split(run(fp.build(program), params, data))
    if not finite(want[0] + want[1]):
        reject("float32 program not finite")
    native_args = fp.cast_floats((params, data), dtype)
    try:
        native = split(run(fp.build(program, native=dtype, fp8=fp8), *native_args))
    except (ValueError, jax.errors.JaxRuntimeError) as e:
        # jax.nn.dot_product_attention asks XLA:CPU for dot algorithms it lacks in 16 bits (float16 at
        # any size, bfloat16 at some tiny ones): no native run to compare with
        if not any(m in str(e) for m in ("is not supported by dot_general on CPU", "ALG_DOT_BF16_BF16_F32")):
            raise
        reject(f"no native {dtype} run on this backend")
    if not finite(native[0] + native[1]):
        reject(f"native {dtype} run not finite")
    return (params, data), want, native


def check_policy(program, dtype, jit=True, rules=False):
    (params, data), want, native = references(program, dtype)
    if rules:  # every primitive the program uses has a rule: none is run in float32 for lack of one
        explanation = jmp_lite.explain(fp.build(program), POLICIES[dtype])(params, data)
        unknown = sorted({e.primitive for e in explanation.events if "has no rule" in e.reason})
        assert not unknown, f"primitives without a rule (a float32 round trip): {unknown}"
    got = split(run(jmp_lite.autocast(fp.build(program), POLICIES[dtype]), params, data, jit=jit))
    assert all(a.dtype == F32 for a in got[0] + got[1]), [a.dtype for a in got[0] + got[1]]
    assert finite(got[0] + got[1]), "the native run is finite, the policy's is not"
    check_yardstick(got[0], native[0], want[0], dtype, "loss and outputs")
    check_yardstick(got[1], native[1], want[1], dtype, "gradients")


# --- float32 policy: bitwise the program ---


def check_float32_bitwise(program, jit):
    params, data = fp.inputs(program)
    f = fp.build(program)
    want = split(run(f, params, data, jit=jit))
    got = split(run(jmp_lite.autocast(f, "f32"), params, data, jit=jit))
    if not jit:
        # Outside jit, autocast runs the program it compiled (engine.transform), also under an eager
        # jax.grad: each array is, bit for bit, the eager program's, the jitted step's, or that of the
        # program jitted and differentiated eagerly.
        # Under an eager jax.grad the compiled program is differentiated as a jitted call is: its
        # forward and backward compile apart, and XLA may fuse each differently from the whole step.
        jitted = split(run(f, params, data))
        called = split(run(jax.jit(f), params, data, jit=False))
        want = [
            [next((r for r in refs if r.tobytes() == g.tobytes()), refs[0]) for g, *refs in zip(*k)]
            for k in zip(got, want, jitted, called)
        ]
    assert_bitwise(got[0], want[0], "loss and outputs")
    assert_bitwise(got[1], want[1], "gradients")


@fuzz("f32")
@given(fp.programs(off=off("f32")))
def test_float32_policy_is_bitwise_the_program_under_jit(program):
    covered(program)
    check_float32_bitwise(program, jit=True)


def broken(prop):
    """A mark for a property that a known engine bug breaks whatever the program (an entry of
    fp.KNOWN_BROKEN with no features): expected to fail until the bug is fixed."""
    why = [
        f"{bug}: {text}"
        for bug, (features, props, text) in fp.KNOWN_BROKEN.items()
        if prop in props and not features
    ]
    return pytest.mark.xfail(bool(why), reason="; ".join(why), strict=False)


@broken("f32_eager")
@fuzz("f32_eager")
@given(fp.programs(off=off("f32") | off("f32_eager"), max_ops=4))
def test_float32_policy_is_bitwise_the_program_without_jit(program):
    covered(program)
    check_float32_bitwise(program, jit=False)


# --- 16-bit policies: within the native yardstick ---


@pytest.mark.parametrize(
    ("dtype", "focus"),
    [(BF16, ()), (F16, ()), (BF16, ("attention",))],
    ids=["bf16", "f16", "bf16-attention"],
)
def test_16bit_policy_is_within_the_native_yardstick_under_jit(dtype, focus):
    prop = ("bf16" if dtype == BF16 else "f16") + ("_attention" if focus else "")

    @fuzz(prop)
    @given(fp.programs(off=off(prop.split("_")[0]), focus=focus, max_ops=6 if not focus else 2))
    def check(program):
        covered(program)
        check_policy(program, dtype, rules=dtype == BF16)

    check()


@fuzz("eager16")
@given(fp.programs(off=off("eager16"), max_ops=4, focus=CONTRACTIONS))
def test_bfloat16_policy_is_within_the_native_yardstick_without_jit(program):
    covered(program)
    check_policy(program, BF16, jit=False)


# --- fp8 contractions: within the native fp8 yardstick ---

# The fp8 policy: the bfloat16 policy with ``fp8=``, so that every contraction reading an argument (a
# parameter, or data: autocast cannot tell them apart) runs as ``jmp_lite.fp8.dot_general``. Its yardstick
# is the program run natively in bfloat16 with every ``dot`` and ``linear`` op written as that contraction
# (a superset of the policy's: an activation times an activation stays 16-bit under the policy). Attention
# is left out: its projections are einsums of the generator's kernel that the native run keeps 16-bit.
# Measured (60 programs, seed 1, "hybrid,current"): err(policy) / max(err(native), 2**-5) at most 1.06 for
# values and 1.24 for gradients; with no floor the ratio reached 4.5 (a gradient that fp8 roundings happen
# to leave nearly exact in the native run). The floor 2**-5 is half of e4m3's unit roundoff; C_FP8 = 4
# keeps a margin of 3. A missing or doubled descale (a power of two), a transposed operand or a wrong
# scale are errors of order 1, outside it.
FP8_RECIPES = ("hybrid,current", "hybrid,block")
C_FP8, FLOOR_FP8 = 4.0, 2.0**-5
ATTENTION = frozenset(f for f in fp.FEATURES if f.startswith("attention")) | {"attention"}


def check_fp8(program, recipe):
    (params, data), want, native = references(program, BF16, fp8=recipe)
    f = jmp_lite.autocast(fp.build(program), POLICIES[BF16], fp8=recipe)
    got = split(run(f, params, data))
    assert all(a.dtype == F32 for a in got[0] + got[1]), [a.dtype for a in got[0] + got[1]]
    assert finite(got[0] + got[1]), "the native fp8 run is finite, the policy's is not"
    check_yardstick(got[0], native[0], want[0], BF16, "fp8: loss and outputs", C_FP8, FLOOR_FP8)
    check_yardstick(got[1], native[1], want[1], BF16, "fp8: gradients", C_FP8, FLOOR_FP8)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_policy_is_within_the_native_fp8_yardstick_under_jit(recipe):
    @fuzz("fp8")
    @given(fp.programs(off=off("fp8") | ATTENTION | {"inner_autocast"}, focus=("dot", "linear")))
    def check(program):
        covered(program)
        check_fp8(program, recipe)

    check()


@fuzz("highest")
@given(fp.programs(off=off("highest"), highest=True, focus=("attention", "dot", "linear", "conv")))
def test_a_program_asking_precision_highest_everywhere_is_bitwise_under_16bit_policies(program):
    covered(program)
    check_highest(program)


def check_highest(program):
    """Every contraction asks ``precision="highest"``, which the policy honours (float32): nothing is left
    for the policy to run in 16 bits, the attention kernel included."""
    params, data = fp.inputs(program)
    f = fp.build(program)
    want = split(run(f, params, data))
    called = call(f, params, data)
    # a row with every key masked by -inf: NaN in one compiled program, finite garbage in another
    if not finite(want[0] + want[1] + called):
        reject("float32 program not finite")
    for dtype in (BF16, F16):
        got = split(run(jmp_lite.autocast(f, POLICIES[dtype], remat_float32=False), params, data))
        assert_bitwise(got[0], want[0], f"{dtype} loss and outputs")
        assert_bitwise(got[1], want[1], f"{dtype} gradients")
        # the 16-bit policy's jax.checkpoint (with nothing 16-bit to keep) may move a value by an ulp
        got = split(run(jmp_lite.autocast(f, POLICIES[dtype]), params, data))
        assert_close_in_ulps(got[0] + got[1], want[0] + want[1], f"{dtype} with remat_float32")
    # the fp8 pass with nothing to do (no contraction may run in fp8) leaves the program as it is
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jmp_lite.fp8.NoFp8ContractionWarning)
        fp8 = jmp_lite.autocast(f, POLICIES[BF16], fp8="hybrid,current", remat_float32=False)
        got = split(run(fp8, params, data))
    assert_bitwise(got[0], want[0], "fp8: loss and outputs")
    assert_bitwise(got[1], want[1], "fp8: gradients")


# --- identity ops and remat change nothing ---


@fuzz("identity")
@given(fp.programs(off=off("identity"), focus=CONTRACTIONS_AND_ELEMENTWISE, sprinkle=("name", "shard")))
def test_erasing_identity_ops_changes_no_decision_under_a_16bit_policy(program):
    covered(program)
    check_identity_ops(program)


IDENTITY_PRIMITIVES = ("sharding_constraint", "name")


def decisions(program, erase, params, data):
    """What the engine emits for the program under the bfloat16 policy (its backward pass is JAX's
    derivative of that): each equation's primitive and operand and result types, identity ops left out."""
    f = jmp_lite.autocast(fp.build(program, erase=erase), POLICIES[BF16])
    jaxpr = jax.make_jaxpr(f)(params, data).jaxpr
    return [
        (e.primitive.name, tuple(str(v.aval) for v in e.invars), tuple(str(v.aval) for v in e.outvars))
        for e in eqns(jaxpr)
        if e.primitive.name not in (*IDENTITY_PRIMITIVES, "reshard")  # (JAX's, around a constraint)
    ]


def check_identity_ops(program):
    params, data = fp.inputs(program)
    # each identity op returns the dtype it is given (no float32 round trip), wherever it sits (inside a
    # nested autocast the inner policy decided, as written)
    explanation = jmp_lite.explain(fp.build(program), POLICIES[BF16])(params, data)
    changed = [
        (e.primitive, e.ran, e.outputs)
        for e in explanation.events
        if e.primitive in IDENTITY_PRIMITIVES and e.mode != "as_written"
    ]
    assert all(ran == out for _, ran, out in changed), f"identity ops that changed a dtype: {changed}"
    # and changes no decision of the engine: the same program, op for op and dtype for dtype
    same_program = decisions(program, False, params, data) == decisions(program, True, params, data)
    if not same_program and "inner_autocast" in program.features:
        # A nested autocast casts its inputs to its compute dtype where they are used, an identity op
        # too; erased, a block that only annotates returns its input uncast (a policy's semantics)
        reject("identity ops are the only use of a nested policy's input")
    assert same_program, "identity ops changed what the engine emits"
    plain = [split(run(fp.build(program, erase=erase), params, data)) for erase in (False, True)]
    # values: only where the program as written is bitwise the same without them (XLA may partition a
    # sharded program's sums differently)
    kept, erased = plain[0][0] + plain[0][1], plain[1][0] + plain[1][1]
    same = all(a.tobytes() == b.tobytes() for a, b in zip(kept, erased))
    if not same:
        reject("identity ops change bits of the program as written")
    kept, erased = (
        split(run(jmp_lite.autocast(fp.build(program, erase=erase), POLICIES[BF16]), params, data))
        for erase in (False, True)
    )
    if "shard" in program.features:
        # A sharding constraint bounds XLA's fusions, and XLA skips 16-bit roundings inside a fusion
        # (--xla_allow_excess_precision, on by default): the same ops may round once more or less.
        for what, got, want in (("loss and outputs", kept[0], erased[0]), ("gradients", kept[1], erased[1])):
            bad = [(i, e) for i, e in enumerate(errors(got, want)) if e > C * FLOOR[BF16]]
            assert not bad, f"{what}: constraints moved (array, relative difference) {bad}"
        return
    assert_bitwise(kept[0], erased[0], "loss and outputs")
    assert_bitwise(kept[1], erased[1], "gradients")


@fuzz("remat")
@given(fp.programs(off=off("remat"), focus=CONTRACTIONS + FLOAT32_OPS))
def test_remat_float32_changes_no_value(program):
    covered(program)
    check_remat(program)


# remat_float32 may move a float32 value by an ulp or two, no more: jax.checkpoint alone does (XLA fuses the
# checkpointed forward pass differently: a float32 layer norm's loss is 0.9175083 under value_and_grad with
# it, 0.9175085 without, in plain JAX), and so does the engine's (a single bfloat16 matmul's loss, 3.284183
# against 3.2841825: issue 27's report). A value that moves by more (a 16-bit rounding, a wrong value) fails.
# 0 makes the check bitwise.
REMAT_ULPS = 8


def assert_close_in_ulps(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        # a NaN (a row with every key masked by -inf) or an infinity is the same in both, where it is
        special = ~np.isfinite(b64)
        assert (
            np.array_equal(a64[special], b64[special], equal_nan=True) and np.isfinite(a64[~special]).all()
        ), f"{what}[{i}]: not finite in different places"
        a64, b64 = a64[~special], b64[~special]
        scale = float(np.max(np.abs(b64))) if b64.size else 0.0
        bound = REMAT_ULPS * float(np.finfo(np.float32).eps) * scale
        diff = float(np.max(np.abs(a64 - b64))) if b64.size else 0.0
        assert diff <= bound, (
            f"{what}[{i}]: differs by {diff:.3g}, more than {REMAT_ULPS} ulps of {scale:.3g}"
        )


def check_remat(program):
    params, data = fp.inputs(program)
    f = fp.build(program)
    policy = POLICIES[BF16]
    remat = split(run(jmp_lite.autocast(f, policy), params, data))
    plain = split(run(jmp_lite.autocast(f, policy, remat_float32=False), params, data))
    called = call(jmp_lite.autocast(f, policy), params, data)
    assert_close_in_ulps(remat[0], called, "values of value_and_grad against the plain call")
    assert_close_in_ulps(remat[0], plain[0], "values with remat_float32 against without")
    rebuilt = split(run(jmp_lite.autocast(f, policy, recompute="wide_contractions"), params, data))
    assert_close_in_ulps(rebuilt[0], remat[0], "values with recompute against without")
    assert_close_in_ulps(rebuilt[1], remat[1], "gradients with recompute against without")


# --- each check fails on a deliberately broken engine ---

LINEAR = ("linear", (0,), {"w": "w1", "b": None, "how": "matmul"})
LINEAR_ADD = fp.program(
    {"w0": (4, 3), "w1": (3, 5)},
    [
        LINEAR,
        ("binary", (1, 1), {"fn": "add", "from_axis": 1}),
        ("layernorm", (2,), {"kind": "layer", "scale": None}),
    ],
)
LINEAR_SHARD_TANH = fp.program(
    {"w0": (4, 3), "w1": (3, 5)},
    [LINEAR, ("shard", (1,), {"mesh": "mesh1", "spec": (None, None)}), ("unary", (2,), {"fn": "tanh"})],
)
LINEAR_NORM = fp.program(
    {"w0": (4, 3), "w1": (3, 5)}, [LINEAR, ("layernorm", (1,), {"kind": "layer", "scale": None})]
)


def break_engine(monkeypatch, change):
    """The engine with ``change(original, eqn, args, ctx) -> outputs`` in place of its per-equation rule."""
    from jmp_lite._src.engine import dtype_rules

    original = dtype_rules.evaluate_equation
    monkeypatch.setattr(
        dtype_rules, "evaluate_equation", lambda eqn, args, ctx: change(original, eqn, args, ctx)
    )


def rounded(xs, dtype):
    return [x.astype(dtype).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]


@pytest.mark.unit
def test_a_float32_policy_whose_adds_round_to_bfloat16_is_not_bitwise(monkeypatch):
    check_float32_bitwise(LINEAR_ADD, jit=True)
    broken = lambda original, eqn, args, ctx: (  # noqa: E731
        rounded(original(eqn, args, ctx), BF16) if eqn.primitive.name == "add" else original(eqn, args, ctx)
    )
    break_engine(monkeypatch, broken)
    with pytest.raises(AssertionError, match="differs bitwise"):
        check_float32_bitwise(LINEAR_ADD, jit=True)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_a_policy_whose_adds_round_to_float8_is_outside_the_yardstick(monkeypatch, dtype):
    check_policy(LINEAR_ADD, dtype)
    fp8 = np.dtype(jnp.float8_e4m3fn)
    broken = lambda original, eqn, args, ctx: (  # noqa: E731
        rounded(original(eqn, args, ctx), fp8) if eqn.primitive.name == "add" else original(eqn, args, ctx)
    )
    break_engine(monkeypatch, broken)
    with pytest.raises(AssertionError, match="policy error beyond"):
        check_policy(LINEAR_ADD, dtype)


@pytest.mark.unit
def test_a_sharding_constraint_that_runs_in_float32_changes_bits(monkeypatch):
    from jmp_lite._src.engine import decisions

    check_identity_ops(LINEAR_SHARD_TANH)
    broken = lambda original, eqn, args, ctx: (  # noqa: E731  (the engine before 24d42a8: as written)
        decisions.as_written(eqn, args)
        if eqn.primitive.name == "sharding_constraint"
        else original(eqn, args, ctx)
    )
    break_engine(monkeypatch, broken)
    with pytest.raises(AssertionError, match="identity ops (that changed a dtype|changed what the engine)"):
        check_identity_ops(LINEAR_SHARD_TANH)


@pytest.mark.unit
def test_a_remat_that_changes_values_is_found(monkeypatch):
    from jmp_lite._src.engine import engine

    check_remat(LINEAR_NORM)

    class RoundingCheckpoint:
        """The engine's ``jax``, with a ``jax.checkpoint`` whose results are rounded to bfloat16."""

        def __getattr__(self, name):
            return getattr(jax, name)

        @staticmethod
        def checkpoint(fun, **kwargs):
            inner = jax.checkpoint(fun, **kwargs)
            return lambda *xs: rounded(inner(*xs), BF16)

    monkeypatch.setattr(engine, "jax", RoundingCheckpoint())
    with pytest.raises(AssertionError, match="with remat_float32 against without.*more than"):
        check_remat(LINEAR_NORM)


FP8_LINEAR = fp.program(
    {"w0": (4, 16), "w1": (16, 8)},
    [("linear", (0,), {"w": "w1", "b": None, "how": "matmul"}), ("unary", (1,), {"fn": "tanh"})],
)


@pytest.mark.unit
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_an_fp8_contraction_that_forgets_half_its_descale_is_outside_the_yardstick(monkeypatch, recipe):
    from jmp_lite._src.engine import fp8_contract

    check_fp8(FP8_LINEAR, recipe)
    original = fp8_contract.contract
    monkeypatch.setattr(fp8_contract, "contract", lambda *a, **k: original(*a, **k) * 2)
    with pytest.raises(AssertionError, match="fp8: loss and outputs: policy error beyond"):
        check_fp8(FP8_LINEAR, recipe)


@pytest.mark.unit
def test_known_broken_entries_name_generator_features_and_properties():
    for bug, (features, props, why) in fp.KNOWN_BROKEN.items():
        assert set(features) <= fp.FEATURES, (bug, set(features) - fp.FEATURES)
        assert set(props) <= set(fp.ALL_PROPERTIES), (bug, set(props) - set(fp.ALL_PROPERTIES))
        assert why, bug


SLOW_EXAMPLES, SLOW_SEED = 50, 20261128
SYSTEM_EXAMPLES, SYSTEM_SEED = 6, 20261206


def _properties_with(examples, seed):
    """The file's property tests again, in a process of their own, on ``examples`` programs per property
    drawn with ``seed``."""
    env = {**os.environ, "JMP_LITE_FUZZ_EXAMPLES": str(examples), "JMP_LITE_FUZZ_SEED": str(seed)}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "property and not scale", __file__]
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]


@pytest.mark.scale
def test_the_properties_hold_on_programs_of_another_seed():
    _properties_with(SYSTEM_EXAMPLES, SYSTEM_SEED)


@pytest.mark.scale
@pytest.mark.nightly
def test_the_properties_hold_on_more_programs_with_another_seed():
    _properties_with(SLOW_EXAMPLES, SLOW_SEED)
