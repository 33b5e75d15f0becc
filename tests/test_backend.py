"""The compiled backend (miles_mis.tensors.backend, ``kernel_backend: compiled``): the same decisions as eager on every
case, values within a few ulps, no graph break in a compiled kernel, no recompile for a new batch size, the same results
on every CP rank as cp = 1, and an eager fallback in one line without a compiler."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from cp_harness import cp_state, make_full_batch, shard, spawn
from test_cp import check_case

from miles_mis import MisConfig, compute_mis_weights_packed, compute_mis_weights_with_cp
from miles_mis.tensors import backend, ops
from miles_mis.inputs import config_text

# weights and the loss: within this many ulps of eager (|Δ| ≤ ULPS·eps·|x|); a metric: ULPS ulps of its largest |value|
# in the micro-batch (assert_within_ulps)
ULPS = 8

CASES = {  # name -> (config, the batch carries lags, advantages)
    "token truncate + RS + veto + normalise": (
        MisConfig(use_tis=True, use_rs=True, rs_lower_bound=0.5, rs_upper_bound=2.0, rs_veto_threshold=1e-4,
                  tis_batch_normalize=True), False, False),
    "token mask, per-lag bounds, staleness gate": (
        MisConfig(use_tis=True, tis_mode="mask", tis_lower_bound=0.6, tis_upper_bound=1.5,
                  tis_upper_bound_by_lag=[1.5, 1.2, 1.1], rs_max_lag=1, rs_max_lag_k3=1e-3), True, False),
    "adaptive token bound + k1/k3 options": (
        MisConfig(use_tis=True, tis_upper_bound="auto", tis_auto_bounds=[1.0, 3.0], tis_auto_target_ess=0.95,
                  rs_divergence={"token_k1": [0.5, 2.0], "seq_mean_k3": 0.05}), False, False),
    "sequence icepop + probability-space and directional options": (
        MisConfig(use_tis=True, tis_level="sequence", tis_mode="icepop", tis_lower_bound=0.2, tis_upper_bound=5.0,
                  rs_divergence={"token_tv": [-0.2, 0.2], "token_dtv": [-0.1, 0.1], "seq_max_bkl": 0.5}), False, True),
}


@pytest.fixture
def compiled_counters():
    """Dynamo's counters from zero; after the test: no graph break and no fallback happened."""
    from torch._dynamo.utils import counters

    counters.clear()
    backend.FALLBACKS.clear()
    yield counters
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert backend.FALLBACKS == []


def packed_batch(seed: int, num_seqs: int = 24, max_len: int = 200, at_bounds: tuple = ()):
    """Random packed inputs with the corners: NaN, a fill value, masked tokens, and tokens whose log ratio is at
    (and one float32 step either side of) each bound's threshold (``ops.log_bound``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    n = int(lengths.sum())
    rollout = -torch.rand(n, generator=gen) * 4.0
    ell = torch.randn(n, generator=gen) * 0.4
    at = 0
    for bound in at_bounds:
        threshold = torch.tensor(ops.log_bound(bound), dtype=torch.float32)
        for value in (torch.nextafter(threshold, -torch.tensor(math.inf)), threshold,
                      torch.nextafter(threshold, torch.tensor(math.inf))):
            ell[at] = value
            at += 7
    train = rollout + ell
    # train − rollout is then not ℓ exactly; rebuild rollout so that the subtraction gives ℓ back where it matters
    rollout[:at + 1] = 0.0
    train[:at + 1] = ell[:at + 1]
    train[n // 2] = float("nan")
    rollout[n // 3] = -1e4
    loss_mask = (torch.rand(n, generator=gen) > 0.1).float()
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return dict(train_log_probs=train, rollout_log_probs=rollout, loss_mask=loss_mask, cu_seqlens=cu_seqlens)


def extras(inputs: dict, lags: bool, advantages: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 1)
    num_seqs = inputs["cu_seqlens"].numel() - 1
    out = {}
    if lags:
        out["version_lags"] = torch.randint(0, 4, (num_seqs,), generator=gen).tolist()
    if advantages:
        out["advantages"] = torch.randn(inputs["train_log_probs"].numel(), generator=gen)
    return out


def assert_within_ulps(name: str, got: torch.Tensor, want: torch.Tensor, batch_scale: bool = False) -> None:
    """|got − want| ≤ ULPS ulps of ``want``'s dtype (the loss may be bf16/fp16), relative to max(|want|, 1e-30), or
    with ``batch_scale`` to the largest |value| of ``want`` (a metric that averages terms of both signs, as χ²'s
    ρ² − 1: the ulps of its terms, not of their mean, bound the difference)."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if not got.numel():
        return
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    scale = want.abs().double().max() if batch_scale else want.abs().double()
    excess = ((got.double() - want.double()).abs() / torch.clamp(scale, min=1e-30)).max().item()
    assert excess <= ULPS * eps, f"{name}: {excess / eps if eps else excess:.1f} ulps ({want.dtype}) from eager"


def is_decision(values: torch.Tensor) -> bool:
    """A 0/1 per-token metric (an indicator: rejected, truncated, masked) must be identical, not close."""
    return bool(((values == 0) | (values == 1)).all())


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_makes_the_same_decisions_as_eager(case, compiled_counters):
    config, lags, advantages = CASES[case]
    bounds = [b for b in (config.tis_lower_bound, config.tis_upper_bound, config.rs_lower_bound,
                          config.rs_upper_bound, *(config.tis_upper_bound_by_lag or ())) if isinstance(b, float)]
    compiled = dataclasses.replace(config, kernel_backend="compiled")
    for seed in range(3):
        inputs = packed_batch(seed, at_bounds=bounds)
        kwargs = extras(inputs, lags, advantages, seed)
        weights, mask, metrics = compute_mis_weights_packed(config, **inputs, **kwargs)
        weights_c, mask_c, metrics_c = compute_mis_weights_packed(compiled, **inputs, **kwargs)
        assert torch.equal(mask_c, mask), f"{case}, seed {seed}: the compiled backend keeps other tokens"
        assert torch.equal(weights_c == 0, weights == 0)
        assert_within_ulps("weights", weights_c, weights)
        assert sorted(metrics_c) == sorted(metrics)
        for name, value in metrics.items():
            if is_decision(value):
                assert torch.equal(metrics_c[name], value), f"{case}, seed {seed}: {name}"
            else:
                assert_within_ulps(f"{case}, seed {seed}: {name}", metrics_c[name], value, batch_scale=True)
    assert {kernel.__name__ for kernel in backend._COMPILED} >= {"token_kernel", "base_token_values",
                                                                   "batch_value_kernel"}


def test_random_differential_cases_decide_alike(compiled_counters):
    """Cases of the differential test (random valid configs and batches: NaN and fill values, extreme ratios, every
    mask kind, lags, the current policy, advantages), at cp = 1 through the list entry point: the compiled backend
    returns the same masks and 0/1 metrics, the weighted loss and the other metrics within ULPS (5 cases: each
    compiles its own kernels; MILES_MIS_BACKEND=compiled runs the whole differential test compiled)."""
    import test_differential as differential

    checked = 0
    for index in range(40):
        case = differential.make_case(index)
        if case.error is not None:
            continue
        torch._dynamo.reset()  # each case its own compile (dynamo's recompile limit is 8 configs per kernel)
        args = SimpleNamespace(**dict(vars(case.args), kernel_backend="compiled"))
        eager = compute_mis_weights_with_cp(case.args, pg_loss=case.pg_loss, parallel_state=cp_state(0, 1), **case.full)
        compiled = compute_mis_weights_with_cp(args, pg_loss=case.pg_loss, parallel_state=cp_state(0, 1), **case.full)
        label = f"differential case {index}"
        assert all(torch.equal(a, b) for a, b in zip(compiled[1], eager[1])), f"{label}: masks"
        assert_within_ulps(f"{label}: loss", compiled[0], eager[0])
        for name, values in eager[2].items():
            got, want = compiled[2][name], values
            if is_decision(want):
                assert torch.equal(got, want), f"{label}: {name}"
            else:
                assert_within_ulps(f"{label}: {name}", got, want, batch_scale=True)
        checked += 1
        if checked == 5:
            break
    assert checked == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expm1_keeps_its_precision_inside_a_compiled_kernel(dtype, compiled_counters):
    """k3 = expm1(ℓ) − ℓ and χ² = expm1(2ℓ) rest on expm1 near 0, which inductor's CPU code computes as e^x − 1:
    ops.expm1 is within 2 ulps of the exact value compiled too, from |x| = 1e-9 to 20, both signs."""
    magnitudes = torch.logspace(-9, math.log10(20.0), 3001, dtype=torch.float64)
    x = torch.cat([magnitudes, -magnitudes, torch.zeros(1, dtype=torch.float64)]).to(dtype)
    exact = torch.expm1(x.double())
    got = torch.compile(ops.expm1, dynamic=True, fullgraph=True)(x)
    error = ((got.double() - exact).abs() / exact.abs().clamp(min=1e-300)).max().item()
    assert error <= 2 * torch.finfo(dtype).eps and got[-1] == 0.0
    assert torch.equal(ops.expm1(x), torch.expm1(x))  # eagerly: torch's own


def test_a_new_batch_size_does_not_recompile(compiled_counters):
    config = MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, kernel_backend="compiled")
    compute_mis_weights_packed(config, **packed_batch(0, num_seqs=16))
    graphs = compiled_counters["stats"]["unique_graphs"]
    for seed, (num_seqs, max_len) in enumerate([(5, 900), (64, 40), (300, 100)], 1):
        compute_mis_weights_packed(config, **packed_batch(seed, num_seqs=num_seqs, max_len=max_len))
    assert compiled_counters["stats"]["unique_graphs"] == graphs


def test_a_kernels_own_error_is_raised_as_eager_raises_it(compiled_counters):
    # a directional option without the advantages: the entry point's error, on either backend
    config = MisConfig(use_tis=True, rs_divergence={"token_dtv": [-0.1, 0.1]})
    errors = []
    for chosen in (config, dataclasses.replace(config, kernel_backend="compiled")):
        with pytest.raises(ValueError) as raised:
            compute_mis_weights_packed(chosen, **packed_batch(0))
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and "advantages" in errors[0]


def test_the_environment_variable_sets_the_backend_where_the_config_does_not(monkeypatch):
    monkeypatch.setenv("MILES_MIS_BACKEND", "compiled")
    assert MisConfig.from_dict({}).kernel_backend == "compiled" and MisConfig().kernel_backend == "compiled"
    assert MisConfig.from_dict({"kernel_backend": None}).kernel_backend == "compiled"
    assert MisConfig.from_dict({"kernel_backend": "eager"}).kernel_backend == "eager"
    monkeypatch.setenv("MILES_MIS_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"^config: MILES_MIS_BACKEND='fast' is invalid: allowed values are eager, "
                                         r"compiled$"):
        MisConfig.from_dict({})
    with pytest.raises(ValueError, match=r"^MILES_MIS_BACKEND='fast' is invalid"):
        MisConfig()  # a config built in code reads it too
    monkeypatch.delenv("MILES_MIS_BACKEND")
    assert MisConfig.from_dict({}).kernel_backend == "eager"
    with pytest.raises(ValueError, match="kernel_backend='fast' is invalid: allowed values are eager, compiled"):
        MisConfig.from_dict({"kernel_backend": "fast"})


def test_the_ranks_agree_on_the_effective_backend(monkeypatch):
    """What CP/DP ranks compare (config_text) is the backend each runs: a rank without a compiler says eager, so a
    group mixing it with compiled ranks fails together, naming the key."""
    config = MisConfig(use_tis=True, kernel_backend="compiled")
    monkeypatch.setitem(backend._PROBE, "reason", None)
    assert "kernel_backend='compiled'" in config_text(config, "thd")
    monkeypatch.setitem(backend._PROBE, "reason", "InvalidCxxCompiler: no working C++ compiler found")
    monkeypatch.setattr(backend, "FALLBACKS", [])
    assert "kernel_backend='eager'" in config_text(config, "thd")
    assert backend.FALLBACKS == ["miles_mis: kernel_backend: compiled runs eager: InvalidCxxCompiler: no working C++ "
                                 "compiler found"]


def test_without_a_compiler_it_runs_eager_after_one_line(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys, warnings
        import torch
        import torch._inductor.config as inductor_config
        inductor_config.cpp.cxx = ("/nonexistent/c++",)
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from test_backend import packed_batch
        from miles_mis import MisConfig, compute_mis_weights_packed
        config = MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4)
        inputs = packed_batch(0)
        eager = compute_mis_weights_packed(config, **inputs)
        compiled = compute_mis_weights_packed(MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4,
                                                        kernel_backend="compiled"), **inputs)
        compute_mis_weights_packed(MisConfig(use_tis=True, kernel_backend="compiled"), **inputs)
        same = torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]) and all(
            torch.equal(eager[2][k], compiled[2][k]) for k in eager[2])
        print(json.dumps({{"same": same}}))
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), MILES_MIS_BACKEND="")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"same": True}
    lines = [line for line in done.stderr.splitlines() if "runs eager" in line]
    assert len(lines) == 1 and lines[0].startswith("miles_mis: kernel_backend: compiled runs eager: "), done.stderr


def compiled_cp_worker(rank, size):
    torch.set_num_threads(1)
    for case in ("token truncate + RS + veto + normalise", "token mask, per-lag bounds, staleness gate"):
        config, lags, _ = CASES[case]
        compiled = dataclasses.replace(config, kernel_backend="compiled")
        full, pg_loss = make_full_batch(seed=40 + len(case), fmt="thd")
        if lags:
            full["version_lags"] = [i % 4 for i in range(len(full["response_lengths"]))]
        check_case(rank, size, compiled, full, pg_loss, "thd")  # every output of this rank against cp = 1
        # and the same masks as the eager backend on this rank's shard
        kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
        outputs = [compute_mis_weights_with_cp(SimpleNamespace(**chosen.to_dict(), qkv_format="thd"), pg_loss=local_pg,
                                               parallel_state=cp_state(rank, size), **kwargs)
                   for chosen in (config, compiled)]
        assert all(torch.equal(a, b) for a, b in zip(outputs[0][1], outputs[1][1])), (rank, case)
    assert backend.FALLBACKS == []


def test_compiled_cp_ranks_equal_cp1():
    spawn(compiled_cp_worker, 2, timeout=600)
