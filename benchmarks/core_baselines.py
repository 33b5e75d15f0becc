"""The implementations benchmarks/bench_core.py times against each other, on the same inputs, and their check.

``make_inputs`` draws a batch (lengths uniform in [T/4, T], log-ratio noise sigma = 0.05) in the list form miles
passes; ``packed_inputs`` and ``padded_inputs`` hold it as a packed and a padded host do. ``ours`` and ``ours_packed``
are miles_mis' list and packed entry points with the default config (``CONFIG``: configs/mis.yaml with --use-tis);
``padded`` (a [B, T] dense implementation), ``per_sequence`` (a Python loop over sequences, the structure of miles'
mis.py) and ``reference_call`` (tests/reference.py) are the baselines; ``list_interface`` is the least a list entry
costs a packed implementation. ``check_same`` asserts every one of them gives ours' outputs before anything is timed.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # reference.py, the readable reference

from miles_mis import MisConfig, compute_mis_weights_packed, compute_mis_weights_with_cp  # noqa: E402
from miles_mis.correction.mismatch_location import BUCKET_NAMES, POSITION_EDGES  # noqa: E402

CONFIG = MisConfig(use_tis=True, use_rs=True, tis_level="token", rs_level="token", tis_mode="truncate",
                   tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4, tis_batch_normalize=True)
CLAMP = 20.0



def detector_metrics(ell: torch.Tensor, usable: torch.Tensor) -> dict:
    """The truncation detector's batch values (miles_mis.correction.truncated_sampling) of ℓ (0 where not usable), any
    layout."""
    from miles_mis.correction import truncated_sampling

    return truncated_sampling.metrics(
        truncated_sampling.local_values(ell.reshape(-1), usable.reshape(-1).double(), None), False)

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


def packed_inputs(inputs):
    """The same batch as a packed host holds it: flat [N] tensors and int64 cu_seqlens [B+1]."""
    offsets = torch.tensor([0] + inputs["response_lengths"], dtype=torch.long).cumsum(0)
    return dict(train_log_probs=torch.cat(inputs["train_log_probs"]),
                rollout_log_probs=torch.cat(inputs["rollout_log_probs"]),
                loss_mask=torch.cat(inputs["loss_masks"]), cu_seqlens=offsets)


def ours_packed(flat):
    return compute_mis_weights_packed(CONFIG, **flat)


def padded_inputs(inputs):
    """The same batch as a padded host holds it: [B, T] tensors (T = the longest response), padding 0 in
    the loss mask (and 0 in the log-probs), plus the bool padding mask used to compare outputs."""
    lengths = torch.tensor(inputs["response_lengths"])
    width = int(lengths.max()) if lengths.numel() else 0
    real = torch.arange(width)[None, :] < lengths[:, None]

    def pad(seqs):
        out = torch.zeros(len(seqs), width)
        out[real] = torch.cat(seqs)
        return out

    return dict(train=pad(inputs["train_log_probs"]), rollout=pad(inputs["rollout_log_probs"]),
                mask=pad(inputs["loss_masks"])), real


def padded(p):
    """Padded dense implementation of the default config (token truncate IS, token RS, veto, batch
    normalisation), same semantics as ours: vectorised over [B, T], per-sequence sums/extremes along dim 1.
    Returns (weights [B, T], mask [B, T], metrics name -> [B, T]), every output materialised (as ours)."""
    cfg = CONFIG
    train, rollout, mask = p["train"], p["rollout"], p["mask"]
    num_seqs, width = train.shape
    lower, upper = cfg.tis_lower_bound, cfg.tis_upper_bound
    valid = (mask != 0).float()
    usable = (torch.maximum(train.abs(), rollout.abs()) < 1e4).float() * valid
    ell = torch.nan_to_num(train - rollout, nan=0.0, posinf=0.0, neginf=0.0) * usable
    train_u = torch.nan_to_num(train, nan=0.0, posinf=0.0, neginf=0.0) * usable
    rho = ell.clamp(-CLAMP, CLAMP).exp()
    f64 = torch.float64  # every sum in float64 and k3 as expm1 in float64, as ours (docs/math.md, precision)
    n_usable = usable.sum(1, dtype=f64)
    count = n_usable.clamp(min=1.0)
    sum_ell = ell.sum(1, dtype=f64)
    mean_train = train_u.sum(1, dtype=f64) / count
    mean_rollout = mean_train - sum_ell / count
    diff = -sum_ell / count
    w = rho.clamp(max=upper)
    catastrophic = (ell < math.log(cfg.rs_veto_threshold)).float() * usable
    vetoed = catastrophic.amax(1) > 0 if width else torch.zeros(num_seqs, dtype=torch.bool)
    seq_keep = ~(vetoed | (valid.sum(1) > n_usable))
    token_keep = usable * (rho >= lower) * (rho <= upper) * seq_keep[:, None]
    kept_w = w * token_keep
    sum_w = kept_w.sum(dtype=f64)
    mean = sum_w / token_keep.sum(dtype=f64).clamp(min=1.0)
    factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    seq_max = torch.where(token_keep > 0, w, -1.0).amax(1) if width else torch.full((num_seqs,), -1.0)
    seq_min = torch.where(token_keep > 0, w, 3e38).amin(1) if width else torch.full((num_seqs,), 3e38)
    has_kept = seq_max >= 0
    max_w = torch.cat([seq_max, torch.tensor([-1.0])]).amax()
    min_w = torch.cat([seq_min, torch.tensor([3e38])]).amin()
    sum_w_sq = (kept_w * w).sum(dtype=f64)
    n_valid = valid.sum(dtype=f64)
    final = kept_w / factor
    # where the mismatch lives: the position of a token is its column, so the buckets are column sums
    ell64 = ell.double()
    k3 = torch.expm1(ell64.clamp(-CLAMP, CLAMP)).sub_(ell64).clamp_(min=0.0)  # 0 where not usable (ℓ = 0)
    low = (rollout < math.log(cfg.metrics_low_prob_threshold)).double() * usable
    column_bucket = torch.bucketize(torch.arange(width), torch.tensor(POSITION_EDGES[1:]), right=True)
    n_buckets = len(BUCKET_NAMES)
    bucket_k3 = torch.zeros(n_buckets, dtype=f64).index_add_(0, column_bucket, k3.sum(0))
    bucket_n = torch.zeros(n_buckets, dtype=f64).index_add_(0, column_bucket, usable.sum(0, dtype=f64))
    usable_n, k3_total = n_usable.sum().double(), k3.sum().double()
    ratio = lambda a, b: (a.double() / b.double().clamp(min=1.0)).float()  # noqa: E731
    first_k3, first_n = (k3[:, 0].sum(), usable[:, 0].sum()) if width else (k3.sum(), usable.sum())
    location = {"k3_first_token": ratio(first_k3, first_n), "k3_low_rollout_prob": ratio((k3 * low).sum(), low.sum()),
                "low_rollout_prob_token_fraction": ratio(low.sum(), usable_n),
                **{f"k3_position_{name}": ratio(bucket_k3[i], bucket_n[i]) for i, name in enumerate(BUCKET_NAMES)},
                "batch_k3": ratio(k3_total, usable_n), "batch_kl": ratio(-sum_ell.sum(), usable_n),
                "batch_max_abs_log_ratio": ell.abs().amax() if ell.numel() else torch.tensor(0.0),
                **detector_metrics(ell, usable)}
    seq = {
        "training_log_ppl": -mean_train, "training_ppl": (-mean_train).clamp(-CLAMP, CLAMP).exp(),
        "rollout_log_ppl": -mean_rollout, "rollout_ppl": (-mean_rollout).clamp(-CLAMP, CLAMP).exp(),
        "kl": diff, "log_ppl_diff": diff, "log_ppl_abs_diff": diff.abs(), "ppl_ratio": diff.clamp(-CLAMP, CLAMP).exp(),
        "k3_kl": k3.sum(1) / count,
        "chi2_token": (torch.expm1(2.0 * ell.clamp(-CLAMP, CLAMP)) * usable).sum(1, dtype=f64) / count,
        "chi2_seq": torch.expm1(2.0 * sum_ell.clamp(-CLAMP, CLAMP)),
        "rs_catastrophic_seq_fraction": vetoed.float(),
        "is_ratio_max_final": torch.where(has_kept, seq_max / factor, 0.0),
        "is_ratio_min_final": torch.where(has_kept, seq_min / factor, 0.0),
    }
    any_kept = max_w >= 0
    batch = {
        "batch_norm_factor": factor,
        "is_ratio_batch_min_final": torch.where(any_kept, min_w / factor, 0.0),
        "is_ratio_batch_max_final": torch.where(any_kept, max_w / factor, 0.0),
        "ess": torch.where(sum_w_sq > 0, sum_w.square() / (n_valid * sum_w_sq).clamp(min=1e-30), 0.0).clamp(max=1.0),
        **location,
    }
    metrics = {
        "nonfinite_token_fraction": valid - usable, "tis_weight_before_bound": rho,
        "tis_truncate_fraction": (rho > upper).float(), "tis_weight_after_bound": w,
        "rs_mask_fraction_low": (rho < lower).float(), "rs_mask_fraction_high": (rho > upper).float(),
        "rs_catastrophic_token_fraction": catastrophic, "is_ratio_mean_after_tis_rs": kept_w,
        "is_ratio_mean_final": final,
    }
    # per-sequence values: one [M, B] table broadcast along T in one copy; batch values: broadcast views
    # (stride 0), as miles_mis returns them
    table = torch.stack([value.float() for value in seq.values()])
    metrics.update(zip(seq, table[:, :, None].expand(-1, -1, width).contiguous().unbind(0)))
    metrics.update({name: value.float().expand(num_seqs, width) for name, value in batch.items()})
    return final, mask * token_keep, {f"mis_{name}": value for name, value in sorted(metrics.items())}


def list_interface(inputs, pg_loss, weights, keep):
    """The list interface's own cost (see the module docstring); ``weights``/``keep``: a packed call's output."""
    lengths = list(map(torch.Tensor.numel, inputs["loss_masks"]))
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0, out=cu_seqlens[1:])
    flat = [torch.cat(inputs[name]) for name in ("train_log_probs", "rollout_log_probs", "loss_masks")]
    weighted = torch.where(keep, pg_loss * weights, 0.0)
    return cu_seqlens, weighted, list(flat[2].split_with_sizes(lengths))


def per_sequence(inputs, pg_loss):
    """Per-sequence torch loop for the default config, same semantics as ours."""
    cfg = CONFIG
    weights, masks, metrics = [], [], {}

    def put(name, value):
        metrics.setdefault(f"mis_{name}", []).append(value)

    log_veto = torch.log(torch.tensor(cfg.rs_veto_threshold))
    log_low = math.log(cfg.metrics_low_prob_threshold)
    edges = torch.tensor(POSITION_EDGES[1:])
    n_buckets = len(BUCKET_NAMES)
    # batch sums: k3 and count of first tokens, of low-probability tokens, usable count, per-bucket k3 and
    # counts, then Σ k3 and Σ ℓ (the gate statistics); and max |ℓ|
    sums = torch.zeros(5 + 2 * n_buckets + 2, dtype=torch.float64)
    max_abs = torch.zeros((), dtype=torch.float64)
    ells, usables = [], []  # for the truncation detector's batch sums
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
        ell64 = ell.double()
        k3 = (torch.expm1(ell64.clamp(-CLAMP, CLAMP)) - ell64).clamp(min=0) * usable  # as ours: float64 expm1
        put("k3_kl", (k3.sum() / count).float() * ones)
        put("chi2_token",
            ((torch.expm1(2 * ell.clamp(-CLAMP, CLAMP)) * usable).sum(dtype=torch.float64) / count).float() * ones)
        put("chi2_seq", torch.expm1(2 * ell.sum(dtype=torch.float64).clamp(-CLAMP, CLAMP)).float() * ones)
        low = usable & (rollout < log_low)
        bucket = torch.bucketize(torch.arange(len(train)), edges, right=True)
        sums += torch.cat([torch.stack([k3[:1].sum(), usable[:1].sum(), k3[low].sum(), low.sum(), usable.sum()]),
                           torch.bincount(bucket, weights=k3, minlength=n_buckets),
                           torch.bincount(bucket, weights=usable.float(), minlength=n_buckets),
                           torch.stack([k3.sum(), ell.sum()])]).double()
        max_abs = torch.maximum(max_abs, ell.abs().max().double() if len(ell) else max_abs)
        ells.append(ell)
        usables.append(usable)
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
    ratio = lambda a, b: (a / b.clamp(min=1.0)).float()  # noqa: E731
    batch = {"k3_first_token": ratio(sums[0], sums[1]), "k3_low_rollout_prob": ratio(sums[2], sums[3]),
             "low_rollout_prob_token_fraction": ratio(sums[3], sums[4])}
    batch.update({f"k3_position_{name}": ratio(sums[5 + i], sums[5 + n_buckets + i])
                  for i, name in enumerate(BUCKET_NAMES)})
    batch.update({"batch_k3": ratio(sums[-2], sums[4]), "batch_kl": ratio(-sums[-1], sums[4]),
                  "batch_max_abs_log_ratio": max_abs.float(),
                  **detector_metrics(torch.cat(ells) if ells else torch.zeros(0),
                                     torch.cat(usables) if usables else torch.zeros(0, dtype=torch.bool))})
    for w, k in zip(weights, masks):
        ones = torch.ones_like(w)
        put("batch_norm_factor", factor * ones)
        put("is_ratio_mean_final", w)
        put("is_ratio_min_final", (w[k].min() if k.any() else torch.tensor(0.0)) * ones)
        put("is_ratio_max_final", (w[k].max() if k.any() else torch.tensor(0.0)) * ones)
        put("is_ratio_batch_min_final", kept_final.min() * ones)
        put("is_ratio_batch_max_final", kept_final.max() * ones)
        put("ess", ess * ones)
        for name, value in batch.items():
            put(name, value * ones)
    out_loss = pg_loss * torch.cat(weights)
    return out_loss, [m.float() for m in masks], {k: torch.cat(v) for k, v in metrics.items()}


def reference_call(inputs, pg_loss):
    from reference import reference

    return reference(CONFIG, inputs["train_log_probs"], inputs["rollout_log_probs"], inputs["loss_masks"])


def check_same(inputs, pg_loss, flat, dense, real):
    """Every implementation gives ours' outputs (pg_loss is ones, so ours' loss is the weights)."""
    a_loss, a_masks, a_metrics = ours(inputs, pg_loss)
    b_loss, b_masks, b_metrics = per_sequence(inputs, pg_loss)
    torch.testing.assert_close(a_loss, b_loss, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(x, y) for x, y in zip(a_masks, b_masks))
    assert a_metrics.keys() == b_metrics.keys(), set(a_metrics) ^ set(b_metrics)
    for name in a_metrics:
        torch.testing.assert_close(a_metrics[name], b_metrics[name], rtol=1e-4, atol=1e-5, msg=name)
    p_weights, p_mask, p_metrics = ours_packed(flat)  # the same core on the same tokens: identical
    assert torch.equal(p_weights, a_loss) and torch.equal(p_mask, torch.cat(a_masks))
    assert p_metrics.keys() == a_metrics.keys() and all(torch.equal(p_metrics[k], a_metrics[k]) for k in a_metrics)
    d_weights, d_mask, d_metrics = padded(dense)
    assert not d_weights[~real].any() and not d_mask[~real].any()
    torch.testing.assert_close(d_weights[real], a_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(d_mask[real], torch.cat(a_masks))
    assert d_metrics.keys() == a_metrics.keys(), set(d_metrics) ^ set(a_metrics)
    for name in a_metrics:
        torch.testing.assert_close(d_metrics[name][real], a_metrics[name], rtol=1e-4, atol=1e-5, msg=name)
