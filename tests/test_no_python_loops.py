"""The core must not loop over sequences in Python: the number of aten operations per call is the same
at B = 8 and B = 64 (counts, not timings), for the default config and for heavier ones."""

import pytest
import torch
from op_count import OP_COUNT_CONFIGS, OP_COUNT_IDS, count_aten_ops

from miles_mis import MisConfig, compute_mis_weights_with_cp


def ops_per_call(config, num_seqs, lags=False):
    gen = torch.Generator().manual_seed(num_seqs)
    lengths = torch.randint(4, 40, (num_seqs,), generator=gen).tolist()
    train = [-torch.rand(n, generator=gen) for n in lengths]
    rollout = [t + 0.05 * torch.randn(t.shape, generator=gen) for t in train]
    kwargs = dict(pg_loss=torch.ones(sum(lengths)), train_log_probs=train, rollout_log_probs=rollout,
                  loss_masks=[torch.ones(n) for n in lengths], total_lengths=[n + 8 for n in lengths],
                  response_lengths=lengths)
    if lags:  # per-sequence lags (docs/staleness.md): their metrics, bounds and gate are vectorised too
        kwargs["version_lags"] = [i % 5 for i in range(num_seqs)]
    return count_aten_ops(lambda: compute_mis_weights_with_cp(config, **kwargs))


@pytest.mark.parametrize("config", OP_COUNT_CONFIGS, ids=OP_COUNT_IDS)
def test_op_count_does_not_grow_with_batch_size(config):
    ops_per_call(config, 8)  # the first call of a process builds cached constants (ops.constant): not counted
    assert ops_per_call(config, 8) == ops_per_call(config, 64)


LAG_CONFIGS = [MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True),
               MisConfig(use_tis=True, tis_upper_bound_by_lag=[2.0, 1.5, 1.2], rs_max_lag=2, rs_max_lag_k3=0.01),
               MisConfig(use_tis=True, tis_level="sequence", tis_mode="mask", tis_lower_bound=0.5,
                         tis_upper_bound_by_lag=[2.0, 1.5], rs_max_lag=1),
               MisConfig(use_tis=False)]


@pytest.mark.parametrize("config", LAG_CONFIGS, ids=["default", "token-bounds-gate", "sequence-bounds-drop",
                                                     "metrics-only"])
def test_op_count_with_lags_does_not_grow_with_batch_size(config):
    ops_per_call(config, 8, lags=True)
    assert ops_per_call(config, 8, lags=True) == ops_per_call(config, 64, lags=True)


OP_BUDGET = 265  # aten ops of one default-config call (benchmarks/bench_core.py prints the counts per config)


def test_default_call_stays_within_its_op_budget():
    """The default config's call (use_rs, veto, batch normalisation) runs at most OP_BUDGET aten operations: the
    per-call cost on CPU is mostly op dispatch at small B, so a new stage must pay for its ops elsewhere."""
    ops_per_call(OP_COUNT_CONFIGS[0], 8)
    assert ops_per_call(OP_COUNT_CONFIGS[0], 8) <= OP_BUDGET
