"""The JAX range jmp_lite claims (``jax>=`` in pyproject.toml up to the newest release pip installs).

CI (``.ci/run``) runs the fast tier on both ends. What differs between versions goes through
``jmp_lite/_src/base/compat.py``; these tests pin down what it handles and what a newer JAX than any the suite
has seen meets: an unknown primitive, or a ``shard_map`` whose parameters moved, runs as written and warns
once (docs/autocast.md, "JAX versions").
"""

import ast
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr import eqns
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jmp_lite
from jmp_lite._src.base import compat
from jmp_lite._src.engine import decisions
from jmp_lite.amp import UnknownPrimitiveWarning

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
BF16 = np.dtype(jnp.bfloat16)
POLICY = "p=f32,c=bf16,o=f32"


def _dtypes(jaxpr, name):
    return [tuple(np.dtype(v.aval.dtype) for v in e.invars) for e in eqns(jaxpr) if e.primitive.name == name]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _mesh(*shape_names):
    shape, names = zip(*shape_names) if shape_names else ((8,), ("d",))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


# --- shard_map: its manual axes are "manual_axes" in jax 0.10.0/0.10.1, "newly_manual_axes" from 0.10.2 ---


def test_autocast_rewrites_inside_shard_map_on_every_supported_jax():
    # jax 0.10.0 and 0.10.1 raised KeyError: 'newly_manual_axes' here (the repro of issue 42, item 4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))

    def f(w, x):
        body = lambda w, x: jax.lax.psum(jnp.sum(jnp.tanh(x @ w)), "d")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())(w, x)

    w = jax.random.normal(jax.random.key(0), (4, 4)) / 2
    x = jax.random.normal(jax.random.key(1), (16, 4))
    g = jmp_lite.autocast(f, POLICY)
    assert (BF16, BF16) in _dtypes(jax.make_jaxpr(g)(w, x).jaxpr, "dot_general")
    assert _rel(g(w, x), f(w, x)) < 0.02
    assert _rel(jax.grad(g)(w, x), jax.grad(f)(w, x)) < 0.02


def test_autocast_rewrites_a_shard_map_over_some_axes_inside_another():
    # the nested case is where the two parameters differ: 0.10.2 leaves out the axes already manual
    mesh = _mesh((4, "a"), (2, "b"))

    def inner(x, w):
        return jax.lax.psum(jnp.tanh(x @ w), "b")

    def f(w, x):
        def outer(w, x):
            return jax.shard_map(inner, in_specs=(P("b"), P()), out_specs=P(), axis_names={"b"})(x, w)

        specs = {"in_specs": (P(), P("a")), "out_specs": P("a")}
        return jax.shard_map(outer, mesh=mesh, axis_names={"a"}, **specs)(w, x)

    w = jax.random.normal(jax.random.key(2), (4, 4)) / 2
    x = jax.random.normal(jax.random.key(3), (16, 4))
    calls = [e for e in eqns(jax.make_jaxpr(f)(w, x).jaxpr) if e.primitive.name == "shard_map"]
    assert [compat.shard_map_axis_names(e.params) for e in calls] == [{"a"}, {"b"}]
    g = jmp_lite.autocast(f, POLICY)
    assert (BF16, BF16) in _dtypes(jax.make_jaxpr(g)(w, x).jaxpr, "dot_general")
    assert _rel(jax.jit(g)(w, x), jax.jit(f)(w, x)) < 0.02  # jitted: jax runs nested shard_maps only so


def test_autocast_rewrites_inside_pmap_on_every_supported_jax():
    # pmap is a jit around a shard_map in jax 0.10: the same KeyError on 0.10.0 and 0.10.1
    x = jax.random.normal(jax.random.key(4), (16, 8))
    w = jax.random.normal(jax.random.key(5), (8, 8)) / 3
    f = lambda w, x: jax.pmap(lambda xb: jnp.tanh(xb @ w).sum())(x.reshape(8, 2, 8)).sum()  # noqa: E731
    g = jmp_lite.autocast(f, POLICY)
    assert (BF16, BF16) in _dtypes(jax.make_jaxpr(g)(w, x).jaxpr, "dot_general")
    assert _rel(g(w, x), f(w, x)) < 0.02


def test_a_shard_map_whose_parameters_moved_runs_as_written_and_warns_once(monkeypatch):
    # a newer jax that renames the parameter again: the shard_map runs as traced (float32), not a KeyError
    monkeypatch.setattr(compat, "SHARD_MAP_AXES_PARAMS", ("axes_of_a_future_jax",))
    decisions.WARNED.discard("shard_map")
    mesh = _mesh()

    def f(w, x):
        h = x @ w  # bfloat16 under the policy: cast back to float32 for the shard_map
        body = lambda h: jax.lax.psum(jnp.sum(jnp.tanh(h @ w)), "d")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())(h)

    w = jax.random.normal(jax.random.key(6), (4, 4)) / 2
    x = jax.random.normal(jax.random.key(7), (16, 4))
    g = jmp_lite.autocast(f, POLICY)
    with pytest.warns(UnknownPrimitiveWarning, match="shard_map.*axes_of_a_future_jax") as record:
        jaxpr = jax.make_jaxpr(g)(w, x).jaxpr
    assert sum("shard_map" in str(r.message) for r in record) == 1
    assert _dtypes(jaxpr, "dot_general")[0] == (BF16, BF16)  # outside: rewritten
    assert _dtypes(jaxpr, "shard_map") == [(np.dtype(np.float32), np.dtype(np.float32))]  # as traced
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert _rel(g(w, x), f(w, x)) < 0.02
    decisions.WARNED.discard("shard_map")


def test_shard_map_axis_names_names_the_parameters_it_knows():
    assert compat.shard_map_axis_names({"newly_manual_axes": {"d"}, "mesh": None}) == {"d"}
    assert compat.shard_map_axis_names({"manual_axes": frozenset({"a", "b"})}) == {"a", "b"}
    with pytest.raises(NotImplementedError, match=r"parameters \['jaxpr', 'mesh'\].*newly_manual_axes"):
        compat.shard_map_axis_names({"mesh": None, "jaxpr": None})


# --- a primitive of a newer JAX ------------------------------------------------------------------------

# As a JAX release adds a primitive jmp_lite's table has never seen (made here with jax.extend, as a
# library's own primitive is): it runs as written, and the first 16-bit program to reach it warns, once.
_newer_p = jcore.Primitive("jmp_lite_test_newer_jax_op")
_newer_p.def_impl(lambda x: jnp.sin(x) * 2)
_newer_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(_newer_p, mlir.lower_fun(lambda x: jnp.sin(x) * 2, multiple_results=False))
ad.defjvp(_newer_p, lambda t, x: t * jnp.cos(x) * 2)
batching.defvectorized(_newer_p)


def test_a_primitive_newer_than_the_table_runs_as_written_and_warns_once():
    name = _newer_p.name
    decisions.WARNED.discard(name)
    f = lambda w, x: jnp.sum(_newer_p.bind(x @ w) @ w.T)  # noqa: E731
    w = jax.random.normal(jax.random.key(8), (4, 3)) / 2
    x = jax.random.normal(jax.random.key(9), (5, 4))
    g = jmp_lite.autocast(f, POLICY)
    with pytest.warns(UnknownPrimitiveWarning) as record:
        value, grad = jax.jit(jax.value_and_grad(g))(w, x)
    assert [str(r.message) for r in record if name in str(r.message)] == [
        f"jmp_lite: primitive {name!r} ran as written under a bfloat16 policy (jmp_lite has no rule for it): "
        "its operands were cast back to the dtypes the program was traced with. Give it a rule, e.g. "
        f"rules={{{name!r}: 'follow'}} (runs in the dtype its operands arrive in) or 'float32', and tell "
        "jmp_lite which class it belongs to."
    ]
    jaxpr = jax.make_jaxpr(g)(w, x).jaxpr
    assert _dtypes(jaxpr, name) == [(np.dtype(np.float32),)]  # as traced: the float32 round trip shows
    assert (BF16, BF16) in _dtypes(jaxpr, "dot_general")  # the rest of the program is still rewritten
    assert _rel(value, f(w, x)) < 0.02 and _rel(grad, jax.grad(f)(w, x)) < 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per primitive: not again, eagerly or under another policy
        g(w, x)
        jmp_lite.autocast(f, "p=f32,c=f16,o=f32")(w, x)
    decisions.WARNED.discard(name)


# --- one compatibility module, one floor --------------------------------------------------------------


def test_only_compat_reaches_into_jax_internals():
    """No module of jmp_lite but compat imports jax._src or reads shard_map's axis parameters."""
    offenders = []
    for path in sorted((ROOT / "jmp_lite").rglob("*.py")):
        if path.name == "compat.py" and path.parent.name == "base":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and node.value in compat.SHARD_MAP_AXES_PARAMS:
                names = [repr(node.value)]
            if any(n.startswith("jax._src") or n.startswith("'") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {names[0]}")
    assert not offenders, "route JAX internals through jmp_lite/_src/base/compat.py:\n" + "\n".join(offenders)


def test_ci_runs_the_fast_tier_on_the_jax_floor_read_from_pyproject():
    (floor,) = re.findall(r'^\s*"jax>=([\d.]+)",', (ROOT / "pyproject.toml").read_text(), re.M)
    version = lambda v: tuple(int(p) for p in re.findall(r"\d+", v)[:3])  # noqa: E731
    assert version(jax.__version__) >= version(floor)
    ci = (ROOT / ".ci" / "run").read_text()
    assert floor not in ci, ".ci/run reads the floor from pyproject.toml; it does not repeat it"
    assert "pyproject.toml" in ci and '"jax==' in ci and '"jaxlib==' in ci


def test_compiles_inside_persistent_cache_off_skip_the_cache_that_jax_decided_to_use():
    from jax._src import compilation_cache as cc

    backend = jax.extend.backend.get_backend()
    before = cc.is_cache_used(backend)  # decided once per process: the flag alone no longer changes it
    with compat.persistent_cache_off():
        assert cc.is_cache_used(backend) is False
        assert not jax.config.jax_enable_compilation_cache
    assert cc.is_cache_used(backend) is before  # restored, whatever it was
