"""``miles-mis analyze DUMP_DIR``: read miles policy-loss dumps and say which correction the engine needs.

miles writes ``<dump_dir>/policy_loss_debug/rank_<r>_call_<c>.pt`` when run with ``--dump-details``:
per sequence the trainer's π_old (``old_log_probs``), the engine's ``rollout_log_probs`` and the local
loss mask, as this rank's context-parallel shard. Shards of one call are joined across ranks (every
statistic here is a sum or a per-token value, so their order does not matter).

The report has the mismatch itself (token KL, k3, χ², tails of ρ = π_old/π_rollout, catastrophic and
non-finite tokens, response lengths), every shipped preset simulated on the dumped tokens (kept
fraction, ESS, bias of the bounded weights) and a recommendation from the rules in
``recommend`` (heuristics, stated with their reasons).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import MisConfig, preset_files
from .plugin import compute_mis_weights

CANDIDATES = ("token_tis", "mis", "token_icepop", "geo_rs", "k3_rs", "seq_mis")


@dataclass
class Dump:
    train_log_probs: list = field(default_factory=list)  # π_old per sequence
    rollout_log_probs: list = field(default_factory=list)
    loss_masks: list = field(default_factory=list)
    files: int = 0


def load_dumps(directory: Path) -> Dump:
    """All sequences of all calls, shards of one (call, sequence) joined across ranks."""
    files = sorted(Path(directory).glob("**/rank_*_call_*.pt"))
    if not files:
        raise ValueError(f"{directory}: no miles dumps (policy_loss_debug/rank_<r>_call_<c>.pt); run miles with "
                         "--dump-details DIR to write them")
    joined: dict[tuple[int, int], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for path in files:
        data = torch.load(path, map_location="cpu", weights_only=False)
        for sample in data["samples"]:
            if sample.get("rollout_log_probs") is None:
                raise ValueError(f"{path}: sample {sample.get('index')} has no rollout_log_probs: the rollout must "
                                 "keep per-token log-probs")
            key = (int(data.get("call", 0)), int(sample["index"]))
            joined[key]["old"].append(sample["old_log_probs"].float())
            joined[key]["rollout"].append(sample["rollout_log_probs"].float())
            joined[key]["mask"].append(sample["local_loss_mask"].float())
    dump = Dump(files=len(files))
    for key in sorted(joined):
        parts = joined[key]
        dump.train_log_probs.append(torch.cat(parts["old"]))
        dump.rollout_log_probs.append(torch.cat(parts["rollout"]))
        dump.loss_masks.append(torch.cat(parts["mask"]))
    return dump


def mismatch_summary(dump: Dump) -> dict[str, float]:
    """Token- and sequence-level mismatch statistics over valid tokens."""
    train = torch.cat(dump.train_log_probs)
    rollout = torch.cat(dump.rollout_log_probs)
    mask = torch.cat(dump.loss_masks) > 0
    finite = torch.isfinite(train) & torch.isfinite(rollout)
    usable = mask & finite
    ell = (train - rollout)[usable].double()
    rho = ell.clamp(-20, 20).exp()
    seq_sums = torch.tensor([float(((t - r)[(m > 0) & torch.isfinite(t - r)]).sum())
                             for t, r, m in zip(dump.train_log_probs, dump.rollout_log_probs, dump.loss_masks)])
    lengths = torch.tensor([float((m > 0).sum()) for m in dump.loss_masks])
    count = max(int(usable.sum()), 1)
    return {
        "sequences": float(len(dump.loss_masks)),
        "valid tokens": float(mask.sum()),
        "mean response length": float(lengths.mean()) if lengths.numel() else 0.0,
        "non-finite token fraction": float((mask & ~finite).sum()) / max(int(mask.sum()), 1),
        "token KL k1 (mean log pi_rollout - log pi_old)": float(-ell.sum()) / count,
        "token KL k3": float((rho - ell.clamp(-20, 20) - 1).sum()) / count,
        "chi2 token (mean rho^2 - 1)": float(rho.square().sum()) / count - 1.0,
        "max abs(log ratio)": float(ell.abs().max()) if ell.numel() else 0.0,
        "fraction rho > 2": float((rho > 2).sum()) / count,
        "fraction rho < 0.5": float((rho < 0.5).sum()) / count,
        "catastrophic fraction (rho < 1e-4)": float((rho < 1e-4).sum()) / count,
        "sequences with abs(sum log ratio) > log 2": float((seq_sums.abs() > math.log(2)).float().mean())
        if seq_sums.numel() else 0.0,
    }


def simulate_presets(dump: Dump, names=CANDIDATES) -> dict[str, dict[str, float]]:
    """Each preset run (use_tis on) over the dumped tokens: kept fraction, ESS, weight stats, bias proxy."""
    files = preset_files()
    valid = sum(float((m > 0).sum()) for m in dump.loss_masks)
    out = {}
    for name in names:
        if name not in files:
            continue
        config = MisConfig.preset(name, use_tis=True)
        weights, masks, metrics = compute_mis_weights(config, train_log_probs=dump.train_log_probs,
                                                      rollout_log_probs=dump.rollout_log_probs,
                                                      loss_masks=dump.loss_masks)
        kept = torch.cat(masks) > 0
        w = torch.cat(weights)
        raw = torch.cat(metrics["mis_tis_weight_before_bound"])
        after = torch.cat(metrics["mis_tis_weight_after_bound"])
        changed = ((after - raw).abs() > 1e-6 * raw.abs().clamp(min=1)) & kept
        ess = torch.cat(metrics["mis_ess"])
        out[name] = {
            "kept token fraction": float(kept.sum()) / max(valid, 1.0),
            "ESS": float(ess[0]) if ess.numel() else 0.0,
            "mean final weight (kept)": float(w[kept].mean()) if kept.any() else 0.0,
            "bounded-weight fraction (bias)": float(changed.sum()) / max(float(kept.sum()), 1.0),
        }
    return out


def recommend(summary: dict[str, float], presets: dict[str, dict[str, float]]) -> tuple[str, list[str]]:
    """A preset and the reasons, from simple, stated rules (heuristics, not a guarantee)."""
    reasons = []
    if summary["non-finite token fraction"] > 0:
        reasons.append(f"{summary['non-finite token fraction']:.2e} of valid tokens have NaN/inf log-probs: an "
                       "engine bug (SGLang serialises NaN as null, miles #2662); every miles_mis config rejects those "
                       "sequences, but fix the engine")
    k3 = summary["token KL k3"]
    tails = summary["fraction rho > 2"] + summary["fraction rho < 0.5"]
    if summary["catastrophic fraction (rho < 1e-4)"] > 0:
        reasons.append("tokens with rho < 1e-4 exist: use a veto; mis.yaml vetoes them and rejects token tails")
        return "mis", reasons
    if k3 < 1e-4 and tails < 1e-3:
        reasons.append(f"token k3 = {k3:.1e} and {tails:.1e} of ratios outside [0.5, 2]: the engine agrees with the "
                       "trainer; token_tis is cheap insurance (or metrics_only to monitor)")
        return "token_tis", reasons
    if tails >= 1e-3 and presets.get("mis", {}).get("kept token fraction", 0) >= 0.95:
        reasons.append(f"{tails:.1e} of token ratios outside [0.5, 2]: heavy token tails; mis.yaml rejects them and "
                       f"keeps {presets['mis']['kept token fraction']:.1%} of tokens")
        return "mis", reasons
    if tails >= 1e-3:
        reasons.append(f"{tails:.1e} of token ratios outside [0.5, 2], too many to reject: IcePop zeroes their "
                       "weight but keeps the denominators")
        return "token_icepop", reasons
    if summary["sequences with abs(sum log ratio) > log 2"] > 0.05 and summary["mean response length"] > 512:
        reasons.append("long responses whose product ratios leave [0.5, 2]: sequence-level IS would reject or clip "
                       "them; stay at token level (token_tis)")
    else:
        reasons.append(f"moderate mismatch (token k3 = {k3:.1e}) without heavy tails: token truncated IS")
    return "token_tis", reasons


def report(directory: Path) -> str:
    dump = load_dumps(directory)
    summary = mismatch_summary(dump)
    presets = simulate_presets(dump)
    choice, reasons = recommend(summary, presets)
    lines = [f"# miles_mis analysis of {directory}", "",
             f"{dump.files} dump files, {int(summary['sequences'])} sequences, {int(summary['valid tokens'])} valid "
             "tokens (pi_old = the trainer's recompute, against the engine's log-probs).", "", "## Mismatch", "",
             "| statistic | value |", "|---|---|"]
    lines += [f"| {name} | {value:.4g} |" for name, value in summary.items()]
    lines += ["", "## Presets on these tokens (use_tis on)", ""]
    if presets:
        columns = list(next(iter(presets.values())))
        lines += ["| preset | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{v[c]:.4g}" for c in columns) + " |" for name, v in presets.items()]
    lines += ["", f"## Recommendation: `{choice}`", ""] + [f"- {reason}" for reason in reasons]
    lines += ["", f"Use it with `--use-tis --custom-tis-function-path miles_mis.compute_mis_weights_with_cp "
              f"--custom-config-path configs/{choice}.yaml`."]
    return "\n".join(lines) + "\n"
