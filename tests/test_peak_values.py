"""What holds a compiled program's temporaries at their peak (``compiled(..., peak_values=True)``,
``jmp_lite._src.tools.live_buffers``): the reader on a dump written here, and on programs compiled for
this machine and, with the aot extra, for an H100 and a TPU v5e chip."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from jmp_lite._src.tools.live_buffers import by_operation, live_at_peak
from jmp_lite.memory import LiveValue, compiled

pytestmark = pytest.mark.unit

# A dump as XLA writes it (abridged): one heap of temporaries (allocation 2) holding three values, a
# parameter outside it, and a copy without metadata whose origin is its operand.
ASSIGNMENT = """BufferAssignment:
allocation 0: size 4096, parameter 0, shape |f32[32,32]| at ShapeIndex {}:
 value: <1 p.1 @0> (size=4096,offset=0): f32[32,32]{1,0}
allocation 1: size 512, color 1, preallocated-temp:
 value: <9 small.1 @0> (size=512,offset=0): f32[128]{0}
allocation 2: size 9000, preallocated-temp:
 value: <2 fusion.1 @0> (size=4000,offset=0): f32[1000]{0}
 value: <3 fusion.2{1} @0> (size=2000,offset=4000): bf16[1000]{0}
 value: <4 copy.7 @0> (size=2000,offset=6000): bf16[1000]{0}
 value: <5 fusion.3 @0> (size=3000,offset=0): (f32[10], f32[20])
"""
LIVE_RANGE = """HloLiveRange (max 9):
  InstructionSequence:
    0:p.1
  BufferLiveRange:
    p.1{}:0-9
    small.1{}:0-9
    fusion.1{}:1-3
    fusion.2{1}:2-5
    copy.7{}:3-4
    fusion.3{}:6-8
"""
HLO = """ENTRY %main {
  %p.1 = f32[32,32]{1,0} parameter(0)
  %fusion.1 = f32[1000]{0} fusion(%p.1), kind=kLoop, metadata={op_name="jit(f)/Block_0/Dense_1/dot_general"}
  %fusion.2 = (f32[1], bf16[1000]) fusion(%fusion.1), metadata={op_name="jit(f)/Block_1/Dense_1/dot_general"}
  %copy.7 = bf16[1000]{0} copy(%gte.2)
  %gte.2 = bf16[1000]{0} get-tuple-element(%fusion.2), index=1
  %fusion.3 = (f32[10], f32[20]) fusion(%copy.7), kind=kLoop
}
"""


def _dump(tmp_path, suffix="", assignment=ASSIGNMENT, live_range=LIVE_RANGE, hlo=HLO):
    for name, text in (
        ("after_optimizations-buffer-assignment.txt", assignment),
        ("after_optimizations-live-range.txt", live_range),
        ("after_optimizations.txt", hlo),
    ):
        (tmp_path / f"module_0001.jit_f.{suffix}{name}").write_text(text)
    return str(tmp_path)


def test_the_values_live_where_the_heap_peaks_largest_first(tmp_path):
    values = live_at_peak(_dump(tmp_path))
    # steps 1-3: fusion.1 (4000) from 1, fusion.2{1} (2000) from 2, copy.7 (2000) from 3: 8000 at step 3;
    # fusion.3 (3000) alone later; the parameter and the other memory space are not temporaries
    assert [(v.name, v.bytes) for v in values] == [
        ("fusion.1{}", 4000),
        ("copy.7{}", 2000),
        ("fusion.2{1}", 2000),
    ]
    assert values[0] == LiveValue(4000, "f32[1000]", "jit(f)/Block_0/Dense_1/dot_general", "fusion.1{}")
    # a copy XLA made carries no metadata: it is named after what it copies (two hops up)
    assert values[1].where == "jit(f)/Block_1/Dense_1/dot_general"


def test_a_buffer_updated_in_place_is_counted_once_under_its_latest_name(tmp_path):
    # a scatter-add into fusion.1's buffer (the same offset, while fusion.1 lives): one buffer of 4000
    assignment = ASSIGNMENT.replace(
        " value: <3 fusion.2{1}",
        " value: <8 scatter.9 @0> (size=4000,offset=0): f32[1000]{0}\n value: <3 fusion.2{1}",
    )
    live_range = LIVE_RANGE.replace("    copy.7{}", "    scatter.9{}:3-5\n    copy.7{}")
    hlo = HLO.replace(
        "  %copy.7",
        '  %scatter.9 = f32[1000] scatter(%fusion.1), metadata={op_name="jit(f)/scatter-add"}\n  %copy.7',
    )
    values = live_at_peak(_dump(tmp_path, assignment=assignment, live_range=live_range, hlo=hlo))
    assert [(v.name, v.bytes, v.where) for v in values][:1] == [("scatter.9{}", 4000, "jit(f)/scatter-add")]
    assert sum(v.bytes for v in values) == 8000  # not 12000


def test_layers_group_into_one_line_by_shape_and_operation(tmp_path):
    groups = by_operation(live_at_peak(_dump(tmp_path)))
    assert groups == [  # equal sizes: by shape
        (4000, 2, "bf16[1000]", "jit(f)/Block_*/Dense_*/dot_general"),
        (4000, 1, "f32[1000]", "jit(f)/Block_*/Dense_*/dot_general"),
    ]


def test_the_dump_of_a_gpu_compile_is_read_by_its_own_prefix(tmp_path):
    # XLA:GPU prefixes its files with the target ("sm_9.0a_gpu_"); a smaller program beside it is ignored
    _dump(tmp_path, "sm_9.0a_gpu_")
    (tmp_path / "module_0000.jit_iota.cpu_after_optimizations-buffer-assignment.txt").write_text("x")
    assert [v.bytes for v in live_at_peak(str(tmp_path))] == [4000, 2000, 2000]


def test_a_directory_without_a_dump_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="xla_dump_to"):
        live_at_peak(str(tmp_path))


@pytest.mark.compiled
def test_a_program_compiled_here_names_the_activation_its_backward_pass_keeps():
    w = jax.ShapeDtypeStruct((512, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)

    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 3))(w)

    report = compiled(step, w, x, target=None, peak_values=True)
    assert report.peak_values, report
    assert sum(v.bytes for v in report.peak_values) <= report.temp_bytes
    shapes = {v.shape for v in report.peak_values}
    assert "f32[256,1024]" in shapes  # tanh(x @ w), kept for the backward pass
    assert "live at the peak of the temporaries" in report.peak_table()
    assert report.to_dict()["peak_values"][0]["bytes"] == report.peak_values[0].bytes
    # without the option: nothing read, the same program
    plain = compiled(step, w, x, target=None)
    assert plain.peak_values == () and plain.temp_bytes == report.temp_bytes
    assert "compiled(..., peak_values=True)" in plain.peak_table()


@pytest.mark.compiled
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the aot extra (libtpu)")
@pytest.mark.parametrize("target", ["v5e", "h100"])
def test_the_peak_of_a_16_bit_step_on_a_target_holds_its_16_bit_activation(target):
    import jmp_lite

    # big enough that XLA:TPU keeps the activation in HBM (a small one lives in the chip's own memory)
    w = jax.ShapeDtypeStruct((1024, 8192), jnp.float32)
    x = jax.ShapeDtypeStruct((8192, 1024), jnp.float32)

    def loss(w, x):
        return jnp.mean(jax.nn.gelu(x @ w) ** 2)

    step = jax.grad(jmp_lite.autocast(loss, "p=f32,c=bf16,o=f32"))
    report = compiled(step, w, x, target=target, peak_values=True)
    assert sum(v.bytes for v in report.peak_values) <= report.temp_bytes
    # the matmul's 16-bit result is what the backward pass keeps, not a float32 copy of it
    kept = [v for v in report.peak_values if v.shape.endswith("[8192,8192]")]
    assert kept and all(v.shape.startswith("bf16") for v in kept), report.peak_table()
