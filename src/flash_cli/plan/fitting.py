"""The planner against the published figures (calibration.py's data): predict each figure, and
re-solve the fitted constants. Above both the planner and its data, so neither imports back."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .calibration import FIGURES, FIT_FIGURE, GIB, Figure


def predict(fig: Figure, hw=None) -> float:
    """The model's value for one figure (tokens, ratio, GiB or token delta), planned from geometry."""
    from ..settings import resolve
    from . import build
    from .hardware import PRESETS

    hw = hw or PRESETS["gb10"]

    def plan(values: dict) -> dict:
        return build(resolve(None, None, values), hw, snapshot=None)

    top = plan(fig.settings)
    if fig.unit == "tokens":
        return top["kv_cache_tokens"]
    if fig.unit == "gib":
        return top["one_request_at_ctx_gib"]
    bottom = plan(fig.ratio_of or {})
    if fig.unit == "delta":
        return top["kv_cache_tokens"] - bottom["kv_cache_tokens"]
    return top["kv_cache_tokens"] / bottom["kv_cache_tokens"]


def error_pct(fig: Figure, predicted: float) -> float:
    return (predicted - fig.published) / fig.published * 100


def _solve(constant: str, predicted: Callable[[], float], target: float) -> int:
    """The value of the planner's overhead `constant` (a name in flash_cli.plan) at which
    `predicted()` meets `target`: bisection on bytes (the prediction falls as the overhead grows).
    The planner's own value is put back afterwards."""
    import flash_cli.plan as plan_pkg

    saved = getattr(plan_pkg, constant)
    lo, hi = 0, 20 * GIB
    try:
        while hi - lo > 1024**2:
            mid = (lo + hi) // 2
            setattr(plan_pkg, constant, mid)
            if predicted() > target:
                lo = mid
            else:
                hi = mid
    finally:
        setattr(plan_pkg, constant, saved)
    return (lo + hi) // 2


def fit(hw=None) -> int:
    """Solve RUNTIME_OVERHEAD so FIT_FIGURE is met."""
    fig = next(f for f in FIGURES if f.key == FIT_FIGURE)
    return _solve("RUNTIME_OVERHEAD", lambda: predict(fig, hw), fig.published)


def _pool(settings, hw, snapshot) -> Callable[[], float]:
    """The plan's KV pool for `settings` as `_solve` asks it, read afresh at each trial constant."""
    from . import build

    return lambda: build(settings, hw, snapshot=snapshot, live_checks=False)["kv_cache_tokens"]


def solve_discrete(settings, hw, measured_tokens: int) -> int:
    """The discrete-GPU overhead that makes the plan's pool for `settings` (its checkpoint found in
    HF_CACHE) equal vLLM's measured tokens: the constant of the graph regime `settings` render."""
    from . import overhead_constant

    return _solve(overhead_constant(settings, hw), _pool(settings, hw, True), measured_tokens)


def solve_shape_extra(settings, hw, config: Path, measured_tokens: int) -> int:
    """RUNTIME_SHAPE_EXTRA that makes the plan's pool for `settings`, with the geometry and weights of
    the bench checkpoint `config` (real layers, no weights on disk), equal vLLM's measured tokens."""
    return _solve("RUNTIME_SHAPE_EXTRA", _pool(settings, hw, config), measured_tokens)
