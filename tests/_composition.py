"""The composition matrix's harness: every feature against every ordinary part of a training setup.

Rows (``FEATURES``) are what jmp_lite adds; columns (``PARTS``) are the parts of a real training setup
that a feature must live with. Each cell trains a small model for a few steps (or runs the tool) and
checks what a user relies on: the loss stays within the feature's band of the same setup in float32, a
checkpoint column resumes bit for bit, a skipped step is named, a tool's output feeds back in. A cell
that is not supported must say so in a clear error naming the pair; ``EXPECTED_ERRORS`` lists those
cells with the words their message must contain. docs/composition.md shows the same table;
``tests/test_composition_*.py`` run the cells, a group of columns per file (so that the two test workers share
them), and ``tests/test_composition_autocast.py`` checks that the docs table is this matrix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import quantized_arrays
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jmp_lite
import jmp_lite.flax.linen as jlinen
import jmp_lite.flax.nnx as jnnx
from jmp_lite import fp8
from jmp_lite.distributed import shard_params
from jmp_lite.flax import TrainState

LR = 3e-3
STEPS = 3
BF16 = "p=f32,c=bf16,o=f32"


@dataclasses.dataclass(frozen=True)
class Feature:
    """One row: the policy, optimizer and loss scale it trains with, and what its cell checks."""

    policy: str = BF16
    fp8: str | None = None
    scale: Callable[[], jmp_lite.LossScale] = jmp_lite.NoOpLossScale
    inner: Callable[[], optax.GradientTransformation] = lambda: optax.adam(LR)
    record_nonfinite: bool = False
    check: str = "train"  # train | skip | report | residual | export
    fsdp: bool = False  # parameters sharded over the 8 devices (mesh=, fsdp_axis=), the batch split
    reduce_scatter: str = "collective"  # a sharded row's gradient reduce-scatters (reduce_scatter=)
    quantized: bool = False  # the optimizer state must hold 8-bit arrays (QuantizedArray)
    band: float = 0.05  # |loss - float32 loss| <= band * |float32 loss| after STEPS steps
    recompute: str | None = None  # the front-ends' recompute= (wide contractions rebuilt, not kept)


FEATURES: dict[str, Feature] = {
    "bf16": Feature(),
    "f16_dynamic": Feature(policy="p=f32,c=f16,o=f32", scale=lambda: jmp_lite.DynamicLossScale(2.0**10)),
    "fp8_current": Feature(fp8="hybrid,current", band=0.1),
    "fp8_delayed": Feature(fp8="hybrid,delayed,history=4", band=0.1),
    "fp8_block": Feature(fp8="hybrid,block", band=0.1),
    "kahan_summation": Feature(
        policy="p=bf16,c=bf16,o=f32",
        inner=lambda: optax.chain(optax.adam(LR), jmp_lite.kahan_summation(wide_params="pass")),
    ),
    "stochastic_rounding": Feature(
        policy="p=bf16,c=bf16,o=f32",
        inner=lambda: optax.chain(
            optax.adam(LR), jmp_lite.stochastic_rounding(jax.random.key(7), wide_params="pass")
        ),
    ),
    "low_precision_state": Feature(inner=lambda: jmp_lite.low_precision_state(optax.adam(LR))),
    # the small models' kernels (8 x 16, 16 x 16) in 8 bits, blocks of one row; biases stay float32
    "int8_moments": Feature(
        inner=lambda: jmp_lite.low_precision_state(
            optax.adam(LR), "int8", block_size=16, min_quantized_size=128
        ),
        quantized=True,
    ),
    "record_nonfinite": Feature(
        scale=lambda: jmp_lite.DynamicLossScale(2.0**10), record_nonfinite=True, check="skip"
    ),
    "precision_report": Feature(check="report"),
    "residual_bytes": Feature(check="residual"),
    "export_params": Feature(check="export"),
    "fsdp": Feature(fsdp=True),
    "fsdp_ring": Feature(fsdp=True, reduce_scatter="ring"),
    "recompute": Feature(recompute="wide_contractions"),
}


def _mesh(axes: str = "explicit") -> jax.sharding.Mesh:
    """The 8 devices on one axis, ``"data"``: ``jax.make_mesh``'s default (``AxisType.Explicit`` in jax
    0.10), or with ``AxisType.Auto`` axes."""
    if axes == "auto":
        return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,), mesh.axis_types
    return mesh


def _sharding(feature: Feature, axes: str | None = None) -> dict[str, Any]:
    """The front-ends' options of a row beside its policy and fp8 recipe: ``recompute=``, and a sharded
    (FSDP) row's (on a mesh column's mesh, ``axes``)."""
    rebuilt = {"recompute": feature.recompute} if feature.recompute else {}
    if not feature.fsdp:
        return rebuilt
    ring = {"reduce_scatter": "ring"} if feature.reduce_scatter == "ring" else {}
    return {"mesh": _mesh(axes or "explicit"), "fsdp_axis": "data", **ring, **rebuilt}


def _place(tree: Any, feature: Feature, axes: str) -> Any:
    """A mesh column's parameters (or NNX state), as a user of that mesh places them: sharded over
    ``"data"`` with ``shard_params`` in a sharded (FSDP) row, replicated otherwise (docs/distributed.md's
    data parallelism: the batch split, the parameters on every device)."""
    mesh = _mesh(axes)
    if feature.fsdp:
        return shard_params(tree, mesh, "data")
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _placed(batch: Callable[..., Any], mesh: jax.sharding.Mesh) -> Callable[[int], Any]:
    """Batch ``i`` of 8 examples a device, split over the mesh's ``"data"`` axis."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    return lambda i: jax.device_put(batch(i, 8 * jax.device_count()), sharding)


FLOAT32 = Feature(policy="f32")


def _tx(feature: Feature, axis_name: Any = None, multisteps: bool = False) -> optax.GradientTransformation:
    inner = feature.inner()
    if multisteps:
        inner = optax.MultiSteps(inner, every_k_schedule=2)
    check = True if feature.record_nonfinite else None
    return jmp_lite.loss_scaling(
        inner,
        feature.scale(),
        axis_name=axis_name,
        record_nonfinite=feature.record_nonfinite,
        check_finite=check,
    )


POISONED: set[int] = set()  # steps whose targets hold a NaN (the record_nonfinite row)


def _poisonable(
    batch: Callable[..., tuple[jax.Array, jax.Array]],
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    def poisoned(i: int, n: int = 8) -> tuple[jax.Array, jax.Array]:
        x, y = batch(i, n)
        return (
            (x, jnp.asarray(np.where(np.arange(y.shape[0])[:, None] == 0, np.nan, y)))
            if i in POISONED
            else (x, y)
        )

    return poisoned


@_poisonable
def _batch(i: int, n: int = 8) -> tuple[jax.Array, jax.Array]:
    x = np.random.default_rng(0).standard_normal((n, 8), np.float32)  # one batch (NumPy: nothing to compile)
    return jnp.asarray(x), jnp.asarray(np.sin(x[:, :2] + x[:, 2:4]))


@_poisonable
def _image_batch(i: int, n: int = 8) -> tuple[jax.Array, jax.Array]:
    """Images of 6 x 6 pixels and 2 channels (NHWC), and 2 targets each: the convolution columns' batch."""
    x = np.random.default_rng(0).standard_normal((n, 6, 6, 2), np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(2 * x[:, 1:4, 1:4].mean(axis=(1, 2))))


def _mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(tree)]


# ---------------------------------------------------------------------------------------------------------
# Linen: the model, how its call is made, and the ways a TrainState is stepped.


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(2)(nn.gelu(nn.Dense(16)(x)))


class _DropoutMlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(2)(nn.Dropout(0.1, deterministic=False)(nn.gelu(nn.Dense(16)(x))))


class _BatchNormMlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(2)(nn.gelu(nn.BatchNorm(use_running_average=False)(nn.Dense(16)(x))))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return nn.gelu(nn.Dense(16)(h)), None


class _ScanMlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layers = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        h, _ = layers()(nn.Dense(16)(x), None)
        return nn.Dense(2)(h)


class _ConvNet(nn.Module):
    """Convolutions only, no Dense (a ResNet's trunk, as Hugging Face's FlaxResNetModel): two 3 x 3
    convolutions and a mean over the pixels."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.mean(nn.Conv(2, (3, 3))(nn.gelu(nn.Conv(16, (3, 3))(x))), axis=(1, 2))


@dataclasses.dataclass
class _Linen:
    module: nn.Module
    dropout_key: Callable[[int], jax.Array] | None = None
    mutable: tuple[str, ...] = ()
    mode: str = "jit"  # jit | eager | multisteps | pmap | sharded | serialization
    batch: Callable[[int], tuple[jax.Array, jax.Array]] = _batch
    loss: Callable[[jax.Array, jax.Array], jax.Array] = _mse
    # a mesh column: "auto" | "explicit" axes; the parameters placed (_place), the batch split
    mesh: str | None = None

    def _call(self, apply: Callable, variables: Any, x: jax.Array, i: Any) -> tuple[jax.Array, Any]:
        kwargs: dict[str, Any] = {}
        if self.dropout_key is not None:
            kwargs["rngs"] = {"dropout": jax.random.fold_in(self.dropout_key(0), i)}
        if self.mutable:
            return apply(variables, x, mutable=list(self.mutable), **kwargs)
        return apply(variables, x, **kwargs), {}

    def run(self, feature: Feature, rules: Any = None) -> _Run:
        sharding = _sharding(feature, self.mesh)
        model = jlinen.apply_policy(self.module, feature.policy, rules, fp8=feature.fp8, **sharding)
        x0, _ = self.batch(0)
        init_kwargs = {"rngs": {"params": jax.random.key(0), "dropout": jax.random.key(1)}}
        variables = dict(model.init(init_kwargs["rngs"], x0))
        model_state = {k: variables.pop(k) for k in self.mutable}
        params = variables if "fp8" in variables else variables["params"]
        if self.mesh:
            params = _place(params, feature, self.mesh)
        elif feature.fsdp and self.mode != "pmap":  # pmap replicates its own arguments
            params = shard_params(params, _mesh(), "data")
        wrap = (lambda p: p) if "fp8" in variables else (lambda p: {"params": p})
        pmap = self.mode == "pmap"
        tx = _tx(feature, axis_name="d" if pmap else None, multisteps=self.mode == "multisteps")
        state = TrainState.create(
            apply_fn=model.apply,
            params=params,
            tx=tx,
            model_state=model_state,
            fp8_axis_name="d" if pmap and feature.fp8 and "delayed" in feature.fp8 else None,
        )

        def step(state: TrainState, x: jax.Array, y: jax.Array, i: Any) -> tuple[TrainState, jax.Array]:
            def loss_fn(params: Any) -> tuple[jax.Array, Any]:
                out, new_state = self._call(state.apply_fn, {**wrap(params), **state.model_state}, x, i)
                return self.loss(out, y), new_state

            (loss, new_state), grads = jmp_lite.value_and_grad(loss_fn, has_aux=True)(state, state.params)
            if pmap:
                grads = jax.lax.pmean(grads, "d")
                new_state = jax.lax.pmean(new_state, "d")
                loss = jax.lax.pmean(loss, "d")
            return state.apply_gradients(grads=grads, model_state=new_state), loss

        def pure(variables: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            out, _ = self._call(self.module.apply, variables, x, 0)
            return self.loss(out, y)

        n = jax.local_device_count()
        if pmap:
            stepped = jax.pmap(step, axis_name="d", in_axes=(0, 0, 0, None))
            state = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), state)

            def split(i: int) -> tuple[jax.Array, jax.Array]:
                x, y = self.batch(i, 8 * n)
                return x.reshape(n, 8, *x.shape[1:]), y.reshape(n, 8, *y.shape[1:])

            call = _Call(stepped, lambda i: (*split(i), i))
            return _Run(state, call, pure, wrap, self.batch, replicated=True)
        if self.mode == "eager":
            # un-jitted: every operation dispatched on its own; a sharded (FSDP) row on its mesh in a
            # jax.set_mesh context, as docs/distributed.md says eager steps on Explicit axes need
            mesh = sharding.get("mesh")
            call = _Call(step, lambda i: (*self.batch(i), i), eager=True, mesh=mesh)
            return _Run(state, call, pure, wrap, self.batch)
        stepped = jax.jit(step)
        if self.mesh:  # the batch split over the mesh the parameters are placed on (the tools' too)
            batch = _placed(self.batch, _mesh(self.mesh))
            return _Run(state, _Call(stepped, lambda i: (*batch(i), i)), pure, wrap, lambda i, n=0: batch(i))
        if self.mode == "sharded":
            # Auto axes: the compiler places the gradient reduction (Explicit axes would need out_sharding=
            # on the weight gradient's contraction, in float32 JAX as well)
            mesh = jax.make_mesh((n,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))

            def placed(i: int) -> tuple[jax.Array, jax.Array]:
                return jax.device_put(self.batch(i, 8 * n), sharding)

            return _Run(state, _Call(stepped, lambda i: (*placed(i), i)), pure, wrap, self.batch)
        if feature.fsdp:  # a batch of 8: one example per device
            return _Run(state, _Call(stepped, lambda i: (*self.batch(i, 8), i)), pure, wrap, self.batch)
        return _Run(state, _Call(stepped, lambda i: (*self.batch(i), i)), pure, wrap, self.batch)


def _jitted_loss(step: Any, state: Any, i: int) -> float:
    """The loss of step ``i`` from ``state``, by ``step`` (a ``_Call``) under ``jax.jit``; the state is
    left as it is (an eager step's reference)."""
    return float(np.mean(step.under_jit(state, *step.args(i))[1]))


@dataclasses.dataclass
class _Call:
    """A jitted step and the arguments of step ``i`` after the state: called to train, lowered to trace.
    An ``eager`` step is the un-jitted function (run in ``jax.set_mesh(mesh)`` when there is a mesh)."""

    jitted: Any
    args: Callable[[int], tuple[Any, ...]]
    eager: bool = False
    mesh: Any = None

    @functools.cached_property
    def under_jit(self) -> Any:
        """The step under ``jax.jit`` (an eager step's reference)."""
        return jax.jit(self.jitted) if self.eager else self.jitted

    def __call__(self, state: Any, i: int) -> tuple[Any, jax.Array]:
        if self.mesh is not None:
            with jax.set_mesh(self.mesh):
                return self.jitted(state, *self.args(i))
        return self.jitted(state, *self.args(i))


@dataclasses.dataclass
class _Run:
    """A built cell: a state, a step, and the pure loss the tools read."""

    state: Any
    step: _Call
    pure: Callable[..., jax.Array]
    wrap: Callable[[Any], Any]
    batch: Callable[..., tuple[jax.Array, jax.Array]]
    replicated: bool = False

    @property
    def eager(self) -> bool:
        return self.step.eager

    def jitted_loss(self, i: int) -> float:
        return _jitted_loss(self.step, self.state, i)

    def train(self, steps: int = STEPS, start: int = 0) -> list[float]:
        losses = []
        for i in range(start, start + steps):
            self.state, loss = self.step(self.state, i)
            losses.append(float(np.mean(loss)))
        return losses

    def lower(self, i: int = 0) -> Any:
        return self.step.jitted.lower(self.state, *self.step.args(i))

    def params(self) -> Any:
        params = self.state.params
        return jax.tree_util.tree_map(lambda a: a[0], params) if self.replicated else params

    def opt_state(self) -> Any:
        opt = self.state.opt_state
        return jax.tree_util.tree_map(lambda a: a[0], opt) if self.replicated else opt

    def tool_args(self) -> tuple[Any, ...]:
        x, y = self.batch(0)
        variables = dict(self.wrap(self.params()))
        variables.pop("fp8", None)
        state = self.state.model_state
        if self.replicated:
            state = jax.tree_util.tree_map(lambda a: a[0], state)
        return ({**variables, **state}, x, y)


# ---------------------------------------------------------------------------------------------------------
# NNX: the models, a view, and LossScaledOptimizer.


class _NnxMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: bool = False, norm: bool = False):
        self.inp = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs) if norm else None
        self.drop = nnx.Dropout(0.1, rngs=rngs) if dropout else None
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.inp(x)
        if self.norm is not None:
            h = self.norm(h)
        h = nnx.gelu(h)
        if self.drop is not None:
            h = self.drop(h)
        return self.out(h)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return nnx.gelu(self.lin(h))


class _NnxScanMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(8, 16, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> _NnxBlock:
            return _NnxBlock(rngs)

        self.blocks = blocks(rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block: _NnxBlock, h: jax.Array) -> jax.Array:
            return block(h)

        return self.out(body(self.blocks, self.inp(x)))


class _NnxConvNet(nnx.Module):
    """Convolutions only, no Linear: the NNX twin of ``_ConvNet``."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(2, 16, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 2, (3, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.mean(self.conv2(nnx.gelu(self.conv1(x))), axis=(1, 2))


def _store(model: nnx.Module, dtype: Any) -> nnx.Module:
    """The model with its Linear and Conv layers' parameters stored in ``dtype`` (the float32 ones,
    rounded: the same start as the float32 run), and its norm layers' in float32, as docs/flax.md
    advises."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, (nnx.Linear, nnx.Conv)):
            for name in ("kernel", "bias"):
                variable = getattr(module, name)
                variable.set_value(variable.get_value().astype(dtype))
    return model


@dataclasses.dataclass
class _Nnx:
    make: Callable[..., nnx.Module]
    mode: str = "jit"  # jit | eager | orbax
    batch: Callable[..., tuple[jax.Array, jax.Array]] = _batch
    # a mesh column: "auto" | "explicit" axes; the model's variables placed (_place), the batch split
    mesh: str | None = None

    def build(self, feature: Feature, rules: Any = None) -> tuple[Any, Any]:
        model = _store(self.make(nnx.Rngs(0)), jmp_lite.get_policy(feature.policy).param)
        if self.mesh:
            nnx.update(model, _place(nnx.state(model), feature, self.mesh))
        elif feature.fsdp:
            nnx.update(model, shard_params(nnx.state(model), _mesh(), "data"))
        sharding = _sharding(feature, self.mesh)
        view = jnnx.apply_policy(model, feature.policy, rules, fp8=feature.fp8, **sharding)
        return view, jnnx.LossScaledOptimizer(view, _tx(feature))

    def step_batch(self, i: int) -> tuple[jax.Array, jax.Array]:
        return _placed(self.batch, _mesh(self.mesh))(i) if self.mesh else self.batch(i)

    def run(self, feature: Feature, rules: Any = None) -> _NnxRun:
        view, optimizer = self.build(feature, rules)
        return _NnxRun(self, feature, rules, view, optimizer)


def _nnx_eager_step(view: Any, optimizer: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    rollback = jnnx.snapshot(view, nnx.BatchStat, nnx.RngState)
    loss, grads = jmp_lite.value_and_grad(lambda v: _mse(v(x), y))(optimizer, view)
    optimizer.update(view, grads, rollback=rollback)
    return loss


_nnx_step = nnx.jit(_nnx_eager_step)


@dataclasses.dataclass
class _NnxRun:
    part: _Nnx
    feature: Feature
    rules: Any
    view: Any
    optimizer: Any

    def step(self, state: Any, i: int) -> tuple[Any, jax.Array]:
        view, optimizer = state
        if self.eager:
            mesh = _sharding(self.feature).get("mesh")  # a sharded row: in its mesh's context
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                return state, _nnx_eager_step(view, optimizer, *self.part.step_batch(i))
        return state, _nnx_step(view, optimizer, *self.part.step_batch(i))

    @property
    def eager(self) -> bool:
        return self.part.mode == "eager"

    def jitted_loss(self, i: int) -> float:
        """The loss of step ``i`` from the current state, by the jitted step; the view's and the
        optimizer's state are then put back as they were."""
        # nnx.state holds the live Variables: tree_map copies them (the arrays are not copied)
        saved = jax.tree_util.tree_map(lambda a: a, (nnx.state(self.view), nnx.state(self.optimizer)))
        loss = float(_nnx_step(self.view, self.optimizer, *self.part.step_batch(i)))
        nnx.update(self.view, saved[0])
        nnx.update(self.optimizer, saved[1])
        return loss

    def lower(self, i: int = 0) -> Any:
        return _nnx_step.lower(self.view, self.optimizer, *self.part.step_batch(i))

    @property
    def state(self) -> tuple[Any, Any]:
        return self.view, self.optimizer

    def train(self, steps: int = STEPS, start: int = 0) -> list[float]:
        return [float(self.step(self.state, i)[1]) for i in range(start, start + steps)]

    def params(self) -> Any:
        return nnx.state(self.view.model, nnx.Param)

    def opt_state(self) -> Any:
        return nnx.as_pure(self.optimizer.opt_state)

    def save(self) -> Callable[[], None]:
        """Saves ``nnx.state(view)`` and the optimizer with orbax (as docs/checkpoints.md does); the
        returned function restores them into a fresh build, which then becomes this run's state."""
        import orbax.checkpoint as ocp

        directory = pathlib.Path(tempfile.mkdtemp()) / "ck"
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(directory, {"view": nnx.state(self.view), "opt": nnx.state(self.optimizer)})
        checkpointer.wait_until_finished()

        def restore() -> None:
            abstract = nnx.eval_shape(lambda: self.part.build(self.feature, self.rules))
            target = {"view": nnx.state(abstract[0]), "opt": nnx.state(abstract[1])}
            restored = checkpointer.restore(directory, target)
            self.view, self.optimizer = self.part.build(self.feature, self.rules)
            nnx.update(self.view, restored["view"])
            nnx.update(self.optimizer, restored["opt"])

        return restore

    def tool(self) -> tuple[Callable[..., jax.Array], tuple[Any, ...]]:
        graphdef, state = nnx.split(self.view.model)
        x, y = self.part.step_batch(0)

        def pure(state: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            return _mse(nnx.merge(graphdef, state)(x), y)

        return pure, (state, x, y)


# ---------------------------------------------------------------------------------------------------------
# autocast over Equinox and over plain JAX with a user's jax.checkpoint.


def _plain_remat_mlp(params: Any, x: jax.Array) -> jax.Array:
    @jax.checkpoint
    def layer(w: jax.Array, h: jax.Array) -> jax.Array:
        return jax.nn.gelu(checkpoint_name(h @ w, "pre"))

    policy = jax.checkpoint_policies.save_only_these_names("pre")
    layer = jax.checkpoint(layer, policy=policy)
    return layer(params["w2"], layer(params["w1"], x)) @ params["w3"]


def _plain_params() -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = {"w1": (8, 16), "w2": (16, 16), "w3": (16, 2)}
    return {k: jax.random.normal(key, s) / np.sqrt(s[0]) for key, (k, s) in zip(keys, shapes.items())}


def _equinox_model() -> tuple[Any, Callable[[Any, jax.Array], jax.Array]]:
    eqx = pytest.importorskip("equinox", reason="the Equinox column needs equinox")
    model = eqx.nn.MLP(8, 2, 16, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    return params, lambda p, x: jax.vmap(eqx.combine(p, static))(x)


@dataclasses.dataclass
class _Autocast:
    make: Callable[[], tuple[Any, Callable[[Any, jax.Array], jax.Array]]]
    mode: str = "jit"  # jit | eager
    # a mesh column: "auto" | "explicit" axes; the parameters placed (_place), the batch split
    mesh: str | None = None

    def run(self, feature: Feature, rules: Any = None) -> _AutocastRun:
        params, apply = self.make()
        policy = jmp_lite.get_policy(feature.policy)
        params = jax.tree_util.tree_map(
            lambda a: a.astype(policy.param) if jnp.issubdtype(a.dtype, jnp.floating) else a, params
        )
        sharding = _sharding(feature, self.mesh)
        f = jmp_lite.autocast(apply, feature.policy, rules=rules, fp8=feature.fp8, **sharding)
        if self.mesh:
            params = _place(params, feature, self.mesh)
        elif feature.fsdp:
            params = shard_params(params, _mesh(), "data")
        recipe = jmp_lite.get_fp8_recipe(feature.fp8) if feature.fp8 else None
        states = f.init_fp8_state(params, _batch(0)[0]) if recipe and recipe.scaling == "delayed" else None
        tx = _tx(feature)

        def step(carry: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
            params, states, opt_state = carry
            if states is None:
                loss, grads = jmp_lite.value_and_grad(lambda p: _mse(f(p, x), y))(opt_state, params)
            else:
                loss_fn = lambda p, s: _mse(f(p, x, fp8_state=s), y)  # noqa: E731
                loss, (grads, seen) = jmp_lite.value_and_grad(loss_fn, argnums=(0, 1))(
                    opt_state, params, states
                )
            updates, opt_state = tx.update(grads, opt_state, params)
            if states is not None:
                finite = jmp_lite.get_loss_scaling_state(opt_state).last_grads_finite
                states = fp8.update_fp8_state(states, seen, recipe, finite=finite)
            return (optax.apply_updates(params, updates), states, opt_state), loss

        if self.mode == "eager":  # un-jitted; a sharded row in its mesh's context (docs/distributed.md)
            call = _Call(step, _batch, eager=True, mesh=sharding.get("mesh"))
        else:
            call = _Call(jax.jit(step), _placed(_batch, _mesh(self.mesh)) if self.mesh else _batch)
        pure = lambda p, x, y: _mse(apply(p, x), y)  # noqa: E731
        return _AutocastRun((params, states, tx.init(params)), call, pure)


@dataclasses.dataclass
class _AutocastRun:
    state: Any
    step: _Call
    pure: Callable[..., jax.Array]

    @property
    def eager(self) -> bool:
        return self.step.eager

    def jitted_loss(self, i: int) -> float:
        return _jitted_loss(self.step, self.state, i)

    def train(self, steps: int = STEPS, start: int = 0) -> list[float]:
        losses = []
        for i in range(start, start + steps):
            self.state, loss = self.step(self.state, i)
            losses.append(float(loss))
        return losses

    def lower(self, i: int = 0) -> Any:
        return self.step.jitted.lower(self.state, *self.step.args(i))

    def params(self) -> Any:
        return self.state[0]

    def opt_state(self) -> Any:
        return self.state[2]

    def tool_args(self) -> tuple[Any, ...]:
        return (self.params(), *self.step.args(0))  # the step's batch: on the mesh in a mesh column


# ---------------------------------------------------------------------------------------------------------
# The columns.


@_poisonable
def _token_batch(i: int, n: int = 4) -> tuple[jax.Array, jax.Array]:
    """The language models' batch: 4 sequences of 8 tokens (of 64) and the next tokens."""
    tokens = np.random.default_rng(0).integers(0, 64, (n, 9), np.int32)
    # float targets, so that a NaN can mark a bad batch
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:].astype(np.float32))


def _token_loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32) + 0.0 * jnp.sum(y)  # NaN logits (and gradients) for a bad batch
    return optax.softmax_cross_entropy_with_integer_labels(logits, y.astype(jnp.int32)).mean()


def _hf_gpt2() -> _Linen:
    transformers = pytest.importorskip("transformers", reason="the Hugging Face column needs transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    module = transformers.FlaxGPT2LMHeadModel(config, seed=0, _do_init=False).module

    class Lm(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            gpt2 = module.clone(parent=self, name="gpt2")
            return gpt2(tokens, jnp.ones_like(tokens), positions, deterministic=True).logits

    return _Linen(Lm(), batch=_token_batch, loss=_token_loss)


PARTS: dict[str, Callable[[], Any]] = {
    "linen": lambda: _Linen(_Mlp()),
    "nnx": lambda: _Nnx(_NnxMlp),
    "equinox": lambda: _Autocast(_equinox_model),
    "huggingface_gpt2": _hf_gpt2,
    "dropout_typed_key": lambda: _Linen(_DropoutMlp(), dropout_key=jax.random.key),
    "dropout_raw_key": lambda: _Linen(_DropoutMlp(), dropout_key=jax.random.PRNGKey),
    "nnx_dropout": lambda: _Nnx(lambda rngs: _NnxMlp(rngs, dropout=True)),
    "batchnorm": lambda: _Linen(_BatchNormMlp(), mutable=("batch_stats",)),
    "nnx_batchnorm": lambda: _Nnx(lambda rngs: _NnxMlp(rngs, norm=True)),
    "user_remat": lambda: _Autocast(lambda: (_plain_params(), _plain_remat_mlp)),
    "nn_scan": lambda: _Linen(_ScanMlp()),
    "nnx_scan": lambda: _Nnx(_NnxScanMlp),
    "multisteps": lambda: _Linen(_Mlp(), mode="multisteps"),
    "pmap": lambda: _Linen(_Mlp(), mode="pmap"),
    "sharded_jit": lambda: _Linen(_Mlp(), mode="sharded"),
    "orbax": lambda: _Nnx(lambda rngs: _NnxMlp(rngs, norm=True), mode="orbax"),
    "flax_serialization": lambda: _Linen(_BatchNormMlp(), mutable=("batch_stats",), mode="serialization"),
    "eager_linen": lambda: _Linen(_Mlp(), mode="eager"),
    "eager_nnx": lambda: _Nnx(_NnxMlp, mode="eager"),
    "eager_equinox": lambda: _Autocast(_equinox_model, mode="eager"),
    "mesh_auto": lambda: _Linen(_Mlp(), mesh="auto"),
    "mesh_explicit": lambda: _Linen(_Mlp(), mesh="explicit"),
    "nnx_mesh_explicit": lambda: _Nnx(_NnxMlp, mesh="explicit"),
    "conv": lambda: _Linen(_ConvNet(), batch=_image_batch),
    "nnx_conv": lambda: _Nnx(_NnxConvNet, batch=_image_batch),
}

# Cells that are refused by design, with the words the error must contain (it names the pair and the fix).
EXPECTED_ERRORS: dict[tuple[str, str], tuple[type[Exception], str]] = {
    (f, p): refused
    for f in ("fsdp", "fsdp_ring")  # the two ways of reduce-scattering share these refusals
    for p, refused in {
        # sharded training returns only state the devices agree on; batch statistics in training differ
        "batchnorm": (ValueError, r"apply\(mutable=\.\.\.\) is not supported in sharded training"),
        "flax_serialization": (ValueError, r"apply\(mutable=\.\.\.\) is not supported in sharded"),
        "nnx_batchnorm": (ValueError, "updates state that differs between devices"),
        "orbax": (ValueError, "updates state that differs between devices"),
        # FSDP maps itself over its mesh: not inside pmap, not on a batch laid out on another mesh
        "pmap": (ValueError, "called inside jax.pmap or jax.shard_map .* call it under jax.jit"),
        "sharded_jit": (ValueError, "a batch argument is laid out on another mesh"),
    }.items()
}

# Cells that run, with a warning the cell checks (its category and words): fp8 on a model whose only
# contractions are convolutions runs nothing in fp8 (docs/fp8.md), and says so.
EXPECTED_WARNINGS: dict[tuple[str, str], tuple[type[Warning], str]] = {
    **{
        (f, p): (UserWarning, r"fp8=\.\.\.\): no contraction of this model reads a weight")
        for f in ("fp8_current", "fp8_delayed", "fp8_block")
        for p in ("conv", "nnx_conv")
    },
    # the user's checkpoints decide what their program keeps: recompute= has nothing to change, and says so
    ("recompute", "user_remat"): (UserWarning, r"recompute='wide_contractions' has no effect on this"),
}

# Cells that a bug in jmp_lite breaks (not a refusal by design), with the bug and the tiers it shows in
# ("trace", "train"): each runs as pytest.mark.xfail(strict=True), so the fix makes it fail until its
# entry here is removed. None today.
KNOWN_BUGS: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}


# ---------------------------------------------------------------------------------------------------------
# What each cell checks.


def _tools(run: Any) -> tuple[Callable[..., jax.Array], tuple[Any, ...]]:
    if isinstance(run, _NnxRun):
        return run.tool()
    return run.pure, run.tool_args()


_REFERENCE: dict[str, list[float]] = {}  # each column's float32 losses (and sharded ones), computed once


def _check_train(name: str, part: Any, feature: Feature) -> None:
    run = part.run(feature)
    column = name.split(" x ")[1]
    # a sharded row against float32 sharded the same way: each device draws its own dropout masks
    key = f"{column} fsdp" if feature.fsdp else column
    if key not in _REFERENCE:  # an eager column's float32 run jitted: eager and jit agree (checked below)
        jitted = dataclasses.replace(part, mode="jit") if run.eager else part
        _REFERENCE[key] = jitted.run(dataclasses.replace(FLOAT32, fsdp=feature.fsdp)).train()
    reference = _REFERENCE[key]
    if getattr(part, "mode", None) in ("orbax", "serialization"):
        # STEPS - 1 steps, save, one more step (the uninterrupted run); restore, the same step again
        losses = run.train(STEPS - 1)
        restore = _save(run)
        losses += run.train(1, start=STEPS - 1)
        after = _bits(run.params())
        restore()
        resumed = run.train(1, start=STEPS - 1)
        assert resumed[-1] == losses[-1], f"{name}: resumed {resumed[-1]!r} != uninterrupted {losses[-1]!r}"
        assert _bits(run.params()) == after, f"{name}: the resumed parameters differ"
    elif run.eager:
        losses = _train_eagerly(name, run, feature)
    else:
        losses = run.train()
    assert all(np.isfinite(losses)), losses
    assert abs(losses[-1] - reference[-1]) <= feature.band * abs(reference[-1]), (losses, reference)
    if feature.quantized:
        _assert_quantized(name, run.opt_state())
    assert losses[-1] != losses[0], f"{name}: the loss did not move: {losses}"


def _train_eagerly(name: str, run: Any, feature: Feature) -> list[float]:
    """An eager column's training: STEPS un-jitted steps, each of whose losses is within two roundings
    of the compute dtype (2 eps relative) of the same step jitted from the same state, and after which
    every parameter keeps its dtype. Not bit for bit: an eager step runs its operations as separate XLA
    programs, each rounding its 16-bit result, where the jitted step is one program whose fusions round
    differently (an FSDP Dense under the bf16 policy: 1.04930 eager, 1.04819 jitted, 1e-3 apart; the
    same bfloat16 arithmetic written out in NumPy order gives the eager value)."""
    tolerance = 2 * float(jnp.finfo(jmp_lite.get_policy(feature.policy).compute).eps)
    dtypes = [a.dtype for a in jax.tree_util.tree_leaves(run.params())]
    losses = []
    for i in range(STEPS):
        jitted = run.jitted_loss(i)
        losses += run.train(1, start=i)
        assert abs(losses[-1] - jitted) <= tolerance * abs(jitted), (
            f"{name}: step {i} eager {losses[-1]!r} != jit {jitted!r} (within {tolerance:.3g} relative)"
        )
    assert [a.dtype for a in jax.tree_util.tree_leaves(run.params())] == dtypes, (
        f"{name}: a parameter changed dtype"
    )
    return losses


def _assert_quantized(name: str, opt_state: Any) -> None:
    n = quantized_arrays(opt_state)
    assert n >= 2, f"{name}: {n} state arrays in 8 bits; the kernels' mu and nu should be"


def _save(run: Any) -> Callable[[], None]:
    """Saves the run's training state the documented way; the returned function restores it."""
    if isinstance(run, _NnxRun):
        return run.save()
    import flax.serialization

    blob = flax.serialization.to_bytes(run.state)

    def restore() -> None:  # into the live state as the target: every value must come from the bytes
        run.state = flax.serialization.from_bytes(run.state, blob)

    return restore


def _check_skip(name: str, part: Any, feature: Feature) -> None:
    run = part.run(feature)
    run.train(1)
    before = _bits(run.params())
    POISONED.add(1)
    try:
        run.train(1, start=1)
    finally:
        POISONED.discard(1)
    assert _bits(run.params()) == before, f"{name}: a skipped step changed the parameters"
    report = jmp_lite.describe_skip(run.opt_state())
    assert report.skipped_total == 1 and report.paths, report
    assert not report.last_step_applied and all(isinstance(p, str) and p for p in report.paths), report


def _report(run: Any, part: Any, feature: Feature) -> Any:
    """The precision report, taken the way docs/doctor.md shows for the front-end."""
    if isinstance(run, _NnxRun):
        x, y = run.part.step_batch(0)
        return jmp_lite.precision_report(run.view, loss=lambda out: _mse(out, y))(x)
    if isinstance(part, _Linen):
        variables, x, y = run.tool_args()
        model = jlinen.apply_policy(part.module, feature.policy)
        kwargs: dict[str, Any] = {}
        if part.dropout_key is not None:
            kwargs["rngs"] = {"dropout": part.dropout_key(0)}
        if part.mutable:
            kwargs["mutable"] = list(part.mutable)

        def loss(out: Any) -> jax.Array:
            return part.loss(out[0] if part.mutable else out, y)

        return jmp_lite.precision_report(model.apply, loss=loss)(variables, x, **kwargs)
    return jmp_lite.precision_report(run.pure, feature.policy)(*run.tool_args())


def _check_report(name: str, part: Any, feature: Feature) -> None:
    run = part.run(feature)
    report = _report(run, part, feature)
    assert report.ranking(), f"{name}: an empty report"
    suggestion = jmp_lite.suggest_rules(report, error=1e-9)  # a rule wherever 16 bits err: the most rules
    rerun = part.run(feature, rules=suggestion)  # what suggest_rules returns goes straight into rules=
    losses = rerun.train(1)
    assert np.isfinite(losses).all()


def _check_residual(name: str, part: Any, feature: Feature) -> None:
    run = part.run(feature)
    pure, args = _tools(run)
    half = jmp_lite.memory.residual_bytes(jmp_lite.autocast(pure, feature.policy), *args, argnums=0)
    full = jmp_lite.memory.residual_bytes(pure, *args, argnums=0)
    assert 0 < half.total < full.total, (half.total, full.total)


def _check_export(name: str, part: Any, feature: Feature, steps: int = 1) -> None:
    run = part.run(feature)
    run.train(steps)
    params = run.params()
    exported = jmp_lite.export_params(params, "bf16")
    floats = [a for a in jax.tree_util.tree_leaves(exported) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert floats and all(a.dtype == jnp.bfloat16 for a in floats)
    back = jax.tree_util.tree_map(
        lambda e, p: e.astype(p.dtype), exported, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    for e, p in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_allclose(
            np.asarray(e, np.float32), np.asarray(p, np.float32), rtol=2**-7, atol=1e-6
        )


CHECKS = {
    "train": _check_train,
    "skip": _check_skip,
    "report": _check_report,
    "residual": _check_residual,
    "export": _check_export,
}


def _state_bits(run: Any) -> list[bytes]:
    if isinstance(run, _NnxRun):
        return _bits((nnx.state(run.view), nnx.state(run.optimizer)))
    return _bits(run.state)


def _trace(name: str, part: Any, feature: Feature) -> None:
    """A traced cell: the cell's training step traced and lowered for XLA (everything but the
    compile: the policy, fp8, loss scaling and the optimizer, forward and backward), the checkpoint
    round trip of its state, and the tools that only trace (``residual_bytes``, ``export_params``)."""
    if feature.check == "residual":
        _check_residual(name, part, feature)
        return
    if feature.check == "export":
        _check_export(name, part, feature, steps=0)
        return
    run = part.run(feature)
    if feature.quantized:
        _assert_quantized(name, run.opt_state())
    assert not run.eager, f"{name}: an eager column has nothing to trace (it runs in the system tier)"
    lowered = run.lower(0)
    if not isinstance(run, _NnxRun):  # jax's Lowered: the step returns (state, loss), the loss in float32
        loss = lowered.out_info[1]
        assert loss.dtype == jnp.float32, f"{name}: the loss is {loss.dtype}"
    if getattr(part, "mode", None) in ("orbax", "serialization"):
        before = _state_bits(run)
        _save(run)()
        assert _state_bits(run) == before, f"{name}: the restored state differs from the saved one"


def run_cell(feature: str, part: str, *, trace: bool = False) -> None:
    """Runs one cell (traced when ``trace``): its check passes, or it raises the expected clear error."""
    built = PARTS[part]()
    row = FEATURES[feature]
    check = _trace if trace else CHECKS[row.check]
    warning = EXPECTED_WARNINGS.get((feature, part))
    warns = pytest.warns(warning[0], match=warning[1]) if warning else contextlib.nullcontext()
    expected = EXPECTED_ERRORS.get((feature, part))
    if expected is None:
        with warns:
            check(f"{feature} x {part}", built, row)
        return
    exc, words = expected
    with pytest.raises(exc, match=words):
        check(f"{feature} x {part}", built, row)


# Columns whose cells the system tier trains for some rows only (its time: an eager step dispatches
# every operation on its own), and which; docs/composition.md says why each subset stands for its
# column. EDGE_TRACES: the cells of the edges columns that are traced (the other files'
# columns trace every row); a cell neither trains nor traces is "not run".
_EAGER = ("bf16", "f16_dynamic", "fp8_delayed", "record_nonfinite")
_NO_REPORT = tuple(f for f in FEATURES if f != "precision_report")  # the report: ~10 s a mesh cell
ROWS: dict[str, tuple[str, ...]] = {
    "eager_linen": (*_EAGER, "stochastic_rounding", "int8_moments", "recompute"),
    "eager_nnx": (*_EAGER, "kahan_summation", "int8_moments", "fsdp"),
    "eager_equinox": (*_EAGER[:2], "fp8_current", "record_nonfinite"),
    "mesh_auto": _NO_REPORT,
    "nnx_mesh_explicit": _NO_REPORT,
}
EDGE_TRACES: dict[str, tuple[str, ...]] = {
    "mesh_explicit": ("bf16", "fp8_block", "int8_moments"),
    "nnx_mesh_explicit": ("fp8_delayed", "low_precision_state"),
    "conv": ("bf16", "fp8_current"),
    "nnx_conv": ("bf16", "fp8_current"),
}


def rows(part: str) -> tuple[str, ...]:
    """The rows a column runs: every feature, or the subset ``ROWS`` gives it."""
    return ROWS.get(part, tuple(FEATURES))


def cells(
    *parts: str,
    first_in_ci: tuple[str, ...] = (),
    tier: str = "trace",
    only: dict[str, tuple[str, ...]] | None = None,
) -> Any:
    """The parametrization of the cells of these columns in a tier (``"trace"``, ``"train"``): each
    column's ``rows``, or the rows ``only`` names for it. Every cell is a ``composition`` test, in the
    system tier (conftest.py). CI traces every cell (each is a different pair: ``all_params``), but those
    of the columns in ``first_in_ci`` once per column, the rest nightly; it trains each column's first
    cell, the rest nightly (see conftest._mark_nightly). A cell in ``KNOWN_BUGS`` for this tier is a
    strict xfail naming its bug."""
    assert set(parts) <= set(PARTS) and set(first_in_ci) <= set(parts), (set(parts) - set(PARTS), first_in_ci)
    assert tier in ("trace", "train"), tier

    def marks(f: str, p: str) -> list[Any]:
        bug = KNOWN_BUGS.get((f, p))
        xfail = [pytest.mark.xfail(strict=True, reason=bug[0])] if bug and tier in bug[1] else []
        if tier == "train" or p in first_in_ci:
            return xfail
        return [pytest.mark.all_params, *xfail]

    pairs = [
        pytest.param(f, p, id=f"{f}-{p}", marks=marks(f, p))
        for p in parts
        for f in FEATURES
        if (f in only.get(p, ()) if only is not None else f in rows(p))
    ]
    return pytest.mark.parametrize("feature, part", pairs)


# Which file runs which columns: every column exactly once (checked in test_composition_autocast.py).
GROUPS = {
    "frontends": ("linen", "huggingface_gpt2", "dropout_typed_key", "dropout_raw_key", "batchnorm"),
    "linen_steps": ("nn_scan", "multisteps", "pmap", "sharded_jit", "flax_serialization"),
    "nnx": ("nnx", "nnx_dropout", "nnx_batchnorm", "nnx_scan", "orbax"),
    "autocast": ("equinox", "user_remat"),
    "edges": (
        "eager_linen",
        "eager_nnx",
        "eager_equinox",
        "mesh_auto",
        "mesh_explicit",
        "nnx_mesh_explicit",
        "conv",
        "nnx_conv",
    ),
}
