"""Call the plugin the way a miles host does, on the shipped synthetic batch, and reduce the metrics
the way the host does (mean over sequences of per-sequence masked means).

    python examples/call_like_a_host.py [configs/mis.yaml]
"""

import argparse
import importlib
import sys

import torch
import yaml

from miles_mis.cli.example_batch import make_example_batch
from miles_mis.cli.reporting import reduce_metrics

config_path = sys.argv[1] if len(sys.argv) > 1 else "configs/mis.yaml"
args = argparse.Namespace(use_tis=True, get_mismatch_metrics=False, qkv_format="thd", calculate_per_token_loss=False)
for key, value in (yaml.safe_load(open(config_path)) or {}).items():  # what --custom-config-path does
    setattr(args, key, value)

module_name, _, attr = "miles_mis.compute_mis_weights_with_cp".rpartition(".")
tis_function = getattr(importlib.import_module(module_name), attr)  # what --custom-tis-function-path does

batch = make_example_batch()
pg_loss = torch.randn(sum(batch["response_lengths"]), requires_grad=True)
pg_loss_out, modified_masks, metrics = tis_function(args=args, pg_loss=pg_loss, parallel_state=None,
                                                    max_seq_lens=None, **batch)
kept = sum(float(m.sum()) for m in modified_masks) / sum(float(m.sum()) for m in batch["loss_masks"])
print(f"kept token fraction: {kept:.4f}")
for name, value in reduce_metrics(metrics, batch["loss_masks"]).items():
    print(f"{name:40s} {value: .6g}")
