"""The numerics core: dtype facts, rounding emulation, metrics, tolerance policy, frontiers.

Modules and the harness use these and never re-implement them.
"""

from .collective import all_reduce
from .dtypes import DTypeFacts, compute_dtype, dtype_name, facts, is_float8, resolve_dtype, supported_dtypes
from .frontier import exp_fits, headroom, ln_max
from .metrics import Metrics, compare, relative_max_error, where_text, worst_element
from .policy import (
    BASELINE_K,
    BASELINE_RULE,
    EXPECTED_NONFINITE,
    FAIL,
    FP64_AGREEMENT_REL,
    FP64_RULE,
    FRONTIER_RULE,
    PASS,
    RULES,
    STATUSES,
    UNAVAILABLE,
    VERDICT_STATUSES,
    Verdict,
    baseline_rule,
    expected_nonfinite,
    fp64_agreement,
    mismatch_rule,
    noise_floor,
    rule_for,
)
from .rounding import OVERFLOW_MODES, round_to, round_to_reference, rounder, spacing, storage_for
from .tensors import cast_floats, map_tensors, named_tensors

__all__ = [
    "BASELINE_K",
    "BASELINE_RULE",
    "EXPECTED_NONFINITE",
    "FAIL",
    "FP64_AGREEMENT_REL",
    "FP64_RULE",
    "FRONTIER_RULE",
    "OVERFLOW_MODES",
    "PASS",
    "RULES",
    "STATUSES",
    "UNAVAILABLE",
    "VERDICT_STATUSES",
    "DTypeFacts",
    "Metrics",
    "Verdict",
    "all_reduce",
    "baseline_rule",
    "cast_floats",
    "compare",
    "compute_dtype",
    "dtype_name",
    "exp_fits",
    "expected_nonfinite",
    "facts",
    "fp64_agreement",
    "headroom",
    "is_float8",
    "ln_max",
    "map_tensors",
    "mismatch_rule",
    "named_tensors",
    "noise_floor",
    "relative_max_error",
    "resolve_dtype",
    "round_to",
    "round_to_reference",
    "rounder",
    "rule_for",
    "spacing",
    "storage_for",
    "supported_dtypes",
    "where_text",
    "worst_element",
]
