"""Compile-only targets: TPU topologies and NVIDIA GPUs as devices that XLA compiles for, on a machine
that has neither.

JAX can describe a topology it is not attached to (``jax.experimental.topologies``): libtpu (the
``tpu`` extra of jax) builds TPU slices by name, and the CUDA plugin builds NVIDIA GPUs from one of
XLA's own target descriptions (``target_configs/``, copied from OpenXLA with their license). The
devices cannot run anything, but ``jax.jit(f).lower(*abstract_args).compile()`` on arrays placed on
them is the program the hardware would run: its memory, its dtypes, its collectives. ``pip install
"jmp-lite[aot]"`` installs both compilers.
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources
from typing import Any

import jax
import numpy as np

from jmp_lite._src.base import caches

__all__ = ["Target", "compile_only_target", "known_targets"]

# HBM per chip, from Google Cloud's TPU system-architecture pages (v4, v5e, v5p, v6e/Trillium).
_TPU_MEMORY_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
# the slice of one host, whose first chip stands for one chip ("v5e")
_ONE_HOST = {"v4": "2x2x1", "v5e": "2x2", "v5p": "2x2x1", "v6e": "2x2"}
_TPU_EXAMPLES = ("v5e", "v5e:2x2", "v5e:4x4", "v5e:16x16", "v5p:2x2x1", "v6e:2x2", "v4:2x2x1")
# name -> XLA's target description (the file names are XLA's)
_NVIDIA = {
    "h100": "h100_sxm.txtpb",
    "h200": "h200.txtpb",
    "b200": "b200.txtpb",
    "a100": "a100_sxm_80.txtpb",
}
# Fields of XLA's newer descriptions that jaxlib 0.10 cannot parse
_NEWER_FIELDS = ("collective_memory_granularity",)


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile-only target: ``devices`` that XLA compiles for (nothing runs on them).

    Attributes:
        name: the name it was asked by, normalised (``"v5e:2x2"``, ``"h100:1x1x8"``).
        platform: ``"tpu"`` or ``"gpu"``.
        device_kind: the chip, as XLA names it (``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``).
        devices: the compile-only devices, one per chip.
        memory_bytes: memory per chip (HBM): from the target description for NVIDIA GPUs, from Google
            Cloud's published figure per TPU generation; ``None`` if unknown.

    Example:
        >>> from jmp_lite.memory import compile_only_target
        >>> t = compile_only_target("h100")  # doctest: +SKIP
        >>> t.device_kind, len(t.devices), t.memory_bytes  # doctest: +SKIP
        ('NVIDIA H100 80GB HBM3', 1, 84942979072)
    """

    name: str
    platform: str
    device_kind: str
    devices: tuple[Any, ...]
    memory_bytes: int | None

    def mesh(self, axis_names: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None) -> Any:
        """A ``jax.sharding.Mesh`` over the target's devices (all of them along one axis by default).

        Example:
            >>> from jmp_lite.memory import compile_only_target
            >>> compile_only_target("v5e:2x2").mesh().shape  # doctest: +SKIP
            OrderedDict({'data': 4})
        """
        shape = (len(self.devices),) if shape is None else tuple(shape)
        if int(np.prod(shape)) != len(self.devices) or len(shape) != len(axis_names):
            raise ValueError(
                f"Target.mesh: shape {shape} with axes {axis_names} does not cover the {len(self.devices)} "
                f"devices of {self.name!r}; give one size per axis, whose product is {len(self.devices)}"
            )
        return jax.sharding.Mesh(np.array(self.devices).reshape(shape), tuple(axis_names))

    def __repr__(self) -> str:
        memory = (
            "unknown memory" if self.memory_bytes is None else f"{self.memory_bytes / 2**30:.1f} GiB each"
        )
        return f"Target({self.name!r}: {len(self.devices)} x {self.device_kind}, {memory})"


def known_targets() -> dict[str, str]:
    """The target names ``compile_only_target`` takes, each with what it is.

    Example:
        >>> from jmp_lite.memory import known_targets
        >>> sorted(known_targets())[:2]
        ['a100', 'b200']
    """
    gpus = {name: f"NVIDIA {name.upper()} (XLA's {file}); '{name}:1x1x8' for 8 on one host"
            for name, file in _NVIDIA.items()}  # fmt: skip
    tpus = {name: f"TPU {name.split(':')[0]} slice {name.split(':')[1]} (libtpu's topology names)"
            if ":" in name else f"one TPU {name} chip" for name in _TPU_EXAMPLES}  # fmt: skip
    return {**gpus, **tpus, "cpu": "this machine's CPU devices ('cpu:1' for one)"}


def _config_text(file: str) -> str:
    return resources.files("jmp_lite._src.tools").joinpath("target_configs", file).read_text()


def _without_newer_fields(text: str) -> str:
    """``text`` without the fields of XLA's newer descriptions (their defaults apply without them)."""
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if line.strip().split(":")[0] not in _NEWER_FIELDS)


def _jaxlib_version() -> tuple[int, ...]:
    import jaxlib.version

    return tuple(int(p) for p in re.findall(r"\d+", jaxlib.version.__version__)[:2])


def _nvidia(name: str, topology: str) -> Target:
    from jax.experimental import topologies

    # The plugin checks for a CUDA driver when it loads; compiling needs none.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    text = _config_text(_NVIDIA[name])
    if _jaxlib_version() < (0, 11):  # it cannot parse them (and would log the error before the retry)
        text = _without_newer_fields(text)
    try:
        devices = topologies.get_topology_desc(platform="cuda", target_config=text, topology=topology).devices
    except Exception as error:  # noqa: BLE001 - jaxlib raises its own error types
        if "Failed to parse" not in str(error):
            raise
        text = _without_newer_fields(text)
        devices = topologies.get_topology_desc(platform="cuda", target_config=text, topology=topology).devices
    size = re.search(r"device_memory_size:\s*(\d+)", text)
    return Target(
        f"{name}:{topology}" if topology != "1x1x1" else name,
        "gpu",
        devices[0].device_kind,
        tuple(devices),
        int(size.group(1)) if size else None,
    )


def _tpu(generation: str, topology: str, chips: int | None = None) -> Target:
    from jax.experimental import topologies

    # A compile-only description opens no chip, so it need not take libtpu's one-process lock (a test
    # runner's second process, a training job beside `jmp-lite plan`).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(platform="tpu", topology_name=f"{generation}:{topology}").devices
    memory = _TPU_MEMORY_GIB.get(generation)
    name = generation if chips == 1 else f"{generation}:{topology}"
    devices = devices[:chips] if chips else devices
    return Target(name, "tpu", devices[0].device_kind, tuple(devices), memory * 2**30 if memory else None)


def _missing_extra(what: str, error: Exception) -> ImportError:
    return ImportError(
        f"compile_only_target: compiling for {what} without the hardware needs the aot extra: "
        f"pip install 'jmp-lite[aot]' (jax's tpu and cuda12-local extras). ({type(error).__name__}: {error})"
    )


def _tpu_plugin_installed() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_plugin_installed() -> bool:
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return False
    return True


@caches.lru_cache("targets.compile_only", 32)
def compile_only_target(name: str) -> Target:
    """The compile-only devices of ``name``: a TPU slice by libtpu's topology name (``"v5e:2x2"``,
    ``"v5p:2x2x1"``, ``"v6e:2x2"``, ``"v4:2x2x1"``, ``"v5e:16x16"``, ...), one TPU chip by its
    generation (``"v5e"``, ``"v6e"``, ``"v5p"``, ``"v4"``), or an NVIDIA GPU (``"h100"``,
    ``"h200"``, ``"b200"``, ``"a100"``; ``"h100:1x1x8"`` is 8 of them on one host: slices x hosts x
    GPUs per host). ``"cpu"`` (``"cpu:N"``: the first N) is this machine's CPU devices, which also run.

    Arrays placed on them (``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(target.mesh(),
    spec))``) compile with ``jax.jit(f).lower(...).compile()`` into the target's program; nothing can
    run. Needs the ``aot`` extra (libtpu, the CUDA plugin). The result is cached per name.

    Example:
        >>> from jmp_lite.memory import compile_only_target
        >>> compile_only_target("v5e:2x2").device_kind  # doctest: +SKIP
        'TPU v5 lite'
        >>> compile_only_target("tpu9")
        Traceback (most recent call last):
        ValueError: compile_only_target: unknown target 'tpu9'; ...
    """
    if not isinstance(name, str):
        raise TypeError(
            f"compile_only_target: the target is a name such as 'h100' or 'v5e:2x2', got {name!r}"
        )
    key = name.strip().lower()
    base, _, topology = key.partition(":")
    if base == "cpu":  # this machine's CPU devices (they run, too): the same report for a program here
        devices = jax.devices("cpu")
        count = int(topology) if topology.isdigit() and 0 < int(topology) <= len(devices) else None
        if topology and count is None:
            raise ValueError(f"compile_only_target: {name!r}: 'cpu:N' takes N from 1 to {len(devices)}")
        return Target(key, "cpu", devices[0].device_kind, tuple(devices[:count]), None)
    if base in _NVIDIA:
        topology = topology or "1x1x1"
        if not re.fullmatch(r"\d+x\d+x\d+", topology) or "0" in topology.split("x"):
            raise ValueError(
                f"compile_only_target: {name!r}: an NVIDIA topology is slices x hosts x GPUs per host, "
                f"e.g. '{base}:1x1x8', got {topology!r}"
            )
        if not _cuda_plugin_installed():
            raise _missing_extra("NVIDIA GPUs", ModuleNotFoundError("jax_plugins.xla_cuda12"))
        return _nvidia(base, topology)
    if base in _TPU_MEMORY_GIB or re.fullmatch(r"v\d+[a-z]*", base):
        if not _tpu_plugin_installed():
            raise _missing_extra("TPUs", ModuleNotFoundError("libtpu"))
        if not topology:  # one chip: the first of the smallest slice libtpu describes (one host's)
            return _tpu(base, _ONE_HOST.get(base, "2x2x1"), chips=1)
        return _tpu(base, topology)
    raise ValueError(
        f"compile_only_target: unknown target {name!r}; known: {', '.join(sorted(_NVIDIA))} (NVIDIA, "
        f"optionally ':slicesxhostsxgpus') and TPU topologies such as {', '.join(_TPU_EXAMPLES)}"
    )
