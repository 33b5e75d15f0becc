"""Speed of the vectorised core against per-sequence implementations, side by side in one process.

Inputs: lengths uniform in [T/4, T], log-ratio noise sigma = 0.05, the default config (configs/mis.yaml
with --use-tis: token truncate [0.5, 2], token RS, veto 1e-4, batch normalisation).

Compared on the same inputs:
  ours        miles_mis.compute_mis_weights_with_cp
  per-seq     a per-sequence torch loop (vectorised inside a sequence, one Python iteration per
              sequence, the structure of miles' mis.py), checked equal to ours before timing
  reference   the readable pure-Python reference of tests/reference.py (one point only: it is slow)

Also counts aten operations per call (TorchDispatchMode) at B=8 and B=512: they must be equal.

    python benchmarks/bench_core.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from op_count import count_aten_ops  # noqa: E402

from miles_mis import MisConfig, compute_mis_weights_with_cp  # noqa: E402

CONFIG = MisConfig(use_tis=True, use_rs=True, tis_level="token", rs_level="token", tis_mode="truncate",
                   tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4, tis_batch_normalize=True)
CLAMP = 20.0


def make_inputs(num_seqs: int, max_len: int, seed: int = 0, prompt_len: int = 128):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 4, max_len + 1, (num_seqs,), generator=gen).tolist()
    total = sum(lengths)
    train = -torch.rand(total, generator=gen) * 2.0
    rollout = train + 0.05 * torch.randn(total, generator=gen)
    return dict(train_log_probs=list(torch.split(train, lengths)),
                rollout_log_probs=list(torch.split(rollout, lengths)),
                loss_masks=[torch.ones(n) for n in lengths], response_lengths=lengths,
                total_lengths=[n + prompt_len for n in lengths])


def ours(inputs, pg_loss):
    return compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, **inputs)


def per_sequence(inputs, pg_loss):
    """Per-sequence torch loop for the default config, same semantics as ours."""
    cfg = CONFIG
    weights, masks, metrics = [], [], {}

    def put(name, value):
        metrics.setdefault(f"mis_{name}", []).append(value)

    log_veto = torch.log(torch.tensor(cfg.rs_veto_threshold))
    for train, rollout, mask in zip(inputs["train_log_probs"], inputs["rollout_log_probs"], inputs["loss_masks"]):
        valid = mask != 0
        usable = valid & torch.isfinite(train) & torch.isfinite(rollout)
        count = usable.sum().clamp(min=1)
        train_u = torch.where(usable, train, 0.0)
        rollout_u = torch.where(usable, rollout, 0.0)
        ell = train_u - rollout_u
        rho = ell.clamp(-CLAMP, CLAMP).exp()
        mean_train, mean_rollout = train_u.sum() / count, rollout_u.sum() / count
        diff = mean_rollout - mean_train
        ones = torch.ones_like(train)
        put("training_log_ppl", -mean_train * ones)
        put("training_ppl", (-mean_train).clamp(-CLAMP, CLAMP).exp() * ones)
        put("rollout_log_ppl", -mean_rollout * ones)
        put("rollout_ppl", (-mean_rollout).clamp(-CLAMP, CLAMP).exp() * ones)
        put("kl", diff * ones)
        put("log_ppl_diff", diff * ones)
        put("log_ppl_abs_diff", diff.abs() * ones)
        put("ppl_ratio", diff.clamp(-CLAMP, CLAMP).exp() * ones)
        put("k3_kl", ((rho - ell - 1) * usable).sum() / count * ones)
        put("chi2_token", ((rho.square() * usable).sum() / count - 1) * ones)
        put("chi2_seq", ((2 * ell.sum().clamp(-CLAMP, CLAMP)).exp() - 1) * ones)
        put("nonfinite_token_fraction", (valid & ~usable).float())
        w = rho.clamp(max=cfg.tis_upper_bound)
        put("tis_weight_before_bound", rho)
        put("tis_truncate_fraction", (rho > cfg.tis_upper_bound).float())
        put("tis_weight_after_bound", w)
        put("rs_mask_fraction_low", (rho < cfg.rs_lower_bound).float())
        put("rs_mask_fraction_high", (rho > cfg.rs_upper_bound).float())
        catastrophic = usable & (ell < log_veto)
        put("rs_catastrophic_token_fraction", catastrophic.float())
        put("rs_catastrophic_seq_fraction", catastrophic.any().float() * ones)
        keep = usable & (rho >= cfg.rs_lower_bound) & (rho <= cfg.rs_upper_bound) & ~catastrophic.any()
        keep = keep & ~(valid & ~usable).any()
        w = torch.where(keep, w, 0.0)
        put("is_ratio_mean_after_tis_rs", w)
        weights.append(w)
        masks.append(keep)
    kept = torch.cat([w[k] for w, k in zip(weights, masks)])
    mean = kept.mean() if kept.numel() else torch.tensor(0.0)
    factor = mean if mean > 1e-8 else torch.tensor(1.0)
    weights = [w / factor for w in weights]
    all_w = torch.cat(weights)
    n_valid = sum(int((m != 0).sum()) for m in inputs["loss_masks"])
    ess = all_w.sum().square() / (n_valid * all_w.square().sum()) if all_w.square().sum() > 0 else torch.tensor(0.)
    kept_final = kept / factor
    for w, k in zip(weights, masks):
        ones = torch.ones_like(w)
        put("batch_norm_factor", factor * ones)
        put("is_ratio_mean_final", w)
        put("is_ratio_min_final", (w[k].min() if k.any() else torch.tensor(0.0)) * ones)
        put("is_ratio_max_final", (w[k].max() if k.any() else torch.tensor(0.0)) * ones)
        put("is_ratio_batch_min_final", kept_final.min() * ones)
        put("is_ratio_batch_max_final", kept_final.max() * ones)
        put("ess", ess * ones)
    out_loss = pg_loss * torch.cat(weights)
    return out_loss, [m.float() for m in masks], {k: torch.cat(v) for k, v in metrics.items()}


def reference_call(inputs, pg_loss):
    from reference import reference

    return reference(CONFIG, inputs["train_log_probs"], inputs["rollout_log_probs"], inputs["loss_masks"])


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved_medians_ms(fn_a, fn_b, repeats):
    """Median times of two functions run alternately, so that drift on a shared machine hits both."""
    fn_a(), fn_b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a) * 1e3, statistics.median(times_b) * 1e3


def count_ops(num_seqs: int) -> int:
    inputs = make_inputs(num_seqs, 64, seed=1)
    pg_loss = torch.ones(sum(inputs["response_lengths"]))
    return count_aten_ops(lambda: ours(inputs, pg_loss))


def check_same(inputs, pg_loss):
    a_loss, a_masks, a_metrics = ours(inputs, pg_loss)
    b_loss, b_masks, b_metrics = per_sequence(inputs, pg_loss)
    torch.testing.assert_close(a_loss, b_loss, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(x, y) for x, y in zip(a_masks, b_masks))
    assert a_metrics.keys() == b_metrics.keys(), set(a_metrics) ^ set(b_metrics)
    for name in a_metrics:
        torch.testing.assert_close(a_metrics[name], b_metrics[name], rtol=1e-4, atol=1e-5, msg=name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, default config (configs/mis.yaml + --use-tis)")
    print(f"{'B':>5} {'T':>5} {'tokens':>8} {'ours ms':>9} {'per-seq ms':>11} {'ratio':>7}")
    for num_seqs, max_len in [(64, 512), (256, 1024), (1024, 128)]:
        inputs = make_inputs(num_seqs, max_len)
        pg_loss = torch.ones(sum(inputs["response_lengths"]))
        check_same(inputs, pg_loss)
        t_ours, t_seq = interleaved_medians_ms(lambda: ours(inputs, pg_loss), lambda: per_sequence(inputs, pg_loss),
                                               args.repeats)
        print(f"{num_seqs:>5} {max_len:>5} {len(pg_loss):>8} {t_ours:>9.2f} {t_seq:>11.2f} {t_seq / t_ours:>6.1f}x")

    inputs = make_inputs(64, 512)
    pg_loss = torch.ones(sum(inputs["response_lengths"]))
    t_ours = median_ms(lambda: ours(inputs, pg_loss), args.repeats)
    t_ref = median_ms(lambda: reference_call(inputs, pg_loss), 1)
    print(f"pure-Python reference (tests/reference.py) at B=64, T=512: {t_ref:.0f} ms vs ours {t_ours:.2f} ms "
          f"({t_ref / t_ours:.0f}x)")

    small, large = count_ops(8), count_ops(512)
    print(f"aten ops per call: B=8 -> {small}, B=512 -> {large} ({'equal' if small == large else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
