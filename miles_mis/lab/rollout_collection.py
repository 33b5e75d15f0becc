"""A lab step's rollout batch: the engine generates it at the schedule's weight versions (schedule.py), the trainer
recomputes π_old over it (over the kept sets with ``--sampling-mask``), rewards give the GRPO advantages, and the
step's row starts with the reward and the raw mismatch of π_old against the engine (:func:`raw_mismatch`) split into
staleness and numerics. ``miles-mis train`` optimizes on the batch; ``miles-mis measure`` reuses the recompute
(:func:`old_log_probs_over_sets`) and :func:`raw_mismatch`. With ``--rollout-top-logprobs-num K`` the batch also
carries each sample's score-centering candidates as the engine recorded them (``Rollout.candidates``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch

from ..analyze.estimators import k3_terms
from ..tensors import ops
from . import kept_set, schedule
from .model import routing_disagreement
from .policy import group_advantages



def raw_mismatch(old_log_probs: list[torch.Tensor], rollout_log_probs: list[torch.Tensor]) -> dict[str, float]:
    """The batch's raw mismatch, over every response token, ℓ = log π_old − log π_rollout, ρ = e^clamp(ℓ, ±20):

      raw_kl = mean(−ℓ),   raw_ess = (Σρ)² / (N Σρ²),   raw_k3 = mean(max(expm1(clamp(ℓ)) − ℓ, 0)),
      raw_ratio_mean = mean(ρ)

    all in float64, from the float64 differences of the log-probs: an engine that nearly agrees has k3 ≈ ℓ²/2
    (5e-9 at ℓ = 1e-4), below float32's resolution of e^ℓ near 1 (6e-8), where e^ℓ − ℓ − 1 cancels to 0
    (analyze/estimators.py).
    """
    raw = torch.cat([o.double() - r.double() for o, r in zip(old_log_probs, rollout_log_probs)])
    ratio = raw.clamp(-20, 20).exp()
    ess = ops.ess(ratio.sum(), ratio.square().sum(), ratio.numel(), 0.0)
    return {"raw_kl": float(-raw.mean()), "raw_ess": float(ess), "raw_k3": float(k3_terms(raw).mean()),
            "raw_ratio_mean": float(ratio.mean())}


def truncated_fraction(responses: list[torch.Tensor], max_new_tokens: int, stop_token_ids=()) -> float:
    """The share of responses the budget cut: ``max_new_tokens`` long and not ending in a stop token (a model without
    stop tokens, the tiny one: every full-length response)."""
    stops = set(int(t) for t in stop_token_ids)
    cut = [r.numel() >= max_new_tokens and not (r.numel() and int(r[-1]) in stops) for r in responses]
    return sum(cut) / max(len(cut), 1)


@dataclass
class Rollout:
    """One step's rollout batch: the engine's samples, their rewards and π_old (the trainer's recompute)."""

    sequences: list[torch.Tensor]
    prompt_lengths: list[int]
    response_lengths: list[int]
    total_lengths: list[int]
    rollout_log_probs: list[torch.Tensor]
    old_log_probs: list[torch.Tensor]
    advantages: torch.Tensor
    routing: list[torch.Tensor] | None
    features: Any = None  # what the policy's π_old pass leaves for the minibatch steps (a frozen trunk's output)
    lags: list[int] = field(default_factory=list)  # per sample: weight versions behind the trainer (schedule.py)
    kept: list | None = None  # per sample, the kept sets every trainer pass scores over (--sampling-mask)
    # per sample, its engine's top-K candidates (--rollout-top-logprobs-num): (ids [R, K] int64, unused -1; log-probs
    # [R, K] float32, unused -inf), miles' rollout_topk_token_ids / rollout_topk_log_probs; None with K = 0
    candidates: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def collect_rollout(run: Any, args: argparse.Namespace, step: int) -> tuple[Rollout, dict[str, float]]:
    """Generate a GRPO batch at the schedule's weight versions (schedule.py), score it; (rollout, the step's row of
    reward, raw mismatch and its decomposition into staleness and numerics)."""
    prompts = run.policy.sample_prompts(run.prompt_generator)
    versions = schedule.group_versions(step, len(prompts.problems), args.group_size, args.rollout_staleness,
                                       args.async_max_lag, getattr(args, "rollout_lag", 0))
    if run.snapshots.keep > 1:  # the weights of this version, for the samples it generates and their scoring
        run.snapshots.save(step, run.policy)
    responses, rollout_log_probs, engine_kept, prefill, candidates = _generate(run, args, step, prompts, versions)
    if args.rollout_top_logprobs_num and candidates is None:  # the engine's construction did not receive the flag
        raise RuntimeError(f"--rollout-top-logprobs-num {args.rollout_top_logprobs_num}: the rollout engine recorded "
                           "no candidates (it was built without top_logprobs_num)")
    routing = run.engine.last_routing if args.router_replay else None  # R3: the trainer uses the engine's experts
    rewards = run.policy.rewards(prompts, responses)
    sequences = [torch.cat([p, r]) for p, r in zip(prompts.tokens, responses)]
    old_log_probs, features, kept, mask_row = old_log_probs_over_sets(args, run.policy, sequences, prompts.lengths,
                                                                      routing, engine_kept)
    lags = [step - v for v in versions]
    rollout = Rollout(sequences, prompts.lengths, [r.numel() for r in responses], [s.numel() for s in sequences],
                      rollout_log_probs, old_log_probs, group_advantages(rewards, args.group_size), routing, features,
                      lags, kept, candidates)
    row: dict[str, float] = {
        "step": step + 1, "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
        "exact_match": float((rewards == 1.0).float().mean()),
        "response_length": sum(rollout.response_lengths) / len(responses),
        "truncated_fraction": truncated_fraction(responses, run.policy.max_new_tokens,
                                                 getattr(run.policy, "stop_token_ids", ())),
        **raw_mismatch(old_log_probs, rollout_log_probs),  # every algorithm: π_old (trainer) vs π_rollout
    }
    at_versions = _scored_at_versions(run, step, rollout, versions)
    row.update(schedule.decompose(old_log_probs, at_versions, rollout_log_probs, lags))
    row.update(mask_row)
    if args.decode_term:
        row.update(schedule.decode_terms(at_versions, prefill, rollout_log_probs))
    if args.moe_experts:  # how often the trainer's own router disagrees with the engine's (replay or not)
        row["routing_mismatch"] = routing_disagreement(run.policy.model, sequences, run.engine.last_routing)
    return rollout, row


def _generate(run: Any, args: argparse.Namespace, step: int, prompts, versions: list[int]):
    """(responses, rollout log-probs, the engine's kept sets or None, with --decode-term the engine's prefill scores
    of the responses else None, the engine's candidates or None) of every prompt, each generated by the engine
    holding its version's weights: one sync every --rollout-staleness steps, or with --async-max-lag or --rollout-lag
    one sync and one generate call per version (each sample's kept set and candidates from the call that generated
    it)."""
    if not (args.async_max_lag or getattr(args, "rollout_lag", 0)):
        if step % args.rollout_staleness == 0:
            run.engine.sync(run.policy.model)
        responses, log_probs = run.engine.generate(prompts.tokens, run.policy.max_new_tokens)
        return (responses, log_probs, getattr(run.engine, "last_kept", None),
                _score_generated(run, args, prompts.tokens, responses), getattr(run.engine, "last_candidates", None))
    responses: list = [None] * len(versions)
    log_probs: list = [None] * len(versions)
    prefill: list | None = [None] * len(versions) if args.decode_term else None
    kept: list = [None] * len(versions)
    candidates: list = [None] * len(versions)
    for version, indices in schedule.by_version(versions).items():
        tokens = (prompts.tokens[torch.tensor(indices)] if isinstance(prompts.tokens, torch.Tensor)
                  else [prompts.tokens[i] for i in indices])
        with schedule.weights_of(run.policy, run.snapshots, version, step):
            run.engine.sync(run.policy.model)
        generated, scored = run.engine.generate(tokens, run.policy.max_new_tokens)
        sets = getattr(run.engine, "last_kept", None)
        recorded = getattr(run.engine, "last_candidates", None)  # before _score_generated's engine call
        scores = _score_generated(run, args, tokens, generated)
        for k, (i, response, lp) in enumerate(zip(indices, generated, scored)):
            responses[i], log_probs[i] = response, lp
            if prefill is not None:
                prefill[i] = scores[k]
            kept[i] = None if sets is None else sets[k]
            candidates[i] = None if recorded is None else recorded[k]
    return (responses, log_probs, None if any(k is None for k in kept) else kept, prefill,
            None if any(c is None for c in candidates) else candidates)


def _score_generated(run: Any, args: argparse.Namespace, prompts, responses) -> list | None:
    """With --decode-term: the engine's prefill log-probs of the responses just generated, at the weights that
    generated them (before any other sync); None without."""
    if not args.decode_term:
        return None
    prompts = list(prompts)
    return run.engine.score([torch.cat([p, r]) for p, r in zip(prompts, responses)], [p.numel() for p in prompts])


def old_log_probs_over_sets(args: argparse.Namespace, policy, sequences, prompt_lengths, routing, engine_kept):
    """π_old of every response token, the policy's features, the kept sets every later pass scores over (None with
    --sampling-mask off) and the step's sampling-mask metrics: mean kept-set size, and with recompute the share of
    tokens whose sampled token the trainer's set missed (added) and, where the engine recorded its sets, the share
    whose recomputed set differs from the engine's."""
    mode = args.sampling_mask
    if mode == "off":
        old, features = policy.old_log_probs(sequences, prompt_lengths, routing)
        return old, features, None, {}
    if mode == "engine":
        old, features = policy.old_log_probs(sequences, prompt_lengths, routing, kept=engine_kept)
        kept = engine_kept
    else:
        old, features = policy.old_log_probs(sequences, prompt_lengths, routing,
                                             recompute=(args.rollout_top_k, args.rollout_top_p))
        kept = policy.last_kept
    joined = kept_set.KeptSets.cat(kept)
    tokens = max(len(joined), 1)
    row = {"kept_set_size_mean": float(joined.sizes.double().mean()) if len(joined) else 0.0}
    if mode == "recompute":
        row["kept_set_forced_fraction"] = joined.forced / tokens
        if engine_kept is not None:
            same = joined.masks_equal(kept_set.KeptSets.cat(engine_kept))
            row["kept_set_differs_fraction"] = float((~same).double().sum()) / tokens
    return old, features, kept, row


def _scored_at_versions(run: Any, step: int, rollout: Rollout, versions: list[int]) -> list[torch.Tensor]:
    """π_trainer(v) of every sample: the trainer's log-probs with the weights that generated it (π_old itself for
    the samples of the current version)."""
    scored = list(rollout.old_log_probs)
    for version, indices in schedule.by_version(versions).items():
        if version == step:
            continue
        routing = None if rollout.routing is None else [rollout.routing[i] for i in indices]
        kept = None if rollout.kept is None else [rollout.kept[i] for i in indices]
        with schedule.weights_of(run.policy, run.snapshots, version, step), torch.no_grad():
            values, _ = run.policy.old_log_probs([rollout.sequences[i] for i in indices],
                                                 [rollout.prompt_lengths[i] for i in indices], routing, kept=kept)
        for i, value in zip(indices, values):
            scored[i] = value
    return scored
