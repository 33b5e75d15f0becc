"""The lab's asynchronous schedule: which weight version generated each sample, and what the mismatch is made of.

The trainer's version at RL step t is t (its weights after t steps). Two schedules, as miles runs them:

- ``--rollout-staleness K``: the engine is synced every K steps, so the whole batch of step t comes from version
  t − (t mod K) (``train_async.py``-like staleness; K = 1 is synchronous RL);
- ``--async-max-lag M``: a fully asynchronous buffer (miles' ``--fully-async``): prompt group g of step t was
  generated at version max(t − (g mod (M+1)), 0), so every batch mixes the lags 0..M;
- ``--rollout-lag L``: the whole batch of step t comes from version max(t − L, 0) (one-step-off asynchronous RL
  at L = 1: the engine generates the next batch while the trainer trains on this one).

The trainer keeps its weights at every version still in use (``Snapshots``), so it can score a sample with the
weights that generated it, π_trainer(v), and split the measured log ratio ℓ = log π_old − log π_rollout into

    staleness  a = log π_old − log π_trainer(v)        (the policy moved since the sample was generated)
    numerics   b = log π_trainer(v) − log π_rollout    (the engine's arithmetic at the same weights)

ℓ = a + b exactly; as k3 (k3(x) = e^x − x − 1), k3(a + b) = k3(a) + k3(b) + (e^a − 1)(e^b − 1): the
staleness k3, the numerics k3 and an interaction term whose mean is small when either part is (``decompose``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor

from ..analyze.estimators import k3_terms
from ..tensors.ops import LOG_RATIO_CLAMP
from ..correction.staleness import BUCKETS, bucket_of  # 0, 1, 2, 3plus: the plugin's lag buckets


def group_versions(step: int, num_samples: int, group_size: int, rollout_staleness: int,
                   async_max_lag: int, rollout_lag: int = 0) -> list[int]:
    """The weight version that generated each sample of step ``step`` (group members share one)."""
    if rollout_lag:
        return [max(step - rollout_lag, 0)] * num_samples
    if async_max_lag:
        return [max(step - (i // group_size) % (async_max_lag + 1), 0) for i in range(num_samples)]
    return [step - step % rollout_staleness] * num_samples


def by_version(versions: list[int]) -> dict[int, list[int]]:
    """Version -> the indices of the samples it generated, in increasing version order."""
    groups: dict[int, list[int]] = {}
    for index, version in enumerate(versions):
        groups.setdefault(version, []).append(index)
    return dict(sorted(groups.items()))


class Snapshots:
    """The trainer's weights at the versions still in use (``policy.state_dict()`` copies, by version)."""

    def __init__(self, keep: int):
        self.keep = keep  # versions older than the newest − keep are dropped
        self.states: dict[int, dict[str, Tensor]] = {}

    def save(self, version: int, policy: Any) -> None:
        if version not in self.states:
            self.states[version] = {name: value.detach().clone() for name, value in policy.state_dict().items()}
        for old in [v for v in self.states if v < version - self.keep]:
            del self.states[old]

    def state_dict(self) -> dict:
        return {"states": {str(v): s for v, s in self.states.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.states = {int(v): s for v, s in state["states"].items()}


@contextlib.contextmanager
def weights_of(policy: Any, snapshots: Snapshots, version: int, current: int) -> Iterator[None]:
    """``policy`` holds the weights of ``version`` inside the block, its own again after (a no-op when ``version``
    is the current one). Loaded in place, so the optimizer's parameters stay the same objects."""
    if version == current:
        yield
        return
    own = {name: value.detach().clone() for name, value in policy.state_dict().items()}
    try:  # a load that fails half-way (a mismatched snapshot) is undone too
        policy.load_state_dict(snapshots.states[version])
        yield
    finally:
        policy.load_state_dict(own)


def decompose(old: list[Tensor], at_version: list[Tensor], rollout: list[Tensor], lags: list[int]) -> dict[str, float]:
    """The step's mismatch split into staleness and numerics, over every response token (float64):

      stale_k3 = mean k3(a),  numerics_k3 = mean k3(b),  cross_k3 = mean (e^a − 1)(e^b − 1)
      (raw_k3 = mean k3(a + b) = stale_k3 + numerics_k3 + cross_k3, up to the ±20 clamp of k3_terms)

    with a = log π_old − log π_trainer(v), b = log π_trainer(v) − log π_rollout; and by lag bucket (0, 1, 2, 3plus)
    each bucket's share of the tokens and its raw, staleness and numerics k3 (0 for an empty bucket); mean_lag
    over the samples.
    """
    old_flat = torch.cat(old).double()
    mid = torch.cat(at_version).double()
    roll = torch.cat(rollout).double()
    a, b = old_flat - mid, mid - roll
    lag_of_token = torch.repeat_interleave(torch.tensor(lags), torch.tensor([t.numel() for t in old]))
    parts = {"raw": k3_terms(a + b), "stale": k3_terms(a), "numerics": k3_terms(b)}
    row = {"stale_k3": float(parts["stale"].mean()), "numerics_k3": float(parts["numerics"].mean())}
    clamp = lambda x: x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # noqa: E731
    row["cross_k3"] = float((torch.expm1(clamp(a)) * torch.expm1(clamp(b))).mean())
    row["mean_lag"] = sum(lags) / len(lags)
    bucket = bucket_of(lag_of_token)
    for index, name in enumerate(BUCKETS):
        mine = bucket == index
        count = int(mine.sum())
        row[f"lag_{name}_token_fraction"] = count / bucket.numel()
        for part, values in parts.items():
            row[f"lag_{name}_{part}_k3"] = float(values[mine].mean()) if count else 0.0
    return row


def decode_terms(at_version: list[Tensor], prefill: list[Tensor], rollout: list[Tensor]) -> dict[str, float]:
    """The numerics part b = log π_trainer(v) − log π_rollout split at the engine's own prefill score of the same
    tokens, at the same weights (``--decode-term``), over every response token (float64):

      kernel_k3 = mean k3(c),  decode_k3 = mean k3(d),   c = log π_trainer(v) − log π_prefill,
                                                          d = log π_prefill − log π_rollout   (b = c + d)

    d is what the decode batch's composition moved the engine's log-probs (0 where generation and prefill agree to
    the bit, as vLLM-CPU's do in decode batches of 16 and more); c is the kernels' own mismatch."""
    trainer, scored, generated = (torch.cat(values).double() for values in (at_version, prefill, rollout))
    return {"kernel_k3": float(k3_terms(trainer - scored).mean()),
            "decode_k3": float(k3_terms(scored - generated).mean()),
            "decode_changed_token_fraction": float((scored != generated).double().mean())}
