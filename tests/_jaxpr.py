"""Reading traced programs in tests: every equation, nested bodies included."""

import numpy as np


def eqns(jaxpr):
    """All equations, including those inside pjit/remat/scan/custom_vjp sub-jaxprs."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from eqns(inner)


def in_dtypes(jaxpr, prims):
    """Operand dtypes of every equation whose primitive is named in ``prims``."""
    return [tuple(np.dtype(v.aval.dtype) for v in e.invars) for e in eqns(jaxpr) if e.primitive.name in prims]
