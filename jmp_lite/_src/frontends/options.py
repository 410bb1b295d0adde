"""What a front-end is asked for beside its model: one ``Options`` value, checked once at the door.

``autocast``, Linen ``apply_policy`` and NNX ``apply_policy`` take the same keywords (``fp8=``,
``remat_float32=``, ``attention=``, ``mesh=``, ``fsdp_axis=``, ``reduce_dtype=``; the Flax ones also
``accumulate=``). Each resolves its policy, then hands it and the keywords to ``options``, which checks
every one once (the fp8 recipe against the policy, the sharded-training keywords together) and returns the
value the front-end keeps: it builds the engine's root scope and options from it, and never checks them
again. A new option is a field and a check here, and a keyword in each front-end's signature.

Example:
    >>> from jmp_lite._src.base.policy import get_policy
    >>> from jmp_lite._src.frontends.options import options
    >>> opts = options("autocast", get_policy("p=f32,c=bf16,o=f32"), fp8="hybrid,current")
    >>> opts.fp8.stateful, opts.engine_options()
    (False, {'remat_float32': True, 'attention': True})
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jmp_lite._src.base import validate
from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine
from jmp_lite._src.fp8.fp8 import Fp8Recipe
from jmp_lite._src.frontends import fp8_weights
from jmp_lite._src.parallel import fsdp

__all__ = ["Options", "options"]


class Options(NamedTuple):
    """A front-end's checked options: hashable (a model's static attribute, a cache key)."""

    policy: Policy
    accumulate: bool = True  # 16-bit contractions accumulate in float32
    fp8: Fp8Recipe | None = None
    remat_float32: bool = True
    attention: bool = True
    sharding: fsdp.FsdpOptions | None = None  # sharded training (mesh=, fsdp_axis=, reduce_dtype=)

    @property
    def root(self) -> engine.Scope:
        """The engine scope of the whole model."""
        return engine.Scope(self.policy, self.accumulate, self.fp8)

    def engine_options(self) -> dict[str, bool]:
        """The keywords of ``engine.transform`` these options set."""
        return {"remat_float32": self.remat_float32, "attention": self.attention}

    def discovering(self) -> Options:
        """These options for finding the weights fp8 contractions read: current scaling (no states
        needed), on one device."""
        assert self.fp8 is not None
        return self._replace(fp8=self.fp8.replace(scaling="current"), sharding=None)


def options(
    what: str,
    policy: Policy,
    *,
    accumulate: Any = True,
    fp8: Any = None,
    remat_float32: Any = True,
    attention: Any = True,
    mesh: jax.sharding.Mesh | None = None,
    fsdp_axis: str | None = None,
    reduce_dtype: Any = None,
) -> Options:
    """The ``Options`` of front-end ``what`` (``"autocast"``, ``"apply_policy"``) for its resolved
    ``policy``; a bad keyword raises an error that names it and says what is accepted."""
    validate.flags(accumulate=accumulate, remat_float32=remat_float32, attention=attention)
    recipe = fp8_weights.check_fp8(fp8, policy, what, accumulate)
    sharding = fsdp.options(mesh, fsdp_axis, reduce_dtype, recipe, what)
    return Options(policy, accumulate, recipe, remat_float32, attention, sharding)
