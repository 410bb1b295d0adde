"""Gives the tests 8 CPU devices (before jax is imported) and marks the slow tests.

``python -m pytest -q`` runs everything (CI); ``python -m pytest -q -m "not slow"`` is the development loop.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

ROOT = Path(__file__).resolve().parent
# `slow`: tests that build, lint, spawn processes or train (whole files), and the tests that took more
# than about 5 s each (all parametrizations together) in `python -m pytest -q --durations=0`, mostly XLA
# compiles. tests/test_architecture.py checks that every entry still names a real file and test.
SLOW_FILES = {
    "tests/test_lint.py": "ruff over the whole repository",
    "tests/test_docs_build.py": "the Sphinx build",
    "tests/test_wheel.py": "builds the sdist and wheel, installs into a fresh venv",
    "tests/test_examples.py": "trains every example",
    "tests/test_demo.py": "runs the demo",
    "tests/test_benchmarks.py": "the GPU benchmark suite's CPU dry run",
    "tests/test_multihost.py": "two processes over jax.distributed",
}
SLOW_TESTS = {
    "tests/test_accumulate.py": (
        "test_dot_and_conv_gradients_take_16_bit_operands_and_accumulate_in_float32",
        "test_linen_policy_accumulates_in_float32_forward_and_backward",
    ),
    "tests/test_attention_kernels.py": (
        "test_values_and_gradients_match_float32_reference_under_jit",
        "test_vmap_grad_and_any_number_of_batch_axes",
    ),
    "tests/test_attention_pattern.py": (
        "test_autocast_trace_block",
        "test_equinox_mha",
        "test_heads_first_layout_with_key_first_logits",
        "test_jax_nn_xla",
        "test_linen_dot_product_attention_with_bias",
        "test_linen_mha",
        "test_lm_gpt_every_layer",
        "test_nnx_mha",
    ),
    "tests/test_autocast.py": (
        "test_all_float32_policy_is_bitwise_the_function",
        "test_backward_float32_sums_keep_forward_mode",
        "test_backward_sums_run_in_float32_under_grad",
        "test_composes_with_vmap_pmap_shard_map_and_inner_shard_map",
        "test_equinox_attention_backward_sums_run_in_float32",
        "test_explicit_precision_highest_runs_in_float32_under_grad",
        "test_forward_mode_and_hessians_of_matmuls",
        "test_no_accumulate_rule_16bit_grads_close_and_forward_mode",
        "test_output_and_grads_float32_and_close",
        "test_trains_with_loss_scaling_and_dynamic_loss_scale",
    ),
    "tests/test_autocast_flax.py": (
        "test_equinox_example_trains_with_autocast_and_loss_scaling",
        "test_linen_apply_same_dtypes_as_apply_policy",
    ),
    "tests/test_checkpoint.py": ("test_orbax_restore_then_continue_is_bitwise_equal",),
    "tests/test_diagnostics.py": ("test_runs_under_jit_vmap_and_on_real_gradients",),
    "tests/test_distributed.py": (
        "test_eight_devices_match_one_device",
        "test_one_replica_overflowing_keeps_replicas_bitwise_equal",
        "test_sharded_jit_with_sharded_params_and_state_matches_one_device",
    ),
    "tests/test_docs.py": ("test_doc_examples_run",),
    "tests/test_memory.py": ("test_gpt2_small_is_measured_without_allocating",),
    "tests/test_export.py": (
        "test_measured_sizes_training_checkpoints_equal_exports_half",
        "test_nnx_state_stays_a_state_and_halves",
    ),
    "tests/test_flax_linen.py": (
        "test_dots_and_convs_run_in_compute_dtype_params_in_param_dtype",
        "test_gradients_reach_the_optimizer_in_param_dtype",
        "test_rules_by_class_and_path_and_their_errors",
        "test_as_accurate_as_hand_written_dtypes",
        "test_scan_remat_and_setup_style",
    ),
    "tests/test_flax_nnx.py": (
        "test_attention_dropout_path_matches_float32_reference_and_drops",
        "test_dots_convs_in_compute_dtype_norms_and_softmax_in_float32",
        "test_gradients_and_batch_stats_in_param_dtype",
        "test_optimizer_errors_are_clear",
        "test_as_accurate_as_hand_written_dtypes",
        "test_skipped_step_leaves_model_and_optimizer_bitwise_unchanged",
        "test_view_under_nnx_jit_and_vmap",
        "test_whole_optimizer_state_is_kept_when_transformations_wrap_loss_scaling",
    ),
    "tests/test_flax_train_state.py": ("test_skipped_step_changes_only_the_loss_scale",),
    "tests/test_fp8.py": (
        "test_checkpoint_layout_and_resume_are_bitwise",
        "test_einsum_is_one_fp8_dot_general_with_the_state_rows_in_operand_order",
        "test_fp8_report_counts_saturation_and_underflow_per_tensor",
        "test_matches_flax_fp8_direct_dot_general",
        "test_replicas_hold_bitwise_equal_state_after_ten_pmap_steps",
        "test_scan_over_stacked_layer_states_remat_and_jit_match_the_unrolled_loop",
        "test_shard_map_max_reduces_the_state_and_matches_sharded_jit",
        "test_skipped_step_leaves_the_state_bitwise_unchanged",
        "test_values_and_gradients_are_float32_up_to_fp8_rounding",
        "test_vmap_over_a_shared_state_is_the_explicit_batch",
    ),
    "tests/test_fp8_training.py": (
        "test_a_skipped_step_leaves_the_fp8_state_bitwise_unchanged",
        "test_autocast_fp8_matches_hand_written_fp8_contractions_bitwise",
        "test_fp8_argument_errors_name_what_is_accepted",
        "test_linen_checkpoint_layout_restore_and_continue_are_bitwise",
        "test_linen_collection_layout_rules_and_training_move_the_states",
        "test_multisteps_of_four_microbatches_hold_the_history_of_one_big_batch",
        "test_nnx_checkpoint_restore_and_continue_are_bitwise",
        "test_nnx_states_follow_the_parameter_paths_and_move_once_per_step",
        "test_replicas_hold_bitwise_equal_fp8_state_after_ten_pmap_steps",
    ),
    "tests/test_get_policy.py": ("test_any_string_parses_or_raises_value_error",),
    "tests/test_jmp_differential.py": ("test_haiku_recipe_matches_jmp_bitwise",),
    "tests/test_layouts.py": (
        "test_equinox_mlp_attention_and_matvec_mlp_under_autocast_grad",
        "test_layout_forward_grad_jit_vmap",
    ),
    "tests/test_loss_scale.py": ("test_trajectory_matches_reference_and_stays_in_bounds",),
    "tests/test_low_precision.py": (
        "test_injected_inf_steps_equal_omitting_those_batches",
        "test_multisteps_of_identical_microbatches_equals_one_step",
        "test_orbax_restore_then_continue_is_bitwise_equal",
        "test_pmap_replicas_agree_and_match_one_device",
        "test_vmap_over_an_ensemble_equals_a_loop",
    ),
    "tests/test_optax_inputs.py": (
        "test_cases_that_raised_under_cond",
        "test_every_leaf_type_plain_optax_takes_also_works_under_loss_scaling",
    ),
    "tests/test_optax_transform.py": (
        "test_composes_in_chain_multisteps_inject_hyperparams",
        "test_cond_skip_adds_a_constant_number_of_copies",
        "test_injected_nonfinite_steps_equal_omitting_those_batches",
        "test_inner_sees_unscaled_gradients",
        "test_pmap_replicas_agree_when_one_overflows",
        "test_skip_counters_match_a_reference",
    ),
    "tests/test_record_nonfinite.py": (
        "test_the_compiled_step_has_no_host_transfer_and_no_extra_conditional",
    ),
    "tests/test_scaled_grad.py": (
        "test_pmap_with_loss_scaling_reduce_matches_one_device",
        "test_same_loss_and_grads_as_the_manual_path_under_jit",
    ),
    "tests/test_step.py": ("test_skipped_steps_never_move_params_or_state_in_optax_linen_and_nnx",),
}


# The files that take longest (about a minute and more of one core each, `--durations`), handed to the
# two workers first: with whole files per worker (`--dist loadfile`), a long file last would leave one
# core idle at the end of the run.
LONGEST_FIRST = (
    "tests/test_examples.py",
    "tests/test_low_precision.py",
    "tests/test_fp8_training.py",
    "tests/test_demo.py",
    "tests/test_benchmarks.py",
    "tests/test_report.py",
    "tests/test_flax_linen.py",
    "tests/test_flax_nnx.py",
    "tests/test_docs.py",
    "tests/test_autocast.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {}
    for item in items:
        path = Path(item.path).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
        name = getattr(item, "originalname", None) or item.name
        if rel in SLOW_FILES or name in SLOW_TESTS.get(rel, ()):
            item.add_marker(pytest.mark.slow)
        rank[item] = LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank.__getitem__)  # stable: each file keeps its own order
