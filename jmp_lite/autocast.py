"""Deprecated module path: the names of the module ``jmp_lite.autocast`` live in ``jmp_lite.amp``.

``jmp_lite.autocast`` is the function, and a module of that name was hidden by it: ``import
jmp_lite.autocast as m`` gave the function, so ``jmp_lite.autocast.explain`` raised ``AttributeError``.
``from jmp_lite.autocast import name`` still works for every name of ``jmp_lite.amp``, with a
``DeprecationWarning``.
"""

from jmp_lite import amp as _amp
from jmp_lite._src.base.exports import moved as _moved

__all__: list[str] = []

__getattr__ = _moved(
    __name__,
    _amp.__all__,
    _amp,
    "the module path jmp_lite.autocast is deprecated (jmp_lite.autocast is the function); import {name} "
    "from jmp_lite.amp",
)
