"""The core must not loop over sequences in Python: the number of aten operations per call is the same
at B = 8 and B = 64 (counts, not timings), for the default config and for heavier ones."""

import pytest
import torch
from op_count import count_aten_ops

from miles_mis import MisConfig, compute_mis_weights_with_cp


def ops_per_call(config, num_seqs):
    gen = torch.Generator().manual_seed(num_seqs)
    lengths = torch.randint(4, 40, (num_seqs,), generator=gen).tolist()
    train = [-torch.rand(n, generator=gen) for n in lengths]
    rollout = [t + 0.05 * torch.randn(t.shape, generator=gen) for t in train]
    kwargs = dict(pg_loss=torch.ones(sum(lengths)), train_log_probs=train, rollout_log_probs=rollout,
                  loss_masks=[torch.ones(n) for n in lengths], total_lengths=[n + 8 for n in lengths],
                  response_lengths=lengths)
    return count_aten_ops(lambda: compute_mis_weights_with_cp(config, **kwargs))


@pytest.mark.parametrize("config", [
    MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True),
    MisConfig(use_tis=True, tis_level="geometric", tis_mode="mask", use_rs=True, rs_level="sequence",
              tis_lower_bound=0.9, tis_upper_bound=1.1, tis_batch_normalize=True),
    MisConfig(use_tis=True, rs_divergence={"token_k2": 0.1, "seq_mean_k1": [0.9, 1.1], "seq_max_k3": 0.5}),
    MisConfig(use_tis=False),
], ids=["default", "geometric-mask-seq-rs", "divergence", "metrics-only"])
def test_op_count_does_not_grow_with_batch_size(config):
    assert ops_per_call(config, 8) == ops_per_call(config, 64)
