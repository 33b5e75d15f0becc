"""The packed entry point through the reference host: `--custom-tis-function-path miles_mis.compute_mis_weights_packed`
gives the list entry point's loss, gradients, metrics and masks; refused under context parallelism (every rank)
and with a data-parallel scope over several DP ranks."""

import math
from types import SimpleNamespace

import pytest
import torch
from cp_harness import cp_state, make_full_batch, spawn
from test_host import grads, make_batch

from miles_mis import MisConfig, compute_mis_weights_packed, compute_mis_weights_with_cp, reference_host

LIST = "miles_mis.compute_mis_weights_with_cp"
PACKED = "miles_mis.compute_mis_weights_packed"


def host_args(path, *flags, config=None, repo_root=None):
    argv = ["--use-tis", "--custom-tis-function-path", path, *flags]
    if config:
        argv += ["--custom-config-path", str(repo_root / "configs" / config)]
    return reference_host.parse_args(argv)


def rejection_batch():
    """seq 0: product ratio π_old/π_rollout = e^-2 (rejected by seq_mis), seq 1: kept, seq 2: a hole in its mask
    and a token ratio e^1.5 (truncated by token TIS), seq 3: empty, seq 4: a NaN rollout log-prob (rejected)."""
    batch, current = make_batch(
        [[0.0] * 3, [0.0] * 2, [0.0] * 4, [], [0.0] * 2],
        [[-1.0, -0.5, -0.5], [0.1, -0.1], [0.2, 1.5, -0.1, 0.0], [], [0.3, 0.0]],
        [[1.0] * 3, [1.0] * 2, [1.0, -1.0, 0.5, 2.0], [], [1.0, -1.0]],
        masks=[[1, 1, 1], [1, 1], [1, 0, 1, 1], [], [1, 1]])
    batch["rollout_log_probs"][4][1] = float("nan")
    return batch, current


def test_host_gives_the_packed_entry_the_hand_checked_seq_mis_result(repo_root):
    # test_host's seq_mis case through the packed entry: sequence 0 (ratio e^-2 < 0.5) is rejected, its loss
    # and gradient are 0; sequence 1 keeps its own mean over its original count
    batch, current = make_batch([[0.0] * 3, [0.0] * 2], [[-1.0, -0.5, -0.5], [0.1, -0.1]], [[1.0] * 3, [1.0] * 2])
    args = host_args(PACKED, config="seq_mis.yaml", repo_root=repo_root)
    loss, metrics, (g0, g1) = grads(args, batch, current)
    assert g0.abs().sum() == 0
    torch.testing.assert_close(g1, torch.tensor([-1.0 / 2, -1.0 / 2]))
    assert loss.item() == pytest.approx(-1.0, rel=1e-6)
    assert metrics["mis_tis_mask_fraction_low"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("config", ["seq_mis.yaml", "mis.yaml", "geo_rs.yaml", "token_icepop.yaml",
                                    "metrics_only.yaml"])
def test_packed_through_the_host_equals_the_list_entry_point(repo_root, config):
    batch, current = rejection_batch()
    (loss_l, metrics_l, grads_l), (loss_p, metrics_p, grads_p) = [
        grads(host_args(path, config=config, repo_root=repo_root), batch, current) for path in (LIST, PACKED)]
    assert torch.equal(loss_l, loss_p)
    assert metrics_l.keys() == metrics_p.keys() and "mis_kl" in metrics_p
    for name in metrics_l:
        assert torch.equal(torch.as_tensor(metrics_l[name]), torch.as_tensor(metrics_p[name])), name
    for a, b in zip(grads_l, grads_p):
        assert torch.equal(a, b)
    if config == "seq_mis.yaml":  # the batch has rejections: sequences 0 and 4 give no gradient
        assert grads_p[0].abs().sum() == 0 and grads_p[4].abs().sum() == 0 and grads_p[1].abs().sum() > 0


@pytest.mark.parametrize("config", [MisConfig.preset("seq_mis", use_tis=True), MisConfig.preset("mis", use_tis=True),
                                    MisConfig(use_tis=True, rs_batch_gate={"k3": 1e-9}),
                                    MisConfig.preset("metrics_only")])
def test_call_packed_returns_the_list_entry_points_loss_masks_and_metrics(config):
    full, pg_loss = make_full_batch(seed=5, num_seqs=9)
    # the first sequence with a trained token is far off (log ratio ~3): rejected by sequence and token RS
    far = next(i for i, m in enumerate(full["loss_masks"]) if m.sum() > 0)
    full["rollout_log_probs"][far] = full["rollout_log_probs"][far] - 3.0
    kwargs = {k: full[k] for k in ("train_log_probs", "rollout_log_probs", "loss_masks", "response_lengths")}
    mask = torch.cat(full["loss_masks"])
    start = sum(full["response_lengths"][:far])
    pg_loss[start + int(full["loss_masks"][far].nonzero()[0])] = float("nan")  # on a rejected trained token
    pg_loss[int((mask == 0).nonzero()[0])] = float("nan")  # and on an untrained token: both must become 0
    want_loss, want_masks, want_metrics = compute_mis_weights_with_cp(
        config, pg_loss=pg_loss, total_lengths=full["total_lengths"], **kwargs)
    got_loss, got_masks, got_metrics = reference_host.call_packed(compute_mis_weights_packed, config, pg_loss=pg_loss,
                                                                  **kwargs)
    if config.use_tis:
        assert torch.equal(got_loss, want_loss) and torch.isfinite(got_loss).all()
    else:  # metrics-only: pg_loss unchanged, NaN included
        assert got_loss is pg_loss and want_loss is pg_loss
    assert len(got_masks) == len(want_masks) == 9
    for a, b in zip(got_masks, want_masks):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got_metrics.keys() == want_metrics.keys()
    for name in want_metrics:
        assert torch.equal(got_metrics[name], want_metrics[name]), name
    kept = sum(float(m.sum()) for m in got_masks)
    trained = sum(float(m.sum()) for m in full["loss_masks"])
    if config.rs_batch_gate:  # gated: every mask 0, every loss 0
        assert kept == 0 and torch.equal(got_loss, torch.zeros_like(got_loss))
    elif config.use_tis:
        assert 0 < kept < trained  # rejections happened (sequence or token RS on the far sequence)
    else:
        assert kept == trained  # metrics-only: the input masks


def test_a_file_that_reexports_the_packed_function_takes_the_packed_path(tmp_path, repo_root):
    plugin = tmp_path / "my_packed.py"
    plugin.write_text("from miles_mis import compute_mis_weights_packed\n")
    path = f"{plugin}:compute_mis_weights_packed"
    assert (reference_host.is_packed_entry(reference_host.load_function(path))
            and reference_host.is_packed_entry(reference_host.load_function(PACKED)))
    assert not reference_host.is_packed_entry(reference_host.load_function(LIST))
    batch, current = rejection_batch()
    # called with the list contract (args=, pg_loss=, ...) the packed function would raise a TypeError
    loss_f, metrics_f, _ = grads(host_args(path, config="seq_mis.yaml", repo_root=repo_root), batch, current)
    loss_l, metrics_l, _ = grads(host_args(LIST, config="seq_mis.yaml", repo_root=repo_root), batch, current)
    assert torch.equal(loss_f, loss_l) and metrics_f.keys() == metrics_l.keys()


def test_batch_gate_through_the_packed_host_path(caplog):
    batch, current = rejection_batch()
    args = host_args(PACKED, "--mis-set", "rs_batch_gate={k3: 1e-9}")
    with caplog.at_level("WARNING", logger="miles_mis"):
        loss, metrics, g = grads(args, batch, current)
    assert loss.item() == 0.0 and all(t.abs().sum() == 0 for t in g)
    # the host sums per-sequence means: 1 for each of the 4 sequences with a trained token (the empty one gives 0)
    assert metrics["mis_batch_gated"].item() == pytest.approx(4.0)
    assert any("gate" in record.getMessage() for record in caplog.records)


def test_empty_micro_batch_through_the_packed_path():
    args = host_args(PACKED)
    batch = dict(advantages=[], log_probs=[], rollout_log_probs=[], loss_masks=[], response_lengths=[],
                 total_lengths=[])
    loss, metrics = reference_host.policy_loss(args, batch, [])
    assert loss.item() == 0.0 and metrics["pg_loss"].item() == 0.0


def test_context_parallel_is_refused_at_validation():
    args = reference_host.build_parser().parse_args(["--use-tis", "--custom-tis-function-path", PACKED])
    args.context_parallel_size = 2  # a host with miles' --context-parallel-size flag
    with pytest.raises(ValueError) as info:
        reference_host.validate_args(args)
    message = str(info.value)
    assert message == ("--custom-tis-function-path miles_mis.compute_mis_weights_packed: compute_mis_weights_packed "
                       "takes whole sequences, but --context-parallel-size is 2: under context parallelism use "
                       "miles_mis.compute_mis_weights_with_cp (same results, CP shards)")
    args.context_parallel_size = 1
    reference_host.validate_args(args)


def test_lab_refuses_the_packed_entry_with_context_parallelism():
    from miles_mis.lab.train import parse_args

    with pytest.raises(ValueError, match=r"compute_mis_weights_packed takes whole sequences, but "
                                         r"--context-parallel-size is 2"):
        parse_args(["--use-tis", "--custom-tis-function-path", PACKED, "--context-parallel-size", "2"])


def test_a_data_parallel_scope_is_refused():
    """The packed entry point takes no DP group: a dp scope is refused (with any number of DP ranks), never
    silently computed per micro-batch."""
    batch, current = rejection_batch()
    single_cp = SimpleNamespace(rank=0, size=1, group=None)
    for flags in (["--mis-set", "rs_batch_gate={k3: 0.5}", "--mis-set", "rs_batch_gate_scope=dp"],
                  ["--mis-set", "tis_batch_normalize=true", "--mis-set", "tis_batch_normalize_scope=dp"],
                  ["--mis-set", "tis_upper_bound=auto", "--mis-set", "tis_auto_scope=dp"]):
        args = host_args(PACKED, *flags)
        for dp_size in (1, 2):
            state = SimpleNamespace(cp=single_cp, dp=SimpleNamespace(rank=0, size=dp_size, group=None))
            with pytest.raises(ValueError, match=r"compute_mis_weights_packed corrects each micro-batch alone, but "
                                                 r"\w+_scope: dp asks for the data-parallel group: use"):
                reference_host.policy_loss(args, batch, current, parallel_state=state)


def _cp2_worker(rank, size):
    args = host_args(PACKED)
    full, _ = make_full_batch(seed=11, num_seqs=5)
    batch = dict(full, log_probs=full["train_log_probs"], advantages=[torch.ones(n) for n in full["response_lengths"]])
    current = [t.clone().requires_grad_() for t in full["train_log_probs"]]  # lengths need not fit: refused first
    with pytest.raises(ValueError) as info:
        reference_host.policy_loss(args, batch, current, parallel_state=cp_state(rank, size))
    assert str(info.value) == ("--custom-tis-function-path miles_mis.compute_mis_weights_packed: "
                               "compute_mis_weights_packed takes whole sequences, but the context parallel size is "
                               "2: under context parallelism use miles_mis.compute_mis_weights_with_cp (same results, "
                               "CP shards)")
    # the group is still usable: the list entry point's collectives run after the refusal
    from cp_harness import shard

    kwargs, _, _ = shard(full, torch.zeros(sum(full["response_lengths"])), rank, size, "thd")
    batch = dict(full, log_probs=kwargs["train_log_probs"], rollout_log_probs=kwargs["rollout_log_probs"],
                 advantages=[torch.ones(t.numel()) for t in kwargs["train_log_probs"]])
    loss, _ = reference_host.policy_loss(host_args(LIST), batch, [t.clone() for t in kwargs["train_log_probs"]],
                               parallel_state=cp_state(rank, size))
    assert math.isfinite(loss.item())


def test_every_cp_rank_refuses_the_packed_entry_together():
    spawn(_cp2_worker, 2)
