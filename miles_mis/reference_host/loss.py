"""The reference host's policy loss: miles' loss of one micro-batch for standard PPO, bypass PPO
(``--use-rollout-logprobs``), decoupled 3-policy PPO (``--use-tis``) and REINFORCE + IS (``--loss-type reinforce``),
with off-policy sequence masking, the built-in vanilla TIS, the call of a correction plugin exactly as the contract
says (keyword arguments, local CP shards, full masks; or the packed entry point at CP size 1), and miles' reducer
(the sum over sequences of per-sequence masked token means); docs/algorithms.md gives each loss and its gradient.
"""

from __future__ import annotations

import argparse
import functools
import inspect
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..parallel import distributed
from .cp_shards import rank_shards
from .flags import is_packed_entry, load_function, packed_cp_message

LOG_RATIO_CLAMP = 20.0
# the contract's optional keyword arguments the host forwards as the batch holds them (docs/contract.md): each
# sequence's lag, and the engine's sampling masks (miles', slime's offsets, or their sizes)
LAG_KWARGS = ("version_lags", "weight_versions", "current_weight_version")
SAMPLING_MASK_KWARGS = ("rollout_sampling_mask_offsets", "rollout_top_p_token_offsets", "sampling_mask_sizes")


def ppo_clip_loss(ppo_kl: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float,
                  eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token clipped PPO loss. r = exp(clamp(−ppo_kl)) = π_θ/π_old:

    L = max(−r·A, −clip(r, 1−ε, 1+ε_high)·A); with dual clip (A < 0): L = min(L, −c·A).
    Returns (loss, clipped indicator).
    """
    ratio = (-ppo_kl).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipfrac


def outside_clip_range(ppo_kl: Tensor, eps_clip: float, eps_clip_high: float) -> Tensor:
    """Per-token 0/1: r = π_θ/π_old outside [1 − ε, 1 + ε_high], whatever the advantage's sign (pg_clipfrac counts
    only the tokens whose gradient the clip removes). In bypass at the first minibatch r = π_θ/π_rollout = e^ℓ: the
    share of tokens the engine's mismatch alone puts outside the trust region."""
    ratio = (-ppo_kl).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return (ratio < 1.0 - eps_clip).float() + (ratio > 1.0 + eps_clip_high).float()


def vanilla_tis(args: argparse.Namespace, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                rollout_log_probs: list[Tensor], loss_masks: list[Tensor], **kwargs: Any):
    """The built-in TIS (no custom path): w = clamp(exp(π_old − π_rollout), tis_clip_low, tis_clip)."""
    ratio = safe_ratio(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weight = ratio.clamp(args.tis_clip_low, args.tis_clip)
    metrics = {"tis": ratio, "tis_clipfrac": (weight != ratio).float(), "tis_abs": (ratio - 1.0).abs()}
    return pg_loss * weight, list(loss_masks), metrics


def safe_ratio(log_ratio: Tensor) -> Tensor:
    """exp of a log ratio with NaN -> 0 and ±inf/huge -> ±20: a NaN log-prob (SGLang null), even on an
    untrained token, must not turn the loss into NaN (the reducer multiplies by the mask, and NaN·0 = NaN)."""
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def mask_sums(masks: Sequence[Tensor]) -> Tensor:
    """[B] each full-length mask's sum: the per-sequence denominators of the loss mean."""
    return torch.stack([m.float().sum() for m in masks]) if len(masks) else torch.zeros(0)


ROLLOUT_KEYS = ("rollout_ids", "rollout_mask_sums")  # split rollouts, as the hosts' batches hold them


def sample_denominators(batch: Mapping[str, Any], loss_masks: Sequence[Tensor]) -> Tensor:
    """[B] the per-sample denominators of the loss mean, by the hosts' rule: ``rollout_mask_sums`` when the batch holds
    them (each sample's whole rollout's trained-token count, summed over every sibling sample, also those in other
    micro-batches); else, with ``rollout_ids``, the sums over the siblings in this batch; else each mask's own sum.
    The siblings' shares then add up to one token mean per rollout."""
    own = mask_sums(loss_masks)
    given = batch.get("rollout_mask_sums")
    if given is not None:
        values = torch.stack([torch.as_tensor(v).detach().reshape(()).double().cpu() for v in given]) if len(given) \
            else torch.zeros(0, dtype=torch.float64)
        if values.numel() != own.numel():
            raise ValueError(f"batch['rollout_mask_sums'] has {values.numel()} entries but the batch has {own.numel()} "
                             "sequences")
        bad = (~torch.isfinite(values) | (values < 0)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"sequence {i}: batch['rollout_mask_sums'][{i}]={float(values[i])!r} is invalid: a "
                             "trained-token count is finite and >= 0")
        return values.to(own.dtype)
    ids = batch.get("rollout_ids")
    if ids is None:
        return own
    if len(ids) != own.numel():
        raise ValueError(f"batch['rollout_ids'] has {len(ids)} entries but the batch has {own.numel()} sequences")
    totals: dict[Any, float] = {}
    for rollout, count in zip(ids, own.tolist()):
        key = rollout.item() if isinstance(rollout, Tensor) else rollout
        totals[key] = totals.get(key, 0.0) + count
    return torch.tensor([totals[r.item() if isinstance(r, Tensor) else r] for r in ids], dtype=own.dtype)


class Reducer:
    """miles' ``sum_of_sample_mean`` over this rank's tokens: Σ_seq Σ_local x·m / n_seq, n_seq the per-sequence
    count given (the input masks' sums, or the returned masks' with --loss-denominator returned-mask; a token sum
    with per-token loss). ``masks`` (full length) give the numerator; under CP each rank takes its own positions
    of them."""

    def __init__(self, masks: Sequence[Tensor], denominators: Tensor, seq_index: Tensor,
                 positions: Tensor | None, per_token: bool):
        full = torch.cat(list(masks)).double() if len(masks) else torch.zeros(0, dtype=torch.float64)
        self.mask = full if positions is None else full.index_select(0, positions)
        self.seq_index = seq_index
        self.denominators = denominators.double().clamp(min=1.0) if not per_token else None
        self.num_seqs = denominators.numel()

    def __call__(self, values: Tensor) -> Tensor:
        """float64: each CP rank's partial sum must add up to the cp = 1 sum (float32 partials of terms of
        opposite sign, e.g. ±1e4 fill values in π_old, round differently on each rank); a division, not a
        product by 1/n, so that the mean of a constant is that constant exactly."""
        per_seq = torch.zeros(self.num_seqs, dtype=torch.float64, device=values.device)
        per_seq = per_seq.index_add(0, self.seq_index, values.double() * self.mask)
        return (per_seq if self.denominators is None else per_seq / self.denominators).sum()


def policy_loss(args: argparse.Namespace, batch: Mapping[str, Any], log_probs: Sequence[Tensor],
                parallel_state: Any = None) -> tuple[Tensor, dict[str, Any]]:
    """Policy loss of one micro-batch, as miles computes it (entropy and KL-loss terms off).

    ``log_probs``: the current policy's log-probs (with grad), this rank's CP shards. ``batch`` keys:
    ``advantages`` (local shards), ``log_probs`` (π_old, local; may be absent in bypass),
    ``rollout_log_probs`` (local), ``loss_masks`` (FULL length), ``response_lengths``,
    ``total_lengths``, optional ``max_seq_lens``, and optional per-sequence lags (``version_lags``, or
    ``weight_versions`` with ``current_weight_version``), handed to the correction function as they are. With
    ``--pass-current-log-probs`` the function also gets ``cur_log_probs`` (``log_probs``; it detaches them).

    Returns (loss, metrics), as miles: ``loss`` and every metric are sums over this rank's sequences of the
    per-sequence masked token mean (token sums with --calculate-per-token-loss); under context parallelism they
    are this rank's partial sums (the trainer's gradient all-reduce adds the ranks), accumulated and returned in
    float64 so that the ranks' partial sums add up to the cp = 1 value. Divide by the number of sequences
    (tokens) for a mean.
    """
    cp = distributed.resolve_cp_group(parallel_state)
    prepared = _prepare_batch_on_every_rank(args, batch, log_probs, cp)
    metrics: dict[str, Any] = {}
    pg_loss, pg_clipfrac = _token_loss(args, prepared)
    if args.use_opsm:
        behaviour = prepared.old if prepared.rollout is None else prepared.rollout
        keep = opsm_keep(behaviour, list(log_probs), batch["advantages"], prepared.loss_masks, prepared.seq_index,
                         prepared.positions, args.opsm_delta, cp)
        pg_loss = pg_loss * keep.index_select(0, prepared.seq_index)
        metrics["opsm_fraction"] = float(1.0 - keep.mean()) if keep.numel() else 0.0

    reduce, reduce_loss = prepared.reduce, prepared.reduce
    if prepared.function is not None:  # --use-tis or --get-mismatch-metrics
        pg_loss, reduce_loss = _call_correction(args, prepared, pg_loss, parallel_state, metrics)

    loss = reduce_loss(pg_loss)
    metrics.update(loss=loss.detach(), pg_loss=loss.detach(), pg_clipfrac=reduce(pg_clipfrac).detach(),
                   ppo_kl=reduce(prepared.ppo_kl).detach())
    if args.loss_type == "ppo":
        outside = outside_clip_range(prepared.ppo_kl, args.eps_clip, _eps_high(args))
        metrics["ppo_ratio_outside_clip"] = reduce(outside).detach()
    if prepared.rollout is not None and log_probs:
        abs_diff = torch.cat(prepared.trainer_scored) - torch.cat(prepared.rollout)
        abs_diff = torch.nan_to_num(abs_diff.abs(), nan=0.0, posinf=0.0, neginf=0.0)
        metrics["train_rollout_logprob_abs_diff"] = reduce(abs_diff * prepared.active).detach()
    if prepared.current.numel() == 0 and log_probs:  # keep the graph connected for an empty shard
        loss = loss + 0.0 * sum(t.sum() for t in log_probs)
    return loss, metrics


def _prepare_batch_on_every_rank(args: argparse.Namespace, batch: Mapping[str, Any], log_probs: Sequence[Tensor],
                                 cp: distributed.Group) -> SimpleNamespace:
    """:func:`_prepare_batch`, failing together: a rank whose batch is bad tells its CP peers (one fixed-size
    exchange) before anyone enters the OPSM or plugin collectives, and every rank raises the same error."""
    try:
        prepared, error = _prepare_batch(args, batch, log_probs, cp), None
    except Exception as failure:  # noqa: BLE001 (re-raised below, after the peers have been told)
        prepared, error = None, failure
    if cp.size > 1:
        distributed.agree(cp, "cp", error=error, batch_size=-1 if prepared is None else len(prepared.loss_masks),
                          config_text=host_config_text(args))
    elif error is not None:
        raise error
    return prepared


def _token_loss(args: argparse.Namespace, prepared: SimpleNamespace) -> tuple[Tensor, Tensor]:
    """(per-token loss, clipped indicator) of ``--loss-type``: clipped PPO, or REINFORCE (× the detached
    π_θ/π_rollout within the built-in TIS bounds in bypass)."""
    if args.loss_type == "ppo":
        return ppo_clip_loss(prepared.ppo_kl, prepared.advantages, args.eps_clip, _eps_high(args), args.eps_clip_c)
    current = prepared.current
    pg_loss = -prepared.advantages * torch.nan_to_num(current, nan=0.0, posinf=0.0, neginf=0.0)
    pg_clipfrac = torch.zeros_like(pg_loss)
    if args.use_rollout_logprobs:  # bypass: w = π_θ/π_rollout, detached, within the built-in TIS bounds
        weight = safe_ratio(current.detach() - torch.cat(prepared.rollout)).clamp(args.tis_clip_low, args.tis_clip)
        pg_loss = pg_loss * weight
    return pg_loss, pg_clipfrac


def _eps_high(args: argparse.Namespace) -> float:
    return args.eps_clip if args.eps_clip_high is None else args.eps_clip_high


def _call_correction(args: argparse.Namespace, prepared: SimpleNamespace, pg_loss: Tensor, parallel_state: Any,
                     metrics: dict[str, Any]) -> tuple[Tensor, Reducer]:
    """Call the correction function on ``pg_loss``: (the corrected loss, the reducer of the returned masks). Adds
    ``ois`` and the function's metrics, reduced with the ORIGINAL masks, to ``metrics``."""
    extra = dict(prepared.lag_kwargs)  # the optional kwargs: lags as the batch holds them, the current policy
    extra["advantages"] = prepared.advantages  # flat, this rank's tokens, as slime PR 1912 passes them
    if getattr(args, "pass_current_log_probs", False):
        extra["cur_log_probs"] = prepared.log_probs
    extra = optional_kwargs_taken(prepared.function, extra)
    if prepared.packed_config is not None:  # compute_mis_weights_packed: flat tensors and cu_seqlens (cp 1)
        pg_loss, modified_masks, tis_metrics = call_packed(
            prepared.function, prepared.packed_config, pg_loss=pg_loss, train_log_probs=prepared.trainer_scored,
            rollout_log_probs=prepared.rollout, loss_masks=prepared.loss_masks,
            response_lengths=prepared.response_lengths, **extra)
    else:
        pg_loss, modified_masks, tis_metrics = prepared.function(
            args=args, pg_loss=pg_loss, train_log_probs=prepared.trainer_scored, rollout_log_probs=prepared.rollout,
            loss_masks=prepared.loss_masks, total_lengths=prepared.total_lengths,
            response_lengths=prepared.response_lengths, parallel_state=parallel_state,
            max_seq_lens=prepared.max_seq_lens, **extra)
    # modified masks rebuild the numerator; the denominators stay the original counts, or (as miles' reducer
    # without rollout_mask_sums) are the sums of the whole returned masks, identical on every CP rank
    denominators = prepared.denominators
    if getattr(args, "loss_denominator", "input-mask") == "returned-mask":
        denominators = mask_sums(modified_masks)
    reduce_loss = Reducer(modified_masks, denominators, prepared.seq_index, prepared.positions,
                          args.calculate_per_token_loss)
    reduce = prepared.reduce
    metrics["ois"] = reduce((-prepared.ppo_kl).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()).detach()
    metrics.update(removed_token_metrics(reduce, reduce_loss.mask, prepared.advantages))
    for name, value in tis_metrics.items():
        metrics[name] = reduce(value.float()).detach()  # with the ORIGINAL masks
    return pg_loss, reduce_loss


def removed_token_metrics(reduce: Reducer, returned_mask: Tensor, advantages: Tensor) -> dict[str, Tensor]:
    """What the correction's returned mask took out of the loss (local tokens, the reducer of the input masks):
    ``removed_token_fraction`` (tokens dropped), ``removed_abs_advantage`` (their |A|) beside ``abs_advantage`` (every
    token's |A|): the ratio of the two is the share of the advantage mass removed, and ``removed_positive_advantage``
    (dropped tokens with A > 0), which says which way the removed gradient pointed."""
    removed = (returned_mask == 0).double()
    magnitude = advantages.double().abs()
    return {"removed_token_fraction": reduce(removed).detach(), "abs_advantage": reduce(magnitude).detach(),
            "removed_abs_advantage": reduce(removed * magnitude).detach(),
            "removed_positive_advantage": reduce(removed * (advantages > 0).double()).detach()}


def optional_kwargs_taken(function: Callable, extra: dict[str, Any]) -> dict[str, Any]:
    """The optional keyword arguments (lags, advantages, the current policy) ``function`` takes: all of them if it
    has ``**kwargs`` (as every miles_mis entry point), else those it names. So a correction function written for a
    host that passes none of them (an explicit signature) still loads; ``cur_log_probs`` asked for with
    --pass-current-log-probs but not taken is an error, not a silent drop."""
    try:
        parameters = _named_keywords(function)
    except TypeError:  # an unhashable callable: read its signature uncached
        parameters = _named_keywords.__wrapped__(function)
    if parameters is None:
        return extra
    if "cur_log_probs" in extra and "cur_log_probs" not in parameters:
        raise ValueError(f"--pass-current-log-probs: the correction function {getattr(function, '__name__', function)} "
                         "takes no cur_log_probs (nor **kwargs), so it cannot read the current policy")
    return {key: value for key, value in extra.items() if key in parameters}


@functools.lru_cache(maxsize=32)
def _named_keywords(function: Callable) -> frozenset[str] | None:
    """The parameter names of ``function``, or None when it takes **kwargs or has no signature (a builtin: pass
    everything, as miles does); once per function, not per call."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


# flags that change which collectives a host call makes, or what it computes: equal on every CP rank
AGREED_FLAGS = ("use_tis", "use_rollout_logprobs", "get_mismatch_metrics", "custom_tis_function_path", "loss_type",
                "use_opsm", "opsm_delta", "eps_clip", "eps_clip_high", "eps_clip_c", "calculate_per_token_loss",
                "loss_denominator", "qkv_format", "tis_clip", "tis_clip_low", "pass_current_log_probs")


def host_config_text(args: argparse.Namespace) -> str:
    """The :data:`AGREED_FLAGS` of ``args``, one ``name=value`` a line: the text every CP rank must agree on."""
    return "\n".join(f"{name}={getattr(args, name, None)!r}" for name in AGREED_FLAGS)


def call_packed(function: Callable, config: Any, *, pg_loss: Tensor, train_log_probs: Sequence[Tensor],
                rollout_log_probs: Sequence[Tensor] | None, loss_masks: Sequence[Tensor],
                response_lengths: Sequence[int], **kwargs: Any) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """The packed entry point (``compute_mis_weights_packed``) called with what the list entry point gets, at
    context parallel size 1, returning what the list entry point returns: (``pg_loss`` × weights where the returned
    mask keeps the token, 0 elsewhere; the returned mask split into per-sequence masks; the ``mis_`` metrics).

    The per-sequence tensors are concatenated and ``cu_seqlens`` is built from ``response_lengths``
    (whole sequences: the local lengths are the response lengths). Metrics-only (``weights`` None): ``pg_loss``
    unchanged and the input mask values. ``kwargs``: the lags and the (flat) advantages, passed on as they are, and
    ``cur_log_probs`` (per sequence), passed on concatenated as ``current_log_probs``.
    """
    def flat(values: Sequence[Tensor]) -> Tensor:
        return torch.cat(list(values)) if len(values) else torch.zeros(0)

    train = flat(train_log_probs)
    rollout = None if rollout_log_probs is None else flat(rollout_log_probs)
    mask = flat(loss_masks).to(train.device)
    cu_seqlens = torch.tensor([0, *response_lengths], dtype=torch.long, device=train.device).cumsum(0)
    extra = {key: kwargs[key] for key in (*LAG_KWARGS, *SAMPLING_MASK_KWARGS, *ROLLOUT_KEYS, "advantages")
             if kwargs.get(key) is not None}
    if kwargs.get("cur_log_probs") is not None:
        extra["current_log_probs"] = flat([t.detach() for t in kwargs["cur_log_probs"]])
    weights, kept_mask, metrics = function(config, train_log_probs=train, rollout_log_probs=rollout,
                                           loss_mask=mask, cu_seqlens=cu_seqlens, **extra)
    if weights is not None:
        # as a packed host weighs its loss: pg_loss × w on kept tokens, exactly 0 elsewhere (a NaN loss included)
        pg_loss = torch.where(kept_mask != 0, pg_loss * weights, torch.zeros_like(pg_loss))
    return pg_loss, list(kept_mask.split_with_sizes([int(n) for n in response_lengths])), metrics


def _packed_config(args: argparse.Namespace, path: Any, cp: distributed.Group) -> Any:
    """The MisConfig of a call of the packed entry point, after refusing what it cannot do: CP shards, and a
    data-parallel scope (``*_scope: dp``: the packed entry point takes no DP group to exchange over)."""
    from ..config import MisConfig

    if cp.size > 1:
        raise ValueError(packed_cp_message(path, cp.size))
    config = MisConfig.from_args(args)
    dp_keys = [key for key, value in config.to_dict().items() if key.endswith("_scope") and value == "dp"]
    if dp_keys and config.use_tis:
        setting = ", ".join(f"{key}: dp" for key in dp_keys)
        raise ValueError(f"--custom-tis-function-path {path!s}: compute_mis_weights_packed corrects each "
                         f"micro-batch alone, but {setting} asks for the data-parallel group: use "
                         "miles_mis.compute_mis_weights_with_cp, or micro_batch")
    return config


def _prepare_batch(args: argparse.Namespace, batch: Mapping[str, Any], log_probs: Sequence[Tensor],
                   cp: distributed.Group) -> SimpleNamespace:
    """Everything a rank computes from its own batch before any collective (errors are agreed on)."""
    function = packed_config = None
    if args.use_tis or args.get_mismatch_metrics:
        path = args.custom_tis_function_path
        function = load_function(path) if path else vanilla_tis
        if is_packed_entry(function):  # refused under CP here, so that every rank raises together
            packed_config = _packed_config(args, path, cp)
    response_lengths = [int(n) for n in batch["response_lengths"]]
    total_lengths = [int(n) for n in batch["total_lengths"]]
    loss_masks = list(batch["loss_masks"])
    max_seq_lens = batch.get("max_seq_lens")
    local_lengths = [t.numel() for t in log_probs]
    if not len(response_lengths) == len(total_lengths) == len(loss_masks) == len(local_lengths):
        raise ValueError(f"batch disagrees on the number of sequences: log_probs has {len(local_lengths)}, "
                         f"loss_masks {len(loss_masks)}, response_lengths {len(response_lengths)}, total_lengths "
                         f"{len(total_lengths)}")

    # this rank's positions in the full masks (None at cp 1) and each local token's sequence
    positions = None
    if cp.size > 1:
        expected, held = rank_shards(total_lengths, response_lengths, cp.rank, cp.size, args.qkv_format,
                                     None if max_seq_lens is None else [int(n) for n in max_seq_lens])
        if expected != local_lengths:
            i = next(i for i, (n, e) in enumerate(zip(local_lengths, expected)) if n != e)
            raise ValueError(f"sequence {i}: log_probs has {local_lengths[i]} tokens on cp rank {cp.rank} of "
                             f"{cp.size}, but the zigzag layout ({args.qkv_format}) gives this rank {expected[i]}")
        positions = torch.tensor(held, dtype=torch.long)
    elif local_lengths != response_lengths:
        raise ValueError(f"log_probs lengths {local_lengths} differ from response_lengths {response_lengths}")
    for key in ("advantages", "log_probs", "rollout_log_probs"):
        values = batch.get(key)
        if values is not None and [t.numel() for t in values] != local_lengths:
            i = next((i for i, (t, n) in enumerate(zip(values, local_lengths)) if t.numel() != n), len(local_lengths))
            raise ValueError(f"sequence {i}: batch[{key!r}] does not have this rank's local lengths of log_probs "
                             f"({[t.numel() for t in values]} vs {local_lengths})")
    seq_index = torch.repeat_interleave(torch.arange(len(local_lengths)), torch.tensor(local_lengths, dtype=torch.long))
    full_mask = torch.cat(loss_masks).float() if loss_masks else torch.zeros(0)
    active = full_mask if positions is None else full_mask.index_select(0, positions)
    denominators = sample_denominators(batch, loss_masks)
    reduce = Reducer(loss_masks, denominators, seq_index, positions, args.calculate_per_token_loss)

    rollout = batch.get("rollout_log_probs")
    rollout = None if rollout is None else [t.detach().float() for t in rollout]
    if (args.use_rollout_logprobs or args.use_tis or args.loss_type == "reinforce") and rollout is None:
        raise ValueError("batch has no rollout_log_probs, but --use-rollout-logprobs, --use-tis or "
                         "--loss-type reinforce needs the rollout engine's log-probs")
    recomputed = None if batch.get("log_probs") is None else [t.detach().float() for t in batch["log_probs"]]
    if args.use_rollout_logprobs:
        old = rollout
    elif recomputed is None:
        raise ValueError("batch has no log_probs (π_old recomputed by the trainer): pass them, or use "
                         "--use-rollout-logprobs to use the rollout log-probs instead")
    else:
        old = recomputed
    # what the plugin and the train/rollout metric compare with the rollout: the trainer's log-probs when
    # it computed them (in bypass too), else π_old itself
    trainer_scored = recomputed if recomputed is not None else old

    current = torch.cat(list(log_probs)).float() if log_probs else torch.zeros(0, requires_grad=True)
    old_flat = torch.cat(old) if old else torch.zeros(0)
    # as miles: NaN/inf advantages and log-ratios on trained tokens become 0, untrained tokens are 0
    advantages = torch.cat([a.detach().float() for a in batch["advantages"]]) if log_probs else torch.zeros(0)
    advantages = torch.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0) * active
    ppo_kl = torch.nan_to_num(old_flat - current, nan=0.0, posinf=0.0, neginf=0.0) * active
    # what the batch holds for the plugin as it is: lags, and the engine's sampling masks (CSR offsets per sample)
    lag_kwargs = {key: batch[key] for key in (*LAG_KWARGS, *SAMPLING_MASK_KWARGS, *ROLLOUT_KEYS)
                  if batch.get(key) is not None}
    return SimpleNamespace(function=function, packed_config=packed_config, log_probs=list(log_probs),
                           lag_kwargs=lag_kwargs,
                           response_lengths=response_lengths, total_lengths=total_lengths, loss_masks=loss_masks,
                           max_seq_lens=max_seq_lens, positions=positions, seq_index=seq_index, active=active,
                           denominators=denominators, reduce=reduce, rollout=rollout, old=old,
                           trainer_scored=trainer_scored, current=current, advantages=advantages, ppo_kl=ppo_kl)


def opsm_keep(behaviour: Sequence[Tensor], log_probs: Sequence[Tensor], advantages: Sequence[Tensor],
              loss_masks: Sequence[Tensor], seq_index: Tensor, positions: Tensor | None, delta: float,
              cp: distributed.Group) -> Tensor:
    """Off-policy sequence masking, decided per sequence: keep = 0 when the sequence's mean advantage
    over its valid tokens is negative AND mean_t (log π_behaviour − log π_θ) > δ over its valid tokens.
    π_behaviour is the rollout policy when its log-probs are given. Sums cross CP ranks (one all-reduce)."""
    full_mask = torch.cat(list(loss_masks)).float() if loss_masks else torch.zeros(0)
    mask = full_mask if positions is None else full_mask.index_select(0, positions)
    num_seqs = len(loss_masks)
    gap = torch.cat(list(behaviour)) - torch.cat([t.detach().float() for t in log_probs]) if num_seqs else mask
    adv = torch.cat([a.detach().float() for a in advantages]) if num_seqs else mask
    gap = torch.nan_to_num(gap, nan=0.0, posinf=0.0, neginf=0.0) * mask
    adv = torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0) * mask
    sums = torch.zeros(num_seqs, 3, dtype=torch.float64)
    sums.index_add_(0, seq_index, torch.stack([gap, adv, mask], 1).double())
    sums = distributed.all_reduce_sum(sums, cp)
    count = sums[:, 2].clamp(min=1.0)
    reject = (sums[:, 1] / count < 0) & (sums[:, 0] / count > delta)
    return (~reject).float()
