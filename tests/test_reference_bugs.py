"""The slow reference (tests/reference.py) against docs/math.md on the cases where it used to be wrong.

Expected values are computed here from the documented formulas (by hand or by a Taylor series in float64),
not from the package: the reference is what the equivalence tests lean on, so it is checked on its own.
One test at the end shows the package and the reference now agree on those cases.

- χ²_seq = exp(2·clamp(L)) − 1, L = Σ ℓ: the clamp is on L (it was applied to 2L, wrong for 10 < |L| ≤ 20);
- a seq_sum_k1 range is decided for any Σ ℓ (exp(Σ ℓ) overflowed past 709);
- k3 and ρ² − 1 are exact for tiny log ratios (e^ℓ − ℓ − 1 and ρ² − 1 cancelled to rounding noise);
- the returned masks are the input mask values with rejected tokens 0 (0.5 stays 0.5), and metrics-only
  returns the input masks unchanged (they came back as 1.0).
"""

import math

import pytest
import torch
from reference import reference

from miles_mis import MisConfig, compute_mis_weights


def one_sequence(ells, dtype=torch.float64, mask=None):
    """One sequence whose log ratios are ``ells`` exactly (rollout log-probs 0), as the host's lists."""
    train = torch.tensor(ells, dtype=dtype)
    mask = torch.ones(len(ells)) if mask is None else torch.tensor(mask)
    return [train], [torch.zeros(len(ells), dtype=dtype)], [mask]


def seq_value(metrics, name, seq=0):
    """A sequence metric of the reference (broadcast: every token carries it)."""
    values = metrics[name][seq]
    assert len(set(values)) == 1, f"{name} is not constant over the sequence"
    return values[0]


# --------------------------------------------------------------------------- χ²_seq
@pytest.mark.parametrize("total", [5.0, 10.5, 15.0, 20.0, 25.0, -12.0, -15.0, -25.0])
def test_chi2_seq_clamps_the_log_product_not_twice_it(total):
    """χ²_seq = exp(2·clamp(L, ±20)) − 1 (math.md): L = 15 gives e³⁰ − 1 ≈ 1.07e13, not e²⁰ − 1 (the clamp was
    applied to 2L), and L = −15 gives −1 + e⁻³⁰, not −1 + e⁻²⁰."""
    ells = [total / 5] * 5
    _, _, metrics = reference(MisConfig(use_tis=False), *one_sequence(ells))
    clamped = max(min(total, 20.0), -20.0)
    expected = math.exp(2 * clamped) - 1.0  # no cancellation here: |2·clamp(L)| ≥ 10
    assert seq_value(metrics, "mis_chi2_seq") == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_chi2_seq_is_exact_for_a_tiny_log_product():
    """L = 1e-9: χ²_seq = e^{2e-9} − 1 = 2e-9 + 2e-18 + ... (e^{2L} − 1 in float64 would lose half the digits)."""
    _, _, metrics = reference(MisConfig(use_tis=False), *one_sequence([5e-10, 5e-10]))
    x = 2e-9
    assert seq_value(metrics, "mis_chi2_seq") == pytest.approx(x + x * x / 2 + x ** 3 / 6, rel=1e-12, abs=0)


# --------------------------------------------------------------------------- seq_sum_k1 beyond exp's range
@pytest.mark.parametrize("ell, kept", [
    (20.0, False),        # Σ c = 800: the product ratio e^800 > 2 (exp(800) overflowed)
    (-20.0, False),       # Σ c = −800: e^-800 < 0.5
    (0.01, True),         # Σ c = 0.4: e^0.4 = 1.49 in [0.5, 2]
    (0.018, False),       # Σ c = 0.72 > log 2 = 0.693
])
def test_seq_sum_k1_range_decided_for_any_log_product(ell, kept):
    """seq_sum_k1: keep L ≤ Π ρ_t ≤ U, i.e. −log U ≤ Σ k1 ≤ −log L, for a sequence of 40 tokens of ℓ = ``ell``;
    with Σ k1 = −800 the reference raised OverflowError instead of rejecting the sequence."""
    cfg = MisConfig(use_tis=True, tis_upper_bound=2.0, rs_divergence={"seq_sum_k1": [0.5, 2.0]})
    _, masks, metrics = reference(cfg, *one_sequence([ell] * 40))
    assert masks[0] == [1.0 if kept else 0.0] * 40
    assert seq_value(metrics, "mis_rs_seq_sum_k1_masked_seq_fraction") == (0.0 if kept else 1.0)
    assert seq_value(metrics, "mis_rs_seq_sum_k1_mean") == pytest.approx(-40 * ell, rel=1e-12, abs=0)


def test_seq_mean_and_token_k1_ranges_at_the_boundary_in_log_space():
    """The k1 range test in log space keeps exactly the ratios inside [L, U] (an option never sees Σ ℓ past
    ±709 at token or seq_mean level, but the comparison is the same one)."""
    cfg = MisConfig(use_tis=True, tis_upper_bound=2.0,
                    rs_divergence={"token_k1": [0.5, 2.0], "seq_mean_k1": [0.5, 2.0]})
    # ρ = 1.9 (kept), 2.1 (removed by token_k1); geometric mean e^{(log 1.9 + log 2.1)/2} = 1.997: kept
    _, masks, metrics = reference(cfg, *one_sequence([math.log(1.9), math.log(2.1)]))
    assert masks[0] == [1.0, 0.0]
    assert metrics["mis_rs_token_k1_masked_token_fraction"][0] == [0.0, 1.0]
    assert seq_value(metrics, "mis_rs_seq_mean_k1_masked_seq_fraction") == 0.0


# --------------------------------------------------------------------------- k3 and ρ² − 1 for tiny log ratios
def k3_taylor(ell):
    """e^ℓ − ℓ − 1 = ℓ²/2 + ℓ³/6 + ℓ⁴/24 + ...: exact to ~ℓ³ relative for |ℓ| ≤ 1e-6."""
    return ell ** 2 / 2 + ell ** 3 / 6 + ell ** 4 / 24


@pytest.mark.parametrize("ell", [1e-8, -1e-8, 3e-7, -2e-6])
def test_k3_is_exact_for_tiny_log_ratios(ell):
    """k3 = expm1(c) − ℓ: 5e-17 at ℓ = 1e-8, where e^ℓ − ℓ − 1 in float64 is a rounding step (~1e-16) or 0
    (float64 expm1 is good to ~1e-8 relative there: half an ulp of ℓ over ℓ²/2).
    Checked on every k3 the reference reports: k3_kl, the batch gate's k3, where-the-mismatch-lives (first
    token, position) and the divergence estimator token_k3 (per token)."""
    cfg = MisConfig(use_tis=True, tis_upper_bound=2.0, rs_divergence={"token_k3": 1.0})
    _, _, metrics = reference(cfg, *one_sequence([ell, ell]))
    expected = k3_taylor(ell)
    for name in ("mis_k3_kl", "mis_batch_k3", "mis_k3_first_token", "mis_k3_position_1_16"):
        assert seq_value(metrics, name) == pytest.approx(expected, rel=1e-7, abs=0), name
    assert metrics["mis_rs_token_k3_mean"][0] == pytest.approx([expected] * 2, rel=1e-7, abs=0)


def test_k3_kl_subtracts_the_unclamped_log_ratio():
    """k3_kl = max(e^{clamp(ℓ)} − ℓ − 1, 0) (math.md): at ℓ = −30, e^-20 + 29; the divergence estimator uses c
    = clamp(ℓ) on both sides: e^-20 + 19."""
    cfg = MisConfig(use_tis=True, tis_upper_bound=2.0, rs_divergence={"token_k3": 100.0})
    _, _, metrics = reference(cfg, *one_sequence([-30.0]))
    assert seq_value(metrics, "mis_k3_kl") == pytest.approx(math.exp(-20) + 29.0, rel=1e-15, abs=0)
    assert metrics["mis_rs_token_k3_mean"][0] == pytest.approx([math.exp(-20) + 19.0], rel=1e-15, abs=0)


def test_chi2_token_is_exact_for_tiny_log_ratios():
    """χ²_token = mean(ρ² − 1) = mean(expm1(2ℓ)): for ℓ = ±1e-8, (expm1(2e-8) + expm1(−2e-8)) / 2 = (2e-8)²/2 =
    2e-16, where mean(ρ²) − 1 is float64 rounding of 1 (a multiple of 1.1e-16, or 0)."""
    _, _, metrics = reference(MisConfig(use_tis=False), *one_sequence([1e-8, -1e-8]))
    x = 2e-8
    assert seq_value(metrics, "mis_chi2_token") == pytest.approx(x * x / 2 + x ** 4 / 24, rel=1e-6, abs=0)
    _, _, metrics = reference(MisConfig(use_tis=False), *one_sequence([1e-7, 1e-7, 1e-7]))
    x = 2e-7
    assert seq_value(metrics, "mis_chi2_token") == pytest.approx(x + x * x / 2 + x ** 3 / 6, rel=1e-12, abs=0)


# --------------------------------------------------------------------------- returned masks keep their values
def test_masks_keep_the_input_mask_values():
    """math.md (final mask): the input mask with every non-kept token set to 0, a kept token keeps its value
    (0.5 stays 0.5); metrics-only: the input masks unchanged."""
    ells = [0.0, 0.0, math.log(3.0), 0.0]  # ρ = 1, 1, 3, 1
    batch = one_sequence(ells, mask=[0.5, 1.0, 0.25, 0.0])
    _, masks, _ = reference(MisConfig(use_tis=False), *batch)
    assert masks == [[0.5, 1.0, 0.25, 0.0]]
    _, masks, _ = reference(MisConfig(use_tis=True, tis_upper_bound=2.0), *batch)
    assert masks == [[0.5, 1.0, 0.25, 0.0]]
    # mask mode rejects the token of ratio 3 > U = 2: its mask becomes 0, the others keep their values
    weights, masks, _ = reference(MisConfig(use_tis=True, tis_mode="mask", tis_upper_bound=2.0), *batch)
    assert masks == [[0.5, 1.0, 0.0, 0.0]]
    assert weights == [[1.0, 1.0, 0.0, 0.0]]


def test_adaptive_sequence_population_counts_kept_tokens_not_mask_values():
    """With tis_upper_bound: auto at sequence level, each kept sequence's ratio counts once per kept token
    (math.md), whatever its mask values: sequences of ratio e^0.5 (mask values 0.1 × 4) and 1 (one token, mask
    1) weigh 4 : 1. ESS(∞) = (4·1.6487 + 1)² / (5·(4·2.7183 + 1)) = 0.9716 (by mask values, 0.4 : 1, it would be
    0.9424)."""
    cfg = MisConfig(use_tis=True, tis_level="sequence", tis_upper_bound="auto")
    train = [torch.tensor([0.125] * 4, dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)]
    rollout = [torch.zeros(4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    masks = [torch.full((4,), 0.1), torch.ones(1)]
    _, out_masks, metrics = reference(cfg, train, rollout, masks)
    rho = math.exp(0.5)
    expected = (4 * rho + 1) ** 2 / (5 * (4 * rho * rho + 1))
    assert seq_value(metrics, "mis_ess_before_bound") == pytest.approx(expected, rel=1e-12, abs=0)
    assert out_masks == [[pytest.approx(0.1)] * 4, [1.0]]


# --------------------------------------------------------------------------- the package agrees
def test_package_agrees_with_reference_on_long_log_products():
    """chi2_seq for Σ ℓ in (10, 20] and beyond, and the seq_sum_k1 decision for Σ ℓ = ±800 (exp's range
    exceeded): the package and the fixed reference agree (values only at large ratios, where float32 k3/χ²
    rounding is irrelevant)."""
    cfg = MisConfig(use_tis=True, tis_upper_bound=2.0, rs_divergence={"seq_sum_k1": [0.5, 2.0]})
    ells = [[5.0] * 3, [-6.0] * 2, [20.0] * 40, [-20.0] * 40, [0.01] * 40, [4.0] * 6]  # Σ ℓ = 15, −12, ±800, 0.4, 24
    train = [torch.tensor(e) for e in ells]
    rollout = [torch.zeros(len(e)) for e in ells]
    masks = [torch.ones(len(e)) for e in ells]
    weights, out_masks, metrics = compute_mis_weights(cfg, train_log_probs=train, rollout_log_probs=rollout,
                                                      loss_masks=masks)
    ref_weights, ref_masks, ref_metrics = reference(cfg, train, rollout, masks)
    assert [m.tolist() for m in out_masks] == ref_masks
    assert [float(m[0]) for m in out_masks] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    for name in ("mis_chi2_seq", "mis_rs_seq_sum_k1_masked_seq_fraction", "mis_rs_seq_sum_k1_mean"):
        for i in range(len(ells)):
            torch.testing.assert_close(metrics[name][i].double(), torch.tensor(ref_metrics[name][i],
                                                                               dtype=torch.float64),
                                       rtol=1e-5, atol=1e-6, msg=lambda s: f"{name}[{i}]: {s}")
    for w, rw in zip(weights, ref_weights):
        torch.testing.assert_close(w.double(), torch.tensor(rw, dtype=torch.float64), rtol=1e-5, atol=1e-6)
