"""jmp_lite: mixed-precision training for JAX, Flax and optax."""

from jmp_lite import accumulate, amp, attention, distributed, fp8, losses
from jmp_lite import autocast as _autocast_module_path  # noqa: F401  (deprecated; loaded before the function takes the name)
from jmp_lite._src.base.caches import clear_caches
from jmp_lite._src.base.exports import lazy as _lazy
from jmp_lite.amp import autocast, float32_region
from jmp_lite.distributed import reduce_gradients
from jmp_lite.export import export_params
from jmp_lite.fp8 import Fp8Recipe, get_fp8_recipe
from jmp_lite.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from jmp_lite.low_precision import (
    KahanSummationState,
    LowPrecisionState,
    QuantizedArray,
    StochasticRoundingState,
    kahan_summation,
    low_precision_state,
    stochastic_rounding,
)
from jmp_lite.optax_transform import (
    LossScalingState,
    SkipLimitReachedError,
    SkipReport,
    TinyGradientsState,
    describe_skip,
    get_loss_scale,
    get_loss_scaling_state,
    loss_scaling,
    raise_if_skip_limit_reached,
)
from jmp_lite.policy import (
    Policy,
    cast_to_full,
    cast_to_half,
    dtype_to_names,
    get_policy,
    half_dtype,
    preferred_half_dtype,
)
from jmp_lite.step import apply_scaled_gradients, scale_loss_fn, value_and_grad

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "Explanation",
    "Fp8Recipe",
    "GradientReport",
    "KahanSummationState",
    "LeafReport",
    "LossScale",
    "LossScalingState",
    "LowPrecisionState",
    "NoOpLossScale",
    "Policy",
    "PrecisionReport",
    "QuantizedArray",
    "RuleSuggestion",
    "SkipLimitReachedError",
    "SkipReport",
    "StaticLossScale",
    "StochasticRoundingState",
    "TinyGradientsState",
    "accumulate",
    "amp",
    "all_finite",
    "apply_scaled_gradients",
    "attention",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "clear_caches",
    "describe_skip",
    "distributed",
    "doctor",
    "dtype_to_names",
    "explain",
    "export_params",
    "float32_region",
    "fp8",
    "get_fp8_recipe",
    "get_loss_scale",
    "get_loss_scaling_state",
    "get_policy",
    "gradient_diagnostics",
    "half_dtype",
    "kahan_summation",
    "loss_scaling",
    "losses",
    "low_precision_state",
    "memory",
    "precision_report",
    "preferred_half_dtype",
    "raise_if_skip_limit_reached",
    "reduce_gradients",
    "scale_loss_fn",
    "select_tree",
    "stochastic_rounding",
    "suggest_rules",
    "value_and_grad",
]

# The tools (reports, doctor, memory accounting, diagnostics) load on first use: `import jmp_lite` is the core
__getattr__ = _lazy(
    __name__,
    globals(),
    {
        "doctor": "jmp_lite.doctor",
        "memory": "jmp_lite.memory",
        "Explanation": "jmp_lite.amp",
        "explain": "jmp_lite.amp",
        "GradientReport": "jmp_lite.diagnostics",
        "LeafReport": "jmp_lite.diagnostics",
        "gradient_diagnostics": "jmp_lite.diagnostics",
        "PrecisionReport": "jmp_lite.doctor",
        "RuleSuggestion": "jmp_lite.doctor",
        "precision_report": "jmp_lite.doctor",
        "suggest_rules": "jmp_lite.doctor",
    },
)
