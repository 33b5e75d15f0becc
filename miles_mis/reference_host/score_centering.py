"""The reference host's score-centering loss: miles' ``--loss-type score_centering`` policy loss, written again from
the paper's formula and from a reading of miles' source, slowly and one token at a time, as an independent oracle
for the product code (it shares no code with :mod:`miles_mis.centering`).

Read from sii-avalanche/miles at commit 4d412b5aca323b49cd414dadb10d7ae1742ec637, files (under
``miles/backends/training_utils/``): ``loss/hub/score_centering_loss.py`` (the loss function miles calls,
``score_centering_loss_function``: response rows, candidates, masks, regularisers, logs),
``loss/hub/score_centering/estimator.py`` (the per-token estimator), ``.../importance_sampling.py`` (f, the head
coefficient and the tail scale of each mode), ``.../masks.py`` (padding, NaN and -inf rules),
``.../selected_log_probs.py`` (full-vocabulary or support log-probabilities), ``loss/hub/logit_processors.py``
(``_iter_response_chunks``: which logit row scores which token), ``loss/hub/math_utils.py`` (``compute_approx_kl``) and
``data/context_parallel.py`` (the reducer and the loss masks at CP size 1).

The formula (arXiv:2609.20807, Appendix A). Per response token t with sampled token y, advantage A (detached), the
trainer's p = softmax(logits_row / T) (T = ``args.rollout_temperature``), the sampler's recorded log q_y
(``batch["rollout_log_probs"]``) and its K recorded candidates H (``batch["rollout_topk_token_ids"]``, -1 unused,
with log q_h from ``batch["rollout_topk_log_probs"]``, -inf unused), f the importance-weight function
(none: f = 1; tis: f(r) = min(r, c); mis: f(r) = r if lo <= r <= hi else 0) and eps = 1e-6::

    P = sum_H p_h,  Q = sum_H q_h,  rho = max(1 - Q, eps) / max(1 - P, eps),  alpha = rho * f(1 / rho)
    c_h = q_h * f(p_h / q_h) - alpha * p_h          (0 when q_h = 0: q * f(p / q) -> 0)
    w   = f(p_y / q_y)
    loss_t = -A * (sg(w) * log p_y - sum_H sg(c_h) * log p_h)
    pg_loss = sum_of_sample_mean(loss_t)

The sampled token is its own term and is NOT removed from H: when y is a candidate, log p_y appears in both terms.
A term whose coefficient is 0, or whose log-probability is not finite, is left out (no 0 * -inf).

What the source adds to the formula (each confirmed there; see also the tests):

- Masks. A token is trained when its loss mask is non-zero. On an untrained token miles sets A = 0 and log q_y = 0
  and records no candidate (H empty), so its loss is 0 and its metrics are rho = 1 and w = f(p_y); the reducer's
  mask removes them. A token with loss mask 1 and A = 0 keeps its candidates (its P, Q, rho are logged).
- NaN. On a token with A = 0, a NaN log-ratio log p_y - log q_y counts as 0 (w = f(1)) and a NaN candidate
  log-probability as zero mass. On a token with A != 0, a NaN log-ratio is an error in tis and mis (none never reads
  it). miles lets a NaN candidate log-probability of a token with A != 0 through (NaN loss in none and tis; in mis
  it zeroes alpha); this oracle raises ValueError instead.
- Support mode (``args.use_sampling_support_replay``, filtered sampling). Without ``--use-kl-loss`` p is
  renormalised over the recorded candidate slots: log p_v = z_v / T - logsumexp_H(z / T), the sampled token
  included, also when it is not a candidate (then log p_y may be > 0: miles does not check); a token with no
  candidate gets log p_y = 0 and no gradient. With ``--use-kl-loss`` miles scores the full vocabulary and subtracts
  logsumexp_H of those log-probabilities (the same values), except that a token with no candidate keeps its
  full-vocabulary log p_y; the reference KL then uses the full-vocabulary log p_y.
- Regularisers. ``entropy_coef != 0`` (or ``observe_training_entropy``): loss -= entropy_coef *
  sum_of_sample_mean(entropy), logged as ``entropy_loss`` (the reduced entropy), entropy over the full vocabulary,
  or over the candidates in support mode. ``use_kl_loss``: miles' masked reference KL (``kl_loss``,
  ``kl_invalid_fraction``), see :func:`_reference_kl`.
- Logs, each by ``sum_of_sample_mean`` and in miles' order: [entropy_loss], [kl_loss, kl_invalid_fraction],
  sc_correction (sum_H c_h log p_h), sc_train_head_mass (P), sc_rollout_head_mass (Q), sc_tail_ratio (rho),
  sc_importance_weight (w), loss, pg_loss, train_rollout_logprob_abs_diff (|log p_y - log q_y|) and
  train_rollout_kl (miles' low_var_kl of (log q_y, log p_y): r - 1 - log r, r = p_y / q_y, log r clamped to
  [-20, 20], the result to [-10, 10]).
- Vocabulary. With ``args.vocab_size`` the softmax runs over the first vocab_size columns (Megatron pads the rest);
  a token id outside [-1, vocab_size) is a ValueError.

Layouts (CP and TP size 1 only). ``args.qkv_format`` "thd": logits [1, sum of total lengths, V], samples back to
back. "bshd": logits [B, S, V] or [1, B * S, V], sample i from row i * batch["max_seq_lens"][i]. Sample i with
prompt length n and response length R: the logit row at start + n - 1 + j scores response token j (the token at
position n + j of ``batch["unconcat_tokens"][i]``). ``true_on_policy_mode`` is refused (NotImplementedError): there
miles divides the logits by T twice.

Everything is computed in float64 (miles: float32, or float64 for float64 logits); the loss and logs are float64.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

MILES_SOURCE = "sii-avalanche/miles@4d412b5aca323b49cd414dadb10d7ae1742ec637"
EPS = 1e-6  # the floor of the tail masses (estimator.py, ScoreCenteringInputs.eps)
KL_LOG_RATIO_CLAMP = 20.0  # math_utils.py: low_var_kl clamps its log-ratio to [-20, 20] ...
KL_VALUE_CLAMP = 10.0  # ... and its value to [-10, 10]
KL_MAX_ABS_LOG_RATIO = 40.0  # score_centering_loss.py: reference-KL tokens with |log ratio| > 40 are left out
MODES = ("none", "tis", "mis")


# ---- f, the importance-weight function ---------------------------------------------------------------------------

class ImportanceWeight:
    """f(r) for one mode: none f = 1; tis f(r) = min(r, clip); mis f(r) = r if low <= r <= high else 0."""

    def __init__(self, mode: str, clip: float, low: float, high: float):
        if mode not in MODES:
            raise ValueError(f"Unknown score-centering importance weighting: {mode}")
        if mode == "tis" and not (math.isfinite(clip) and clip > 0):
            raise ValueError("Score-centering TIS clip must be positive and finite")
        if mode == "mis" and not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
            raise ValueError("Score-centering MIS bounds must be finite with 0 < low <= high")
        self.mode, self.clip, self.low, self.high = mode, clip, low, high

    def __call__(self, r: float) -> float:
        if self.mode == "none":
            return 1.0
        if self.mode == "tis":
            return min(r, self.clip)
        return r if self.low <= r <= self.high else 0.0

    def times_q(self, p: float, q: float) -> float:
        """q * f(p / q), with its limit 0 at q = 0 (none: q; tis: min(p, clip * q); mis: 0 for r = inf)."""
        if q == 0.0:
            return 0.0
        return q * self(p / q)  # a float division overflows to inf, never raises


def _exp(x: float) -> float:
    """math.exp without OverflowError (a log-ratio may be +inf or huge)."""
    return math.inf if x > 709.0 else math.exp(x)


# ---- one token's trainer log-probabilities -----------------------------------------------------------------------

class TokenScores:
    """The trainer's scores of one response token: log p_y, the log p_h of each candidate slot (None for an unused
    slot), the full-vocabulary log p_y the reference KL reads, and the entropy (None unless asked); tensors in the
    graph of the logits."""

    def __init__(self, log_p_sampled: Tensor, log_p_head: list, kl_log_p_sampled: Tensor, entropy: Tensor | None):
        self.log_p_sampled = log_p_sampled
        self.log_p_head = log_p_head
        self.kl_log_p_sampled = kl_log_p_sampled
        self.entropy = entropy


def score_token(z: Tensor, sampled: int, slots: list, *, support: str, with_entropy: bool) -> TokenScores:
    """Score one token from its logit row divided by T (``z``, [V'] float64, V' = the true vocabulary).

    support "no": p = softmax(z) over V'; "only": p renormalised over the used slots (miles' support-only path);
    "kl": full-vocabulary scores renormalised over the used slots afterwards (miles' replay + reference KL path)."""
    zero = z.sum() * 0.0  # a zero in the graph
    used = [h for h in slots if h >= 0]
    if support == "only":
        if not used:  # no recorded support: every score 0, no gradient (selected_log_probs.py, _SupportLogProbs)
            return TokenScores(zero, [None] * len(slots), zero, zero if with_entropy else None)
        normaliser = torch.logsumexp(torch.stack([z[h] for h in used]), 0)  # one term per slot, as miles
        log_p_y = z[sampled] - normaliser if sampled >= 0 else zero
        log_p_head = [None if h < 0 else z[h] - normaliser for h in slots]
        entropy = _slot_entropy(log_p_head, zero) if with_entropy else None
        return TokenScores(log_p_y, log_p_head, log_p_y, entropy)

    log_p = z - torch.logsumexp(z, 0)
    log_p_y = log_p[sampled] if sampled >= 0 else zero
    log_p_head = [None if h < 0 else log_p[h] for h in slots]
    if support == "kl":
        kl_log_p_y = log_p_y
        if used:  # the full normaliser cancels; a token without candidates keeps its full-vocabulary scores
            normaliser = torch.logsumexp(torch.stack([log_p[h] for h in used]), 0)
            log_p_y = log_p_y - normaliser
            log_p_head = [None if lp is None else lp - normaliser for lp in log_p_head]
        entropy = _slot_entropy(log_p_head, zero) if with_entropy else None
        return TokenScores(log_p_y, log_p_head, kl_log_p_y, entropy)
    entropy = None
    if with_entropy:
        p = log_p.exp()
        entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum()
    return TokenScores(log_p_y, log_p_head, log_p_y, entropy)


def _slot_entropy(log_p_head: list, zero: Tensor) -> Tensor:
    """-sum over the used slots of p_h log p_h (the support's entropy; a slot of zero probability adds nothing)."""
    entropy = zero
    for lp in log_p_head:
        if lp is not None and math.isfinite(lp.item()):
            entropy = entropy - lp.exp() * lp
    return entropy


# ---- one token's estimator ---------------------------------------------------------------------------------------

class TokenTerms:
    """The estimator of one token: its loss (a tensor) and its detached metrics (floats)."""

    def __init__(self, loss: Tensor, correction: float, p_mass: float, q_mass: float, rho: float, weight: float):
        self.loss, self.correction = loss, correction
        self.p_mass, self.q_mass, self.rho, self.weight = p_mass, q_mass, rho, weight


def token_terms(f: ImportanceWeight, scores: TokenScores, *, advantage: float, rollout_log_p: float,
                head_log_q: list, trained: bool) -> TokenTerms:
    """loss_t = -A (w log p_y - sum_H c_h log p_h) for one token; ``advantage`` and ``rollout_log_p`` as miles hands
    them to the estimator (0 on an untrained token), ``head_log_q`` one float per candidate slot."""
    zero = scores.log_p_sampled * 0.0
    has_advantage = advantage != 0.0

    # H: the slots with a token id (>= 0) of a trained token; their p_h and q_h (NaN -> 0 where A = 0)
    head = []  # (log p_h tensor, p_h, q_h)
    for log_p_h, log_q_h in zip(scores.log_p_head, head_log_q):
        if log_p_h is None or not trained:
            continue
        log_p_value = log_p_h.item()
        if math.isnan(log_q_h) or math.isnan(log_p_value):
            if has_advantage:
                raise ValueError("a candidate log-probability of a trained token with a non-zero advantage is NaN "
                                 "(miles would propagate it into the loss)")
            log_q_h = -math.inf if math.isnan(log_q_h) else log_q_h
            log_p_value = -math.inf if math.isnan(log_p_value) else log_p_value
        head.append((log_p_h, math.exp(log_p_value), math.exp(log_q_h)))

    p_mass = sum(p for _, p, _ in head)
    q_mass = sum(q for _, _, q in head)
    rho = max(1.0 - q_mass, EPS) / max(1.0 - p_mass, EPS)
    alpha = rho * f(1.0 / rho)

    correction = zero
    for log_p_h, p_h, q_h in head:
        c_h = f.times_q(p_h, q_h) - alpha * p_h
        if c_h != 0.0 and math.isfinite(log_p_h.item()):
            correction = correction + c_h * log_p_h

    log_p_y = scores.log_p_sampled
    log_ratio = log_p_y.item() - rollout_log_p
    if math.isnan(log_ratio):
        if has_advantage and f.mode != "none":
            raise ValueError("Score-centering importance log-ratio contains NaN")
        log_ratio = 0.0
    weight = f(_exp(log_ratio))
    sampled = weight * log_p_y if weight != 0.0 and math.isfinite(log_p_y.item()) else zero

    loss = -advantage * (sampled - correction)
    return TokenTerms(loss, correction.item(), p_mass, q_mass, rho, weight)


# ---- the batch: which row scores which token, and its candidates ------------------------------------------------

def response_rows(args: Any, batch: Mapping[str, Any], logits: Tensor) -> tuple[Tensor, list]:
    """(the logits as rows [N, V], per sample the row of each of its response tokens) for thd or bshd at CP 1."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be [1, T, V] or [B, S, V], got {tuple(logits.shape)}")
    fmt = getattr(args, "qkv_format", "thd")
    totals, responses = list(batch["total_lengths"]), list(batch["response_lengths"])
    if fmt == "thd":
        if logits.shape[0] != 1:
            raise ValueError(f"thd logits must be [1, T, V], got {tuple(logits.shape)}")
        starts = [sum(totals[:i]) for i in range(len(totals))]
    elif fmt == "bshd":
        if batch.get("max_seq_lens") is None:
            raise ValueError("qkv_format bshd needs batch['max_seq_lens']")
        starts = [i * int(batch["max_seq_lens"][i]) for i in range(len(totals))]
    else:
        raise ValueError(f"qkv_format must be thd or bshd, got {fmt!r}")
    rows = logits.reshape(-1, logits.shape[-1])
    per_sample = []
    for start, total, response in zip(starts, totals, responses):
        prompt = int(total) - int(response)
        sample_rows = [start + prompt - 1 + j for j in range(int(response))]
        if sample_rows and (sample_rows[0] < 0 or sample_rows[-1] >= rows.shape[0]):
            raise ValueError(f"response rows {sample_rows[0]}..{sample_rows[-1]} fall outside the logits' "
                             f"{rows.shape[0]} rows")
        per_sample.append(sample_rows)
    return rows, per_sample


def candidate_ids(batch: Mapping[str, Any], i: int) -> Tensor:
    """[R, K] the candidate token ids of sample i (-1 unused): ``rollout_topk_token_ids``, or miles' compact
    support form (row t: ``rollout_sampling_mask_ids[offsets[t] : offsets[t] + lengths[t]]``, -1 after)."""
    if batch.get("rollout_topk_token_ids") is not None:
        return torch.as_tensor(batch["rollout_topk_token_ids"][i]).long().cpu()
    lengths = torch.as_tensor(batch["rollout_topk_lengths"][i]).long().tolist()
    offsets = torch.as_tensor(batch["rollout_sampling_mask_offsets"][i]).long().tolist()
    support = torch.as_tensor(batch["rollout_sampling_mask_ids"][i]).long().tolist()
    width = torch.as_tensor(batch["rollout_topk_log_probs"][i]).shape[-1]
    ids = torch.full((len(lengths), width), -1, dtype=torch.long)
    for t, (length, offset) in enumerate(zip(lengths, offsets)):
        for k in range(min(length, width)):
            ids[t, k] = support[offset + k]
    return ids


# ---- the loss ----------------------------------------------------------------------------------------------------

def score_centering_loss(args: Any, batch: Mapping[str, Any], logits: Tensor,
                         sum_of_sample_mean: Callable[[Tensor], Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """miles' score-centering policy loss of one micro-batch at CP 1, TP 1 (module docstring): (loss, log).

    ``sum_of_sample_mean`` is miles' reducer, called on [N] float64 per-token values over every response token in
    batch order; the loss and every log value are float64 scalars."""
    if getattr(args, "true_on_policy_mode", False):
        raise NotImplementedError("true_on_policy_mode: miles divides the logits by the temperature twice there")
    temperature = float(args.rollout_temperature)
    if not temperature > 0:
        raise ValueError("Score centering needs a positive temperature")
    f = ImportanceWeight(args.score_centering_is, float(getattr(args, "score_centering_tis_clip", 2.0)),
                         float(getattr(args, "score_centering_mis_low", 0.5)),
                         float(getattr(args, "score_centering_mis_high", 5.0)))
    use_kl = bool(getattr(args, "use_kl_loss", False))
    replay = bool(getattr(args, "use_sampling_support_replay", False))
    support = "kl" if replay and use_kl else "only" if replay else "no"
    entropy_coef = float(getattr(args, "entropy_coef", 0.0))
    with_entropy = entropy_coef != 0 or bool(getattr(args, "observe_training_entropy", False))

    rows, per_sample = response_rows(args, batch, logits)
    vocab = getattr(args, "vocab_size", None) or rows.shape[-1]
    if not 0 < vocab <= rows.shape[-1]:
        raise ValueError(f"vocab_size {vocab} must be in (0, {rows.shape[-1]}]")

    losses, entropies, kl_inputs = [], [], []
    metrics = {"sc_correction": [], "sc_train_head_mass": [], "sc_rollout_head_mass": [], "sc_tail_ratio": [],
               "sc_importance_weight": []}
    abs_diffs, rollout_train_kls = [], []
    for i, sample_rows in enumerate(per_sample):
        response = len(sample_rows)
        tokens = torch.as_tensor(batch["unconcat_tokens"][i]).long().tolist()
        sampled_tokens = tokens[len(tokens) - response:] if response else []
        masks = torch.as_tensor(batch["loss_masks"][i]).tolist()
        advantages = torch.as_tensor(batch["advantages"][i]).double().tolist()
        rollout = torch.as_tensor(batch["rollout_log_probs"][i]).double().tolist()
        ids = candidate_ids(batch, i).tolist()
        head_log_q = torch.as_tensor(batch["rollout_topk_log_probs"][i]).double().tolist()
        for j, row in enumerate(sample_rows):
            y, slots = sampled_tokens[j], ids[j]
            if any(not -1 <= v < vocab for v in [y, *slots]):
                raise ValueError("Score-centering token ID is outside the model vocabulary")
            trained = masks[j] != 0
            advantage = advantages[j] if trained else 0.0
            rollout_log_p = rollout[j] if trained else 0.0
            z = rows[row, :vocab].double() / temperature
            scores = score_token(z, y, slots, support=support, with_entropy=with_entropy)
            terms = token_terms(f, scores, advantage=advantage, rollout_log_p=rollout_log_p,
                                head_log_q=head_log_q[j], trained=trained)
            losses.append(terms.loss)
            metrics["sc_correction"].append(terms.correction)
            metrics["sc_train_head_mass"].append(terms.p_mass)
            metrics["sc_rollout_head_mass"].append(terms.q_mass)
            metrics["sc_tail_ratio"].append(terms.rho)
            metrics["sc_importance_weight"].append(terms.weight)
            if with_entropy:
                entropies.append(scores.entropy)
            if use_kl:
                ref = float(torch.as_tensor(batch["ref_log_probs"][i]).double()[j])
                kl_inputs.append((scores.kl_log_p_sampled, scores.log_p_sampled, ref, rollout_log_p, trained))
            train_log_p = scores.log_p_sampled.item() if trained else 0.0
            abs_diffs.append(abs(train_log_p - rollout_log_p))
            kl = low_var_kl(rollout_log_p, train_log_p)
            rollout_train_kls.append(kl if trained and math.isfinite(kl) else 0.0)

    def reduce(values: list) -> Tensor:
        if values and isinstance(values[0], Tensor):
            return sum_of_sample_mean(torch.stack(values))
        return sum_of_sample_mean(torch.tensor(values, dtype=torch.float64, device=logits.device))

    log: dict[str, Tensor] = {}
    loss = torch.zeros((), dtype=torch.float64, device=logits.device)
    if with_entropy:
        entropy = reduce(entropies) if entropies else loss
        loss = loss - entropy_coef * entropy
        log["entropy_loss"] = entropy.detach()
    if use_kl:
        kl_loss, kl_invalid = _reference_kl(args, kl_inputs, reduce, loss)
        if float(args.kl_loss_coef) != 0:
            loss = loss + float(args.kl_loss_coef) * kl_loss
        log["kl_loss"], log["kl_invalid_fraction"] = kl_loss.detach(), kl_invalid.detach()
    pg_loss = reduce(losses) if losses else loss * 0.0
    loss = loss + pg_loss
    for name, values in metrics.items():
        log[name] = reduce(values).detach()
    log["loss"] = loss.detach()
    log["pg_loss"] = pg_loss.detach()
    log["train_rollout_logprob_abs_diff"] = reduce(abs_diffs).detach()
    log["train_rollout_kl"] = reduce(rollout_train_kls).detach()
    return loss, log


# ---- the KL estimators -------------------------------------------------------------------------------------------

def _clamp_log_ratio(x: float) -> float:
    """low_var_kl's log-ratio: NaN -> 0, then clamped to [-20, 20] (±inf to ±20)."""
    return 0.0 if math.isnan(x) else min(max(x, -KL_LOG_RATIO_CLAMP), KL_LOG_RATIO_CLAMP)


def low_var_kl(log_p: float, log_p_base: float) -> float:
    """miles' compute_approx_kl(log_p, log_p_base, "low_var_kl"): with l = clamp(log_p_base - log_p),
    e^l - 1 - l clamped to [-10, 10] (k3 of KL(p || base) from samples of p)."""
    lr = _clamp_log_ratio(log_p_base - log_p)
    return min(max(math.exp(lr) - 1.0 - lr, -KL_VALUE_CLAMP), KL_VALUE_CLAMP)


def approx_kl(log_p: Tensor, log_p_base: Tensor, kind: str, ratio: Tensor | None) -> Tensor:
    """compute_approx_kl on tensors (k1, k2, k3, low_var_kl), times the importance ratio when given."""
    log_ratio = log_p - log_p_base
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = log_ratio ** 2 / 2.0
    elif kind in ("k3", "low_var_kl"):
        lr = -log_ratio
        if kind == "low_var_kl":
            lr = torch.nan_to_num(lr, nan=0.0, posinf=KL_LOG_RATIO_CLAMP, neginf=-KL_LOG_RATIO_CLAMP)
            lr = lr.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        kl = lr.exp() - 1.0 - lr
    else:
        raise ValueError(f"Unknown kl_loss_type: {kind}")
    if ratio is not None:
        kl = ratio * kl
    if kind == "low_var_kl":
        kl = kl.clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    return kl


def _reference_kl(args: Any, inputs: list, reduce: Callable[[list], Tensor], zero: Tensor) -> tuple[Tensor, Tensor]:
    """miles' reference-KL regulariser (score_centering_loss.py, _regularization): per trained token with finite
    full-vocabulary log p_y (the actor) and reference log-prob and |actor - ref| <= 40 (with use_unbiased_kl also a
    finite |log p_y - log q_y| <= 40), kl = compute_approx_kl(actor, ref, kl_loss_type) (times
    exp(log p_y - log q_y), in the graph, with use_unbiased_kl); elsewhere 0. Returns (reduced kl, reduced
    fraction of trained tokens left out)."""
    unbiased = bool(getattr(args, "use_unbiased_kl", False))
    kls, invalid = [], []
    for actor, log_p_y, ref, rollout_log_p, trained in inputs:
        actor_value = actor.item()
        valid = trained and math.isfinite(actor_value) and math.isfinite(ref)
        valid = valid and abs(actor_value - ref) <= KL_MAX_ABS_LOG_RATIO
        ratio_log = log_p_y - rollout_log_p
        if unbiased:
            valid = valid and math.isfinite(ratio_log.item()) and abs(ratio_log.item()) <= KL_MAX_ABS_LOG_RATIO
        invalid.append(1.0 if trained and not valid else 0.0)
        if not valid:
            kls.append(actor * 0.0)
            continue
        ratio = ratio_log.exp() if unbiased else None
        kl = approx_kl(actor, torch.tensor(ref, dtype=torch.float64, device=actor.device), args.kl_loss_type, ratio)
        kls.append(kl if math.isfinite(kl.item()) else actor * 0.0)  # miles: nan_to_num(..., 0)
    kl_loss = reduce(kls) if kls else zero * 0.0
    return kl_loss, reduce(invalid)
