"""`miles-mis train --dump-details DIR`: policy-loss dumps in miles' layout, for `miles-mis analyze`.

miles' format (miles/backends/training_utils/debug_dump.py): DIR/policy_loss_debug/rank_<r>_call_<c>.pt,
one per policy-loss call per rank, holding rank, call, samples, ppo_kl, pg_loss and finite.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from cp_harness import free_port

from miles_mis.parallel.cp_layout import zigzag_layout
from miles_mis.lab.train import parse_args, train

TOP_KEYS = {"rank", "call", "samples", "ppo_kl", "pg_loss", "finite"}
SAMPLE_KEYS = {"index", "total_length", "response_length", "train_log_probs", "old_log_probs", "advantages",
               "local_loss_mask", "rollout_log_probs", "train_rollout_abs_diff", "version_lag"}
TENSOR_KEYS = SAMPLE_KEYS - {"index", "total_length", "response_length", "version_lag"}
FINITE_KEYS = {"ppo_kl", "pg_loss", "train_log_probs", "old_log_probs", "advantages"}
TINY = ["--quiet", "--prompts-per-step", "4", "--sft-steps", "10"]  # 32 sequences, 2 minibatches per step


def lab(tmp_path, *flags, steps=2, name="run"):
    return train(parse_args([*flags, "--steps", str(steps), "--out-dir", str(tmp_path / name), *TINY]))


def dumps(directory):
    """{(rank, call): payload} of every file, each loaded with weights_only=True."""
    files = sorted((directory / "policy_loss_debug").iterdir())
    out = {}
    for path in files:
        match = re.fullmatch(r"rank_(\d+)_call_(\d+)\.pt", path.name)
        assert match, path.name
        out[int(match[1]), int(match[2])] = torch.load(path, map_location="cpu", weights_only=True)
    return out


def check_payload(payload, rank, call):
    """miles' keys and types; every per-token tensor of a sample has the sample's local length."""
    assert set(payload) == TOP_KEYS
    assert type(payload["rank"]) is int and type(payload["call"]) is int and (payload["rank"], payload["call"]) == (
        rank, call)
    assert set(payload["finite"]) == FINITE_KEYS and all(v is True for v in payload["finite"].values())
    local_total = 0
    for position, sample in enumerate(payload["samples"]):
        assert set(sample) == SAMPLE_KEYS
        assert sample["index"] == position and all(type(sample[k]) is int for k in ("index", "total_length",
                                                                                  "response_length"))
        n = sample["train_log_probs"].numel()
        for key in TENSOR_KEYS:
            t = sample[key]
            assert t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad and t.shape == (n,), key
        diff = (sample["train_log_probs"] - sample["rollout_log_probs"]).abs()
        assert torch.equal(sample["train_rollout_abs_diff"], diff)  # miles: |current policy - rollout|
        assert sample["total_length"] > sample["response_length"] > 0
        local_total += n
    for key in ("ppo_kl", "pg_loss"):
        assert payload[key].dtype == torch.float32 and payload[key].shape == (local_total,)
    return local_total


def same_history(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k != "seconds"} == {k: v for k, v in y.items() if k != "seconds"}


def test_dump_files_format_and_unchanged_trajectory(tmp_path):
    flags = ["--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"]
    plain = lab(tmp_path, *flags, name="plain")
    dumped = lab(tmp_path, *flags, "--dump-details", str(tmp_path / "dump"), name="dumped")
    same_history(plain, dumped)  # exactly: dumping draws no random numbers and leaves the graph alone

    files = dumps(tmp_path / "dump")
    assert sorted(files) == [(0, c) for c in range(4)]  # 2 steps x 2 minibatch calls, rank 0, calls 0..3
    for (rank, call), payload in files.items():
        local_total = check_payload(payload, rank, call)
        assert len(payload["samples"]) == 16  # 32 sequences / 2 minibatches
        for sample in payload["samples"]:  # cp 1: the local shard is the whole response
            assert sample["train_log_probs"].numel() == sample["response_length"]
            assert torch.equal(sample["local_loss_mask"], torch.ones(sample["response_length"]))
            assert sample["advantages"].unique().numel() == 1  # one GRPO advantage per sequence
        old = torch.cat([s["old_log_probs"] for s in payload["samples"]])
        current = torch.cat([s["train_log_probs"] for s in payload["samples"]])
        assert payload["ppo_kl"] == pytest.approx(old - current, abs=1e-7) and local_total == old.numel()
    # the first minibatch call of a step: π_θ is π_old (no optimizer step yet), so ppo_kl is 0
    assert files[0, 0]["ppo_kl"].abs().max() < 1e-6 and files[0, 1]["ppo_kl"].abs().max() > 0

    # the analyzer reads them
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "analyze", str(tmp_path / "dump")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_dump_interval_writes_every_nth_step(tmp_path):
    lab(tmp_path, "--dump-details", str(tmp_path / "dump"), "--dump-interval", "2", steps=3)
    # steps 1..3, written: step 2 only; the counter counts every call, so its calls are 2 and 3
    assert sorted(dumps(tmp_path / "dump")) == [(0, 2), (0, 3)]


def test_call_counter_continues_across_resume(tmp_path):
    straight, resumed = tmp_path / "straight_dump", tmp_path / "resumed_dump"
    lab(tmp_path, "--dump-details", str(straight), steps=3, name="straight")
    lab(tmp_path, "--dump-details", str(resumed), "--save-interval", "1", steps=2, name="resumed")
    checkpoint = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert checkpoint["policy_loss_calls"] == 4
    lab(tmp_path, "--dump-details", str(resumed), "--resume", steps=3, name="resumed")
    a, b = dumps(straight), dumps(resumed)
    assert sorted(a) == sorted(b) == [(0, c) for c in range(6)]
    for key in ((0, 4), (0, 5)):  # written after the resume: same call numbers, same values
        assert b[key]["call"] == key[1]
        for x, y in zip(a[key]["samples"], b[key]["samples"]):
            for name in TENSOR_KEYS:
                assert torch.allclose(x[name], y[name], rtol=1e-6, atol=1e-7), (key, name)
    # a fresh (not resumed) run into a directory with another run's dumps is refused before it trains
    with pytest.raises(ValueError, match="already holds 6 dump"):
        lab(tmp_path, "--dump-details", str(resumed), steps=1, name="again")


def test_torchrun_cp2_dumps_are_shards_of_the_cp1_dumps(tmp_path):
    flags = ["--use-tis", "--rollout-dtype", "fp32", "--steps", "1", *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for cp in (1, 2):
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                     str(free_port())] if cp == 2 else [sys.executable])
        out = subprocess.run([*launcher, "-m", "miles_mis.lab", "train", *flags, "--context-parallel-size", str(cp),
                              "--out-dir", str(tmp_path / f"cp{cp}"), "--dump-details", str(tmp_path / f"dump{cp}")],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[cp] = dumps(tmp_path / f"dump{cp}")
    assert sorted(runs[2]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for call in (0, 1):
        whole = runs[1][0, call]
        shards = [runs[2][rank, call] for rank in (0, 1)]
        for rank, payload in enumerate(shards):
            check_payload(payload, rank, call)
        for i, sample in enumerate(whole["samples"]):
            parts = [payload["samples"][i] for payload in shards]
            for key in ("response_length", "total_length"):  # the full lengths on every rank
                assert [p[key] for p in parts] == [sample[key]] * 2
            assert sum(p["train_log_probs"].numel() for p in parts) == sample["response_length"]
            assert sum(float(p["local_loss_mask"].sum()) for p in parts) == sample["response_length"]
            # each rank's tokens are the zigzag positions of the full response
            for rank, part in enumerate(parts):
                lengths = torch.tensor([sample["total_length"]]), torch.tensor([sample["response_length"]])
                layout = zigzag_layout(*lengths, rank, 2)
                positions = layout.positions(torch.tensor([0]))
                for key in ("old_log_probs", "rollout_log_probs", "advantages"):
                    assert torch.allclose(part[key], sample[key][positions], atol=1e-5), (call, i, rank, key)
