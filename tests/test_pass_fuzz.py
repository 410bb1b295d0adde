"""Differential fuzzing of the program rewrites other than the dtype rules (issue 41): random programs
(tests/_fuzz_programs.py) through the interpreter and through sharded training.

Properties, for every drawn program ``f(params, data) -> (loss, outputs)``:

* the interpreter with nothing to do: ``interpret.evaluate`` with a hook that changes no equation gives,
  bitwise, ``f``'s loss, outputs and ``jax.grad`` under ``jax.jit`` (every rewrite is a hook of that loop);
* FSDP with nothing to change: ``jmp_lite.distributed.fsdp`` on two devices under the float32 policy (every
  float input a parameter, sharded where it splits, gathered where read, its gradient reduce-scattered)
  gives the loss and the gradients of ``f`` up to float32 roundings (``FSDP_FLOAT32_ERROR``: halving and
  summing two equal halves is exact, but XLA fuses the program inside ``shard_map`` otherwise);
* the precision report (its observer pass and its evaluator of lifted constants) under the float32
  policy: every measured error exactly zero, its loss the program's (up to the roundings of XLA fusing
  the report's one program otherwise);
* FSDP under a 16-bit policy: the sharded step's loss and gradients are within the yardstick of the
  unsharded ``autocast`` step (``err(sharded) <= C * max(err(unsharded), FLOOR)`` against the float32
  program, as tests/test_engine_fuzz.py defines it); with fp8 contractions too (``autocast(fp8=...,
  mesh=...)`` against the unsharded fp8 step, within the fp8 yardstick).

The fast tier runs ``FAST_EXAMPLES`` derandomized programs per property; the system tier
(``test_the_pass_properties_hold_on_more_programs``) ``SYSTEM_EXAMPLES`` more with seed ``SYSTEM_SEED``.
``JMP_LITE_FUZZ_EXAMPLES`` and ``JMP_LITE_FUZZ_SEED`` set both, as for the engine's fuzzer.
"""

import os

import _fuzz_programs as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from test_engine_fuzz import (
    BF16,
    C_FP8,
    F16,
    FLOOR_FP8,
    POLICIES,
    C,
    assert_bitwise,
    check_yardstick,
    errors,
    finite,
    reject,
    run,
    split,
)

import jmp_lite
from jmp_lite._src import interpret

pytestmark = pytest.mark.property  # the checks of the checks (a broken interpreter or gather) are unit

FAST_EXAMPLES = 2
SYSTEM_EXAMPLES = 25
SYSTEM_SEED = 41
# sharding annotations of the drawn programs name meshes of 8 devices: not inside a 2-device shard_map
UNSHARDABLE = frozenset({"shard", "shard_8", "jit_shardings"})
_N, _SEED = os.environ.get("JMP_LITE_FUZZ_EXAMPLES"), os.environ.get("JMP_LITE_FUZZ_SEED")


def fuzz(count, seed=None):
    """``count`` examples (derandomized) or ``seed``'s, unless the environment says otherwise."""
    count = int(_N) if _N is not None else count
    seed = int(_SEED) if _SEED is not None else seed
    return fp.fuzz_settings(count, seed)


def interpreted(f, params, data):
    """``f`` traced to a jaxpr and evaluated again by the interpreter, every equation bound as written."""
    closed, shape = jax.make_jaxpr(f, return_shape=True)(params, data)
    tree = jax.tree.structure(shape)

    def g(p, d):
        leaves = jax.tree.leaves((p, d))
        return jax.tree.unflatten(
            tree, interpret.evaluate(closed.jaxpr, closed.consts, leaves, lambda *_: None)
        )

    return g


def check_interpreter(program):
    params, data = fp.inputs(program)
    f = fp.build(program)
    want = split(run(f, params, data))
    got = split(run(interpreted(f, params, data), params, data))
    assert_bitwise(got[0], want[0], "loss and outputs")
    assert_bitwise(got[1], want[1], "gradients")


def _loss_of_everything(program):
    """``(loss(everything), everything)``: the program's loss of one pytree holding its parameters and its
    float data (sharded training's parameters); integer data (indices) is closed over."""
    params, data = fp.inputs(program)
    f = fp.build(program)
    ints = {k: v for k, v in data.items() if not jnp.issubdtype(v.dtype, jnp.floating)}

    def loss(everything):
        return f(everything["params"], {**everything["data"], **ints})[0]

    return loss, {"params": params, "data": {k: v for k, v in data.items() if k not in ints}}


def _mesh():
    return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])


def _step(loss, everything):
    value, grads = jax.jit(jax.value_and_grad(loss))(everything)
    return [np.asarray(value)], [np.asarray(g) for g in jax.tree.leaves(grads)]


# FSDP's float32 step is the program up to float32 roundings: XLA fuses the program inside shard_map
# otherwise (measured: 1 ulp on a gradient, seed 7), while a gather in bfloat16 moves values by 2**-9
FSDP_FLOAT32_ERROR = 2.0**-17


def check_fsdp_float32(program):
    loss, everything = _loss_of_everything(program)
    want = _step(loss, everything)
    if not finite(want[0] + want[1]):
        reject("float32 program not finite")
    got = _step(jmp_lite.distributed.fsdp(loss, _mesh(), axis="data", policy="f32"), everything)
    for what, g, w in (("loss", got[0], want[0]), ("gradients", got[1], want[1])):
        for i, (a, b) in enumerate(zip(g, w)):
            assert a.dtype == b.dtype and a.shape == b.shape, (what, i)
        bad = [(i, e) for i, e in enumerate(errors(g, w)) if not e <= FSDP_FLOAT32_ERROR]
        assert not bad, f"{what}: sharded float32 step off the program by (array, relative error) {bad}"


def check_fsdp_policy(program, dtype, fp8=None):
    """``fp8``: a recipe; then both steps run fp8 contractions (``autocast(fp8=..., mesh=...)`` sharded)
    and the yardstick is the fp8 one of tests/test_engine_fuzz.py."""
    loss, everything = _loss_of_everything(program)
    want = _step(loss, everything)
    if not finite(want[0] + want[1]):
        reject("float32 program not finite")
    unsharded = _step(jmp_lite.autocast(loss, POLICIES[dtype], fp8=fp8), everything)
    if not finite(unsharded[0] + unsharded[1]):
        reject(f"unsharded {dtype} policy not finite")
    if fp8 is None:
        sharded = jmp_lite.distributed.fsdp(loss, _mesh(), axis="data", policy=POLICIES[dtype])
        c, floor = C, None
    else:
        sharded = jmp_lite.autocast(loss, POLICIES[dtype], fp8=fp8, mesh=_mesh(), fsdp_axis="data")
        c, floor = C_FP8, FLOOR_FP8
    got = _step(sharded, everything)
    assert finite(got[0] + got[1]), "the unsharded step is finite, the sharded one is not"
    check_yardstick(got[0], unsharded[0], want[0], dtype, "loss (sharded against unsharded)", c, floor)
    check_yardstick(got[1], unsharded[1], want[1], dtype, "gradients (sharded against unsharded)", c, floor)


@fuzz(FAST_EXAMPLES)
@given(fp.programs())
def test_the_interpreter_with_nothing_to_do_is_the_program_bitwise(program):
    note(repr(program))
    check_interpreter(program)


def check_report_float32(program):
    """The precision report (its observer pass and its own evaluator of lifted constants) under the float32
    policy: every measured error exactly zero, both runs' losses equal, and the program's loss up to the
    float32 roundings of another fusion (the report compiles both runs and their gradients as one program)."""
    params, data = fp.inputs(program)
    f = fp.build(program)
    want = float(jax.jit(f)(params, data)[0])
    report = jmp_lite.precision_report(lambda p, d: f(p, d)[0], "f32")(params, data)
    assert float(report.activations.error.max()) == 0.0, "activations"
    assert float(report.gradients.error.max()) == 0.0, "gradients"
    assert float(report.loss[0]) == float(report.loss[1])
    np.testing.assert_allclose(float(report.loss[0]), want, rtol=1e-5)


@fuzz(FAST_EXAMPLES)
@given(fp.programs())
def test_the_precision_report_under_the_float32_policy_measures_no_error(program):
    note(repr(program))
    check_report_float32(program)


@fuzz(FAST_EXAMPLES)
@given(fp.programs(off=UNSHARDABLE))
def test_fsdp_under_the_float32_policy_is_the_program(program):
    note(repr(program))
    check_fsdp_float32(program)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_fsdp_under_a_16bit_policy_is_within_the_yardstick_of_the_unsharded_step(dtype):
    @fuzz(FAST_EXAMPLES)
    @given(fp.programs(off=UNSHARDABLE))
    def prop(program):
        note(repr(program))
        check_fsdp_policy(program, dtype)

    prop()


def test_fsdp_with_fp8_contractions_is_within_the_fp8_yardstick_of_the_unsharded_step():
    @fuzz(FAST_EXAMPLES)
    @given(fp.programs(off=UNSHARDABLE | {"inner_autocast"}, focus=("dot", "linear")))
    def prop(program):
        note(repr(program))
        check_fsdp_policy(program, BF16, fp8="hybrid,current")

    prop()


@pytest.mark.scale
def test_the_pass_properties_hold_on_more_programs():
    @fuzz(SYSTEM_EXAMPLES, SYSTEM_SEED)
    @given(fp.programs())
    def interpreter(program):
        note(repr(program))
        check_interpreter(program)

    @fuzz(SYSTEM_EXAMPLES, SYSTEM_SEED)
    @given(fp.programs(off=UNSHARDABLE))
    def sharded(program):
        note(repr(program))
        check_fsdp_float32(program)
        check_fsdp_policy(program, BF16)
        check_fsdp_policy(program, F16)
        if "inner_autocast" not in program.features:  # (a nested policy has no fp8 of its own)
            check_fsdp_policy(program, BF16, fp8="hybrid,current")

    @fuzz(SYSTEM_EXAMPLES, SYSTEM_SEED)
    @given(fp.programs())
    def report(program):
        note(repr(program))
        check_report_float32(program)

    interpreter()
    sharded()
    report()


@pytest.mark.unit
def test_the_interpreter_check_sees_a_hook_that_changes_an_equation(monkeypatch):
    """The bitwise check fails for an interpreter whose tanh rounds to bfloat16."""
    program = fp.Program(
        params=(("w0", (4,), 1.0),),
        floats=(),
        ints=(),
        int_values=(),
        inputs=(("param", "w0"),),
        body=fp.Block(
            n_in=1, ops=(fp.Op(kind="unary", args=(0,), attrs=(("fn", "tanh"),), blocks=()),), out=1
        ),
        outputs=(1,),
        seed=3,
    )
    check_interpreter(program)
    real = interpret.evaluate

    def rounding(jaxpr, consts, args, equation, **kw):
        def hook(i, eqn, env):
            outs = interpret.bind(eqn, [env.read(v) for v in eqn.invars])
            if eqn.primitive.name == "tanh":
                outs = [o.astype(jnp.bfloat16).astype(o.dtype) for o in outs]
            return outs

        return real(jaxpr, consts, args, hook, **kw)

    monkeypatch.setattr(interpret, "evaluate", rounding)
    with pytest.raises(AssertionError, match="differs bitwise"):
        check_interpreter(program)


@pytest.mark.unit
def test_the_fsdp_checks_see_a_gather_that_rounds(monkeypatch):
    """The FSDP checks fail when a gathered parameter is rounded to bfloat16 (float32 policy) or comes back
    without its last shard (zeros in its place; 16-bit policy)."""
    from jmp_lite._src.parallel import fsdp

    program = fp.Program(
        params=(("w0", (4, 6), 0.5),),
        floats=(("x0", (3, 4)),),
        ints=(),
        int_values=(),
        inputs=(("float", "x0"),),
        body=fp.Block(
            n_in=1,
            ops=(fp.Op("linear", (0,), (("w", "w0"), ("b", None), ("how", "matmul"), ("precision", None))),),
            out=1,
        ),
        outputs=(1,),
        seed=5,
    )
    check_fsdp_float32(program)
    check_fsdp_policy(program, BF16)
    real = fsdp._Gathers.full

    def rounded(self, held):
        y = real(self, held)
        return y.astype(jnp.bfloat16).astype(y.dtype)

    def missing_a_shard(self, held):
        y = real(self, held)
        if held.dim is None:
            return y
        keep = jnp.arange(y.shape[held.dim]) < y.shape[held.dim] // 2
        return jnp.where(keep.reshape([-1 if d == held.dim else 1 for d in range(y.ndim)]), y, 0)

    monkeypatch.setattr(fsdp._Gathers, "full", rounded)
    with pytest.raises(AssertionError):
        check_fsdp_float32(program)
    monkeypatch.setattr(fsdp._Gathers, "full", missing_a_shard)
    with pytest.raises(AssertionError, match="policy error beyond"):
        check_fsdp_policy(program, BF16)
