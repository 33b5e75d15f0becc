"""Test doubles of miles' and slime's policy-loss entry, written from their source (radixark/miles at
miles_mis.hosts.miles_loss.VERIFIED_COMMIT, THUDM/slime at miles_mis.hosts.slime_loss.VERIFIED_COMMIT): the facts,
not their code. What is doubled: the micro-batch ``batch`` (per-sample lists, CP-local log-probs and advantages, full
int32 loss masks, ``unconcat_tokens``, ``rollout_mask_sums``), the current policy's log-probs from the logits (a
log-softmax at the zigzag rows a CP rank holds; thd ``[1, T_local, V]``, miles' bshd ``[B, S_local, V]``), the
reducer ``get_sum_of_sample_mean`` (denominators = ``rollout_mask_sums``, the numerator rebuilt from the returned
masks), ``policy_loss_function`` (clipped PPO with dual clip, bypass, decoupled PPO, the correction hook called with
each host's exact keyword arguments, miles' skip-forward mode, the log dict and how each entry is reduced) and
``loss_function`` (dispatch by ``--loss-type``, ``--recompute-loss-function``, the rescaling).

Left out, as no path under test reaches them: OPSM, GSPO, CISPO, the KL loss, a custom pg-loss reducer, miles'
``ess_ratio`` and ``train_rollout_kl`` log entries, temperature scaling.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.utils.checkpoint

LOSS_MODULES = {"miles": "miles.backends.training_utils.loss_hub.losses",
                "slime": "slime.backends.megatron_utils.loss"}


# --------------------------------------------------------------------------- the zigzag rows a CP rank holds
def held_positions(span: int, length: int, rank: int, cp: int, bshd: bool = False) -> list[int]:
    """The token positions of one sample's rows on rank ``rank``, as the hosts lay out the logits: at CP size 1 the
    sample's positions (thd: its L tokens; bshd: the span, padded); at CP size C chunk r, then chunk 2C−1−r, of
    ceil(span / 2C) rows each (thd: span = L), padding rows (positions ≥ L) included. No response log-prob lies on a
    padding row."""
    if cp == 1:
        return list(range(span if bshd else length))
    chunk = -(-span // (2 * cp))
    return [p for k in (rank, 2 * cp - 1 - rank) for p in range(k * chunk, (k + 1) * chunk)]


def response_rows(total: int, response: int, held: list[int]) -> list[tuple[int, int]]:
    """(row among the held positions, response index) of each response log-prob the rank holds: position p scores
    token p + 1, so the response occupies positions [prompt − 1, total − 1)."""
    first = total - response - 1
    return [(row, p - first) for row, p in enumerate(held) if first <= p < total - 1]


class Double:
    """One host's double: its parallel state (CP rank, size, group) and the functions its loss module exposes."""

    def __init__(self, host: str, cp_rank: int = 0, cp_size: int = 1, cp_group=None):
        self.host = host
        self.cp = SimpleNamespace(rank=cp_rank, size=cp_size, group=cp_group)
        self.hook_calls: list[dict] = []  # the keyword arguments of every correction-hook call (for the tests)
        self.module = None  # the loss module it is installed as: its policy loss calls the module's helpers by name

    # -------------------------------------------------------------- parallel state
    def get_parallel_state(self):
        return SimpleNamespace(cp=self.cp)

    def _span(self, args, i, total_lengths, max_seq_lens):
        return max_seq_lens[i] if getattr(args, "qkv_format", "thd") == "bshd" else total_lengths[i]

    # -------------------------------------------------------------- log-probs from the logits
    def get_log_probs_and_entropy(self, logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                  with_entropy=False, max_seq_lens=None, **unused):
        """miles returns {"log_probs", "entropy"}; slime returns (empty, that dict)."""
        log_probs, entropy, offset = [], [], 0
        bshd = getattr(args, "qkv_format", "thd") == "bshd"
        for i, (total, response) in enumerate(zip(total_lengths, response_lengths)):
            span = self._span(args, i, total_lengths, max_seq_lens)
            held = held_positions(span, total, self.cp.rank, self.cp.size, bshd)
            rows = response_rows(total, response, held)
            flat = logits.view(-1, logits.shape[-1]) if bshd else logits[0]  # bshd: [B·S_local, V], as the hosts
            sample_logits = flat[offset:offset + len(held)]
            offset += len(held)
            index = torch.tensor([row for row, _ in rows], dtype=torch.long)
            targets = torch.tensor([int(unconcat_tokens[i][held[row] + 1]) for row, _ in rows], dtype=torch.long)
            logp = torch.log_softmax(sample_logits.index_select(0, index).float(), dim=-1)
            log_probs.append(logp.gather(1, targets[:, None]).squeeze(1))
            entropy.append(-(logp.exp() * logp).sum(-1))
        out = {"log_probs": log_probs, "entropy": entropy if with_entropy else []}
        return (torch.empty(0), out) if self.host == "slime" else out

    def get_rollout_top_p_logprob_kwargs(self, args, batch):  # slime; top-p 1.0 in these tests
        return {}

    # -------------------------------------------------------------- the reducer
    def local_masks(self, args, total_lengths, response_lengths, loss_masks, max_seq_lens=None):
        out = []
        for i, (total, response, mask) in enumerate(zip(total_lengths, response_lengths, loss_masks)):
            held = held_positions(self._span(args, i, total_lengths, max_seq_lens), total, self.cp.rank, self.cp.size,
                                  getattr(args, "qkv_format", "thd") == "bshd")
            index = torch.tensor([j for _, j in response_rows(total, response, held)], dtype=torch.long)
            out.append(mask.index_select(0, index))
        return out

    def reducer(self, args, total_lengths, response_lengths, loss_masks, denominators, per_token, max_seq_lens=None):
        """Σ_i Σ_t x·m_i / max(d_i, 1) over this rank's tokens (per-token loss: Σ x·m), d_i =
        ``rollout_mask_sums``, else each full mask's sum. The masks are full length; the reducer takes the rank's
        positions itself."""
        if denominators is None:
            denominators = [m.sum() for m in loss_masks]
        masks = self.local_masks(args, total_lengths, response_lengths, loss_masks, max_seq_lens)
        lengths = [m.numel() for m in masks]

        def reduce(x):
            parts = x.split(lengths, dim=0)
            if per_token:
                return sum((x_i * m_i).sum() for x_i, m_i in zip(parts, masks))
            return sum((x_i * m_i).sum() / torch.clamp_min(torch.as_tensor(d), 1)
                       for x_i, m_i, d in zip(parts, masks, denominators))
        return reduce

    # -------------------------------------------------------------- the policy loss
    def policy_loss_function(self, args, batch, logits, sum_of_sample_mean):
        host = self.host
        advantages = torch.cat([a.detach() for a in batch["advantages"]])
        rollout = batch.get("rollout_log_probs")
        rollout = None if rollout is None else [t.detach() for t in rollout]
        skip = host == "miles" and getattr(args, "skip_actor_forward_only", False)
        if args.use_rollout_logprobs:
            assert rollout is not None
        elif not skip and batch.get("log_probs") is None:
            raise ValueError("policy loss requires old-policy log-probs")
        total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]
        max_seq_lens = batch.get("max_seq_lens")
        with_entropy = host == "slime" or args.entropy_coef != 0
        # looked up in the loss module at call time, as the hosts' module-level functions do
        helper = getattr(self.module, "get_log_probs_and_entropy", self.get_log_probs_and_entropy)
        out = helper(
            logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=total_lengths,
            response_lengths=response_lengths, with_entropy=with_entropy, max_seq_lens=max_seq_lens)
        values = out[1] if host == "slime" else out
        log_probs = values["log_probs"]
        if host == "miles":
            scored = ([t.detach() for t in log_probs] if skip else
                      None if batch.get("log_probs") is None else [t.detach() for t in batch["log_probs"]])
            old = rollout if args.use_rollout_logprobs else scored
            tis_train = scored
        else:  # slime: π_old falls back to the detached current log-probs
            old = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
            if not args.use_rollout_logprobs and not old:
                old = [t.detach() for t in log_probs]
            tis_train = batch.get("log_probs") or [t.detach() for t in log_probs]
        old_flat, current = torch.cat(old), torch.cat(log_probs)
        ppo_kl = old_flat - current
        if host == "miles":  # miles cleans ppo_kl and the advantages on the local mask
            active = torch.cat(self.local_masks(args, total_lengths, response_lengths, batch["loss_masks"],
                                                max_seq_lens)).bool()
            ppo_kl = torch.where(active, torch.nan_to_num(ppo_kl, nan=0.0, posinf=0.0, neginf=0.0),
                                 ppo_kl.new_zeros(()))
            advantages = torch.where(active, torch.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0),
                                     advantages.new_zeros(()))
        pg_loss, pg_clipfrac = compute_policy_loss(ppo_kl, advantages, args.eps_clip, args.eps_clip_high,
                                                   getattr(args, "eps_clip_c", None))
        tis_metrics = None
        if args.get_mismatch_metrics or args.use_tis:
            metric_reducer = sum_of_sample_mean
            function = load_function(args.custom_tis_function_path) if args.custom_tis_function_path else vanilla_tis
            ois = (-ppo_kl).exp()
            kwargs = dict(args=args, pg_loss=pg_loss, train_log_probs=tis_train,
                          rollout_log_probs=rollout if host == "miles" else batch["rollout_log_probs"],
                          loss_masks=batch["loss_masks"], total_lengths=total_lengths,
                          response_lengths=response_lengths)
            if host == "miles":
                kwargs.update(parallel_state=self.get_parallel_state(), max_seq_lens=max_seq_lens)
            self.hook_calls.append(kwargs)
            pg_loss, modified, tis_metrics = function(**kwargs)
            sum_of_sample_mean = self.reducer(args, total_lengths, response_lengths, modified,
                                              batch.get("rollout_mask_sums") if host == "miles"
                                              else batch["rollout_mask_sums"],
                                              args.calculate_per_token_loss, max_seq_lens)
        pg_loss = sum_of_sample_mean(pg_loss)
        pg_clipfrac, ppo_kl_mean = sum_of_sample_mean(pg_clipfrac), sum_of_sample_mean(ppo_kl)
        entropy_loss = pg_loss.new_zeros(())
        loss = pg_loss
        if with_entropy:
            entropy_loss = sum_of_sample_mean(torch.cat(values["entropy"]))
            if args.entropy_coef != 0:
                loss = pg_loss - args.entropy_coef * entropy_loss
            else:
                entropy_loss = entropy_loss.detach()
        if current.numel() == 0:
            loss = loss + 0 * logits.sum()
        log = {"loss": loss.clone().detach(), "pg_loss": pg_loss.clone().detach(),
               "entropy_loss": entropy_loss.clone().detach(), "pg_clipfrac": pg_clipfrac.clone().detach(),
               "ppo_kl": ppo_kl_mean.clone().detach()}
        if rollout:
            compared = current if (host == "slime" and args.use_rollout_logprobs) else old_flat
            log["train_rollout_logprob_abs_diff"] = sum_of_sample_mean((compared - torch.cat(rollout)).abs()).detach()
        if tis_metrics is not None:
            log["ois"] = metric_reducer(ois).clone().detach()
            for name, value in tis_metrics.items():
                log[name] = metric_reducer(value)
        return loss, log

    # -------------------------------------------------------------- the caller
    def loss_function(self, args, batch, logits, num_microbatches=2, global_batch_size=8, dp_cp_size=None):
        """The host's ``loss_function``: the reducer of the input masks, the loss by ``--loss-type``, the rescaling.
        Returns (scaled loss, log dict)."""
        sums = batch.get("rollout_mask_sums")
        reducer = self.reducer(args, batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], sums,
                               args.calculate_per_token_loss, batch.get("max_seq_lens"))
        if args.loss_type == "policy_loss":
            function = self.policy_loss_function
        elif args.loss_type == "custom_loss":
            function = load_function(args.custom_loss_function_path)
        else:
            raise ValueError(f"Unknown loss type: {args.loss_type}")
        if getattr(args, "recompute_loss_function", False):  # miles: torch's default (reentrant); slime: not
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "use_reentrant should be passed explicitly"
                mode = {} if self.host == "miles" else {"use_reentrant": False}
                loss, log = torch.utils.checkpoint.checkpoint(function, args, batch, logits, reducer, **mode)
        else:
            loss, log = function(args, batch, logits, reducer)
        if not args.calculate_per_token_loss:
            loss = loss * num_microbatches / global_batch_size * (dp_cp_size or self.cp.size)
        else:
            loss = loss * self.cp.size
        return loss, log


def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    ratio = torch.nan_to_num(-ppo_kl, nan=0.0, posinf=20.0, neginf=-20.0).clamp(-20.0, 20.0).exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = torch.gt(clipped, unclipped).float()
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.min(-eps_clip_c * advantages, loss), loss)
    return loss, clipfrac


def vanilla_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    tis = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    return pg_loss * weights, loss_masks, {"tis": tis, "tis_clipfrac": (weights != tis).float(),
                                           "tis_abs": (tis - 1).abs()}


def load_function(path):
    """Both hosts: a dotted path, the module imported and the attribute taken."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@contextmanager
def installed(double: Double):
    """The double's loss module in ``sys.modules`` under the host's real module path (and its parents), removed
    afterwards."""
    path = LOSS_MODULES[double.host]
    parts = path.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            raise RuntimeError(f"{name} is already imported: the double would shadow a real host")
        sys.modules[name] = types.ModuleType(name)
        added.append(name)
    module = sys.modules[path]
    for name in ("policy_loss_function", "get_log_probs_and_entropy", "get_parallel_state"):
        setattr(module, name, getattr(double, name))
    if double.host == "slime":
        module.get_rollout_top_p_logprob_kwargs = double.get_rollout_top_p_logprob_kwargs
    double.module = module
    try:
        yield module
    finally:
        for name in reversed(added):
            sys.modules.pop(name, None)


# --------------------------------------------------------------------------- a batch as a rank holds it
def make_batch(seed: int, cp_rank: int = 0, cp_size: int = 1, fmt: str = "thd", num_samples: int = 6,
               vocab: int = 11, extras: bool = False):
    """(batch, logits leaf of the FULL sequences [Σ L_i, V], this rank's logits view of it, args defaults).
    Responses of 0 to 14 tokens, int32 masks with zeros, rollout log-probs off π_old by noise; the same full data on
    every rank (seeded), each rank taking its rows."""
    gen = torch.Generator().manual_seed(seed)
    responses = [int(n) for n in torch.randint(0, 15, (num_samples,), generator=gen)]
    responses[0] = 0
    totals = [n + int(torch.randint(2, 9, (1,), generator=gen)) for n in responses]
    # bshd: every sample padded to the micro-batch's one length (the hosts' row offset of sample i is i·max_seq_len)
    spans = [max(totals) + int(torch.randint(0, 6, (1,), generator=gen))] * num_samples if fmt == "bshd" else None
    tokens = [torch.randint(0, vocab, (t,), generator=gen) for t in totals]
    full_logits = torch.randn(sum(totals), vocab, generator=gen).requires_grad_(True)
    starts = [0] + torch.tensor(totals).cumsum(0).tolist()
    loss_masks, advantages, old, rollout = [], [], [], []
    with torch.no_grad():
        for i, (total, response) in enumerate(zip(totals, responses)):
            logp = torch.log_softmax(full_logits[starts[i]:starts[i + 1]], -1)
            first = total - response - 1
            scored = logp[torch.arange(first, total - 1), tokens[i][first + 1:total]]
            old.append(scored + 0.05 * torch.randn(response, generator=gen))
            rollout.append(old[-1] + 0.2 * torch.randn(response, generator=gen))
            loss_masks.append((torch.rand(response, generator=gen) > 0.2).to(torch.int32))
            advantages.append(torch.randn(response, generator=gen))
    ids = [int(i) for i in torch.randint(0, 3, (num_samples,), generator=gen)]
    mask_sums = {}
    for rid, mask in zip(ids, loss_masks):
        mask_sums[rid] = mask_sums.get(rid, 0.0) + float(mask.sum())

    # this rank's rows: the full logits at the positions it holds, zeros on padding rows
    local, blocks = [], []
    padding = full_logits.new_zeros(1, vocab)
    for i, (total, response) in enumerate(zip(totals, responses)):
        span = spans[i] if fmt == "bshd" else total
        held = held_positions(span, total, cp_rank, cp_size, fmt == "bshd")
        local.append(torch.tensor([j for _, j in response_rows(total, response, held)], dtype=torch.long))
        source = torch.cat([full_logits[starts[i]:starts[i + 1]], padding])  # row `total`: the padding row
        blocks.append(source.index_select(0, torch.tensor([min(p, total) for p in held], dtype=torch.long)))
    logits = torch.stack(blocks) if fmt == "bshd" else torch.cat(blocks)[None]
    take = lambda values: [v.index_select(0, ix) for v, ix in zip(values, local)]  # noqa: E731
    batch = {"advantages": take(advantages), "log_probs": take(old), "rollout_log_probs": take(rollout),
             "loss_masks": loss_masks, "total_lengths": totals, "response_lengths": responses,
             "unconcat_tokens": tokens, "rollout_mask_sums": [torch.tensor(float(m.sum())) for m in loss_masks],
             "max_seq_lens": spans}
    if extras:  # split rollouts: the per-rollout counts of the hosts
        batch["rollout_ids"] = ids
        batch["rollout_mask_sums"] = [torch.tensor(mask_sums[rid]) for rid in ids]
    return batch, full_logits, logits, local


def host_args(**overrides):
    """The host's flags as its Namespace holds them (defaults of both hosts), YAML keys included by the caller."""
    values = dict(loss_type="policy_loss", custom_loss_function_path=None, custom_tis_function_path=None,
                  use_tis=False, use_rollout_logprobs=False, get_mismatch_metrics=False, calculate_per_token_loss=False,
                  qkv_format="thd", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, entropy_coef=0.0,
                  tis_clip=2.0, tis_clip_low=0.0, skip_actor_forward_only=False, recompute_loss_function=False,
                  rollout_top_p=1.0)
    values.update(overrides)
    return SimpleNamespace(**values)
