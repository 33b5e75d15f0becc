"""The fault matrix: every failure on any rank makes EVERY rank of the group raise one clear error, within
seconds, on real gloo groups (cp 2 and 3, and dp 2 x cp 2). Never a hang, never an abort.

Each worker runs the cases in order in one process group and writes one JSON line per case (exception type,
message, seconds). A watchdog in the parent kills the workers when a case makes no progress for
CASE_TIMEOUT seconds, and the test fails naming that case. docs/reliability.md lists the same matrix.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cp_harness import cp_state, free_port, make_full_batch, shard

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_with_cp
from miles_mis.parallel.distributed import HEADER_BYTES

CASE_TIMEOUT = 30.0  # seconds without progress before the watchdog declares a hang
FAST = 5.0  # every case must end within this on every rank (they take milliseconds)


# --------------------------------------------------------------------------- the plugin's CP matrix
def _args(config: MisConfig, **extra):
    return SimpleNamespace(**config.to_dict(), qkv_format="thd", **extra)


def _call(rank, size, args=None, ps=None, **changes):
    full, pg_loss = make_full_batch(seed=3, num_seqs=6)
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    kwargs.update(changes)
    pg = kwargs.pop("pg_loss", local_pg)
    return compute_mis_weights_with_cp(args or _args(MisConfig(use_tis=True)), pg_loss=pg,
                                       parallel_state=ps or cp_state(rank, size), **kwargs)


def _with_bad_entry(rank, size, key, index, value):
    full, pg_loss = make_full_batch(seed=3, num_seqs=6)
    kwargs, _, _ = shard(full, pg_loss, rank, size, "thd")
    entries = list(kwargs[key])
    entries[index] = value(entries[index])
    return {key: entries}


def case_input_error(rank, size):
    if rank != 0:
        return _call(rank, size)
    full, pg_loss = make_full_batch(seed=3, num_seqs=6)
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    grow = lambda seq: [t if i != 5 else torch.zeros(t.numel() + 1) for i, t in enumerate(seq)]  # noqa: E731
    return _call(rank, size, train_log_probs=grow(kwargs["train_log_probs"]),
                 rollout_log_probs=grow(kwargs["rollout_log_probs"]), pg_loss=torch.zeros(local_pg.numel() + 1))


def case_config_typo(rank, size):
    extra = {"tis_mdoe": "clip"} if rank == size - 1 else {}
    return _call(rank, size, args=_args(MisConfig(use_tis=True), **extra))


def case_qkv_format(rank, size):
    args = _args(MisConfig(use_tis=True))
    if rank == 0:
        args.qkv_format = "xyz"
    return _call(rank, size, args=args)


def case_list_instead_of_tensor(rank, size):
    changes = _with_bad_entry(rank, size, "rollout_log_probs", 2, lambda t: t.tolist()) if rank == 1 else {}
    return _call(rank, size, **changes)


def case_sparse_tensor(rank, size):
    changes = _with_bad_entry(rank, size, "train_log_probs", 1, lambda t: t.to_sparse()) if rank == 0 else {}
    return _call(rank, size, **changes)


def case_pg_loss_shape(rank, size):
    return _call(rank, size, pg_loss=torch.zeros(1, 1)) if rank == size - 1 else _call(rank, size)


def case_pg_loss_meta(rank, size):
    full, pg_loss = make_full_batch(seed=3, num_seqs=6)
    _, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    return _call(rank, size, pg_loss=torch.empty(local_pg.numel(), device="meta")) if rank == 1 else _call(rank, size)


def case_dp_scope_on_one_rank(rank, size):
    scope = "dp" if rank == 1 else "micro_batch"
    ps = SimpleNamespace(cp=SimpleNamespace(rank=rank, size=size, group=None),
                         dp=SimpleNamespace(rank=0, size=1, group=None))
    return _call(rank, size, ps=ps, args=_args(MisConfig(use_tis=True, tis_batch_normalize=True,
                                                         tis_batch_normalize_scope=scope)))


def case_table_width(rank, size):
    divergence = {"seq_max_k3": 0.5} if rank == 0 else None
    return _call(rank, size, args=_args(MisConfig(use_tis=True, rs_divergence=divergence)))


def case_token_vs_seq_tis(rank, size):
    return _call(rank, size, args=_args(MisConfig.preset("token_tis" if rank == 0 else "seq_tis", use_tis=True)))


def case_use_tis_on_one_rank(rank, size):
    return _call(rank, size, args=_args(MisConfig(use_tis=rank != size - 1)))


def case_batch_size_across_blocks(rank, size):
    full, pg_loss = make_full_batch(seed=4, num_seqs=70 if rank == 0 else 3)
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    return compute_mis_weights_with_cp(_args(MisConfig(use_tis=True)), pg_loss=local_pg,
                                       parallel_state=cp_state(rank, size), **kwargs)


def case_lengths_disagree(rank, size):
    full, pg_loss = make_full_batch(seed=3, num_seqs=6)
    empty = full["response_lengths"].index(0)  # both shards stay valid: only the exchanged lengths differ
    full["total_lengths"][empty] += rank
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    return compute_mis_weights_with_cp(_args(MisConfig(use_tis=True)), pg_loss=local_pg,
                                       parallel_state=cp_state(rank, size), **kwargs)


def _host_call(rank, size, argv=(), mutate=None, change_batch=None):
    from miles_mis import reference_host

    args = reference_host.parse_args(["--use-tis", "--custom-tis-function-path",
                                      "miles_mis.compute_mis_weights_with_cp", *argv])
    if mutate:
        mutate(args)
    full, _ = make_full_batch(seed=11, num_seqs=5)
    kwargs, _, _ = shard(full, torch.zeros(sum(full["response_lengths"])), rank, size, "thd")
    batch = dict(full, log_probs=kwargs["train_log_probs"], rollout_log_probs=kwargs["rollout_log_probs"],
                 advantages=[torch.ones(t.numel()) for t in kwargs["train_log_probs"]])
    if change_batch:
        change_batch(batch)
    current = [t.clone().requires_grad_() for t in kwargs["train_log_probs"]]
    return reference_host.policy_loss(args, batch, current, parallel_state=cp_state(rank, size))


def case_host_bad_batch(rank, size):
    def drop_token(batch):
        batch["advantages"] = [a[:-1] if i == 2 and a.numel() else a for i, a in enumerate(batch["advantages"])]
        batch["advantages"][2] = torch.ones(batch["advantages"][2].numel() + 1)
    return _host_call(rank, size, change_batch=drop_token if rank == 1 else None)


def case_host_flags_differ(rank, size):
    return _host_call(rank, size, argv=["--use-opsm"] if rank == 0 else [])


def case_host_qkv_format(rank, size):
    def bad(args):
        args.qkv_format = "xyz"
    return _host_call(rank, size, mutate=bad if rank == size - 1 else None)


def case_healthy_after(rank, size):
    loss, masks, metrics = _call(rank, size, args=_args(MisConfig.preset("mis", use_tis=True)))
    assert torch.isfinite(loss).all() and len(masks) == 6 and "mis_kl" in metrics


def _faulty_and_others(faulty: int, own: str, relayed: str):
    """(faulty rank, its message, the message every other rank sees) for a one-rank fault."""
    return lambda rank, size: own if rank == (faulty % size) else relayed


# name -> (case, expected message per (rank, size)); every rank must raise (except "healthy_after")
CP_MATRIX = {
    "input_error": (case_input_error, _faulty_and_others(
        0, r"^sequence 5: train_log_probs has \d+ tokens on cp rank 0",
        r"^cp rank 0 at sequence 5: sequence 5: train_log_probs has \d+ tokens on cp rank 0 .*stops too")),
    "config_typo": (case_config_typo, lambda rank, size: (
        r"^args: unknown attribute 'tis_mdoe' \(did you mean 'tis_mode'\?\)" if rank == size - 1 else
        rf"^cp rank {size - 1}: args: unknown attribute 'tis_mdoe' \(did you mean 'tis_mode'\?\)")),
    "qkv_format": (case_qkv_format, _faulty_and_others(
        0, r"^qkv_format='xyz' is invalid: allowed values are thd, bshd",
        r"^cp rank 0: qkv_format='xyz' is invalid: allowed values are thd, bshd")),
    "list_instead_of_tensor": (case_list_instead_of_tensor, _faulty_and_others(
        1, r"^sequence 2: rollout_log_probs\[2\] is a list, not a tensor",
        r"^cp rank 1 at sequence 2: sequence 2: rollout_log_probs\[2\] is a list, not a tensor")),
    "sparse_tensor": (case_sparse_tensor, _faulty_and_others(
        0, r"^sequence 1: train_log_probs\[1\] is a sparse_coo tensor",
        r"^cp rank 0 at sequence 1: sequence 1: train_log_probs\[1\] is a sparse_coo tensor")),
    "pg_loss_shape": (case_pg_loss_shape, lambda rank, size: (
        r"^pg_loss has shape \(1, 1\)" if rank == size - 1 else rf"^cp rank {size - 1}: pg_loss has shape \(1, 1\)")),
    "pg_loss_meta": (case_pg_loss_meta, _faulty_and_others(
        1, r"^pg_loss is on the meta device", r"^cp rank 1: pg_loss is on the meta device")),
    "dp_scope_on_one_rank": (case_dp_scope_on_one_rank, lambda rank, size: (
        r"^cp ranks disagree on the effective config: tis_batch_normalize_scope: cp rank 0 has 'micro_batch', "
        r"cp rank 1 has 'dp'")),
    "table_width": (case_table_width, lambda rank, size: (
        r"^cp ranks disagree on the effective config: rs_divergence: cp rank 0 has \{'seq_max_k3': 0.5\}, "
        r"cp rank 1 has None")),
    "token_vs_seq_tis": (case_token_vs_seq_tis, lambda rank, size: (
        r"^cp ranks disagree on the effective config: .*tis_level: cp rank 0 has 'token', cp rank 1 has 'sequence'")),
    "use_tis_on_one_rank": (case_use_tis_on_one_rank, lambda rank, size: (
        rf"^cp ranks disagree on the effective config: use_tis: cp rank 0 has True, .*cp rank {size - 1} has False")),
    "batch_size_across_blocks": (case_batch_size_across_blocks, lambda rank, size: (
        r"^cp ranks disagree on the number of sequences: cp rank 0 has 70, cp rank 1 has 3")),
    "lengths_disagree": (case_lengths_disagree, lambda rank, size: (
        r"^sequence \d: context-parallel ranks disagree on its lengths \(cp rank 0: response_length=0")),
    "host_bad_batch": (case_host_bad_batch, _faulty_and_others(
        1, r"^sequence 2: batch\['advantages'\] does not have this rank's local lengths",
        r"^cp rank 1: sequence 2: batch\['advantages'\] does not have this rank's local lengths")),
    "host_flags_differ": (case_host_flags_differ, lambda rank, size: (
        r"^cp ranks disagree on the effective config: use_opsm: cp rank 0 has True, cp rank 1 has False")),
    "host_qkv_format": (case_host_qkv_format, lambda rank, size: (
        r"^qkv_format='xyz' is invalid: allowed values are thd, bshd" if rank == size - 1 else
        rf"^cp rank {size - 1}: qkv_format='xyz' is invalid: allowed values are thd, bshd")),
    "healthy_after": (case_healthy_after, None),
}


def cp_matrix_worker(rank, size, port, out_dir):
    _init(rank, size, port)
    for name, (case, _) in CP_MATRIX.items():
        _record(out_dir, rank, name, lambda: case(rank, size))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- a rank that exits
def exit_worker(rank, size, port, out_dir):
    _init(rank, size, port)
    _record(out_dir, rank, "warm_up", lambda: case_healthy_after(rank, size))
    if rank == 1:
        os._exit(17)  # a crash: no exception, no clean-up
    time.sleep(0.5)
    _record(out_dir, rank, "rank_exits", lambda: _call(rank, size))
    # a group with a dead peer cannot be torn down cleanly (gloo may abort in its destructor at interpreter
    # exit); a real job ends here anyway, so leave without running the destructors
    os._exit(0)


# --------------------------------------------------------------------------- dp 2 x cp 2
def _dp_cp_groups(rank):
    """Global ranks replica * 2 + cp_rank; every rank creates every group in the same order."""
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, cp_rank = divmod(rank, 2)
    return replica, cp_rank, SimpleNamespace(cp=SimpleNamespace(rank=cp_rank, size=2, group=cp_groups[replica]),
                                             dp=SimpleNamespace(rank=replica, size=2, group=dp_groups[cp_rank]))


def dp_matrix_worker(rank, size, port, out_dir):
    _init(rank, size, port)
    replica, cp_rank, ps = _dp_cp_groups(rank)
    dp_config = MisConfig(use_tis=True, tis_batch_normalize=True, tis_batch_normalize_scope="dp")

    def call(args=None, **changes):
        full, pg_loss = make_full_batch(seed=20 + replica, num_seqs=6)
        kwargs, local_pg, _ = shard(full, pg_loss, cp_rank, 2, "thd")
        kwargs.update(changes)
        return compute_mis_weights_with_cp(args or _args(dp_config), pg_loss=kwargs.pop("pg_loss", local_pg),
                                           parallel_state=ps, **kwargs)

    def input_error():  # replica 1, cp rank 0 has a bad shard: its CP peer, then the other replica, raise
        return call(pg_loss=torch.zeros(1, 1)) if rank == 2 else call()

    def config_typo():  # replica 1 cannot build its config at all, but asked for the dp scope
        return call(args=_args(dp_config, tis_mdoe="clip") if replica == 1 else None)

    def configs_differ():
        return call(args=_args(MisConfig(use_tis=True, tis_batch_normalize=True, tis_batch_normalize_scope="dp",
                                         tis_upper_bound=3.0 if replica == 1 else 2.0)))

    def gate_over_dp():  # the gate's statistics combine both replicas' tokens: equal on all 4 ranks
        config = MisConfig(use_tis=True, rs_batch_gate={"k3": 10.0}, rs_batch_gate_scope="dp")
        _, _, metrics = call(args=_args(config))
        replicas = [make_full_batch(seed=20 + r, num_seqs=6)[0] for r in range(2)]
        ell = torch.cat([torch.cat(full["train_log_probs"]) - torch.cat(full["rollout_log_probs"])
                         for full in replicas]).double()
        valid = torch.cat([torch.cat(full["loss_masks"]) for full in replicas]) != 0
        expected = float((ell.exp() - ell - 1)[valid].mean())
        got = float(metrics["mis_batch_k3"][0]) if metrics["mis_batch_k3"].numel() else expected
        assert abs(got - expected) < 1e-6 * max(1.0, expected), (got, expected)

    # the adaptive bound with tis_auto_scope: dp is the only DP exchange (token level: before the table)
    auto_token = MisConfig(use_tis=True, tis_upper_bound="auto", tis_auto_scope="dp", tis_auto_bounds=[1.0, 2.0],
                           tis_auto_target_ess=0.99)
    auto_sequence = MisConfig(use_tis=True, tis_level="sequence", tis_upper_bound="auto", tis_auto_scope="dp",
                              tis_auto_target_ess=0.85)

    def auto_bound_over_dp():  # the bound both replicas pick = the bound of their micro-batches joined, at cp 1
        for config in (auto_token, auto_sequence):
            _, _, metrics = call(args=_args(config))
            replicas = [make_full_batch(seed=20 + r, num_seqs=6)[0] for r in range(2)]
            joined = {key: replicas[0][key] + replicas[1][key] for key in ("train_log_probs", "rollout_log_probs",
                                                                           "loss_masks")}
            local = MisConfig.from_dict(dict(config.to_dict(), tis_auto_scope="micro_batch"))
            _, _, expected = compute_mis_weights(local, **joined)
            want = next(m for m in expected["mis_tis_upper_bound_effective"] if m.numel())[0].item()
            got = metrics["mis_tis_upper_bound_effective"]
            assert bool((got == want).all()), (config.tis_level, got, want)
            assert local.tis_auto_bounds[0] < want < local.tis_auto_bounds[1], want  # the bound moved
            alone = [compute_mis_weights(local, **{key: full[key] for key in joined})[2]
                     ["mis_tis_upper_bound_effective"][0][0].item() for full in replicas]
            assert alone[0] != alone[1], alone  # so the scope matters: each replica alone picks another bound

    def auto_input_error():
        return call(args=_args(auto_token), pg_loss=torch.zeros(1, 1)) if rank == 2 else call(args=_args(auto_token))

    def auto_config_typo():  # replica 1 cannot build its config; its raw attributes ask for the dp bound
        return call(args=_args(auto_token, tis_mdoe="clip") if replica == 1 else _args(auto_token))

    def auto_lengths_after_histogram():
        # replica 1's CP ranks disagree on a length, found in the table exchange, after the DP histogram
        # exchange: replica 1 raises together; replica 0 waits in no DP exchange and finishes
        full, pg_loss = make_full_batch(seed=20 + replica, num_seqs=6)
        if replica == 1:
            full["total_lengths"][full["response_lengths"].index(0)] += cp_rank
        kwargs, local_pg, _ = shard(full, pg_loss, cp_rank, 2, "thd")
        return compute_mis_weights_with_cp(_args(auto_token), pg_loss=local_pg, parallel_state=ps, **kwargs)

    for name, case in (("dp_input_error", input_error), ("dp_config_typo", config_typo),
                       ("dp_configs_differ", configs_differ), ("dp_gate_scope", gate_over_dp),
                       ("dp_auto_bound", auto_bound_over_dp), ("dp_auto_input_error", auto_input_error),
                       ("dp_auto_config_typo", auto_config_typo),
                       ("dp_auto_lengths_after_histogram", auto_lengths_after_histogram),
                       ("dp_healthy_after", lambda: call())):
        _record(out_dir, rank, name, case)
    dist.barrier()
    dist.destroy_process_group()


DP_EXPECTED = {
    "dp_input_error": {2: r"^pg_loss has shape \(1, 1\)", 3: r"^cp rank 0: pg_loss has shape \(1, 1\)",
                       0: r"^dp rank 1: pg_loss has shape \(1, 1\)",
                       1: r"^dp rank 1: cp rank 0: pg_loss has shape \(1, 1\)"},
    "dp_config_typo": {2: r"^args: unknown attribute 'tis_mdoe'", 3: r"^args: unknown attribute 'tis_mdoe'",
                       0: r"^dp rank 1: args: unknown attribute 'tis_mdoe'",
                       1: r"^dp rank 1: args: unknown attribute 'tis_mdoe'"},
    "dp_configs_differ": {r: r"^dp ranks disagree on the effective config: .*tis_upper_bound: dp rank 0 has 2.0, "
                             r"dp rank 1 has 3.0" for r in range(4)},
}
DP_EXPECTED["dp_auto_input_error"] = DP_EXPECTED["dp_input_error"]
DP_EXPECTED["dp_auto_config_typo"] = DP_EXPECTED["dp_config_typo"]
DP_EXPECTED["dp_auto_lengths_after_histogram"] = {
    r: r"^sequence \d: context-parallel ranks disagree on its lengths" for r in (2, 3)}


# --------------------------------------------------------------------------- harness
def _init(rank, size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a short backstop timeout: if anything did hang, gloo itself would end it well before the test's
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=90))


def _record(out_dir, rank, name, fn):
    started = time.monotonic()
    try:
        fn()
        kind, message = "ok", ""
    except BaseException as error:  # noqa: BLE001 (recorded and asserted in the parent)
        kind, message = type(error).__name__, str(error)
        if not isinstance(error, (ValueError, RuntimeError)):
            message += "\n" + traceback.format_exc()
    line = {"case": name, "rank": rank, "type": kind, "message": message,
            "seconds": time.monotonic() - started}
    with open(os.path.join(out_dir, f"rank_{rank}.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def run_matrix(worker, size, out_dir) -> dict[tuple[str, int], dict]:
    """Spawn ``size`` workers; a watchdog kills them if the results stop coming for CASE_TIMEOUT seconds."""
    port = free_port()
    context = mp.start_processes(worker, args=(size, port, str(out_dir)), nprocs=size, join=False,
                                 start_method="spawn")
    results: dict[tuple[str, int], dict] = {}
    last_progress, seen = time.monotonic(), 0
    while any(p.is_alive() for p in context.processes):
        time.sleep(0.1)
        results = _read(out_dir)
        if len(results) != seen:
            seen, last_progress = len(results), time.monotonic()
        elif time.monotonic() - last_progress > CASE_TIMEOUT:
            for process in context.processes:
                process.kill()
            done = {(case, rank) for case, rank in results}
            raise AssertionError(f"watchdog: no case finished for {CASE_TIMEOUT} s (a hang); results so far: "
                                 f"{sorted(done)}")
    return _read(out_dir), [p.exitcode for p in context.processes]


def _read(out_dir) -> dict[tuple[str, int], dict]:
    results = {}
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as lines:
            for line in lines:
                if line.endswith("\n"):
                    row = json.loads(line)
                    results[(row["case"], row["rank"])] = row
    return results


def assert_raised(results, case, rank, pattern):
    row = results.get((case, rank))
    assert row is not None, f"{case}: rank {rank} recorded nothing (hung or died)"
    assert row["type"] != "ok", f"{case}: rank {rank} did not raise"
    assert re.search(pattern, row["message"]), f"{case}: rank {rank} raised {row['type']}: {row['message']!r}"
    assert row["seconds"] < FAST, f"{case}: rank {rank} took {row['seconds']:.1f} s"


@pytest.mark.parametrize("size", [2, 3])
def test_cp_fault_matrix_every_rank_raises(size, tmp_path):
    results, exit_codes = run_matrix(cp_matrix_worker, size, tmp_path)
    assert exit_codes == [0] * size, exit_codes
    for case, (_, expected) in CP_MATRIX.items():
        for rank in range(size):
            if expected is None:
                row = results[(case, rank)]
                assert row["type"] == "ok", f"{case}: rank {rank}: {row['message']}"
            else:
                assert_raised(results, case, rank, expected(rank, size))


@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_that_exits_makes_every_other_rank_raise(size, tmp_path):
    results, exit_codes = run_matrix(exit_worker, size, tmp_path)
    for rank in range(size):
        if rank != 1:
            assert_raised(results, "rank_exits", rank,
                          rf"^the cp exchange failed on cp rank {rank} of {size} \(a peer process exited")
            assert results[("rank_exits", rank)]["type"] == "CollectiveError"
    assert exit_codes[1] == 17 and all(code == 0 for r, code in enumerate(exit_codes) if r != 1), exit_codes


def test_dp_cp_fault_matrix_every_rank_raises(tmp_path):
    results, exit_codes = run_matrix(dp_matrix_worker, 4, tmp_path)
    assert exit_codes == [0] * 4, exit_codes
    for case, per_rank in DP_EXPECTED.items():
        for rank, pattern in per_rank.items():
            assert_raised(results, case, rank, pattern)
    for rank in range(4):
        for case in ("dp_gate_scope", "dp_auto_bound", "dp_healthy_after") + (
                ("dp_auto_lengths_after_histogram",) if rank < 2 else ()):
            assert results[(case, rank)]["type"] == "ok", results[(case, rank)]


def test_header_is_fixed_size_and_round_trips():
    from miles_mis.parallel import distributed
    from miles_mis.plugin import InputError

    blob = distributed.encode_header(error=InputError("sequence 4: bad" + "é" * 400, 4), batch_size=7, table_schema=12,
                                     config_text="use_tis=True\ntis_mode='mask'", payload=[1.5, 2.0])
    assert len(blob) == HEADER_BYTES
    header = distributed.decode_header(blob)
    assert header.error and header.error_sequence == 4 and (header.batch_size, header.table_schema) == (7, 12)
    assert (header.payload == (1.5, 2.0) + (0.0,) * (distributed.PAYLOAD_SLOTS - 2)
            and header.config_text == "use_tis=True\ntis_mode='mask'")
    assert header.message.startswith("sequence 4: badéé") and header.message.endswith("é...")
    assert len(header.message.encode()) <= distributed.MESSAGE_BYTES
    assert header.fingerprint == distributed.config_fingerprint("use_tis=True\ntis_mode='mask'")
