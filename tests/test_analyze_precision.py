"""k3 and χ² when the engines nearly agree: the analyzer and the lab against an exact float64 evaluation.

k3 = e^c − c − 1 ≈ c²/2 is ~5e-9 at c = 1e-4, below float32's resolution of e^c near 1 (6e-8): evaluated as
e^c − c − 1 in float32 it cancels (mean k3 −98 % at log-ratio σ = 1e-4), and in float64 it still cancels once
|c| nears float32's log-prob resolution. The reference here is float64 expm1(c) − c of the float64 difference
of the float32 inputs (and expm1(2c) for ρ² − 1).
"""

import json
import math

import pytest
import torch

from miles_mis import cli
from miles_mis.analyze import DumpReader, compute
from miles_mis.analyze import analyze as run_analysis
from miles_mis.analyze.estimators import chi2_terms, k3_terms
from miles_mis.lab.rollout_collection import raw_mismatch
from miles_mis.lab.train import parse_args, train

SIGMAS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
TINY_SIGMAS = (1e-7, 3e-8)  # at float32's log-prob resolution (6e-8 to 2.4e-7 for log-probs in [-3, -0.5])
# the requirement is 1e-3; float64 expm1 gives ~1e-12 here, so anything looser is a regression
EXACT = 1e-9


def exact_k3(old: torch.Tensor, rollout: torch.Tensor) -> float:
    """Mean of expm1(c) − c in float64, c the float64 difference of the float32 inputs (|c| < 20 here)."""
    c = old.double() - rollout.double()
    return float((torch.expm1(c) - c).mean())


def exact_chi2(old: torch.Tensor, rollout: torch.Tensor) -> float:
    """Mean of ρ² − 1 = expm1(2c) in float64."""
    return float(torch.expm1(2.0 * (old.double() - rollout.double())).mean())


def draw(sigma: float, tokens: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log-probs: π_old in [-3, 0] and π_rollout = π_old + σ·N(0, 1), rounded to float32."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(tokens, generator=gen) * 3.0
    return old, (old + sigma * torch.randn(tokens, generator=gen)).float()


def write_dump(directory, old: torch.Tensor, rollout: torch.Tensor, sequences: int = 1):
    """One call, one rank, the tokens split into ``sequences`` sequences, in miles' --dump-details layout."""
    out = directory / "policy_loss_debug"
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"index": i, "total_length": o.numel() + 5, "response_length": o.numel(), "train_log_probs": o.clone(),
             "old_log_probs": o, "rollout_log_probs": r, "advantages": torch.zeros_like(o),
             "local_loss_mask": torch.ones_like(o)}
            for i, (o, r) in enumerate(zip(old.chunk(sequences), rollout.chunk(sequences)))]
    torch.save({"rank": 0, "call": 0, "samples": rows, "ppo_kl": torch.zeros(1), "pg_loss": torch.zeros(1),
                "finite": {}}, out / "rank_0_call_0.pt")
    return directory


def hand_case(ells: list[float], base: float = -1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log-probs with the given log ratios; near log p = -1e-3 (p ≈ 0.999, a confident token) float32
    resolves them to ~1e-10, so the float32 inputs carry the stated ratios to ~1e-6 relative."""
    old = torch.full((len(ells),), base, dtype=torch.float32)
    rollout = (old.double() - torch.tensor(ells, dtype=torch.float64)).float()
    return old, rollout


def relative(value: float, reference: float) -> float:
    return abs(value / reference - 1.0)


# --------------------------------------------------------------------------- the estimators themselves
def test_estimator_terms_are_float64_expm1():
    c = torch.tensor([0.0, 1e-8, -1e-4, 1e-1, 25.0, -25.0])
    clamped = c.double().clamp(-20, 20)
    assert k3_terms(c).dtype == torch.float64 and chi2_terms(c).dtype == torch.float64
    assert torch.equal(k3_terms(c), (torch.expm1(clamped) - c.double()).clamp(min=0))
    assert torch.equal(chi2_terms(c), torch.expm1(2 * clamped))
    assert float(k3_terms(torch.tensor([1e-8], dtype=torch.float64))) == pytest.approx(5e-17, rel=1e-7)


# --------------------------------------------------------------------------- the analyzer
@pytest.mark.parametrize("sigma", SIGMAS + TINY_SIGMAS)
def test_analyzer_k3_and_chi2_match_exact_float64(tmp_path, sigma):
    old, rollout = draw(sigma)
    stats = compute(DumpReader(write_dump(tmp_path, old, rollout, sequences=8)).batches())  # no advisor pass
    k3, chi2 = exact_k3(old, rollout), exact_chi2(old, rollout)
    assert k3 > 0
    assert relative(stats["k3"], k3) <= 1e-3 and relative(stats["k3"], k3) <= EXACT, (stats["k3"], k3)
    assert relative(stats["chi2_token"], chi2) <= EXACT, (stats["chi2_token"], chi2)
    # the per-call, per-bucket and per-sequence k3 come from the same token terms
    assert relative(stats["by_call"][0]["k3"], k3) <= EXACT
    by_prob = sum(row["k3"] * row["tokens"] for row in stats["by_rollout_prob"] if row["tokens"])
    assert relative(by_prob / old.numel(), k3) <= EXACT
    worst = stats["worst_sequences"][0]
    sequence = worst["index"]
    assert relative(worst["k3"], exact_k3(old.chunk(8)[sequence], rollout.chunk(8)[sequence])) <= EXACT


def test_analyzer_hand_cases(tmp_path):
    # ℓ = ±1e-4, ±2e-4: k3 = (2·(1e-4)² + 2·(2e-4)²) / 2 / 4 = 1.25e-8 (float32 e^ℓ − ℓ − 1 gives 0.0)
    old, rollout = hand_case([1e-4, -1e-4, 2e-4, -2e-4])
    stats = run_analysis(write_dump(tmp_path / "four", old, rollout)).statistics
    assert stats["k3"] == pytest.approx(1.25e-8, rel=1e-3)
    assert relative(stats["k3"], exact_k3(old, rollout)) <= EXACT
    # one token, ℓ = 0.00104523: k3 = 5.4644e-7 (float32 e^ℓ − ℓ − 1 gives 5.96e-7)
    old, rollout = hand_case([0.00104523])
    stats = run_analysis(write_dump(tmp_path / "one", old, rollout)).statistics
    assert stats["k3"] == pytest.approx(5.46e-7, rel=1e-3) and stats["k3"] == pytest.approx(5.4644e-7, rel=1e-4)
    assert relative(stats["k3"], exact_k3(old, rollout)) <= EXACT
    assert relative(stats["chi2_token"], exact_chi2(old, rollout)) <= EXACT


def test_report_json_and_markdown_carry_the_exact_k3(tmp_path, capsys):
    old, rollout = hand_case([1e-4, -1e-4, 2e-4, -2e-4])
    write_dump(tmp_path / "dump", old, rollout)
    assert cli.main(["analyze", str(tmp_path / "dump"), "--out-dir", str(tmp_path / "report"), "--no-figures"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert relative(report["k3"], exact_k3(old, rollout)) <= EXACT
    assert "token k3 = 1.25e-08" in out  # the summary line, 4 significant digits
    assert "| k3 | 1.25e-08 |" in (tmp_path / "report" / "report.md").read_text()


# --------------------------------------------------------------------------- the lab's raw k3
@pytest.mark.parametrize("sigma", SIGMAS + TINY_SIGMAS)
def test_lab_raw_k3_matches_exact_float64(sigma):
    old, rollout = draw(sigma, seed=1)
    raw = raw_mismatch(list(old.chunk(8)), list(rollout.chunk(8)))
    k3 = exact_k3(old, rollout)
    assert relative(raw["raw_k3"], k3) <= 1e-3 and relative(raw["raw_k3"], k3) <= EXACT, (raw["raw_k3"], k3)
    c = old.double() - rollout.double()
    assert raw["raw_kl"] == pytest.approx(float(-c.mean()), rel=1e-12, abs=1e-300)


def test_lab_raw_k3_hand_cases():
    old, rollout = hand_case([1e-4, -1e-4, 2e-4, -2e-4])
    assert raw_mismatch([old[:2], old[2:]], [rollout[:2], rollout[2:]])["raw_k3"] == pytest.approx(1.25e-8, rel=1e-3)
    old, rollout = hand_case([0.00104523])
    assert raw_mismatch([old], [rollout])["raw_k3"] == pytest.approx(5.4644e-7, rel=1e-4)


def test_lab_logged_raw_k3_is_exact_and_agrees_with_the_analyzer(tmp_path):
    # an fp32 engine agrees with the trainer up to rounding (k3 < 1e-6): the case float32 k3 gets wrong.
    # One step, one minibatch: the single dumped call holds every token the step's raw_k3 averages over.
    args = parse_args(["--rollout-dtype", "fp32", "--steps", "1", "--num-minibatches", "1", "--quiet",
                       "--prompts-per-step", "2", "--sft-steps", "0", "--out-dir", str(tmp_path / "run"),
                       "--dump-details", str(tmp_path / "dump")])
    logged = train(args)[0]["raw_k3"]
    payload = torch.load(tmp_path / "dump" / "policy_loss_debug" / "rank_0_call_0.pt", weights_only=True)
    old = torch.cat([s["old_log_probs"] for s in payload["samples"]])
    rollout = torch.cat([s["rollout_log_probs"] for s in payload["samples"]])
    k3 = exact_k3(old, rollout)
    assert 0 < k3 < 1e-6
    assert relative(logged, k3) <= EXACT, (logged, k3)
    assert relative(compute(DumpReader(tmp_path / "dump").batches())["k3"], k3) <= EXACT
    assert math.isfinite(logged)
