"""Fully sharded data parallelism with the collective dtypes chosen, not left to the compiler.

``fsdp(fun, mesh, axis=..., policy=...)`` runs ``fun(params, *batch)`` with every parameter sharded along
one mesh axis and the batch split along it (ZeRO-3, Rajbhandari et al., 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models"; PyTorch's FSDP). Inside, each sharded
parameter is all-gathered in the gather dtype (the policy's compute dtype by default: the cast comes
before the gather, so the wire carries 16 bits), and its gradient comes back reduce-scattered in
``reduce_dtype`` (float32 by default), sharded like the parameter, so an optimizer updates 1/N of the
state on each device. A parameter that cannot be split evenly (a bias, a norm scale, a dimension the
axis size does not divide) is replicated; its gradient is all-reduced in ``reduce_dtype`` too. A
lookup of whole rows of a sharded table (an embedding, ``table[ids]``) gathers no table where the
rows asked for are fewer bytes than the table: each device looks up every device's ids in its own
shard, and one all-to-all (column shards) or reduce-scatter (row shards) hands each device its rows
(``_looked_up``).

Both collectives are written in the program (``shard_map`` with ``all_gather`` and ``psum_scatter``
under a ``custom_vjp``), so the lowered program states their dtypes. XLA:CPU then computes a 16-bit
all-gather in float32 in its compiled code; a GPU's compiled program keeps it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as jax_primitives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_lite._src import interpret, primitive_rules
from jmp_lite._src.base import dtypes as _dtypes
from jmp_lite._src.base import validate
from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine

__all__ = ["FsdpLayout", "fsdp", "fsdp_layout", "shard_params"]


class FsdpLayout(NamedTuple):
    """How ``fsdp`` lays out one parameter: ``dim``, the dimension split over the axis (``None``:
    replicated), and ``why`` a replicated parameter is not split.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.distributed import fsdp_layout
        >>> fsdp_layout(jnp.ones(3), jax.make_mesh((1,), ("data",)), "data")
        FsdpLayout(dim=None, why='fewer than 2 dimensions (a bias or a norm scale)')
    """

    dim: int | None
    why: str = ""


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _layout(x: Any, n: int) -> FsdpLayout:
    # a jax.ShapeDtypeStruct (jax.eval_shape's parameters) is laid out as the array it stands for
    floating = _is_abstract(x) and jnp.issubdtype(x.dtype, jnp.floating)
    if not (floating or _dtypes.is_floating_array(x)):
        return FsdpLayout(None, "not a floating array")
    if np.ndim(x) < 2:
        return FsdpLayout(None, "fewer than 2 dimensions (a bias or a norm scale)")
    shape = np.shape(x)
    # 3 or more dimensions: a leading one may stack layers that a lax.scan slices one per step, and
    # each step gathers its layer only if the split runs along another dimension
    order = [*range(1, len(shape)), 0] if len(shape) >= 3 else range(len(shape))
    for dim in order:
        if shape[dim] % n == 0:
            return FsdpLayout(dim)
    return FsdpLayout(None, f"no dimension of {tuple(np.shape(x))} divides by {n}")


def fsdp_layout(params: Any, mesh: jax.sharding.Mesh, axis: str) -> Any:
    """The ``FsdpLayout`` of each leaf of ``params`` on ``mesh``'s ``axis`` (the first dimension of a
    parameter of 2 or more dimensions that the axis size divides). ``params`` may be arrays or their
    shapes (``jax.ShapeDtypeStruct``, as ``jax.eval_shape(model.init, ...)`` gives): the same layouts.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.distributed import fsdp_layout
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> fsdp_layout({"w": jnp.ones((4, 2)), "b": jnp.ones(2)}, mesh, "data")["b"].dim is None
        True
    """
    n = _axis_size(mesh, axis)
    return jax.tree_util.tree_map(lambda x: _layout(x, n), params)


def _axis_size(mesh: Any, axis: Any) -> int:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"fsdp: mesh must be a jax.sharding.Mesh (jax.make_mesh(...)), got {type(mesh).__name__}"
        )
    if axis not in mesh.axis_names:
        raise ValueError(f"fsdp: axis {axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
    return int(mesh.shape[axis])


REDUCE_SCATTERS = ("collective", "ring")


def _reduce_scattered(g: jax.Array, axis: str, dim: int, how: str) -> jax.Array:
    """``g`` summed over ``axis``, each device keeping its ``1/n`` slice along ``dim``.

    ``"collective"``: ``lax.psum_scatter``, the compiler's reduce-scatter (XLA:TPU rewrites some as an
    all-reduce of the whole array and a slice). ``"ring"``: the ring algorithm written out, ``n - 1``
    exchanges with the next device (``lax.ppermute``), each sending one slice's running sum: the bytes of
    a reduce-scatter, ``(n - 1) / n`` of the array per device, on one link at a time, whatever the
    compiler does with reduce-scatters. The slice for device ``k`` starts at device ``k + 1`` and gathers
    one term per hop until it arrives at ``k``."""
    if how != "ring":
        return lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    n = lax.axis_size(axis)
    if n == 1:
        return g
    me, size = lax.axis_index(axis), g.shape[dim] // n

    def part(k: Any) -> jax.Array:  # this device's term of slice k (mod n)
        return lax.dynamic_slice_in_dim(g, ((k + n) % n) * size, size, axis=dim)

    to_next = [(j, (j + 1) % n) for j in range(n)]
    running = part(me - 1)
    for hop in range(1, n):
        running = lax.ppermute(running, axis, to_next) + part(me - hop - 1)
    return running


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gathered(x: jax.Array, axis: str, dim: int, wire: str, reduce: str, scatter: str) -> jax.Array:
    return lax.all_gather(x.astype(wire), axis, axis=dim, tiled=True)


def _gathered_fwd(x: jax.Array, axis: str, dim: int, wire: str, reduce: str, scatter: str) -> tuple:
    # the residual only carries the parameter's dtype (a residual must be an array)
    return _gathered(x, axis, dim, wire, reduce, scatter), jnp.zeros((0,), x.dtype)


def _gathered_bwd(
    axis: str, dim: int, wire: str, reduce: str, scatter: str, like: jax.Array, g: jax.Array
) -> tuple:
    return (_reduce_scattered(g.astype(reduce), axis, dim, scatter).astype(like.dtype),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _gathered_fp8(
    x: jax.Array, scale: jax.Array, axis: str, dim: int, wire: str, out: str, reduce: str, scatter: str
) -> jax.Array:
    # quantized with one scale for the whole parameter (its global amax): every shard the same grid
    limit = float(jnp.finfo(wire).max)
    q = jnp.clip(x.astype(jnp.float32) * scale, -limit, limit).astype(wire)
    return (lax.all_gather(q, axis, axis=dim, tiled=True).astype(jnp.float32) / scale).astype(out)


def _gathered_fp8_fwd(x: jax.Array, scale: jax.Array, *static: Any) -> tuple:
    return _gathered_fp8(x, scale, *static), (jnp.zeros((0,), x.dtype), jnp.zeros_like(scale))


def _gathered_fp8_bwd(
    axis: str, dim: int, wire: str, out: str, reduce: str, scatter: str, res: tuple, g: jax.Array
) -> tuple:
    like, zero = res  # the scale is a statistic of the parameter, not a function to differentiate
    return _reduce_scattered(g.astype(reduce), axis, dim, scatter).astype(like.dtype), zero


_gathered_fp8.defvjp(_gathered_fp8_fwd, _gathered_fp8_bwd)

_FP8 = ("float8_e4m3fn", "float8_e5m2")


def _fp8_scales(local: list, layouts: list, axis: str, wires: list) -> list:
    """Per sharded parameter gathered in fp8, ``fp8_max / amax`` over all its shards: one all-reduce
    (max) for all of them; ``None`` for the others."""
    sharded = [i for i, lay in enumerate(layouts) if lay.dim is not None and wires[i] in _FP8]
    if not sharded:
        return [None] * len(local)
    amax = jnp.stack([jnp.max(jnp.abs(local[i].astype(jnp.float32))) for i in sharded])
    amax = lax.pmax(lax.stop_gradient(amax), axis)
    limit = jnp.array([float(jnp.finfo(wires[i]).max) for i in sharded], jnp.float32)
    scale = jnp.where(amax > 0, limit / amax, 1.0)
    scales: list = [None] * len(local)
    for k, i in enumerate(sharded):
        scales[i] = scale[k]
    return scales


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _replicated(x: jax.Array, axis: str, wire: str, reduce: str) -> jax.Array:
    # varying over the axis from here on, so that its cotangent reaches _replicated_bwd per device and
    # is summed there, in reduce_dtype, rather than by shard_map's own transpose in the cotangent's dtype
    return lax.pcast(x.astype(wire), axis, to="varying")


def _replicated_fwd(x: jax.Array, axis: str, wire: str, reduce: str) -> tuple:
    return _replicated(x, axis, wire, reduce), jnp.zeros((0,), x.dtype)


def _replicated_bwd(axis: str, wire: str, reduce: str, like: jax.Array, g: jax.Array) -> tuple:
    return (lax.psum(g.astype(reduce), axis).astype(like.dtype),)


_replicated.defvjp(_replicated_fwd, _replicated_bwd)


def fsdp(
    fun: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    *,
    axis: str,
    policy: Policy | str | None = None,
    reduce_dtype: Any = "float32",
    gather_dtype: Any = None,
    shard_params: bool = True,
    reduce_scatter: str = "collective",
) -> Callable[..., Any]:
    """``fun(params, *batch)`` with ``params`` sharded along ``axis`` and ``batch`` split along it.

    ``params`` (float32, say) stay sharded on the devices of ``axis``: one shard of each parameter
    per device (``fsdp_layout`` says which dimension; small or indivisible parameters are
    replicated). Each batch argument is split along its leading dimension. ``fun`` runs on the full
    parameters and the local batch, under ``autocast(policy)`` when a policy is given. Each sharded
    parameter is all-gathered just before the first operation that reads it, so a model's layers
    are gathered one after another; inside a ``lax.scan`` over stacked layers each step gathers its
    own layer. It moves in the dtype the program reads it in: the one engine's decision (the
    policy's compute dtype, float32 in a ``float32_region`` or under a float32 module rule of
    ``apply_policy``), or ``gather_dtype`` where given. The backward pass gathers again the
    parameters it reads instead of keeping them from the forward (ZeRO-3; PyTorch FSDP's default
    ``reshard_after_forward=True``), so one layer's full parameters are live at a time. Under
    ``jax.grad`` each parameter's gradient is reduce-scattered (replicated ones: all-reduced) in
    ``reduce_dtype`` and arrives sharded like the parameter, in its dtype.

    ``gather_dtype`` (one dtype, or a pytree of them with the parameters' structure, ``None`` for
    the default) rounds a parameter to that dtype before it moves. ``"float8_e4m3fn"`` (or
    ``"float8_e5m2"``) gathers in fp8, as torchao's FSDP does: each sharded parameter is multiplied
    by ``fp8_max / amax`` (its amax over all shards; one all-reduce carries every parameter's),
    quantized, gathered, and divided back in the dtype the program reads. The weights are then
    rounded to fp8's 3 (or 2) mantissa bits: for models whose contractions run in fp8 anyway.

    ``reduce_scatter`` says how a sharded gradient is reduce-scattered: ``"collective"`` (the default,
    ``lax.psum_scatter``: the compiler's reduce-scatter) or ``"ring"`` (the ring algorithm written out as
    ``n - 1`` exchanges with the next device, ``lax.ppermute``). Both move ``(n - 1) / n`` of the gradient
    per device where the compiler keeps a reduce-scatter; XLA:TPU compiles some reduce-scatters (on a
    v5e 4x4 slice, every one) as an all-reduce of the whole float32 gradient and a slice, twice the bytes
    and the whole gradient on every chip, and ``"ring"`` keeps those at a reduce-scatter's bytes in the
    compiled program. Its speed on a TPU is not measured: XLA's all-reduce uses every link of the torus,
    the ring one link per hop (docs/distributed.md).

    ``shard_params=False`` is plain data parallelism: every parameter replicated, only the batch split;
    the gradient all-reduce is then written in the program in ``reduce_dtype`` too, instead of being
    placed by the compiler in whatever dtype the gradient is summed in.

    ``fun`` returns a scalar loss (averaged over the devices, so it is the mean over the whole batch
    when ``fun`` averages over its local batch) or per-example outputs (concatenated along the
    leading dimension, sharded along ``axis``).

    The communication, per parameter of ``P`` elements on ``N`` devices: an all-gather of ``P``
    values in the gather dtype forward (and again backward where the backward reads it), and a
    reduce-scatter of ``P`` values in ``reduce_dtype`` backward. PyTorch FSDP2 calls the two
    ``param_dtype`` and ``reduce_dtype``. A parameter read in two dtypes (a cast in one place, its
    own dtype in another) is gathered once per dtype.

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)
        >>> step = jmp_lite.distributed.fsdp(loss, mesh, axis="data", policy="p=f32,c=bf16,o=f32")
        >>> grads = jax.jit(jax.grad(step))({"w": jnp.ones((4, 2))}, jnp.ones((8, 4)))
        >>> grads["w"].dtype, grads["w"].shape
        (dtype('float32'), (4, 2))
    """
    validate.function(fun, "fsdp's fun")
    resolved = validate.policy(policy, "fsdp's policy", optional=True)
    inner = fun
    if resolved is not None:  # autocast(fun, policy), as the plain-JAX front-end builds it
        inner = functools.wraps(fun)(engine.transform(fun, engine.Scope(resolved)))
    return sharded(inner, mesh, axis, reduce_dtype, gather_dtype, shard_params, reduce_scatter=reduce_scatter)


def sharded(
    inner: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis: str,
    reduce_dtype: Any = "float32",
    gather_dtype: Any = None,
    shard_params: bool = True,
    state_outputs: Callable[[Any], Any] | None = None,
    reduce_scatter: str = "collective",
) -> Callable[..., Any]:
    """``fsdp`` of a function that already runs under the engine (a front-end's model call).

    ``state_outputs(outputs)`` marks the outputs that are a model's updated state rather than a loss
    or per-example values: they come back as the devices computed them, which must agree (an RNG
    count); state that differs between devices (batch statistics) is refused."""
    split = validate.flag(shard_params, "fsdp's shard_params")
    scatter = check_reduce_scatter(reduce_scatter, "fsdp")
    n = _axis_size(mesh, axis)
    reduce = _dtypes.as_floating_dtype(reduce_dtype, "fsdp's reduce_dtype").name
    uniform = not _is_tree(gather_dtype)
    chosen_wire = _gather_dtype(gather_dtype) if uniform else None

    def run(params: Any, *batch: Any) -> Any:
        context = jax.sharding.get_abstract_mesh()
        if not context.empty and jax.sharding.AxisType.Manual in context.axis_types:
            raise ValueError(
                f"fsdp: called inside jax.pmap or jax.shard_map (manual axes {context.axis_names}); sharded "
                "training maps itself over its mesh's devices: call it under jax.jit, with the batch as "
                "one global array, not inside pmap"
            )
        layouts = jax.tree_util.tree_map(
            lambda x: _layout(x, n) if split else FsdpLayout(None, "shard_params=False"), params
        )
        for x in jax.tree_util.tree_leaves(batch):
            other = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
            if other is not None and not other.empty and other.axis_names != mesh.axis_names:
                raise ValueError(
                    f"fsdp: a batch argument is laid out on another mesh (axes {other.axis_names}) than "
                    f"the one sharded training runs on (axes {mesh.axis_names}); give the batch unplaced "
                    "or on that mesh: fsdp splits it along its axis itself"
                )
            if np.ndim(x) == 0 or np.shape(x)[0] % n:
                raise ValueError(
                    f"fsdp: every batch argument is split along its leading dimension over the {n} "
                    f"devices of axis {axis!r}; got an array of shape {tuple(np.shape(x))}"
                )
        param_specs = jax.tree_util.tree_map(lambda x, lay: _spec(lay, axis), params, layouts)
        if uniform:
            wires_tree = jax.tree_util.tree_map(lambda x: chosen_wire, params)
        else:
            try:
                chosen = jax.tree_util.tree_map(lambda x, g: (g,), params, gather_dtype)
            except ValueError as e:
                raise ValueError(
                    "fsdp: gather_dtype is a dtype, or a pytree of dtypes (None: the default) with the "
                    f"parameters' structure; it does not match them: {e}"
                ) from None
            wires_tree = jax.tree_util.tree_map(
                lambda x, g: _gather_dtype(g[0]),
                params,
                chosen,
                is_leaf=lambda g: isinstance(g, tuple) and len(g) == 1,
            )
        batch_specs = jax.tree_util.tree_map(lambda x: P(axis), batch)

        def kept(out: Any) -> Any:
            if state_outputs is None:
                return jax.tree_util.tree_map(lambda _: False, out)
            return state_outputs(out)

        def body(local: Any, *local_batch: Any) -> Any:
            flat, tree = jax.tree_util.tree_flatten(local)
            flat = [_own_key(x, axis) for x in flat]
            lays = [
                lay if _dtypes.is_floating_array(x) else FsdpLayout(None)
                for x, lay in zip(flat, tree.flatten_up_to(layouts))
            ]
            wires = tree.flatten_up_to(wires_tree)
            # fp8: every scale from one all-reduce, before the first gather
            gathers = _Gathers(axis, reduce, wires, _fp8_scales(flat, lays, axis, wires), scatter)

            def stand_in(i: int) -> Any:
                """An array of the full parameter's type (varying over the axis, as the batch) to trace
                ``fun`` with; never read (the compiler drops it)."""
                x = flat[i]
                if not _dtypes.is_floating_array(x):
                    return x
                shape = list(np.shape(x))
                if lays[i].dim is not None:
                    shape[lays[i].dim] *= n
                return lax.pcast(jnp.zeros(shape, x.dtype), axis, to="varying")

            def call(full_params: list, *b: Any) -> Any:
                return inner(jax.tree_util.tree_unflatten(tree, full_params), *b)

            closed, out_shape = jax.make_jaxpr(call, return_shape=True)(
                [stand_in(i) for i in range(len(flat))], *local_batch
            )
            held = [
                _Held(i, x, lays[i].dim) if _dtypes.is_floating_array(x) else x for i, x in enumerate(flat)
            ]
            args = [*held, *jax.tree_util.tree_leaves(local_batch)]
            everything = jax.checkpoint_policies.everything_saveable  # but the gathered parameters
            outs = _checkpointed(closed.jaxpr, closed.consts, args, gathers, everything)
            out = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
            marks = kept(out)
            for o, k in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(marks)):
                mat = getattr(jax.typeof(o), "mat", None)
                if k and mat is not None and axis in mat.varying:
                    raise ValueError(_DIFFERING_STATE)
            return jax.tree_util.tree_map(
                lambda o, k: lax.pmean(o, axis) if np.ndim(o) == 0 and not k else o, out, marks
            )

        # on shapes alone: a sharded argument's type would carry its sharding into fun's ops
        unsharded = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        out_shapes = jax.eval_shape(inner, unsharded, *_local(batch, n))
        out_specs = jax.tree_util.tree_map(
            lambda o, k: P() if k or not o.shape else P(axis), out_shapes, kept(out_shapes)
        )
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(param_specs, *batch_specs), out_specs=out_specs)
        placed = jax.tree_util.tree_map(
            lambda x, spec: _place(x, mesh, spec), (params, *batch), (param_specs, *batch_specs)
        )
        return mapped(*placed)

    return run


_DIFFERING_STATE = (
    "fsdp: the model updates state that differs between devices (batch statistics of a BatchNorm in "
    "training, values sown per example); sharded training returns only state every device agrees on "
    "(an RNG count). Run such layers in inference mode, or without mesh="
)


class _Held(NamedTuple):
    """A parameter not gathered yet: ``local``, this device's shard (inside a ``lax.scan`` over stacked
    layers, one layer of it), split along ``dim`` (``None``: replicated), ``casts``, the dtypes
    the program cast it to, in order, before any other use, and ``moves``, the relayout equations
    (transposes, reshapes) it went through before that use: casts commute with them, so
    ``x.T.astype(bf16)`` moves in bfloat16 as ``x.astype(bf16)`` does."""

    index: int
    local: Any
    dim: int | None
    casts: tuple = ()
    moves: tuple = ()  # relayouts the program applied to it (``w.T``), run after the gather and casts


class _Gathers(NamedTuple):
    """How parameter ``i`` moves: the mesh ``axis``, the gradient's ``reduce`` dtype, ``wires[i]``
    (a chosen gather dtype, or ``None``: the dtype the program first reads it in) and ``scales[i]``
    (fp8 gathers: ``fp8_max / amax``; else ``None``)."""

    axis: str
    reduce: str
    wires: list
    scales: list
    scatter: str = "collective"  # how a sharded gradient is reduce-scattered (_reduce_scattered)

    def full(self, held: _Held) -> jax.Array:
        """``held`` gathered, then cast as the program casts it. Casting commutes with gathering, so the
        first cast travels on the wire (a parameter the engine reads in bfloat16 moves in bfloat16) and
        the others run after (a bfloat16 value widened for a float32 sum stays rounded to bfloat16); a
        chosen gather dtype rounds it first."""
        x, own = held.local, held.local.dtype.name
        chosen = self.wires[held.index]
        casts = list(held.casts)
        if held.dim is None:  # already on every device: nothing moves forward
            first = casts.pop(0) if casts else own
            y = _replicated(x, self.axis, first, self.reduce)
        elif chosen is None:
            wire = casts.pop(0) if casts else own
            y = _gathered(x, self.axis, held.dim, wire, self.reduce, self.scatter)
        elif self.scales[held.index] is not None:  # fp8: dequantized into the parameter's dtype
            scale = self.scales[held.index]
            y = _gathered_fp8(x, scale, self.axis, held.dim, chosen, own, self.reduce, self.scatter)
        else:
            y = _gathered(x, self.axis, held.dim, chosen, self.reduce, self.scatter).astype(own)
        for dtype in casts:
            y = y.astype(dtype)
        for eqn in held.moves:
            (y,) = interpret.bind(eqn, [y])
        return y


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], gathers: _Gathers) -> list:
    """Evaluates ``jaxpr`` with each parameter (a ``_Held`` argument) gathered just before the first
    equation that reads it: in program order, layer by layer, so the compiler is handed the gathers
    where they are needed rather than all up front.

    A cast of a parameter that nothing has read yet is folded into its gather: the parameter moves in
    the dtype the engine (its module's rule, a float32 region) reads it in. Calls are evaluated in
    place, checkpointed regions are rebuilt around their own gathers (so the backward pass gathers
    again rather than keeping every full parameter), and a ``lax.scan`` over stacked layers gathers
    one layer per step."""

    def gathered(env: interpret.Env, v: Any) -> Any:
        x = env.read(v)
        if isinstance(x, _Held):
            x = env[v] = gathers.full(x)
        return x

    def equation(i: int, eqn: Any, env: interpret.Env) -> list:
        values = [env.read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if not any(isinstance(x, _Held) for x in values):
            return interpret.bind(eqn, values)
        if eqn.primitive is lax.convert_element_type_p and _castable(eqn.params["new_dtype"]):
            (x,) = values
            env[eqn.outvars[0]] = x._replace(casts=(*x.casts, np.dtype(eqn.params["new_dtype"]).name))
            return interpret.SKIP
        if name in primitive_rules.LAYOUT and eqn.primitive is not lax.convert_element_type_p:
            (x,) = values
            env[eqn.outvars[0]] = x._replace(moves=(*x.moves, eqn))
            return interpret.SKIP
        if name in primitive_rules.INLINED:
            body = eqn.params[primitive_rules.SUBPROGRAMS[name]]
            return _evaluate(body.jaxpr, body.consts, values, gathers)
        if name in primitive_rules.CHECKPOINTS:
            return _checkpointed(eqn.params["jaxpr"], (), values, gathers, eqn.params["policy"])
        if eqn.primitive is jax_primitives.scan_p:
            return _scanned(eqn, values, gathers)
        if eqn.primitive is lax.gather_p and _is_row_lookup(eqn, values, gathers):
            return [_looked_up(eqn, values[0], values[1], gathers.axis)]
        return interpret.bind(eqn, [gathered(env, v) for v in eqn.invars])

    return interpret.evaluate(jaxpr, consts, args, equation, read_out=gathered)


def _is_row_lookup(eqn: Any, values: list, gathers: _Gathers) -> bool:
    """Whether ``eqn`` looks up whole rows (``table[ids]``, an embedding) of a 2-d parameter split along
    its rows or its columns, in the dtype the program reads it in (no chosen gather dtype, no fp8), and
    looking them up on the shards (``_looked_up``) moves fewer bytes than gathering the table."""
    held, ids = values
    if not isinstance(held, _Held) or isinstance(ids, _Held) or held.dim not in (0, 1) or held.moves:
        return False
    if np.ndim(held.local) != 2 or gathers.wires[held.index] is not None or np.ndim(ids) < 2:
        return False
    dims = eqn.params["dimension_numbers"]
    full = eqn.invars[0].aval.shape
    if not (
        tuple(dims.collapsed_slice_dims) == (0,)
        and tuple(dims.start_index_map) == (0,)
        and not tuple(dims.operand_batching_dims)
        and len(dims.offset_dims) == 1
        and tuple(eqn.params["slice_sizes"]) == (1, full[1])
    ):
        return False
    # Only where the rows moved are fewer bytes than the table's gather: the rows of every device's ids
    # (a reduce-scatter of all of them over row shards; an all-to-all of one device's share over column
    # shards) against the rows of the table, in the dtypes each would move in
    n = full[held.dim] // np.shape(held.local)[held.dim]
    ids_here = int(np.prod(np.shape(ids)[:-1]))
    rows = ids_here * n if held.dim == 0 else ids_here
    read = np.dtype(held.casts[-1] if held.casts else held.local.dtype).itemsize
    wire = np.dtype(held.casts[0] if held.casts else held.local.dtype).itemsize
    return rows * read < full[0] * wire


def _looked_up(eqn: Any, held: _Held, ids: jax.Array, axis: str) -> jax.Array:
    """``table[ids]`` from the shards of ``table``, with no shard gathered: every device looks up every
    device's ids in its own shard, and one collective of the looked-up rows hands each device its own.

    Split along its columns, each device reads its columns of every row asked for, and an all-to-all
    hands each device its ids' rows, whole. Split along its rows (vocabulary-parallel, as in Megatron-LM),
    each device reads the rows it holds, zeros elsewhere, and a reduce-scatter sums them into each
    device's ids' rows (one term is not zero). An embedding's lookup otherwise all-gathers the whole
    table in the dtype it is read in (float32 for a float32 table under ``autocast``: GPT-2's
    50257 x 768, 154 MB per step), where this moves the ids and the looked-up rows (6 MB for
    8 x 1024 tokens of width 768 over 4 devices, columns; 4 times that, rows): fewer bytes while a
    step's tokens (columns: one device's) are fewer than the table's rows, where
    ``_is_row_lookup`` takes it. The values are the
    lookup's, out-of-range ids included (``mode``). Differentiated, each device sums its ids'
    cotangents into its own shard: the lookup's part of the gradient arrives sharded."""
    table = held.local
    for dtype in held.casts:
        table = table.astype(dtype)
    columns = eqn.params["dimension_numbers"].offset_dims[0]  # where the row's entries go in the result
    lead = 1 if columns == 0 else 0  # where the ids' leading dimension goes
    params = {**eqn.params, "slice_sizes": (1, table.shape[1]), "indices_are_sorted": False}
    params["unique_indices"] = False
    if held.dim == 1:
        every = lax.all_gather(ids, axis, axis=0, tiled=True)
        rows = eqn.primitive.bind(table, every, **params)
        return lax.all_to_all(rows, axis, lead, columns, tiled=True)
    full = eqn.invars[0].aval.shape[0]
    fill = eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    valid = (ids >= 0) & (ids < full) if fill else None
    if not fill:  # clip (or promised in bounds): every id reads a row
        ids = jnp.clip(ids, 0, full - 1)
    every = lax.all_gather(ids, axis, axis=0, tiled=True)
    mine = every - lax.axis_index(axis) * table.shape[0]
    held_here = (mine >= 0) & (mine < table.shape[0])
    rows = eqn.primitive.bind(table, jnp.where(held_here, mine, 0), **params)
    rows = jnp.where(jnp.expand_dims(held_here[..., 0], columns), rows, jnp.zeros((), rows.dtype))
    out = lax.psum_scatter(rows, axis, scatter_dimension=lead, tiled=True)
    if valid is not None:
        value = eqn.params.get("fill_value")
        value = jnp.nan if value is None else value
        out = jnp.where(jnp.expand_dims(valid[..., 0], columns), out, jnp.asarray(value, out.dtype))
    return out


def _own_key(x: Any, axis: str) -> Any:
    """A typed PRNG key among the parameters (a model's dropout key) folded with the device's index:
    each device draws its own random numbers for its own slice of the batch."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.fold_in(x, lax.axis_index(axis))
    return x


class FsdpOptions(NamedTuple):
    """A front-end's ``mesh=``, ``fsdp_axis=``, ``reduce_dtype=`` and ``reduce_scatter=``, checked."""

    mesh: jax.sharding.Mesh
    axis: str
    reduce_dtype: str
    reduce_scatter: str = "collective"


def sharded_by(
    inner: Callable[..., Any], options: FsdpOptions, state_outputs: Callable[[Any], Any] | None = None
) -> Callable[..., Any]:
    """``sharded(inner, ...)`` with a front-end's checked options (``sharding_options``)."""
    return sharded(
        inner,
        options.mesh,
        options.axis,
        options.reduce_dtype,
        state_outputs=state_outputs,
        reduce_scatter=options.reduce_scatter,
    )


def check_reduce_scatter(how: Any, what: str) -> str:
    """``how`` if it names a way to reduce-scatter (``REDUCE_SCATTERS``), else a ``ValueError``."""
    if not isinstance(how, str) or how not in REDUCE_SCATTERS:
        raise ValueError(
            f"{what}: reduce_scatter={how!r}; it is one of {', '.join(map(repr, REDUCE_SCATTERS))} (how a "
            "sharded gradient is reduce-scattered: the compiler's collective, or the ring written out)"
        )
    return how


def sharding_options(
    mesh: Any, fsdp_axis: Any, reduce_dtype: Any, what: str, reduce_scatter: Any = None
) -> FsdpOptions | None:
    """The sharded-training options of ``what`` (``apply_policy``, ``autocast``), or ``None``."""
    if mesh is None and fsdp_axis is None:
        for name, value in (("reduce_dtype", reduce_dtype), ("reduce_scatter", reduce_scatter)):
            if value is not None:
                raise ValueError(
                    f"{what}: {name} is an option of sharded training's gradient reductions; give it "
                    "with mesh= and fsdp_axis="
                )
        return None
    if mesh is None or fsdp_axis is None:
        raise ValueError(
            f"{what}: sharded training takes both mesh= (a jax.sharding.Mesh) and fsdp_axis= (the name "
            f"of the mesh axis to shard parameters and split the batch along); got mesh={mesh!r}, "
            f"fsdp_axis={fsdp_axis!r}"
        )
    _axis_size(mesh, fsdp_axis)
    reduce = _dtypes.as_floating_dtype(
        "float32" if reduce_dtype is None else reduce_dtype, f"{what}'s reduce_dtype"
    ).name
    how = check_reduce_scatter("collective" if reduce_scatter is None else reduce_scatter, what)
    return FsdpOptions(mesh, fsdp_axis, reduce, how)


def check_keywords(kwargs: Mapping[str, Any], what: str) -> None:
    """Sharded calls take arrays positionally (split along the batch); keywords must be static."""
    arrays = sorted(k for k, v in kwargs.items() if any(map(_is_array, jax.tree_util.tree_leaves(v))))
    if arrays:
        raise ValueError(
            f"{what}(mesh=...): keyword arguments {arrays} hold arrays; in sharded training arrays go "
            "positionally (split along their leading dimension) and keywords hold static options "
            "such as train=True"
        )


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _castable(dtype: Any) -> bool:
    """A cast a gather can carry: to a floating dtype of 16 bits or more (fp8 casts follow a scale)."""
    return bool(jnp.issubdtype(dtype, jnp.floating)) and np.dtype(dtype).itemsize >= 2


def _unheld(values: list, gathers: _Gathers) -> list:
    return [gathers.full(x) if isinstance(x, _Held) else x for x in values]


def _checkpointed(jaxpr: Any, consts: Sequence[Any], values: list, gathers: _Gathers, policy: Any) -> list:
    """``jaxpr`` evaluated as a ``jax.checkpoint`` region with its gathers inside, under ``policy``
    (``None``: keep nothing) except that a gathered parameter is never kept for the backward pass:
    the backward gathers again what it reads, as ZeRO-3 and PyTorch FSDP (its default
    ``reshard_after_forward=True``) do, so only one layer's full parameters are live at a time. That is
    the lowered program. The region leaves XLA free to merge (``prevent_cse=False``, also where the
    policy's own region prevents it): a compiler that finds keeping a gathered layer cheaper than
    gathering it again merges the two, as XLA:GPU does for GPT-2's layers (compiled for 8 H100s, GPT-2
    width, 4 layers: 0.69 GB of temporaries, against 1.02 GB and every weight gathered twice with
    ``prevent_cse=True``)."""
    slots = [i for i, x in enumerate(values) if isinstance(x, _Held)]

    def region(*xs: Any) -> list:
        inside = list(xs)
        for i in slots:
            inside[i] = values[i]._replace(local=xs[i])
        return _evaluate(jaxpr, consts, inside, gathers)

    def keeps(prim: Any, *avals: Any, **params: Any) -> bool:
        if prim in _GATHERS or prim.name in primitive_rules.LAYOUT:
            return False  # a gathered parameter, also once cast or transposed: gathered again (cheap)
        return bool(policy(prim, *avals, **params)) if policy is not None else False

    arrays = [x.local if isinstance(x, _Held) else x for x in values]
    return jax.checkpoint(region, policy=keeps, prevent_cse=False)(*arrays)


# what gathers a parameter (the all-gather, inside _gathered's custom_vjp); a relayout of it (x @ w.T
# reads w transposed, primitive_rules.LAYOUT) is that parameter too
_GATHERS = (jax_primitives.all_gather_p, jax_primitives.custom_vjp_call_p)


def _scanned(eqn: Any, values: list, gathers: _Gathers) -> list:
    """A ``lax.scan`` whose scanned-over operands include stacked parameters split along another
    dimension than the stacking one: each step gathers its own layer. Parameters among the scan's
    constants or carry are gathered before it."""
    params = eqn.params
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts = _unheld(values[:n_consts], gathers)
    init = _unheld(values[n_consts : n_consts + n_carry], gathers)
    xs = values[n_consts + n_carry :]
    # (a relayout recorded on a stacked parameter is of the whole stack: gathered whole, as before)
    per_step = [isinstance(x, _Held) and x.dim != 0 and not x.moves for x in xs]
    xs = [
        x.local if step else (gathers.full(x) if isinstance(x, _Held) else x) for x, step in zip(xs, per_step)
    ]
    body = params["jaxpr"]

    def step(carry: list, x: list) -> tuple:
        sliced = [
            values[n_consts + n_carry + k]._replace(
                local=xk,
                dim=None
                if values[n_consts + n_carry + k].dim is None
                else values[n_consts + n_carry + k].dim - 1,
            )
            if per_step[k]
            else xk
            for k, xk in enumerate(x)
        ]
        outs = _evaluate(body.jaxpr, body.consts, [*consts, *carry, *sliced], gathers)
        return outs[:n_carry], outs[n_carry:]

    carry, ys = lax.scan(
        step, init, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )
    return [*carry, *ys]


def _is_tree(value: Any) -> bool:
    """A pytree of per-parameter gather dtypes (a dict, list, ...), not one dtype (nor ``None``)."""
    if value is None or isinstance(value, str):
        return False
    return isinstance(value, (dict, list, tuple)) or bool(jax.tree_util.tree_leaves(value) != [value])


def _spec(lay: FsdpLayout, axis: str) -> P:
    """The ``PartitionSpec`` of a parameter laid out as ``lay``: split along ``axis`` at ``lay.dim``."""
    return P() if lay.dim is None else P(*([None] * lay.dim), axis)


def _gather_dtype(value: Any) -> str | None:
    """``gather_dtype`` as a dtype name: a floating dtype, or an fp8 one (``"float8_e4m3fn"``,
    ``"float8_e5m2"``: quantized with a per-parameter scale)."""
    if value is None:
        return None
    try:
        name = np.dtype(value).name
    except TypeError:
        name = None
    if name in _FP8:
        return name
    return _dtypes.as_floating_dtype(value, "fsdp's gather_dtype").name


def _place(x: Any, mesh: jax.sharding.Mesh, spec: P) -> Any:
    """``x`` laid out as ``spec`` on ``mesh`` (a no-op where it already is): ``jax.reshard`` on a mesh
    with explicit axes (``jax.make_mesh``'s default), a sharding constraint on one with automatic axes."""
    target = NamedSharding(mesh, spec)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.sharding == target:
        return x
    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if explicit:
        return jax.reshard(x, target)
    return jax.lax.with_sharding_constraint(x, target)


def _local(batch: tuple, n: int) -> tuple:
    """Shape stand-ins for one device's slice of the batch."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] // n, *np.shape(x)[1:]), x.dtype), batch
    )


def shard_params(params: Any, mesh: jax.sharding.Mesh, axis: str) -> Any:
    """``params`` placed on ``mesh`` as ``fsdp`` lays them out (``fsdp_layout``): each splittable
    parameter sharded along ``axis``, the others replicated. A ``jax.ShapeDtypeStruct`` comes back as
    one with that sharding (nothing allocated: the input of ``jax.jit(step).lower(...)``, e.g. for a
    chip this machine does not have, ``jmp_lite.memory.compiled``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmp_lite.distributed import shard_params
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> placed = shard_params({"w": jnp.ones((4, 2)), "b": jnp.ones(2)}, mesh, "data")
        >>> placed["w"].sharding.spec, placed["b"].sharding.spec
        (P('data',), P())
    """
    n = _axis_size(mesh, axis)

    def place(x: Any) -> Any:
        sharding = NamedSharding(mesh, _spec(_layout(x, n), axis))
        if _is_abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map(place, params)
