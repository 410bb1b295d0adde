"""``jmp_lite.memory.compiled``, ``report_of``, ``plan`` on this machine's backend, the HLO text reader,
and the target names and errors: what needs no compile-only target. The targets themselves (TPU, H100)
are ``tests/test_compiled_targets.py``, in the system tier with the aot extra."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import pytest

import jmp_lite
from jmp_lite._src.tools import hlo_text
from jmp_lite._src.tools.plan import main as plan_main
from jmp_lite.memory import (
    CompiledReport,
    compile_only_target,
    compiled,
    known_targets,
    plan,
    report_of,
)

pytestmark = pytest.mark.unit

BF16 = "p=f32,c=bf16,o=f32"

# A fused TPU program as XLA:TPU prints it (abridged from a v5e compile): a float32 dot at HIGHEST
# inside a fusion, a bf16 one with a float32 result, a combined async all-gather and a reduce-scatter.
TPU_TEXT = """HloModule jit_f, is_scheduled=true

%fused_computation.3 (param_0.3: f32[256,512], param_1.3: f32[512,256]) -> f32[256,256] {
  %param_0.3 = f32[256,512]{1,0:T(8,128)} parameter(0)
  %param_1.3 = f32[512,256]{1,0:T(8,128)} parameter(1)
  ROOT %convolution.3 = f32[256,256]{1,0:T(8,128)S(1)} convolution(%param_0.3, %param_1.3), \
dim_labels=bf_io->bf, operand_precision={highest,highest}, metadata={op_name="jit(f)/attention/dot_general"}
}

%fused_computation (param_0: bf16[256,512], param_1: bf16[512,256]) -> f32[256,256] {
  %param_0 = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.2 = f32[256,256]{1,0:T(8,128)} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

ENTRY %main.1 (a.1: f32[256,512], b.1: f32[512,256], c.1: bf16[256,512], d.1: bf16[512,256]) -> f32[256,256] {
  %a.1 = f32[256,512]{1,0:T(8,128)} parameter(0), sharding={replicated}
  %b.1 = f32[512,256]{1,0:T(8,128)} parameter(1), sharding={replicated}
  %c.1 = bf16[256,512]{1,0} parameter(2)
  %d.1 = bf16[512,256]{1,0} parameter(3)
  %fusion.2 = f32[256,256]{1,0:T(8,128)S(1)} fusion(%a.1, %b.1), kind=kOutput, calls=%fused_computation.3
  %fusion.1 = f32[256,256]{1,0} fusion(%c.1, %d.1), kind=kOutput, calls=%fused_computation
  %all-gather-start = ((bf16[256,512]{1,0}, bf16[512,256]{1,0}), (bf16[1024,512]{1,0}, \
bf16[2048,256]{1,0})) all-gather-start(%c.1, %d.1), dimensions={0}
  %reduce-scatter = f32[64,256]{1,0} reduce-scatter(%fusion.1), dimensions={0}, to_apply=%add
  ROOT %add.9 = f32[256,256]{1,0} add(%fusion.2, %fusion.1)
}
"""


def test_the_hlo_reader_resolves_operand_dtypes_across_fusions_and_tuples():
    found = {i.name: i for i in hlo_text.instructions(TPU_TEXT)}
    assert found["convolution.3"].computation == "fused_computation.3"
    assert found["convolution.3"].operands == ("param_0.3", "param_1.3")
    assert found["convolution.3"].attribute("operand_precision") == "highest,highest"
    assert found["fusion.2"].called == ("fused_computation.3",)
    start = found["all-gather-start"]
    assert [s.dtype for s in start.shapes] == ["bf16"] * 4 and start.shapes[2].dims == (1024, 512)
    assert hlo_text.shapes_of("f8e4m3fn[16,32]{1,0}")[0].bytes == 512


class _Stats:  # what XLA's memory_analysis() returns, for a program text given by hand
    argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes, temp_size_in_bytes = 4, 4, 0, 8
    peak_memory_in_bytes = 0


class _Executable:
    def __init__(self, text: str) -> None:
        self.text = text

    def as_text(self) -> str:
        return self.text

    def memory_analysis(self) -> _Stats:
        return _Stats()


def test_the_report_reads_contractions_precisions_and_collectives_of_a_tpu_program():
    report = report_of(_Executable(TPU_TEXT))
    assert report.contraction_counts() == {"f32 x f32 -> f32 @highest": 1, "bf16 x bf16 -> f32": 1}
    [island] = report.float32_contractions()
    assert island.where == "jit(f)/attention/dot_general" and island.precision == "highest"
    # one entry per operand of a combined collective, each the larger of what goes in and out
    assert report.collective_bytes() == {
        "all_gather bf16": (1024 * 512 + 2048 * 256) * 2,
        "reduce_scatter f32": 256 * 256 * 4,
    }
    assert report.peak_bytes == 4 + 4 - 0 + 8  # no peak of its own: arguments + outputs + temporaries
    assert report.fits is None  # no target: its memory is unknown
    assert "float32 x float32: 1 x jit(f)/attention/dot_general" in str(report)


# XLA:TPU's asynchronous all-gather as a chain of steps (abridged from a v5e:2x2 compile of FSDP): each
# step is a fusion holding the whole all-gather and carrying the partial result on
CHAIN_TEXT = """HloModule jit_f, is_scheduled=true

%step_one (p.0: bf16[64,16]) -> (bf16[64,16], bf16[64,64]) {
  %p.0 = bf16[64,16]{1,0} parameter(0)
  %all-gather.1 = bf16[64,64]{1,0} all-gather(%p.0), channel_id=1, dimensions={1}, \
frontend_attributes={chain_id="7"}
  ROOT %t.1 = (bf16[64,16]{1,0}, bf16[64,64]{1,0}) tuple(%p.0, %all-gather.1)
}

%step_two (p.1: bf16[64,16], p.2: bf16[64,64]) -> bf16[64,64] {
  %p.1 = bf16[64,16]{1,0} parameter(0)
  %p.2 = bf16[64,64]{1,0} parameter(1)
  ROOT %all-gather.2 = bf16[64,64]{1,0} all-gather(%p.1), channel_id=1, dimensions={1}, \
frontend_attributes={chain_id="7"}
}

ENTRY %main.2 (x.1: bf16[64,16], y.1: bf16[64,16]) -> bf16[64,64] {
  %x.1 = bf16[64,16]{1,0} parameter(0)
  %y.1 = bf16[64,16]{1,0} parameter(1)
  %f.1 = (bf16[64,16]{1,0}, bf16[64,64]{1,0}) fusion(%x.1), kind=kCustom, calls=%step_one
  %g.1 = bf16[64,16]{1,0} get-tuple-element(%f.1), index=0
  %h.1 = bf16[64,64]{1,0} get-tuple-element(%f.1), index=1
  %f.2 = bf16[64,64]{1,0} fusion(%g.1, %h.1), kind=kCustom, calls=%step_two
  ROOT %all-gather.3 = bf16[64,64]{1,0} all-gather(%y.1), channel_id=1, dimensions={1}, \
frontend_attributes={chain_id="8"}
}
"""


def test_a_collective_run_as_a_chain_of_steps_is_counted_once():
    report = report_of(_Executable(CHAIN_TEXT))
    gathers = [c for c in report.collectives if c.op == "all_gather"]
    assert len(gathers) == 2  # chain 7 (two steps) and chain 8
    assert report.collective_bytes() == {"all_gather bf16": 2 * 64 * 64 * 2}


@pytest.mark.compiled
def test_a_step_compiled_here_reports_its_dtypes_donation_and_bytes():
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    donated = compiled(step, w, w, target=None, donate_argnums=0)
    kept = compiled(step, w, w, target=None)
    assert isinstance(donated, CompiledReport)
    assert donated.alias_bytes == 256 * 256 * 4 and kept.alias_bytes == 0
    assert donated.argument_bytes == kept.argument_bytes == 2 * 256 * 256 * 4
    # arrays are read for their shapes only: the same program
    arrays = compiled(step, jnp.zeros((256, 256)), jnp.zeros((256, 256)), target=None, donate_argnums=0)
    assert arrays.to_dict()["contraction_counts"] == donated.to_dict()["contraction_counts"]


@pytest.mark.compiled
def test_a_plan_compiles_each_setup_and_int8_state_holds_fewer_argument_bytes():
    params = {"w1": jax.ShapeDtypeStruct((512, 1024), jnp.float32), "w2": jnp.zeros((1024, 512))}
    x = jax.ShapeDtypeStruct((32, 512), jnp.float32)

    def loss(p, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    result = plan(loss, params, x, target=None, variants=("float32", "int8-state", "bf16-cast"))
    assert list(result.reports) == ["float32", "int8-state", "bf16-cast"]
    f32, int8 = result.reports["float32"], result.reports["int8-state"]
    # float32 parameters (4 B) and Adam's two float32 moments (8 B) vs two 1-byte moments and scales
    assert f32.argument_bytes > 2.5 * int8.argument_bytes - 4 * 512 * 1024 * 2
    assert int8.argument_bytes < 0.55 * f32.argument_bytes
    assert f32.alias_bytes > 0  # parameters and state donated
    table = result.table()
    assert "| float32 |" in table and "| int8-state |" in table and "1.00x" in table
    assert result.to_dict()["reports"]["float32"]["argument_bytes"] == f32.argument_bytes


@pytest.mark.compiled
def test_fsdp_shards_over_the_targets_devices_and_is_skipped_on_one():
    params = {
        "w1": jax.ShapeDtypeStruct((64, 128), jnp.float32),
        "w2": jax.ShapeDtypeStruct((128, 64), jnp.float32),
    }
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    one = plan(loss, params, x, target="cpu:1", variants=("float32", "fsdp"))
    assert list(one.reports) == ["float32"] and "one device" in one.skipped["fsdp"]
    eight = plan(loss, params, x, target="cpu", variants=("float32", "fsdp"))
    assert eight.devices == 8 and eight.skipped == {}
    dp, fsdp = eight.reports["float32"], eight.reports["fsdp"]
    # data parallel all-reduces whole gradients; FSDP gathers the parameters and keeps an eighth of them
    assert "all_reduce f32" in dp.collective_bytes() and "all_gather bf16" not in dp.collective_bytes()
    assert any(k.startswith("all_gather") for k in fsdp.collective_bytes())
    assert fsdp.argument_bytes < dp.argument_bytes / 4
    # FSDP splits the batch: 12 sequences do not split over 8 devices
    uneven = plan(loss, params, x.update(shape=(12, 64)), target="cpu", variants=("fsdp",))
    assert uneven.reports == {} and "(12, 64) does not split over 8 devices" in uneven.skipped["fsdp"]


def test_bad_input_is_named():
    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    with pytest.raises(ValueError, match="unknown setups \\['fp16'\\]; choose from float32"):
        plan(lambda p, x: jnp.sum(p @ x), x, x, target=None, variants=("fp16",))
    with pytest.raises(TypeError, match="plan: loss must be callable"):
        plan("loss", x, x, target=None)
    with pytest.raises(TypeError, match="plan: optimizer must be an optax"):
        plan(lambda p, x: jnp.sum(p @ x), x, x, target=None, optimizer="adam")
    with pytest.raises(ValueError, match="unknown target 'tpu9'; known: a100, b200, h100, h200"):
        compile_only_target("tpu9")
    with pytest.raises(ValueError, match="slices x hosts x GPUs per host, e.g. 'h100:1x1x8', got '8'"):
        compile_only_target("h100:8")
    with pytest.raises(TypeError, match="a name such as 'h100'"):
        compile_only_target(100)
    with pytest.raises(SystemExit, match="unknown setups \\['fp16'\\]"):
        plan_main(["--variants", "float32,fp16"])
    with pytest.raises(SystemExit, match="--width 100 must be a multiple of --heads 12"):
        plan_main(["--width", "100", "--target", "cpu"])
    with pytest.raises(SystemExit, match="'cpu:N' takes N from 1 to 8"):
        plan_main(["--target", "cpu:9"])
    assert {"h100", "h200", "b200", "a100", "v5e", "v5e:2x2"} <= set(known_targets())


def test_a_missing_compiler_names_the_extra(monkeypatch):
    from jmp_lite._src.tools import targets

    monkeypatch.setattr(targets, "_cuda_plugin_installed", lambda: False)
    monkeypatch.setattr(targets, "_tpu_plugin_installed", lambda: False)
    jmp_lite.clear_caches()
    with pytest.raises(ImportError, match=r"pip install 'jmp-lite\[aot\]'"):
        compile_only_target("h200")
    with pytest.raises(ImportError, match=r"pip install 'jmp-lite\[aot\]'"):
        compile_only_target("v6e:2x2")


def test_jmp_lite_plan_names_itself_and_its_flag_when_the_model_cannot_be_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"^jmp-lite plan: --model must be MODULE:FUNCTION, got 'my_step'$"):
        plan_main(["--model", "my_step", "--target", "cpu"])
    with pytest.raises(SystemExit, match=r"^jmp-lite plan: cannot import 'no_such_module_here'"):
        plan_main(["--model", "no_such_module_here:workload", "--target", "cpu"])
    (tmp_path / "my_step.py").write_text("x = 3\n")
    monkeypatch.delitem(sys.modules, "my_step", raising=False)  # the module is this test's, not another's
    with pytest.raises(SystemExit, match=r"^jmp-lite plan: 'my_step' has no attribute 'workload'$"):
        plan_main(["--model", "my_step:workload", "--target", "cpu"])


@pytest.mark.e2e
def test_jmp_lite_plan_prints_a_table_per_target_for_a_users_workload(tmp_path, monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "my_step", raising=False)  # another test's my_step, in one process
    (tmp_path / "my_step.py").write_text(
        "import jax, jax.numpy as jnp, optax\n"
        "from jmp_lite.memory import Workload\n"
        "def workload():\n"
        "    p = {'w': jax.ShapeDtypeStruct((64, 64), jnp.float32)}\n"
        "    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)\n"
        "    return Workload(lambda p, x: jnp.sum(jnp.tanh(x @ p['w'])), p, (x,), optax.sgd(0.1))\n"
        "def not_a_workload():\n"
        "    return 3\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="must return a jmp_lite.memory.Workload"):
        plan_main(["--model", "my_step:not_a_workload", "--target", "cpu"])
    assert plan_main(["--model", "my_step:workload", "--target", "cpu:1", "--target", "cpu",
                      "--variants", "float32,bf16,fsdp", "--json", "plans.json"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert out.out.count("| float32 |") == 2 and "| fsdp | skipped: one device" in out.out
    assert "[1/3] compiling float32 for cpu:1" in out.err
    saved = json.loads((tmp_path / "plans.json").read_text())
    assert [p["target"] for p in saved["plans"]] == ["cpu:1", "cpu"]
