"""The score-centered policy-gradient loss of every token, from the trainer's and the engine's log-probs of the sampled
token and of the K recorded candidates H (arXiv 2609.20807; the estimator of miles' ``--loss-type score_centering``).

With p the trainer's and q the engine's distribution at a position, y the sampled token, A its advantage and f the
weighting (``Weighting``: none f ≡ 1, tis f(r) = min(r, c), mis f(r) = r on [lo, hi] and 0 outside):

    P = Σ_H p_h,   Q = Σ_H q_h,   ρ = max(1 − Q, ε) / max(1 − P, ε)        (ε = 1e-6; ρ: the tail's q/p)
    α = ρ · f(1/ρ),   c_h = q_h · f(p_h / q_h) − α · p_h,   w = f(p_y / q_y)
    loss_t = −A · (sg(w) · log p_y − Σ_H sg(c_h) · log p_h)               (sg: stop-gradient)

The engine's tail is modelled as q_v = ρ · p_v outside H, so E_{y∼q}[f(p_y/q_y) ∇log p_y] = Σ_H c_h ∇log p_h: the
second term subtracts the score a constant advantage would push on average, exactly when the tail model holds
(with H the whole vocabulary, always). Unused slots (id −1) and tokens outside the loss mask contribute nothing; the
sampled token carries its own recorded q_y whether or not it is in H. Everything is elementwise over [N] or [N, K]
tensors: no loop over sequences or tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .candidates import Candidates
from .vocab_log_probs import VocabShard, selected_log_probs, support_log_probs

TAIL_FLOOR = 1.0e-6  # ε: the tails' floor in ρ (a head holding all the mass on either side)
MODES = ("none", "tis", "mis")


@dataclass(frozen=True)
class Weighting:
    """The importance weighting f composed with the centering (miles' ``--score-centering-is`` and its bounds)."""

    mode: str = "none"
    tis_clip: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 5.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"score_centering_is={self.mode!r} is invalid: allowed values are {', '.join(MODES)}")
        if not (math.isfinite(self.tis_clip) and self.tis_clip > 0):
            raise ValueError(f"score_centering_tis_clip={self.tis_clip!r} is invalid: a finite number > 0")
        if not (math.isfinite(self.mis_low) and math.isfinite(self.mis_high) and 0 < self.mis_low <= self.mis_high):
            raise ValueError(f"score_centering_mis_low={self.mis_low!r}, score_centering_mis_high={self.mis_high!r} "
                             "are invalid: finite, with 0 < low <= high")

    def head_terms(self, p: Tensor, q: Tensor, log_ratio: Tensor) -> Tensor:
        """q · f(p / q) per candidate, from p, q and log(p / q) (the band compared in log space; 0 where q = 0
        under tis: min(p, c·q))."""
        if self.mode == "none":
            return q
        if self.mode == "tis":
            return torch.minimum(p, self.tis_clip * q)
        return torch.where(self._in_band(log_ratio), p, 0.0)

    def tail_scale(self, tail_ratio: Tensor) -> Tensor:
        """α = ρ · f(1/ρ): ρ (none), min(c·ρ, 1) (tis), 1 if 1/hi ≤ ρ ≤ 1/lo else 0 (mis)."""
        if self.mode == "none":
            return tail_ratio
        if self.mode == "tis":
            return (self.tis_clip * tail_ratio).clamp(max=1.0)
        # ρ compared with 1/hi and 1/lo directly (not log ρ with log lo, log hi): at the band's edges the two
        # roundings differ by an ulp, and miles compares ρ
        return ((tail_ratio >= 1.0 / self.mis_high) & (tail_ratio <= 1.0 / self.mis_low)).to(tail_ratio.dtype)

    def sampled_weight(self, log_ratio: Tensor) -> Tensor:
        """w = f(p_y / q_y) from log(p_y / q_y): 1 (none), min(r, c) (tis), r on [lo, hi] else 0 (mis)."""
        if self.mode == "none":
            return torch.ones_like(log_ratio)
        if self.mode == "tis":
            return log_ratio.clamp(max=math.log(self.tis_clip)).exp()
        inside = self._in_band(log_ratio)
        return torch.where(inside, log_ratio.clamp(math.log(self.mis_low), math.log(self.mis_high)).exp(), 0.0)

    def _in_band(self, log_ratio: Tensor) -> Tensor:
        return (log_ratio >= math.log(self.mis_low)) & (log_ratio <= math.log(self.mis_high))


@dataclass(frozen=True)
class CenteredLoss:
    """The per-token loss and what miles logs of it (``sc_*``), each [N] (0 outside the loss mask)."""

    token_loss: Tensor  # loss_t, differentiable through the trainer's log-probs
    correction: Tensor  # Σ_H c_h · log p_h, detached (sc_correction)
    train_head_mass: Tensor  # P (sc_train_head_mass)
    rollout_head_mass: Tensor  # Q (sc_rollout_head_mass)
    tail_ratio: Tensor  # ρ (sc_tail_ratio)
    importance_weight: Tensor  # w (sc_importance_weight)


def centered_loss(train_log_probs: Tensor, rollout_log_probs: Tensor, train_candidate_log_probs: Tensor,
                  rollout_candidate_log_probs: Tensor, used: Tensor, advantages: Tensor, loss_mask: Tensor,
                  weighting: Weighting = Weighting()) -> CenteredLoss:
    """The score-centered loss of N tokens. ``train_log_probs``/``rollout_log_probs``: [N] log p_y and log q_y;
    ``train_candidate_log_probs``/``rollout_candidate_log_probs``: [N, K] log p_h and log q_h; ``used``: [N, K] the
    slot holds a candidate; ``advantages``: [N] A; ``loss_mask``: [N] the token trains (any value ≠ 0)."""
    trains = loss_mask != 0
    head = used & trains[:, None]
    # unused slots and untrained tokens: log-probs 0 (no −inf·0, no NaN gradient), so their terms vanish
    train_head = torch.where(head, train_candidate_log_probs, 0.0)
    with torch.no_grad():
        log_p = train_head.detach()
        log_q = torch.where(head, rollout_candidate_log_probs, 0.0)
        p, q = torch.where(head, log_p.exp(), 0.0), torch.where(head, log_q.exp(), 0.0)
        train_mass, rollout_mass = p.sum(dim=1), q.sum(dim=1)
        tail_ratio = (1.0 - rollout_mass).clamp(min=TAIL_FLOOR) / (1.0 - train_mass).clamp(min=TAIL_FLOOR)
        head_terms = weighting.head_terms(p, q, log_p - log_q)
        coefficients = torch.where(head, head_terms - weighting.tail_scale(tail_ratio)[:, None] * p, 0.0)
        log_ratio = torch.where(trains, train_log_probs.detach() - rollout_log_probs, 0.0)
        weight = torch.where(trains, weighting.sampled_weight(log_ratio), 0.0)
        advantage = torch.where(trains, advantages.detach(), 0.0)
    correction = (coefficients * train_head).sum(dim=1)
    sampled = torch.where(trains, train_log_probs, 0.0)
    token_loss = -advantage * (weight * sampled - correction)
    return CenteredLoss(token_loss, correction.detach(), train_mass, rollout_mass,
                        torch.where(trains, tail_ratio, 0.0), weight)


def centered_loss_from_logits(logits: Tensor, rows: Tensor, tokens: Tensor, candidates: Candidates,
                              rollout_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor,
                              weighting: Weighting = Weighting(), shard: VocabShard = VocabShard(),
                              temperature: float = 1.0, support: bool = False) -> CenteredLoss:
    """``centered_loss`` with the trainer's log-probs taken from this rank's logits [T, W] (its vocabulary slice),
    where response token n is scored by logits row ``rows[n]`` ([N]) and ``tokens`` [N] are the sampled ids. The
    response rows are selected before the softmax, so the rows that score no response token (prompts, padding) cost
    nothing and get no gradient. ``support``: the candidates are the sampled support and p is renormalised over it
    (``support_log_probs``; a trained token sampled outside its support is a ValueError); otherwise p is the full
    softmax (``selected_log_probs``)."""
    if support:
        outside = ~(candidates.ids == tokens.long()[:, None]).any(dim=1) & (loss_mask != 0)
        if bool(outside.any()):
            n = int(outside.nonzero()[0])
            raise ValueError(f"response token {n}: the sampled token {int(tokens[n])} is not in its recorded support "
                             f"{candidates.ids[n][candidates.used[n]].tolist()}: in support mode the engine samples "
                             "from the support it records")
    chosen = torch.cat([tokens.long()[:, None], candidates.ids], dim=1)
    # the response rows first: the softmax's float32 copies and saved probabilities are then [N, W], not [T, W]
    response_logits = logits.index_select(0, rows.long())
    log_probs = (support_log_probs if support else selected_log_probs)(response_logits, chosen, shard, temperature)
    return centered_loss(log_probs[:, 0], rollout_log_probs, log_probs[:, 1:], candidates.log_probs, candidates.used,
                         advantages, loss_mask, weighting)
