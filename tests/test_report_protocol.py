"""Every report of jmp_lite follows one protocol: ``table()``, ``to_dict()`` (JSON-ready) and ``str()``."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_lite
import jmp_lite.fp8
import jmp_lite.memory
from jmp_lite._src.base.reports import Report, plain

pytestmark = pytest.mark.unit


def _loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)


PARAMS = {"w": jnp.ones((8, 4)) / 8}
X = jnp.linspace(-1, 1, 32).reshape(4, 8)
POLICY = "p=f32,c=bf16,o=f32"


def _reports():
    """One instance of each report type, made by the function that returns it."""
    c = jax.jit(_loss).lower(PARAMS, X).compile()
    spec = jax.ShapeDtypeStruct(X.shape, X.dtype)
    return {
        "SkipReport": lambda: jmp_lite.SkipReport(("dense/kernel",), 2, 1, False),
        "GradientReport": lambda: jmp_lite.gradient_diagnostics(
            jax.grad(_loss)(PARAMS, X), jnp.float16, 1024.0
        ),
        "Fp8Report": lambda: jmp_lite.fp8.fp8_report(X, PARAMS["w"], recipe="hybrid,current"),
        "ResidualBytes": lambda: jmp_lite.memory.residual_bytes(jmp_lite.autocast(_loss, POLICY), PARAMS, X),
        "StateBytes": lambda: jmp_lite.memory.state_bytes(PARAMS, optax.adam(1e-3).init(PARAMS)),
        "Explanation": lambda: jmp_lite.explain(_loss, POLICY)(PARAMS, X),
        "PrecisionReport": lambda: jmp_lite.precision_report(_loss, "p=f32,c=f16,o=f32")(PARAMS, X),
        "CompiledReport": lambda: jmp_lite.memory.report_of(c),
        "Plan": lambda: jmp_lite.memory.plan(_loss, PARAMS, spec, target=None, variants=("float32", "bf16")),
    }


KINDS = ["SkipReport", "GradientReport", "Fp8Report", "ResidualBytes", "StateBytes", "Explanation",
         "PrecisionReport", "CompiledReport", "Plan"]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_every_report_has_a_table_a_dict_and_prints_its_table(kind):
    report = _reports()[kind]()
    assert type(report).__name__ == kind
    assert isinstance(report, Report)
    text = report.table()
    assert isinstance(text, str) and text and str(report) == text
    data = report.to_dict()
    assert isinstance(data, dict) and data
    json.dumps(data)  # JSON-ready: no arrays, dtypes or policies left


def test_plain_turns_arrays_tuples_and_objects_into_json_values():
    policy = jmp_lite.get_policy(POLICY)
    value = {"a": jnp.float32(2.5), "b": jnp.arange(3), "c": (1, "x"), 4: jnp.dtype("bfloat16"), "p": policy}
    expected_policy = {"param": "float32", "compute": "bfloat16", "output": "float32"}
    assert plain(value) == {"a": 2.5, "b": [0, 1, 2], "c": [1, "x"], "4": "bfloat16", "p": expected_policy}
