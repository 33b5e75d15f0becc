"""Small tensor helpers shared by the core modules."""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps every weight and sum of weights finite in float32
# A log-prob at or beyond ±LOG_PROB_BOUND is a fill value, not a log-prob (no float32 softmax gets near
# −1e4: its smallest positive probability is ~1e-45, log ≈ −103): treated exactly like NaN/inf.
LOG_PROB_BOUND = 1e4
_BELOW_BOUND = float(torch.nextafter(torch.tensor(LOG_PROB_BOUND, dtype=torch.float32),
                                     torch.tensor(0.0, dtype=torch.float32)))  # the largest float32 < 1e4


def k3(exp_argument: Tensor, log_ratio: Tensor) -> Tensor:
    """k3 = e^a − ℓ − 1 = expm1(a) − ℓ, evaluated in float64 (a = ``exp_argument``, the clamped log ratio;
    ℓ = ``log_ratio``, clamped or not): float64 [N], ≥ 0.

    Why float64 expm1: k3 ≈ ℓ²/2 when the engines nearly agree (5e-9 at ℓ = 1e-4), far below float32's
    resolution of e^ℓ near 1 (6e-8), so e^ℓ − ℓ − 1 in float32 cancels to 0 or to a rounding step (−98 % at
    log-ratio σ = 1e-4); even float32 expm1(ℓ) − ℓ loses ~1 % at ℓ = 1e-5. In float64 the relative error is
    below 1e-9 for every |ℓ| ≥ 1e-7 (benchmarks/bench_precision.py). The max only guards rounding at ℓ ≈ 0.
    """
    return expm1(exp_argument.double()).sub_(log_ratio.double()).clamp_(min=0.0)


def expm1(x: Tensor) -> Tensor:
    """e^x − 1 without cancellation near x = 0, on either backend: ``torch.expm1`` eagerly; inside a compiled kernel

        |x| < 1:  x·(1 + x/2·(1 + x/3·(1 + … (1 + x/n)))),  n = 11 (float32) or 18 (float64): the Taylor series,
                  truncated below half an ulp (1/12! and 1/19!)
        else:     e^x − 1   (no cancellation beyond |x| = 1)

    (≤ 2 ulps, measured: tests/test_backend.py), because inductor's CPU code for expm1 computes e^x − 1: relative
    error 1 at x = 1e-9 in float32 (it returns 0), 8e-8 in float64, 956 float32 ulps at x = −2.3e-4 (torch 2.13),
    which would undo k3's and χ²'s precision. Fused, the polynomial costs less than one log (Kahan's (u − 1)·x / ln u
    doubled the token kernel's time)."""
    if not torch.compiler.is_compiling():
        return torch.expm1(x)
    terms = 18 if x.dtype == torch.float64 else 11
    series = torch.ones_like(x)
    for k in range(terms, 1, -1):
        series = 1.0 + x * series * (1.0 / k)
    return torch.where(x.abs() < 1.0, x * series, torch.exp(x) - 1.0)


def log_bound(bound: float) -> float:
    """A ratio bound B as the log-ratio threshold token decisions compare with: ln B rounded to float32, −inf below
    −LOG_RATIO_CLAMP and +inf above +LOG_RATIO_CLAMP, so that for a float32 log ratio ℓ (unclamped)

        ρ = e^{clamp(ℓ)} > U  ⟺  ℓ > log_bound(U),      ρ < L  ⟺  ℓ < log_bound(L)

    (ρ never leaves [e^−20, e^20], so a bound beyond it is never crossed). Why: a decision taken on ℓ, which every
    kernel computes exactly (a subtraction), does not depend on how a kernel rounds exp (inductor's exp, CUDA's and
    eager CPU's differ by an ulp on a few % of tokens), so every backend and device rejects the same tokens. The
    float32 rounding makes the threshold a value ℓ can equal, compared alike by every kernel."""
    value = math.log(bound)
    if value >= LOG_RATIO_CLAMP:
        return math.inf
    if value <= -LOG_RATIO_CLAMP:
        return -math.inf
    # rounded to float32 in Python (round to nearest even, as torch does): no tensor op, on the first call or any
    return struct.unpack("f", struct.pack("f", value))[0]


def log_bounds(bounds: Tensor) -> Tensor:
    """``log_bound`` of each bound of a float tensor (per-lag bounds), float32."""
    values = torch.log(bounds.double())
    values = torch.where(values >= LOG_RATIO_CLAMP, math.inf,
                         torch.where(values <= -LOG_RATIO_CLAMP, -math.inf, values))
    return values.float()


def to_float32_log_probs(values: Tensor) -> Tensor:
    """Log-probs as float32, with the fill-value test (|log p| ≥ LOG_PROB_BOUND) taken on the values as given:
    a float64 −9999.99999999 is a log-prob, though float32 rounds it to −1e4 (it becomes the largest float32
    inside the bound instead). Only float64 can round across the bound (float16/bfloat16 convert exactly)."""
    converted = values.float()
    if values.dtype != torch.float64:
        return converted
    crossed = (converted.abs() >= LOG_PROB_BOUND) & (values.abs() < LOG_PROB_BOUND)
    if bool(crossed.any()):  # one read, float64 input only
        converted = torch.where(crossed, torch.copysign(torch.tensor(_BELOW_BOUND), values).float(), converted)
    return converted


def indicator(compare, a: Tensor, b) -> Tensor:
    """Float 0/1 result of an elementwise comparison, e.g. ``indicator(torch.gt, ratio, upper)``.

    Written into a float tensor directly: on CPU, bool→float conversion costs ~5× the comparison.
    """
    return compare(a, b, out=torch.empty_like(a, dtype=torch.float32))


def usable_tokens(train_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor) -> Tensor:
    """The one definition of a usable token, float 0/1 (the dtype of the log-probs): a valid token whose two
    log-probs are both finite and inside (−LOG_PROB_BOUND, LOG_PROB_BOUND). NaN propagates through ``maximum`` and
    compares false, so NaN, ±inf and fill values all fail this one test."""
    largest = torch.maximum(train_log_probs.abs(), rollout_log_probs.abs())
    return torch.lt(largest, LOG_PROB_BOUND, out=torch.empty_like(largest)).mul_(valid)


def ess(sum_w: Tensor, sum_w_sq: Tensor, count: Tensor, empty: float) -> Tensor:
    """The effective sample size fraction of n weights from their sums (the one formula for every ESS reported):

        ESS = (Σ w)² / (n · Σ w²)  ∈ (0, 1] by Cauchy–Schwarz,   ``empty`` where n · Σ w² = 0

    (float64 sums: the clamp only keeps the division's unused branch finite)."""
    denominator = count * sum_w_sq
    return torch.where(denominator > 0, sum_w.square() / denominator.clamp(min=1e-300), empty)


def without_history(value: Tensor) -> Tensor:
    """``value`` without autograd history; no op when it has none (a detach is an aten op: the entry points detach
    their inputs and ~40 metrics a call, so a tensor without history is passed through)."""
    return value.detach() if value.requires_grad else value


_CONSTANTS: dict = {}


def constant(values: tuple[int, ...], device) -> Tensor:
    """A small constant int64 tensor (bucket edges, an index), made once per (values, device) and shared:
    read it, never write into it. Building it from a Python tuple each call costs more than the op using it."""
    key = (values, str(device))
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _CONSTANTS[key] = torch.tensor(values, dtype=torch.long, device=device)
    return tensor
