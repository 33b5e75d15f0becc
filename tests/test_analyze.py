"""The dump analyzer on synthetic dumps written in miles' --dump-details format."""

import subprocess
import sys

import pytest
import torch

from miles_mis.analyze import load_dumps, mismatch_summary, recommend, report, simulate_presets


def write_dump(directory, samples_per_rank, call=0):
    """samples_per_rank: {rank: [(old, rollout, mask), ...]} in miles' rank_<r>_call_<c>.pt layout."""
    out = directory / "policy_loss_debug"
    out.mkdir(parents=True, exist_ok=True)
    for rank, samples in samples_per_rank.items():
        rows = [{"index": i, "total_length": 100, "response_length": 50, "train_log_probs": old.clone(),
                 "old_log_probs": old, "rollout_log_probs": rollout, "advantages": torch.zeros_like(old),
                 "local_loss_mask": mask} for i, (old, rollout, mask) in enumerate(samples)]
        torch.save({"rank": rank, "call": call, "samples": rows, "ppo_kl": torch.zeros(1), "pg_loss": torch.zeros(1),
                    "finite": {}}, out / f"rank_{rank}_call_{call}.pt")


def batch(seed, noise, num=16, length=40):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        old = -torch.rand(length, generator=gen) * 2
        samples.append((old, old + noise * torch.randn(length, generator=gen), torch.ones(length)))
    return samples


def test_agreeing_engines_get_token_tis(tmp_path):
    write_dump(tmp_path, {0: batch(0, 0.003)})
    dump = load_dumps(tmp_path)
    summary = mismatch_summary(dump)
    assert summary["sequences"] == 16 and summary["valid tokens"] == 640
    assert summary["token KL k3"] < 1e-4
    choice, reasons = recommend(summary, simulate_presets(dump))
    assert choice == "token_tis" and "agrees" in reasons[0]


def test_catastrophic_tokens_get_the_veto(tmp_path):
    samples = batch(1, 0.01)
    old, rollout, mask = samples[3]
    rollout = rollout.clone()
    rollout[5] = old[5] + 12.0  # ρ = e^-12 < 1e-4
    samples[3] = (old, rollout, mask)
    write_dump(tmp_path, {0: samples})
    dump = load_dumps(tmp_path)
    summary = mismatch_summary(dump)
    assert summary["catastrophic fraction (rho < 1e-4)"] == pytest.approx(1 / 640)
    presets = simulate_presets(dump)
    assert presets["mis"]["kept token fraction"] == pytest.approx(15 / 16)  # the vetoed sequence
    assert recommend(summary, presets)[0] == "mis"


def test_heavy_tails_and_nonfinite_are_reported(tmp_path):
    samples = batch(2, 0.8)  # |ℓ| often > log 2
    old, rollout, mask = samples[0]
    rollout = rollout.clone()
    rollout[0] = float("nan")
    samples[0] = (old, rollout, mask)
    write_dump(tmp_path, {0: samples})
    text = report(tmp_path)
    assert "engine bug" in text and "## Recommendation: `token_icepop`" in text
    assert "| token_tis |" in text and "| geo_rs |" in text


def test_cp_shards_are_joined_across_ranks(tmp_path):
    full = batch(3, 0.05, num=4)
    write_dump(tmp_path / "single", {0: full})
    split = {0: [(o[:10], r[:10], m[:10]) for o, r, m in full], 1: [(o[10:], r[10:], m[10:]) for o, r, m in full]}
    write_dump(tmp_path / "cp2", split)
    a = mismatch_summary(load_dumps(tmp_path / "single"))
    b = mismatch_summary(load_dumps(tmp_path / "cp2"))
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), key


def test_cli_analyze(tmp_path):
    write_dump(tmp_path / "d", {0: batch(4, 0.003)})
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "analyze", str(tmp_path / "d"), "--out",
                          str(tmp_path / "r.md")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Recommendation" in (tmp_path / "r.md").read_text()
    missing = subprocess.run([sys.executable, "-m", "miles_mis.cli", "analyze", str(tmp_path / "none")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "--dump-details" in missing.stderr
