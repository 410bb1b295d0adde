"""precision_report, suggest_rules and jmp-lite doctor (issue 21): the two float16 failures of
tests/_precision_cases.py fail for the stated reason, the report finds the cause, and its rules fix it."""

import functools
import json
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _jaxpr import eqns
from _precision_cases import F16, ResidualMLP, SensorTransformer, data, train, xent
from flax import nnx

import jmp_lite
import jmp_lite.flax.nnx as jnnx
from jmp_lite.flax.linen import apply_policy

pytestmark = pytest.mark.unit

STEPS = 20
ATTENTION = "SensorTransformer/PostNormBlock_0/MultiHeadDotProductAttention_0"


def _fractions(m: jmp_lite.doctor.Measurements) -> np.ndarray:
    return np.stack(
        [np.asarray(m.overflow), np.asarray(m.underflow), np.asarray(m.subnormal), np.asarray(m.nonfinite)]
    )


def _attention(q, k, v):
    logits = jnp.einsum("bqd,bkd->bqk", q, k)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(logits, axis=-1), v)


def _small_loss(w, x):
    """Two named scopes: an attention (logits, softmax) and a dense layer."""
    with jax.named_scope("attn"):
        h = _attention(x @ w, x @ w, x)
    with jax.named_scope("dense"):
        return jnp.mean(jnp.tanh(h @ w))


def _inputs(scale=1.0):
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k1, (8, 8), jnp.float32) / 8**0.5
    return w, scale * jax.random.normal(k2, (4, 6, 8), jnp.float32)


@functools.cache
def _small_report(policy: str) -> jmp_lite.PrecisionReport:
    """``precision_report(_small_loss, policy)(*_inputs())``: a report compiles for seconds, so the tests
    that measure this function under the same policy share one."""
    return jmp_lite.precision_report(_small_loss, policy)(*_inputs())


# --- the two failures of the issue --------------------------------------------------------------


def _transformer():
    model = SensorTransformer()
    x, y = data((256, 8, 16))
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params, x, y):
        return xent(model.apply({"params": params}, x), y)

    return loss, params, x, y


@pytest.mark.numerics
def test_a_attention_logits_past_float16_are_found_and_kept_in_float32():
    loss, params, x, y = _transformer()
    # jmp_lite keeps a softmax in float32 by default (exp is a float32 op, and logits that only float32 ops
    # read keep their float32 accumulator), so this model is fine under the plain float16 policy:
    default = jmp_lite.precision_report(loss, F16)(params, x, y)
    logits = default.names.index(f"{ATTENTION} [logits]")
    assert default.groups[logits].dtypes == "float32" and float(default.activations.nonfinite.max()) == 0
    # A model written for float16 by hand takes the softmax in float16: exp follows its float16 operands.
    hand_written = {"exp": "follow"}
    losses, skipped = train(jmp_lite.autocast(loss, F16, rules=hand_written), params, x, y, STEPS,
                            jmp_lite.DynamicLossScale(2.0**15))  # fmt: skip
    assert skipped == STEPS and all(
        math.isnan(v) for v in losses
    )  # the forward pass is NaN: every step skipped

    report = jax.jit(jmp_lite.precision_report(loss, F16, rules=hand_written, loss_scale=2.0**15))(
        params, x, y
    )
    assert report.ranking()[:2] == [f"{ATTENTION} [logits]", f"{ATTENTION} [softmax]"]
    first = report.names.index(report.ranking()[0])
    assert float(report.activations.max_abs[first]) > 65504 and float(report.activations.overflow[first]) > 0
    assert float(report.activations.headroom_bits[first]) < 0 and math.isnan(float(report.loss[1]))

    suggestion = jmp_lite.suggest_rules(report)
    assert suggestion.added == {"scope:MultiHeadDotProductAttention_0": "float32"}
    assert suggestion.rules == {**hand_written, **suggestion.added}
    assert "overflow float16" in suggestion.reasons[0] and "threshold" in suggestion.reasons[0]
    low, high = suggestion.loss_scale
    fixed_report = jmp_lite.precision_report(loss, F16, rules=suggestion.rules)(params, x, y)
    assert (
        float(fixed_report.activations.overflow.max()) == 0
        and float(fixed_report.activations.nonfinite.max()) == 0
    )

    reference, _ = train(jmp_lite.autocast(loss, "f32"), params, x, y, STEPS)
    static = jmp_lite.StaticLossScale(math.sqrt(low * high))  # the middle of the suggested range
    fixed, skipped = train(jmp_lite.autocast(loss, F16, rules=suggestion.rules), params, x, y, STEPS, static)
    assert skipped == 0 and reference[-1] < 0.95 * reference[0]  # it learns
    assert abs(fixed[-1] - reference[-1]) < 0.01 * reference[-1]


def _step(loss_fn, tx, x, y, params, state):
    loss, grads = jmp_lite.value_and_grad(loss_fn)(state, params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def _train_each(loss_fn, params, x, y, steps, scales):
    """``train(loss_fn, params, x, y, steps, scale)`` for each scale, one compiled step per kind of loss
    scale (``train`` compiles one per call): a scale's value is optimizer state, an argument."""
    compiled, results = {}, []
    for scale in scales:
        tx = jmp_lite.loss_scaling(optax.adam(3e-3), scale)  # train's optimizer
        step = compiled.setdefault(type(scale), jax.jit(functools.partial(_step, loss_fn, tx, x, y)))
        p, state, losses = params, tx.init(params), []
        for _ in range(steps):
            p, state, loss = step(p, state)
            losses.append(float(loss))
        results.append((losses, int(state.skipped_total)))
    return results


@pytest.mark.numerics
def test_b_residual_block_past_float16_is_named_and_loss_scaling_cannot_fix_it():
    module = ResidualMLP()
    x, y = data((256, 16))
    params = apply_policy(module, "f32").init(jax.random.key(0), x)["params"]
    model = apply_policy(module, F16)

    def loss_of(m):
        return lambda p, x, y: xent(m.apply({"params": p}, x), y)

    scales = (
        jmp_lite.DynamicLossScale(2.0**15),
        jmp_lite.StaticLossScale(2.0**8),
        jmp_lite.StaticLossScale(1.0),
    )
    for scale, (losses, skipped) in zip(scales, _train_each(loss_of(model), params, x, y, 5, scales)):
        assert skipped == 5 and all(math.isnan(v) for v in losses), scale  # forward overflow: no scale helps

    report = jmp_lite.precision_report(model.apply, loss=lambda out: xent(out, y))({"params": params}, x)
    assert report.ranking()[0] == "block_0 [ops]"  # the gate * up product of the unnormalized block
    overflowing = [n for n in report.names if float(report.activations.overflow[report.names.index(n)]) > 0]
    assert overflowing and all(n.startswith("block_0") for n in overflowing)
    suggestion = jmp_lite.suggest_rules(report)
    assert suggestion.rules == suggestion.added == {"block_0": "float32"}
    assert len(suggestion.reasons) == 2 and suggestion.reasons[0].startswith("block_0 [ops] -> 'block_0'")

    reference, _ = train(loss_of(apply_policy(module, "f32")), params, x, y, STEPS)
    low, high = suggestion.loss_scale
    static = jmp_lite.StaticLossScale(math.sqrt(low * high))
    fixed, skipped = train(loss_of(apply_policy(module, F16, suggestion.rules)), params, x, y, STEPS, static)
    assert skipped == 0 and reference[-1] < 0.9 * reference[0]
    assert abs(fixed[-1] - reference[-1]) < 0.01 * reference[-1]


# --- what the report measures -------------------------------------------------------------------


def test_float32_policy_is_all_zeros_and_its_errors_exactly_zero():
    w, x = _inputs()
    measure = jmp_lite.precision_report(_small_loss, "f32")
    for fun in (measure, jax.jit(measure)):  # one report, called and under jit
        report = fun(w, x)
        assert not _fractions(report.activations).any() and not _fractions(report.gradients).any()
        assert float(report.activations.error.max()) == 0.0 and float(report.gradients.error.max()) == 0.0
        assert float(report.loss[0]) == float(report.loss[1])
        assert {g.dtypes for g in report.groups} == {"float32"}
        assert jmp_lite.suggest_rules(report).added == {}


@pytest.mark.numerics
@pytest.mark.parametrize("policy", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"])
def test_healthy_model_reports_no_overflow(policy):
    report = _small_report(policy)  # shared with the tests below (under jit: the float32 test above)
    assert float(report.activations.overflow.max()) == 0 and float(report.gradients.overflow.max()) == 0
    assert float(report.activations.nonfinite.max()) == 0 and float(report.gradients.nonfinite.max()) == 0
    error = np.asarray(report.activations.error)
    assert 0 < error.max() < (0.05 if "bf16" in policy else 0.01)  # 16-bit rounding, measured against float32
    assert "bfloat16" in "".join(g.dtypes for g in report.groups) or "bf16" not in policy
    suggestion = jmp_lite.suggest_rules(report)
    assert suggestion.added == {}
    if "bf16" in policy:
        assert suggestion.loss_scale[0] == 1.0 and "NoOpLossScale" in suggestion.reasons[-1]


@pytest.mark.composition
def test_healthy_linen_model_in_bfloat16_has_no_overflow():
    module = ResidualMLP()
    x, y = data((64, 16))
    x = x / 300.0  # readings already normalized: no block sees large values
    params = apply_policy(module, "f32").init(jax.random.key(0), x)["params"]
    model = apply_policy(module, "p=f32,c=bf16,o=f32")
    report = jmp_lite.precision_report(model.apply, loss=lambda out: xent(out, y))({"params": params}, x)
    assert float(report.activations.overflow.max()) == 0 and float(report.gradients.overflow.max()) == 0
    assert {g.kind for g in report.groups} >= {"matmul", "ops", "params"}
    assert "block_1/up [params]" in report.names  # a Linen model's parameters, per module
    assert jmp_lite.suggest_rules(report).added == {}


def test_logits_and_softmax_are_their_own_groups_and_gradients_are_cotangents():
    w, x = _inputs()
    report = _small_report(F16)
    names = report.names
    assert {"attn [matmul]", "attn [logits]", "attn [softmax]", "dense [matmul]", "arg0 [argument]"} <= set(
        names
    )
    # the cotangent at the dense layer's output is d mean(tanh(h))/dh = (1 - tanh^2) / size
    h = _attention(x @ w, x @ w, x) @ w
    expected = float(jnp.max(jnp.abs(1 - jnp.tanh(h) ** 2)) / h.size)
    got = float(report.gradients.max_abs[names.index("dense [matmul]")])
    assert got == pytest.approx(expected, rel=1e-6)
    scaled = jmp_lite.precision_report(_small_loss, F16, loss_scale=jmp_lite.StaticLossScale(2.0**10))(w, x)
    assert float(scaled.gradients.max_abs[names.index("dense [matmul]")]) == pytest.approx(
        2**10 * expected, rel=1e-6
    )
    assert float(scaled.loss_scale) == 2.0**10


def test_underflow_and_loss_scale_range():
    def loss(w, x):
        with jax.named_scope("tiny"):
            return jnp.sum((x @ w) @ w) * 1e-9  # cotangents about 1e-9: below float16's 2^-24 (6e-8)

    w, x = _inputs()
    report = jmp_lite.precision_report(loss, F16)(w, x[0])
    row = report.names.index("tiny [matmul]")  # the first product is float16, the second feeds a float32 sum
    assert report.groups[row].dtypes == "float16+float32"
    assert float(report.gradients.underflow[row]) == 0.5 and float(report.gradients.nonfinite[row]) == 0
    assert float(report.gradients.overflow.max()) == 0 and float(report.activations.underflow.max()) == 0
    assert report.ranking()[:3] == ["arg0 [argument]", "arg1 [argument]", "tiny [matmul]"]  # underflow first
    suggestion = jmp_lite.suggest_rules(report)
    low, high = suggestion.loss_scale
    assert suggestion.added == {} and 1 < low < high == 2.0**24  # the recommended scale is capped at 2^24
    assert f"loss scale in [2^{int(np.log2(low))}, 2^24]" in suggestion.reasons[-1]
    scaled = jmp_lite.precision_report(loss, F16, loss_scale=low)(w, x[0])
    assert float(scaled.gradients.underflow.max()) == 0 and float(scaled.gradients.overflow.max()) == 0


@pytest.mark.composition  # with a JAX transformation or another front-end
def test_report_under_jit_scan_and_as_a_logged_pytree():
    def loss(w, x):
        def body(h, _):
            return jnp.tanh(h @ w), None

        with jax.named_scope("loop"):
            h, _ = jax.lax.scan(body, x, None, length=3)
        return jnp.mean(h**2)

    w, x = _inputs()
    fun = jmp_lite.precision_report(loss, "p=f32,c=bf16,o=f32")

    @jax.jit
    def step(w, x):
        return w - 0.1 * jax.grad(jmp_lite.autocast(loss, "p=f32,c=bf16,o=f32"))(w, x), fun(w, x)

    w2, report = step(w, x[0])
    assert "loop [ops]" in report.names  # the scan is one operation
    leaves = jax.tree_util.tree_leaves(report)
    assert all(isinstance(a, jax.Array) for a in leaves) and len(leaves) == 28  # 2 x 11 measurements + 6
    logged = json.loads(report.to_json())
    assert logged["groups"][0]["name"] == report.ranking()[0] and logged["policy"] == "p=f32,c=bf16,o=f32"
    assert set(logged["groups"][0]["gradients"]) >= {"max_abs", "underflow", "error", "noise", "abs_error"}
    again = jax.tree_util.tree_map(np.asarray, report)  # the tree rebuilds with its static groups
    assert again.names == report.names and "loop [ops]" in report.table(top=None)
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda w, x: fun(w, x).ranking())(w, x[0])


@pytest.mark.composition
def test_nnx_view_rules_are_module_paths():
    class Gated(nnx.Module):
        def __init__(self, rngs):
            self.gate, self.up = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(8, 16, rngs=rngs)
            self.down = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return x + self.down(self.gate(x) * self.up(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Gated(rngs), Gated(rngs)])
            self.norms = nnx.List([nnx.LayerNorm(8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs)])

        def __call__(self, x):
            for block, norm in zip(self.blocks, self.norms):
                x = norm(block(x))
            return x.sum(-1)

    model = Model(nnx.Rngs(0))
    x, _ = data((32, 8))
    report = jmp_lite.precision_report(jnnx.apply_policy(model, F16), loss=jnp.mean)(x)
    assert report.ranking()[0] == "blocks/0 [ops]" and "norms/0 [ops]" in report.names
    suggestion = jmp_lite.suggest_rules(report)
    assert suggestion.added == {"blocks/0": "float32"}
    # the suggestion itself goes where its rules go (it was refused: "rules must be a mapping")
    fixed = jmp_lite.precision_report(jnnx.apply_policy(model, F16, rules=suggestion), loss=jnp.mean)(x)
    assert float(fixed.activations.nonfinite.max()) == 0


def test_a_suggestion_is_accepted_as_rules_by_autocast_and_linen():
    suggestion = jmp_lite.RuleSuggestion({"exp": "float32"}, {"exp": "float32"}, None, (), "autocast")
    f = lambda x: jnp.exp(x).sum()  # noqa: E731
    x = jnp.ones(4)
    assert (
        jmp_lite.explain(f, F16, rules=suggestion)(x).events
        == jmp_lite.explain(f, F16, rules=suggestion.rules)(x).events
    )
    linen = jmp_lite.RuleSuggestion({nn.Dense: "f32"}, {nn.Dense: "f32"}, None, (), "linen")
    variables = nn.Dense(3).init(jax.random.key(0), x)

    def matmul_dtypes(rules):
        jaxpr = jax.make_jaxpr(apply_policy(nn.Dense(3), F16, rules=rules).apply)(variables, x).jaxpr
        return [str(v.aval.dtype) for e in eqns(jaxpr) if e.primitive.name == "dot_general" for v in e.invars]

    assert matmul_dtypes(None) == ["float16", "float16"]
    assert matmul_dtypes(linen) == matmul_dtypes(linen.rules) == ["float32", "float32"]


@pytest.mark.composition
def test_fp8_recipe_is_measured_against_float32():
    w, x = _inputs()
    report = jmp_lite.precision_report(_small_loss, "p=f32,c=bf16,o=f32", fp8="hybrid")(w, x)
    plain = _small_report("p=f32,c=bf16,o=f32")
    row = report.names.index("dense [matmul]")  # reads the argument w: an fp8 contraction
    assert report.source.fp8 is not None and float(report.activations.nonfinite.max()) == 0
    assert float(report.activations.error[row]) > float(plain.activations.error[row])


def test_errors_name_what_was_wrong():
    w, x = _inputs()
    with pytest.raises(TypeError, match="needs a policy"):
        jmp_lite.precision_report(_small_loss)
    with pytest.raises(TypeError, match="floating scalar"):
        jmp_lite.precision_report(lambda w, x: x @ w, F16)(w, x)
    with pytest.raises(ValueError, match="not a JAX primitive"):
        jmp_lite.precision_report(_small_loss, F16, rules={"expp": "float32"})
    model = apply_policy(nn.Dense(3), F16)
    with pytest.raises(ValueError, match="its own policy"):
        jmp_lite.precision_report(model.apply, "bf16")
    with pytest.raises(ValueError, match="rules are apply_policy's"):
        jmp_lite.precision_report(model.apply, rules={"exp": "float32"})
    with pytest.raises(ValueError, match="fp8 recipe is apply_policy's"):
        jmp_lite.precision_report(model.apply, fp8="hybrid")
    with pytest.raises(TypeError, match="PrecisionReport"):
        jmp_lite.suggest_rules({"groups": []})
    with pytest.raises(ValueError, match=r"fraction in \[0, 1\)"):
        jmp_lite.suggest_rules(_small_report(F16), underflow=1.5)
    with pytest.raises(TypeError, match="hashable"):
        jmp_lite.precision_report(lambda w, x, opts: _small_loss(w, x), F16)(w, x, {1, 2})


# --- the command --------------------------------------------------------------------------------


@pytest.mark.e2e
def test_doctor_on_a_target_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "W = jnp.full((16, 16), 100.0, jnp.float32)\n"
        "def loss(batch):\n"
        "    with jax.named_scope('big'):\n"
        "        h = (batch @ W) * (batch @ W)\n"
        "    return jnp.mean(jnp.tanh(h))\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report.json"
    assert jmp_lite.doctor.main(["--target", "my_model:loss", "--shape", "8,16", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "precision report: autocast, policy p=f32,c=f16,o=f32" in text
    assert "big [ops]" in text and "{'scope:big': 'float32'}" in text
    assert json.loads(out.read_text())["groups"][0]["name"] == "big [ops]"
    from jmp_lite.cli import main as cli

    assert (
        cli(["doctor", "--target", "my_model:loss", "--shape", "8,16", "--policy", "f32", "--top", "2"]) == 0
    )
    assert "suggested rules for autocast(fun, policy, rules=...): {}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs --shape"):
        jmp_lite.doctor.main(["--target", "my_model:loss"])
    with pytest.raises(SystemExit, match="has no attribute"):
        jmp_lite.doctor.main(["--target", "my_model:nothing", "--shape", "2"])
    with pytest.raises(SystemExit, match="give --target MODULE:FUNCTION"):
        jmp_lite.doctor.main([])  # the demo's model is the command line's default, not the library's


@pytest.mark.e2e
def test_doctor_on_the_demo_model(capsys):
    from jmp_lite import cli

    assert cli.main(["doctor", "--batch-size", "1024", "--top", "5"]) == 0
    text = capsys.readouterr().out
    assert "the demo's model at initialization" in text and "precision report: linen" in text
    assert "loss scale in [2^" in text  # float16 without loss scaling: the gradients underflow


def test_rules_outside_any_scope_are_primitive_names_autocast_takes():
    """An offending group at the root that is not a contraction gets a rule per primitive it ran, each a
    name ``autocast`` accepts, and the rules fix it."""

    def loss(w, x):
        return jnp.mean(jnp.tanh((x @ w) * (x @ w)))  # 400 * 400 past float16's 65504, in no scope

    w, x = jnp.full((4, 4), 100.0, jnp.float32), jnp.ones((2, 4), jnp.float32)
    suggestion = jmp_lite.suggest_rules(jmp_lite.precision_report(loss, F16)(w, x))
    assert "mul" in suggestion.added and all(v == "float32" for v in suggestion.added.values())
    assert "named_scope" in suggestion.reasons[0]
    fixed = jmp_lite.precision_report(jmp_lite.autocast(loss, F16, rules=suggestion.rules), "f32")(w, x)
    assert np.isfinite(float(jmp_lite.autocast(loss, F16, rules=suggestion.rules)(w, x)))
    assert float(fixed.activations.overflow.max()) == 0


@pytest.mark.composition
def test_a_flax_models_fp8_recipe_is_named_in_the_report():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))

    x = jnp.ones((2, 4))
    model = apply_policy(Net(), "p=f32,c=bf16,o=f32", fp8="hybrid,current")
    variables = model.init(jax.random.key(0), x)
    report = jmp_lite.precision_report(model.apply, loss=lambda y: jnp.mean(y**2))(variables, x)
    assert report.source.fp8 == str(jmp_lite.get_fp8_recipe("hybrid,current"))
    assert report.source.fp8 in report.to_json() and report.source.fp8 in report.table()


@pytest.mark.composition
def test_fp8_scaling_state_of_a_linen_model_is_not_ranked_as_arguments():
    """A Linen model's delayed-scaling states (``variables["fp8"]``: amax histories, scales) are not
    values a 16-bit run rounds: they get no rows (their 'gradients' are the observed amaxes, which
    float32's run has not, so their error read inf and they ranked first); the summary says so."""
    model = apply_policy(nn.Dense(2), "p=f32,c=bf16,o=f32", fp8="hybrid,delayed")
    x = jax.random.normal(jax.random.key(0), (4, 8))
    variables = model.init(jax.random.key(1), x)
    report = jmp_lite.precision_report(model.apply, loss=lambda out: jnp.mean(out**2))(variables, x)
    assert not [n for n in report.names if "fp8" in n]
    assert np.isfinite(np.asarray(report.gradients.error)).all()
    assert " [params]" in " ".join(report.names)  # the kernel's own row stays
    assert report.source.fp8_states == 3  # one state (the kernel's) of 3 arrays
    assert "fp8 scaling state (3 arrays" in report.table() and report.to_dict()["fp8_states"] == 3


_CLOSED_OVER = """
import jax, jax.numpy as jnp, optax
k1, k2 = jax.random.split(jax.random.key(0))
PARAMS = {"w1": jax.random.normal(k1, (16, 64)) / 4, "w2": jax.random.normal(k2, (64, 4)) / 8}
Y = jnp.zeros((256,), jnp.int32)

def loss_fn(params, batch):
    h = jax.nn.relu(batch @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], Y).mean()

def loss(batch):  # the doctor's target: the parameters closed over
    return loss_fn(PARAMS, batch)
"""


@pytest.mark.e2e
def test_doctor_measures_closed_over_parameters_and_its_loss_scale_range_trains(
    tmp_path, monkeypatch, capsys
):
    """``jmp-lite doctor --target mod:loss`` with the parameters closed over (docs/doctor.md allows it):
    their gradients are measured too (rows ``[closed over]``), so no scale of the suggested range makes
    every float16 step skip (it measured only the activations' cotangents, and suggested up to 2^24,
    where every step's parameter gradients overflow)."""
    (tmp_path / "closed_model.py").write_text(_CLOSED_OVER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert jmp_lite.doctor.main(["--target", "closed_model:loss", "--shape", "256,16", "--top", "0"]) == 0
    text = capsys.readouterr().out
    assert "PARAMS/w1 [closed over]" in text
    low, high = (int(e) for e in re.search(r"loss scale between 2\^(\d+) and 2\^(\d+)", text).groups())
    import closed_model as m

    batch = jax.random.normal(jax.random.key(0), (256, 16))  # the doctor's batch (--seed 0)
    f = jmp_lite.autocast(m.loss_fn, F16)

    @jax.jit
    def skipped(scale):  # 3 float16 steps with a static loss scale: how many were skipped
        tx = jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.StaticLossScale(scale))

        def step(_, carry):
            params, state = carry
            _, grads = jmp_lite.value_and_grad(f)(state, params, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        _, state = jax.lax.fori_loop(0, 3, step, (m.PARAMS, tx.init(m.PARAMS)))
        return jmp_lite.get_loss_scaling_state(state).skipped_total

    assert int(skipped(2.0**30)) == 3  # the model does skip every step at a large enough scale
    for log2 in (low, high):  # but at neither end of the suggested range
        assert int(skipped(2.0**log2)) < 3, f"every step skipped at 2^{log2} (range 2^{low}..2^{high})"


@pytest.mark.composition
def test_equinox_linear_layers_of_two_instances_get_rows_of_their_own():
    """The fast case of the test below: ``eqx.nn.Linear`` (its own named scope) in two instances of one
    class, told apart by the path of the parameters each call reads."""
    eqx = pytest.importorskip("equinox")

    class Gate(eqx.Module):
        up: eqx.nn.Linear

        def __init__(self, key):
            self.up = eqx.nn.Linear(4, 4, key=key)

        def __call__(self, x):
            return x * jax.vmap(self.up)(x)

    gates = [Gate(k) for k in jax.random.split(jax.random.key(0), 2)]
    x = jax.random.normal(jax.random.key(1), (3, 4))
    report = jmp_lite.precision_report(lambda x: jnp.mean(gates[1](gates[0](x)) ** 2), F16)(x)
    for i in (0, 1):
        row = report.names.index(f"gates[{i}].up (eqx.nn.Linear) [matmul]")  # closed over as `gates`
        assert report.groups[row].path == "eqx.nn.Linear" and float(report.activations.count[row]) == 3 * 4
        assert f"gates/{i}/up/weight [closed over]" in report.names


@pytest.mark.composition
def test_equinox_instances_of_one_class_get_rows_of_their_own():
    """Equinox layers open a named scope per class (``eqx.nn.MultiheadAttention``), so two attention
    blocks shared one row: each instance now has its own, named by its path in the model (the common
    path of the parameters its call reads), while the row's ``path`` stays the scope its rules name."""
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        attn: eqx.nn.MultiheadAttention

        def __init__(self, key):
            self.attn = eqx.nn.MultiheadAttention(1, 4, key=key)

        def __call__(self, x):
            return x + self.attn(x, x, x)

    class Model(eqx.Module):
        blocks: list

        def __init__(self, key):
            self.blocks = [Block(k) for k in jax.random.split(key, 2)]

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model, x = Model(jax.random.key(0)), jax.random.normal(jax.random.key(1), (3, 4))
    report = jmp_lite.precision_report(lambda model, x: jnp.mean(model(x) ** 2), F16)(model, x)
    for i in (0, 1):
        logits = report.names.index(f"arg0.blocks[{i}].attn (eqx.nn.MultiheadAttention) [logits]")
        assert report.groups[logits].path == "eqx.nn.MultiheadAttention"
        assert report.groups[logits].instance == f"arg0.blocks[{i}].attn"
        assert float(report.activations.count[logits]) == 3 * 3  # one block's logits: T x T (one head)
        assert f"arg0.blocks[{i}].attn.query_proj (eqx.nn.Linear) [matmul]" in report.names
    assert not [n for n in report.names if n.startswith("eqx.nn.")]  # no row merges the two
    assert any(g["instance"] for g in json.loads(report.to_json())["groups"])


def test_arrays_closed_over_by_a_jitted_function_are_lifted_and_inside_a_loop_refuse_a_range():
    """Arrays closed over by a jitted function are lifted (its call is bound again, taking them); one
    closed over inside a loop body cannot be: the report says which, and no loss scale range is
    suggested (it would ignore that parameter's gradients)."""
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    v = jax.random.normal(jax.random.key(1), (8, 8)) / 3
    inner = jax.jit(lambda x: jnp.tanh(x @ w))
    looped = jax.jit(lambda x: jnp.tanh(x @ v))

    def loss(x):
        h, _ = jax.lax.scan(lambda c, _: (looped(c), None), inner(x), None, length=2)
        return jnp.mean(h**2)

    report = jmp_lite.precision_report(loss, F16)(jnp.ones((4, 8)))
    assert "w [closed over]" in report.names and not [n for n in report.names if n.startswith("v ")]
    assert report.source.unmeasured == ("v float32[8, 8]",) and "not measured: 1" in report.table()
    suggestion = jmp_lite.suggest_rules(report)
    assert suggestion.loss_scale is None and "pass the parameters as arguments" in suggestion.reasons[-1]


@pytest.mark.composition
def test_an_nnx_views_report_suggests_no_loss_scale_range_without_its_parameters_gradients():
    """An NNX view's parameters are not arguments of the report: their gradients are not measured, so
    a range from the activations' cotangents alone (up to 2^23 here, where the parameters' gradients,
    up to 0.87, overflow float16 and every step skips) is not suggested; the reason says how."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.inp, self.out = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 4, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.inp(x)))

    def xent(out):
        return optax.softmax_cross_entropy_with_integer_labels(out, jnp.zeros(1024, jnp.int32)).mean()

    x = jax.random.normal(jax.random.key(0), (1024, 16))
    report = jmp_lite.precision_report(jnnx.apply_policy(Net(nnx.Rngs(0)), F16), loss=xent)(x)
    suggestion = jmp_lite.suggest_rules(report)
    assert suggestion.loss_scale is None and "nnx.split(model)" in suggestion.reasons[-1]


@pytest.mark.composition
def test_an_nnx_view_with_dropout_is_reported_and_its_rng_counts_stay_put():
    """The report runs the view inside its own jit and vjp, where NNX refuses writes to the model
    (TraceContextError before): its variants do not write back, so the model's RNG counts stay as they
    were, and the float32 and 16-bit runs draw the same dropout masks."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.inp, self.out = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(jax.nn.gelu(self.inp(x))))

    net = Net(nnx.Rngs(0))
    counts = jax.tree_util.tree_leaves(nnx.state(net, nnx.RngCount))
    view = jnnx.apply_policy(net, "p=f32,c=bf16,o=f32")
    report = jmp_lite.precision_report(view, loss=lambda out: jnp.mean(out**2))(jnp.ones((4, 8)))
    loss = report.to_dict()["loss"]
    assert report.ranking() and math.isfinite(loss["float32"]) and math.isfinite(loss["checked"])
    assert jax.tree_util.tree_leaves(nnx.state(net, nnx.RngCount)) == counts
    view(jnp.ones((4, 8)))  # a plain call still advances them
    assert jax.tree_util.tree_leaves(nnx.state(net, nnx.RngCount)) != counts
