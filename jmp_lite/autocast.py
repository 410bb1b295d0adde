"""Deprecated module path: the names of the module ``jmp_lite.autocast`` live in ``jmp_lite.amp``.

``jmp_lite.autocast`` is the function, and a module of that name was hidden by it: ``import
jmp_lite.autocast as m`` gave the function, so ``jmp_lite.autocast.explain`` raised ``AttributeError``.
``from jmp_lite.autocast import name`` still works for every name of ``jmp_lite.amp``, with a
``DeprecationWarning``.
"""

import warnings
from typing import Any

from jmp_lite import amp as _amp

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    if name in _amp.__all__:
        warnings.warn(
            f"the module path jmp_lite.autocast is deprecated (jmp_lite.autocast is the function); import "
            f"{name} from jmp_lite.amp",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_amp, name)
    raise AttributeError(f"module 'jmp_lite.autocast' has no attribute {name!r}")
