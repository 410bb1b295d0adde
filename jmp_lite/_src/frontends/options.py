"""What a front-end is asked for beside its model: one ``Options`` value, checked once at the door.

``autocast``, Linen ``apply_policy`` and NNX ``apply_policy`` take the same keywords (``fp8=``,
``remat_float32=``, ``recompute=``, ``attention=``, ``mesh=``, ``fsdp_axis=``, ``reduce_dtype=``,
``reduce_scatter=``; the Flax ones also ``accumulate=``). Each hands its policy and the keywords to
``front_end_options``, which checks every one once (the sharded-training keywords together, the fp8
recipe, the policy, and the recipe against the policy) and returns the value the front-end keeps: it
builds the engine's root scope and options from it, and never checks them again. A new option is a field
and a check here, and a keyword in each front-end's signature.

Example:
    >>> from jmp_lite._src.frontends.options import front_end_options
    >>> opts = front_end_options("autocast", "p=f32,c=bf16,o=f32", fp8="hybrid,current")
    >>> opts.fp8.stateful, opts.engine_options()
    (False, {'remat_float32': True, 'attention': True, 'recompute': None})
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.base import validate
from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine
from jmp_lite._src.fp8.fp8 import Fp8Recipe
from jmp_lite._src.frontends import fp8_weights
from jmp_lite._src.parallel import fsdp

__all__ = ["Configured", "Options", "check_recompute", "front_end_options"]


class Options(NamedTuple):
    """A front-end's checked options: hashable (a model's static attribute, a cache key)."""

    policy: Policy
    accumulate: bool = True  # 16-bit contractions accumulate in float32
    fp8: Fp8Recipe | None = None
    remat_float32: bool = True
    attention: bool = True
    sharding: fsdp.FsdpOptions | None = (
        None  # sharded training (mesh=, fsdp_axis=, reduce_dtype=, reduce_scatter=)
    )
    recompute: str | None = None  # what the 16-bit checkpoint rebuilds beside float32 math

    @property
    def root(self) -> engine.Scope:
        """The engine scope of the whole model."""
        return engine.Scope(self.policy, self.accumulate, self.fp8)

    def engine_options(self) -> dict[str, Any]:
        """The keywords of ``engine.transform`` these options set."""
        return {"remat_float32": self.remat_float32, "attention": self.attention, "recompute": self.recompute}

    def discovering(self) -> Options:
        """These options for finding the weights fp8 contractions read: current scaling (no states
        needed), on one device."""
        assert self.fp8 is not None
        return self._replace(fp8=self.fp8.replace(scaling="current"), sharding=None)


class Configured:
    """What a Flax front-end's wrapper (Linen's ``PolicyApplied``, NNX's ``PolicyView``) says of the
    options it was built with; the wrapper gives them by ``_front_end_options``."""

    def _front_end_options(self) -> Options:
        raise NotImplementedError

    @property
    def policy(self) -> Policy:
        """The model-wide policy."""
        return self._front_end_options().policy

    @property
    def fp8_recipe(self) -> Fp8Recipe | None:
        """The fp8 recipe of the contractions with a parameter operand (``None``: fp8 off)."""
        return self._front_end_options().fp8

    @property
    def sharding(self) -> fsdp.FsdpOptions | None:
        """Sharded training's mesh, axis and reduction dtype (``None``: one device)."""
        return self._front_end_options().sharding


def front_end_options(
    what: str,
    policy: Any,
    *,
    accumulate: Any = True,
    fp8: Any = None,
    remat_float32: Any = True,
    attention: Any = True,
    recompute: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    fsdp_axis: str | None = None,
    reduce_dtype: Any = None,
    reduce_scatter: Any = None,
) -> Options:
    """The ``Options`` of front-end ``what`` (``"autocast"``, ``"apply_policy"``): ``policy`` (a ``Policy``
    or a policy string) and the keywords, each checked once; a bad one raises an error that names it and
    says what is accepted. The checks run from the sharded-training keywords down to the policy, each
    argument handed to the layer that knows it."""
    sharding = fsdp.sharding_options(mesh, fsdp_axis, reduce_dtype, what, reduce_scatter)
    recipe = fp8_weights.check_fp8(fp8, what, accumulate)
    validate.flags(accumulate=accumulate, remat_float32=remat_float32, attention=attention)
    resolved = validate.policy(policy, f"{what}'s policy")
    check_recompute(what, recompute, remat_float32, resolved)
    if recipe is not None:
        wide = [n for n in ("param", "compute", "output") if np.dtype(getattr(resolved, n)) == np.float64]
        if wide:
            raise ValueError(
                f"{what}: fp8={str(recipe)!r} was asked for with the float64 policy {resolved} "
                f"({', '.join(wide)} float64); fp8 contractions quantize float32, bfloat16 or float16 "
                "operands and have no place in a float64 program: use a float32, bfloat16 or float16 "
                "policy, or fp8=None"
            )
        if recipe.stateful and sharding is not None:
            raise ValueError(
                f"{what}: delayed fp8 scaling keeps an amax history per contraction, and a sharded step "
                "would add the devices' amaxes where their maximum is meant; with mesh= use current "
                "scaling (fp8='hybrid,current'), or gather weights in fp8 with "
                "jmp_lite.distributed.fsdp(..., gather_dtype='float8_e4m3fn')"
            )
    return Options(resolved, accumulate, recipe, remat_float32, attention, sharding, recompute)


def check_recompute(what: str, recompute: Any, remat_float32: bool, policy: Policy) -> None:
    """``recompute=`` shapes the 16-bit checkpoint: it needs one (a 16-bit compute dtype and
    ``remat_float32=True``), so that nothing asked for is dropped in silence."""
    validate.choice(recompute, f"{what}: recompute", engine.RECOMPUTE_CHOICES)
    if recompute is None:
        return
    if np.dtype(policy.compute) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        raise ValueError(
            f"{what}: recompute={recompute!r} rebuilds 16-bit values in the backward pass, and the "
            f"policy {policy} computes in {np.dtype(policy.compute).name}; use a bfloat16 or float16 "
            "compute dtype, or recompute=None (for a float32 model, wrap its blocks in jax.checkpoint)"
        )
    if not remat_float32:
        raise ValueError(
            f"{what}: recompute={recompute!r} is a choice of the 16-bit checkpoint, which "
            "remat_float32=False switches off; keep remat_float32=True, or use recompute=None"
        )
