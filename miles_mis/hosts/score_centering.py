"""Score centering as a host's policy loss: what ``policy_loss`` runs, instead of the host's own PPO loss, when the
config sets ``score_centering: true`` (docs/score_centering.md).

It is called as a host calls its loss, ``(args, batch, logits, sum_of_sample_mean)``, and reads what miles' own
``--loss-type score_centering`` reads: the sequences (``unconcat_tokens``, ``total_lengths``, ``response_lengths``,
``max_seq_lens`` under bshd), this rank's CP shard of ``rollout_log_probs`` and ``advantages``, the whole responses'
``loss_masks`` and the engine's candidates ``rollout_topk_token_ids`` / ``rollout_topk_log_probs``
([response_length, K] per sample, whole responses). The logits are this rank's: its CP chunks of every sample
(Megatron's zigzag, ``parallel.cp_layout.logits_rows``) and its tensor-parallel slice of the vocabulary (the log-probs
come from a distributed log-normaliser, never a vocabulary gather). The loss is the host's reduction of the per-token
loss, ``sum_of_sample_mean``, as are the ``mis_sc_*`` metrics.

Errors: every input is read and checked before the first collective; under CP the ranks agree on the outcome
(``distributed.agree``), so a bad input on one rank raises on all of them. TP ranks hold the same batch, so they fail
together without an exchange.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from ..centering import IDS_KWARG, LOG_PROBS_KWARG, Candidates, VocabShard, Weighting, centered_loss_from_logits
from ..centering import read_candidates
from ..config import MisConfig, host_setting
from ..inputs.host_call import config_text
from ..inputs.packing import InputError
from ..parallel import distributed
from ..parallel.cp_layout import logits_rows, zigzag_layout

# the keys score centering reads; every other correction key belongs to the hook's correction
SCORE_CENTERING_KEYS = ("score_centering", "score_centering_is", "score_centering_tis_clip", "score_centering_mis_low",
                        "score_centering_mis_high")
NEUTRAL_KEYS = ("kernel_backend", "metrics_low_prob_threshold", "use_tis")  # no effect on the loss; use_tis: below
# the host's miles name of each per-token value, as miles' score-centering loss logs it (sc_*); ours carry mis_
METRICS = {"mis_sc_correction": "correction", "mis_sc_train_head_mass": "train_head_mass",
           "mis_sc_rollout_head_mass": "rollout_head_mass", "mis_sc_tail_ratio": "tail_ratio",
           "mis_sc_importance_weight": "importance_weight"}


@dataclass(frozen=True)
class CenteringBatch:
    """This rank's response tokens, read from a host batch and checked: row ``rows[n]`` of the flattened logits
    scores token n."""

    rows: Tensor  # [N]
    tokens: Tensor  # [N] the sampled ids
    candidates: Candidates
    rollout_log_probs: Tensor  # [N]
    advantages: Tensor  # [N]
    loss_mask: Tensor  # [N]


def weighting_of(config: MisConfig) -> Weighting:
    """The importance weighting f of a config's ``score_centering_*`` keys."""
    return Weighting(config.score_centering_is, config.score_centering_tis_clip, config.score_centering_mis_low,
                     config.score_centering_mis_high)


def check_settings(config: MisConfig, args: Any) -> None:
    """One line for what score centering cannot honour: a key of the hook's correction (it would be silently
    ignored), a host flag whose term this loss does not compute, a CP mode it does not read."""
    others = [name for name in config.keys() if name not in SCORE_CENTERING_KEYS + NEUTRAL_KEYS
              and getattr(config, name) != _default(name)]
    if others:
        raise ValueError(f"score_centering: true replaces the host's policy loss; {', '.join(others)} configure the "
                         "hook's correction, which does not run with it: remove them, or use "
                         "score_centering_is: tis|mis for its importance weighting")
    if host_setting(args, "use_tis"):
        raise ValueError("score_centering: true with --use-tis: score centering carries its own weighting "
                         "(score_centering_is); --use-tis would weight the loss a second time: drop --use-tis")
    for flag, name in (("entropy_coef", "--entropy-coef"), ("kl_loss_coef", "--kl-loss-coef")):
        value = host_setting(args, flag)
        if value and (flag != "kl_loss_coef" or host_setting(args, "use_kl_loss")):
            raise ValueError(f"score_centering: true with {name} {value}: miles_mis's score-centering loss has no "
                             f"{'entropy' if flag == 'entropy_coef' else 'KL'} term; set {name} 0")
    if host_setting(args, "allgather_cp"):
        raise ValueError("score_centering: true with --allgather-cp: the loss reads Megatron's zigzag CP layout; "
                         "run without --allgather-cp")


@functools.cache
def _defaults() -> MisConfig:
    return MisConfig()


def _default(name: str) -> Any:
    return getattr(_defaults(), name)


def support_mode(args: Any) -> bool:
    """The candidates are each token's sampled support (top-p/top-k sampling with the support replayed, miles'
    ``--use-sampling-support-replay``), and p is renormalised over it."""
    return bool(host_setting(args, "use_sampling_support_replay"))


def read_batch(args: Any, batch: Mapping[str, Any], cp: distributed.Group) -> CenteringBatch:
    """This rank's tokens of a host batch, checked (an InputError naming the first bad sequence or field)."""
    for key in (IDS_KWARG, LOG_PROBS_KWARG):
        if batch.get(key) is None:
            raise InputError(f"score_centering: true needs the engine's candidates, but the batch holds no {key}: "
                             "record them in the rollout (miles' --rollout-top-logprobs-num K; docs/hosts.md"
                             "#score-centering)")
    for key in ("unconcat_tokens", "total_lengths", "response_lengths", "rollout_log_probs", "advantages",
                "loss_masks"):
        if batch.get(key) is None:
            raise InputError(f"score_centering: true needs the batch's {key}, which it does not hold")
    qkv_format = host_setting(args, "qkv_format") or "thd"
    total = torch.as_tensor(list(batch["total_lengths"]), dtype=torch.long)
    response = torch.as_tensor(list(batch["response_lengths"]), dtype=torch.long)
    max_seq_lens = batch.get("max_seq_lens")
    max_seq_lens = None if max_seq_lens is None else torch.as_tensor(list(max_seq_lens), dtype=torch.long)
    layout = zigzag_layout(total, response, cp.rank, cp.size, qkv_format, max_seq_lens)
    positions = layout.positions(torch.cumsum(response, 0) - response)
    sequences = list(batch["unconcat_tokens"])
    for i, (tokens, n) in enumerate(zip(sequences, response.tolist())):
        if len(tokens) < n + 1:
            raise InputError(f"sequence {i}: unconcat_tokens[{i}] has {len(tokens)} tokens, fewer than its response "
                             f"({n}) and one prompt token", i)
    responses = torch.cat([torch.as_tensor(t[len(t) - n:]).long() for t, n in zip(sequences, response.tolist())])
    masks = torch.cat([torch.as_tensor(m).reshape(-1) for m in batch["loss_masks"]]).float()
    if masks.numel() != int(response.sum()):
        raise InputError(f"loss_masks hold {masks.numel()} values but the responses {int(response.sum())} tokens: "
                         "one per response token of the whole response")
    local = layout.local_lengths.tolist()
    rollout = _local_values(batch["rollout_log_probs"], "rollout_log_probs", local)
    advantages = _local_values(batch["advantages"], "advantages", local)
    bad = ~torch.isfinite(rollout) | (rollout > 0)
    if bool(bad.any()):
        n = int(bad.nonzero()[0])
        i = _sequence_of(n, local)
        raise InputError(f"sequence {i}: rollout_log_probs[{i}] holds {float(rollout[n])}: a log-prob is finite and "
                         "≤ 0", i)
    tokens, loss_mask = responses.index_select(0, positions), masks.index_select(0, positions)
    candidates = read_candidates(batch[IDS_KWARG], batch[LOG_PROBS_KWARG], response.tolist(), positions)
    if support_mode(args):  # checked here, before the ranks agree, not by the estimator after it
        outside = ~(candidates.ids == tokens[:, None]).any(dim=1) & (loss_mask != 0)
        if bool(outside.any()):
            n = int(outside.nonzero()[0])
            i = _sequence_of(n, local)
            raise InputError(f"sequence {i}: a trained token ({int(tokens[n])}) is not among its recorded candidates: "
                             "with --use-sampling-support-replay the candidates are the support the engine sampled "
                             "from, which holds the sampled token", i)
    return CenteringBatch(rows=logits_rows(total, response, cp.rank, cp.size, qkv_format, max_seq_lens),
                          tokens=tokens, candidates=candidates, rollout_log_probs=rollout, advantages=advantages,
                          loss_mask=loss_mask)


def _sequence_of(token: int, local_lengths: list[int]) -> int:
    """The sequence holding local token ``token`` (its index among this rank's concatenated tokens)."""
    return int(torch.searchsorted(torch.tensor(local_lengths).cumsum(0), token, right=True))


def _local_values(values: Any, name: str, local_lengths: list[int]) -> Tensor:
    """This rank's per-sample values (a list of local shards), concatenated, their lengths checked."""
    parts = list(values)
    if len(parts) != len(local_lengths):
        raise InputError(f"{name} has {len(parts)} sequences but the batch has {len(local_lengths)}")
    for i, (part, n) in enumerate(zip(parts, local_lengths)):
        if torch.as_tensor(part).numel() != n:
            raise InputError(f"sequence {i}: {name}[{i}] has {torch.as_tensor(part).numel()} values but this rank "
                             f"holds {n} of its response tokens", i)
    return torch.cat([torch.as_tensor(p).reshape(-1).float() for p in parts]) if parts else torch.zeros(0)


def score_centering_loss(config: MisConfig, args: Any, batch: Mapping[str, Any], logits: Tensor,
                         sum_of_sample_mean: Callable[[Tensor], Tensor],
                         parallel_state: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The score-centered policy loss of a micro-batch and its log: ``sum_of_sample_mean`` of the per-token loss
    (``centering.centered_loss``), and of each ``mis_sc_*`` value. ``parallel_state``: the host's (``.cp``, ``.tp``),
    else Megatron-core's groups, else one rank."""
    cp = distributed.resolve_cp_group(parallel_state)
    tp = distributed.resolve_tp_group(parallel_state)
    error, read = None, None
    try:
        check_settings(config, args)
        if logits.ndim != 3:
            raise InputError(f"logits have shape {tuple(logits.shape)}: expected [1, T, V] (thd) or [B, S, V] (bshd)")
        read = read_batch(args, batch, cp)
        rows = logits.shape[0] * logits.shape[1]
        if read.rows.numel() and int(read.rows.max()) >= rows:
            raise InputError(f"logits have {rows} rows but the batch's lengths place a response token at row "
                             f"{int(read.rows.max())}: the logits are not this batch's (or not this CP rank's)")
    except ValueError as failure:
        error = failure
    if cp.size > 1:  # every CP rank learns of a failure before the TP collectives and the host's next collective
        distributed.agree(cp, "cp", error=error, config_text=config_text(config, host_setting(args, "qkv_format")
                                                                         or "thd"))
    elif error is not None:
        raise error
    width = logits.shape[-1]
    shard = VocabShard(start=tp.rank * width, vocab_size=host_setting(args, "vocab_size"), group=tp)
    result = centered_loss_from_logits(logits.reshape(-1, width), read.rows, read.tokens, read.candidates,
                                       read.rollout_log_probs, read.advantages, read.loss_mask, weighting_of(config),
                                       shard, float(host_setting(args, "rollout_temperature") or 1.0),
                                       support_mode(args))
    pg_loss = sum_of_sample_mean(result.token_loss)
    log = {name: sum_of_sample_mean(getattr(result, field)).detach() for name, field in METRICS.items()}
    log["pg_loss"] = pg_loss.detach()
    log["loss"] = pg_loss.detach()
    return pg_loss, log


__all__ = ["CenteringBatch", "METRICS", "check_settings", "read_batch", "score_centering_loss", "support_mode",
           "weighting_of"]
