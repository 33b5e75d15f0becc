"""Loading and calling the plugin exactly as a miles host does."""

import argparse
import importlib
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import DEVICE, on_device

import miles_mis
from miles_mis.cli.example_batch import make_example_batch
from miles_mis.cli.reporting import reduce_metrics


def load_function(path: str):
    """miles' loader: import the module part, getattr the last part."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def example_batch(**kwargs) -> dict:
    """miles_mis.cli.example_batch's batch with its tensors on the test device."""
    batch = make_example_batch(**kwargs)
    return {key: on_device(value) if key.endswith(("log_probs", "masks")) else value for key, value in batch.items()}


def host_args(repo_root, config="mis.yaml", **flags):
    """A Namespace as miles builds it: flags, then every YAML key set as an attribute."""
    defaults = dict(use_tis=True, get_mismatch_metrics=False, tis_clip=2.0, tis_clip_low=0.0, qkv_format="thd",
                    calculate_per_token_loss=False, use_rollout_logprobs=False,
                    custom_tis_function_path="miles_mis.compute_mis_weights_with_cp")
    args = argparse.Namespace(**{**defaults, **flags})
    for key, value in (yaml.safe_load((repo_root / "configs" / config).read_text()) or {}).items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("name", ["compute_mis_weights_with_cp", "compute_mis_weights_fsdp",
                                  "compute_mis_weights", "MisConfig"])
def test_public_api(name):
    assert callable(getattr(miles_mis, name))


def test_loaded_by_dotted_path_with_keyword_arguments_only(repo_root):
    fn = load_function("miles_mis.compute_mis_weights_with_cp")
    assert fn is miles_mis.compute_mis_weights_with_cp
    batch = example_batch(num_seqs=6, max_len=32)
    n = sum(batch["response_lengths"])
    pg_loss = torch.randn(n, device=DEVICE, requires_grad=True)
    out, masks, metrics = fn(args=host_args(repo_root), pg_loss=pg_loss, parallel_state=None, max_seq_lens=None,
                             some_future_kwarg=123, **batch)
    assert out.shape == pg_loss.shape and out.requires_grad
    assert [m.shape for m in masks] == [m.shape for m in batch["loss_masks"]]
    assert all(name.startswith("mis_") for name in metrics)
    assert all(v.shape == (n,) for v in metrics.values())
    out.sum().backward()
    assert torch.isfinite(pg_loss.grad).all()


def test_fsdp_entry_point_equals_cp_entry_point_at_cp1(repo_root):
    batch = example_batch(num_seqs=5, max_len=40, seed=3)
    n = sum(batch["response_lengths"])
    pg = torch.randn(n, device=DEVICE)
    a = miles_mis.compute_mis_weights_with_cp(host_args(repo_root), pg_loss=pg, **batch)
    b = miles_mis.compute_mis_weights_fsdp(host_args(repo_root), pg_loss=pg, train_log_probs=batch["train_log_probs"],
                                           rollout_log_probs=batch["rollout_log_probs"],
                                           loss_masks=batch["loss_masks"])
    torch.testing.assert_close(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert a[2].keys() == b[2].keys()


def test_monitoring_mode_with_the_default_yaml(repo_root):
    """--get-mismatch-metrics without --use-tis: same YAML, nothing changed, metrics reported."""
    args = host_args(repo_root, get_mismatch_metrics=True, use_tis=False)
    batch = example_batch(num_seqs=4, max_len=16)
    pg = torch.randn(sum(batch["response_lengths"]), device=DEVICE)
    out, masks, metrics = miles_mis.compute_mis_weights_with_cp(args=args, pg_loss=pg, **batch)
    assert out is pg
    assert all(torch.equal(m, o) for m, o in zip(masks, batch["loss_masks"]))
    assert "mis_kl" in metrics and "mis_tis_weight_before_bound" not in metrics


def test_reduced_metrics_of_identical_engines_show_no_mismatch(repo_root):
    batch = example_batch(num_seqs=8, max_len=64, rollout_dtype=torch.float32)
    pg = torch.ones(sum(batch["response_lengths"]), device=DEVICE)
    _, masks, metrics = miles_mis.compute_mis_weights_with_cp(args=host_args(repo_root), pg_loss=pg, **batch)
    reduced = reduce_metrics(metrics, batch["loss_masks"])
    assert abs(reduced["mis_kl"]) < 1e-6 and abs(reduced["mis_k3_kl"]) < 1e-6
    assert reduced["mis_ess"] == pytest.approx(1.0) and reduced["mis_tis_weight_before_bound"] == pytest.approx(1.0)


def test_cli_check_config(repo_root, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "miles_mis.cli", "check-config", str(repo_root / "configs/mis.yaml"),
                         "--use-tis"], capture_output=True, text=True)
    assert ok.returncode == 0
    assert ("use_tis: true" in ok.stdout and "tis_lower_bound: 0.5" in ok.stdout
            and "rs_veto_threshold: 0.0001" in ok.stdout)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tis_mode: trunc\n")
    err = subprocess.run([sys.executable, "-m", "miles_mis.cli", "check-config", str(bad)], capture_output=True,
                         text=True)
    assert err.returncode == 1 and "did you mean 'truncate'" in err.stderr


def test_cli_plugin_demo_prints_every_config(repo_root):
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "plugin-demo"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[2]
    for name in ("mis", "token_tis", "seq_tis", "seq_mis", "seq_is_rs", "geo_rs", "k3_rs", "token_icepop",
                 "metrics_only"):
        assert name in header.split()
    assert "mis_kl" in out.stdout and "kept_token_fraction" in out.stdout
