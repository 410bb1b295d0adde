"""Dtype names, parsing and validation shared by the policy code."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# Canonical short name first: it is what ``str(Policy)`` prints.
_NAMES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.float16): ("f16", "float16", "fp16"),
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float32): ("f32", "float32", "fp32", "full", "single"),
    np.dtype(jnp.float64): ("f64", "float64", "fp64", "double"),
}

# fp8 formats are named in full: the short forms are ambiguous across vendors.
_FP8 = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
)
for _name in _FP8:
    if hasattr(ml_dtypes, _name):
        _NAMES[np.dtype(getattr(ml_dtypes, _name))] = (_name,)

FP8_DTYPES: tuple[np.dtype, ...] = tuple(d for d in _NAMES if d.itemsize == 1)

_BY_NAME: dict[str, np.dtype] = {n: d for d, names in _NAMES.items() for n in names}
_SPECIAL = ("half",)


class _DtypeNames(Mapping):
    """jmp's ``dtype_to_names``: a read-only map from a floating dtype to its names.

    Any spelling of the dtype works as a key (``jnp.float16``, ``np.float16``,
    ``np.dtype("float16")``); the first name is the one ``str(Policy)`` prints.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> jmp_lite.dtype_to_names[jnp.bfloat16]
        ('bf16', 'bfloat16')
        >>> str(jmp_lite.Policy("f4", b"f2", "f4")) == "p=f32,c=f16,o=f32"
        True
    """

    def __getitem__(self, key: Any) -> tuple[str, ...]:
        try:
            return _NAMES[np.dtype(key)]
        except (TypeError, KeyError):
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[Any]:
        return (d.type for d in _NAMES)

    def __len__(self) -> int:
        return len(_NAMES)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{d.name}: {names}" for d, names in _NAMES.items()) + "}"


DTYPE_TO_NAMES: Mapping[Any, tuple[str, ...]] = _DtypeNames()


def accepted_names() -> str:
    """A human-readable list of the dtype names ``parse_dtype`` accepts."""
    return ", ".join(sorted(_BY_NAME) + list(_SPECIAL))


def dtype_name(dtype: np.dtype) -> str:
    """The canonical short name of a supported floating dtype."""
    return _NAMES[np.dtype(dtype)][0]


def parse_dtype(value: str) -> np.dtype:
    """Parses a dtype name (case and surrounding spaces ignored)."""
    if not isinstance(value, str):
        raise TypeError(f"dtype name must be a str, got {type(value).__name__}: {value!r}")
    key = value.strip().lower()
    if key == "half":
        return np.dtype(half_dtype())
    try:
        return _BY_NAME[key]
    except KeyError:
        raise ValueError(f"Unknown dtype {value!r}; accepted: {accepted_names()}") from None


def as_floating_dtype(value: Any, what: str) -> np.dtype:
    """Validates ``value`` as a supported floating dtype, naming ``what`` on error."""
    if isinstance(value, bytes):  # numpy accepts b"f4"; treat bytes and str alike
        value = value.decode("ascii", errors="replace")
    if isinstance(value, str):
        try:
            return parse_dtype(value)
        except ValueError as e:
            try:  # numpy's own spellings ("f4", "<f2", "float32"), as jmp, which passes dtypes through
                dtype = np.dtype(value.strip())
            except TypeError:
                raise ValueError(f"{what}: {e}, or a numpy dtype string such as 'f4'") from None
            if dtype not in _NAMES:
                raise ValueError(
                    f"{what} must be a floating dtype, got {dtype.name}; accepted: {accepted_names()}"
                ) from None
            return dtype
    if value is None or isinstance(value, (bool, int, float, complex)):
        raise TypeError(
            f"{what} must be a floating dtype, got {value!r}; "
            f"accepted: {accepted_names()} or the matching numpy/jax dtype"
        )
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(
            f"{what} must be a floating dtype, got {value!r} "
            f"({type(value).__name__}); accepted: {accepted_names()}"
        ) from None
    if dtype not in _NAMES:
        raise ValueError(f"{what} must be a floating dtype, got {dtype.name}; accepted: {accepted_names()}")
    return dtype


def is_floating_array(x: Any) -> bool:
    """True for numpy and jax arrays (tracers included) of a floating dtype."""
    return isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating)


def half_dtype() -> Any:
    """jmp's half dtype: bfloat16 when the first local device is a TPU, else float16.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> jmp_lite.half_dtype() in (jnp.float16, jnp.bfloat16)
        True
    """
    return jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16


def preferred_half_dtype(device: jax.Device | str | None = None) -> Any:
    """The 16-bit dtype the hardware runs best with full float32 range.

    bfloat16 on TPU, CPU and NVIDIA GPUs of compute capability 8.0 (Ampere) or
    newer; float16 on older or unknown accelerators, where bf16 math is emulated.
    ``device`` is a ``jax.Device``, ``None`` (the first local device) or the name
    of a backend this process has (``"cpu"``, ``"gpu"``, ``"tpu"``...), which
    stands for its first local device.

    Example:
        >>> import jmp_lite
        >>> jmp_lite.preferred_half_dtype()  # on a CPU
        <class 'jax.numpy.bfloat16'>
        >>> jmp_lite.preferred_half_dtype("cpu")
        <class 'jax.numpy.bfloat16'>
    """
    if isinstance(device, str):
        try:
            device = jax.local_devices(backend=device)[0]
        except RuntimeError as e:
            raise ValueError(
                f"preferred_half_dtype: no {device!r} backend in this process ({e}); pass a jax.Device, "
                "None (the first local device) or the name of a backend present here"
            ) from None
    elif device is None:
        device = jax.local_devices()[0]
    elif not isinstance(getattr(device, "platform", None), str):  # a jax.Device, or anything like one
        raise TypeError(
            "preferred_half_dtype takes a jax.Device (e.g. jax.devices()[0]), None (the first local device) "
            f"or a backend name such as 'cpu', 'gpu' or 'tpu'; got {device!r} ({type(device).__name__})"
        )
    if device.platform in ("tpu", "cpu"):
        return jnp.bfloat16
    capability = getattr(device, "compute_capability", None)
    if device.platform in ("gpu", "cuda") and capability:
        major = str(capability).split(".")[0]
        if major.isdigit():  # NVIDIA "8.0"; ROCm reports "gfx90a" and falls through
            return jnp.bfloat16 if int(major) >= 8 else jnp.float16
    return jnp.float16
