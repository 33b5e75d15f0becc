"""The mismatch lab: short real runs per algorithm, the engine's mismatch, demo files, resume, torchrun cp=2."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from cp_harness import free_port

from miles_mis.lab import task
from miles_mis.lab.demo import (ALGORITHMS, DEFAULT_SETTING, DEFAULT_STEPS, DEMO_ALGORITHMS, centred_mean,
                                figure_panels, markdown_table, per_period_mean, run_algorithm, summarize,
                                sync_period)
from miles_mis.lab.engine import RolloutEngine, quantize_int8
from miles_mis.lab.model import ModelConfig, TinyGPT, sequence_log_probs
from miles_mis.lab.policy import group_advantages
from miles_mis.lab.run_output import Progress
from miles_mis.lab.train import parse_args, train
from miles_mis.lab.train import main as train_main


def read(path):
    return [json.loads(line) for line in open(path)]


def lab(tmp_path, *flags, steps=3, name="run"):
    argv = [*flags, "--steps", str(steps), "--out-dir", str(tmp_path / name), "--quiet", "--prompts-per-step", "4",
            "--sft-steps", "10"]
    return train(parse_args(argv))


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_short_run_per_algorithm_is_finite(tmp_path, name):
    history = run_algorithm(name, ["--rollout-dtype", "bf16"], seed=0, steps=3, out_dir=tmp_path / name,
                            extra=["--prompts-per-step", "4", "--sft-steps", "10"])
    assert len(history) == 3 and len(read(tmp_path / name / "metrics.jsonl")) == 3
    for row in history:
        assert all(v == v and abs(v) != float("inf") for v in row.values())
        assert 0.0 <= row["reward"] <= 1.0 and "mis_kl" in row and "loss" in row


def test_same_dtype_fresh_weights_has_no_mismatch_and_bf16_or_staleness_does(tmp_path):
    plugin = ["--get-mismatch-metrics", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"]
    exact = lab(tmp_path, *plugin, "--rollout-dtype", "fp32", name="fp32")
    assert all(abs(r["mis_kl"]) < 1e-6 and r["mis_k3_kl"] < 1e-9 for r in exact)
    bf16 = lab(tmp_path, *plugin, "--rollout-dtype", "bf16", name="bf16")
    assert all(r["mis_k3_kl"] > 1e-7 for r in bf16)
    assert all(r["train_rollout_logprob_abs_diff"] > 100 * e["train_rollout_logprob_abs_diff"]
               for r, e in zip(bf16, exact))
    stale = lab(tmp_path, *plugin, "--rollout-dtype", "fp32", "--rollout-staleness", "3", "--lr", "1e-2",
                steps=3, name="stale")
    assert abs(stale[0]["mis_kl"]) < 1e-6  # synced at step 1
    assert stale[1]["mis_kl"] > 1e-4 and stale[2]["mis_kl"] > 1e-4  # the engine still has step-1 weights


def test_engine_fp32_matches_trainer_and_int8_differs():
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=16))
    prompts = task.make_prompts(16, 6, torch.Generator().manual_seed(0))
    for dtype, quant, low, high in (("fp32", "none", 0.0, 1e-5), ("fp32", "int8", 1e-4, 1.0)):
        engine = RolloutEngine(model, dtype, quant, seed=0)
        responses, rollout = engine.generate(prompts, 8)
        sequences = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        with torch.no_grad():
            train_lp = sequence_log_probs(model, sequences, [8] * 16, 1.0)
        gap = torch.cat([t - r for t, r in zip(train_lp, rollout)]).abs().max().item()
        assert low <= gap < high, (dtype, quant, gap)
    weight = torch.tensor([[0.5, -1.0, 0.25], [2.0, 0.0, -0.01]])
    quantized = quantize_int8(weight)
    assert quantized[0, 1] == -1.0 and quantized[1, 0] == 2.0
    assert (quantized - weight).abs().max() <= 2.0 / 127 / 2 + 1e-7


def test_task_reward_and_group_advantages():
    prompt = torch.tensor([task.BOS, 3, 1, 2, task.SEP])
    assert task.target(prompt).tolist() == [1, 2, 3, task.EOS]
    assert task.reward(prompt, torch.tensor([1, 2, 3, task.EOS])) == 1.0
    assert task.reward(prompt, torch.tensor([1, 2, task.EOS])) == 0.5  # 2 right of max(4, 3)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert advantages[0] > 0 > advantages[1] and advantages[2:].abs().max() < 1e-5


def test_demo_writes_its_files(tmp_path, repo_root):
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "demo", "--steps", "2", "--out-dir",
                          str(tmp_path / "demo")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    demo = tmp_path / "demo"
    for name in DEMO_ALGORITHMS:
        assert len(read(demo / name / "metrics.jsonl")) == 2
        for file in ("mis.yaml", "command.txt", "checkpoint.pt"):
            assert (demo / name / file).exists(), (name, file)
        assert (demo / name / "command.txt").read_text().startswith("miles-mis train ")
        # per-algorithm progress on stderr (a pipe, not a terminal: plain lines, at the first step and the last)
        lines = [line for line in out.stderr.splitlines() if line.startswith(name + " ")]
        assert [line.split()[2] for line in lines] == ["1/2", "2/2"], out.stderr
        assert all(" reward " in line and " k3 " in line for line in lines)
    assert "\r" not in out.stderr and "Traceback" not in out.stderr
    summary = (demo / "summary.md").read_text()
    assert "One seed is an anecdote" in summary and "Rollout engine: embedded" in summary
    link = summary.split("[docs/lab.md](")[1].split(")")[0]
    assert (demo / link).resolve() == (repo_root / "docs" / "lab.md").resolve()
    header = next(line for line in summary.splitlines() if line.startswith("| algorithm |"))
    assert "| exact match (mean of last 2 steps) |" in header and "| reward (mean of last 2 steps) |" in header
    assert "second" not in header  # wall-clock time is machine-dependent: left out
    for name in DEMO_ALGORITHMS:
        assert f"| {name} |" in summary and f"| {name} |" in out.stdout
    for file in ("metrics.jsonl", "mis.yaml", "command.txt", "checkpoint.pt", "summary.md"):
        assert file in summary and file in out.stdout
    assert "one seed is an anecdote" in out.stdout
    pytest.importorskip("matplotlib")
    assert (demo / "demo.png").stat().st_size > 10_000 and "demo.png" in summary


def test_summary_names_the_window_and_leaves_out_wall_clock():
    history = [{"step": i + 1, "reward": i / 20, "exact_match": (i % 2) / 2, "raw_kl": 0.1, "raw_k3": 0.05,
                "raw_ess": 1 - i / 100, "grad_norm": 1.0, "seconds": 3.0} for i in range(12)]
    row = summarize(history)
    assert row["reward (mean of last 10 steps)"] == pytest.approx(sum(range(2, 12)) / 20 / 10)
    assert row["exact match (mean of last 10 steps)"] == pytest.approx(0.25)
    assert row["min raw ESS"] == pytest.approx(0.89) and row["mean raw k3"] == pytest.approx(0.05)
    assert not any("second" in column for column in row)
    assert "| exact match (mean of last 10 steps) |" in markdown_table({"standard": row})


def test_progress_redraws_a_bar_on_a_terminal_and_prints_lines_elsewhere():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    row = {"reward": 0.5, "raw_k3": 2.5e-3, "grad_norm": 0.3, "seconds": 2.0}
    bar = Progress(label="bypass", stream=Terminal())
    for step in range(1, 4):
        bar(step, 3, row)
    text = bar.stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1  # every step, one line at the end
    assert "\rbypass [" in text and "3/3 reward 0.500 k3 2.5e-03 grad 0.30" in text
    assert "1/3 reward 0.500 k3 2.5e-03 grad 0.30 eta 4s" in text  # 2 s per step so far, 2 steps to go
    bar.close()
    assert text == bar.stream.getvalue()  # the bar ended its line already
    log = Progress(label="seq_mis", stream=io.StringIO(), every=10)
    for step in range(1, 26):
        log(step, 25, dict(row, routing_mismatch=0.125))
    lines = log.stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert lines[-1] == "seq_mis step 25/25 reward 0.500 k3 2.5e-03 routing 0.125 grad 0.30"


def test_train_ends_with_a_line_naming_its_files(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--steps", "2", "--out-dir", str(out), "--prompts-per-step", "4", "--sft-steps", "2",
            "--dump-details", str(tmp_path / "dump")]
    assert train_main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in err[:-1]] == ["1/2", "2/2"] and all(" k3 " in line for line in err[:-1])
    assert err[-1] == (f"wrote {out / 'metrics.jsonl'} (2 steps), {out / 'checkpoint.pt'}, 4 policy-loss dump(s) in "
                       f"{tmp_path / 'dump' / 'policy_loss_debug'}")
    # --quiet: the closing line only; a checkpoint an earlier run left in the directory is not claimed
    earlier = (out / "checkpoint.pt").stat().st_mtime - 100
    os.utime(out / "checkpoint.pt", (earlier, earlier))
    assert train_main(["--steps", "1", "--out-dir", str(out), "--prompts-per-step", "4", "--sft-steps", "2",
                       "--save-interval", "0", "--quiet"]) == 0
    assert capsys.readouterr().err == f"wrote {out / 'metrics.jsonl'} (1 step)\n"


def test_measure_on_the_tiny_model_equals_the_mismatch_of_its_batches(tmp_path, capsys):
    """`miles-mis measure` with the embedded engine: its k3 is raw_mismatch's over the batches it generated (the
    same engine, prompts and seeds, regenerated here), and its location metrics are the plugin's."""
    from miles_mis import MisConfig, compute_mis_weights
    from miles_mis.cli import main
    from miles_mis.lab.policy import make_policy
    from miles_mis.lab.rollout_collection import raw_mismatch

    flags = ["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8", "--prompts-per-step", "4", "--sft-steps",
             "5"]
    assert main(["measure", *flags, "--batches", "2", "--json", str(tmp_path / "row.json")]) == 0
    row = json.loads((tmp_path / "row.json").read_text())
    args = parse_args(flags)
    policy = make_policy(args)
    engine = policy.make_engine()
    generator = torch.Generator().manual_seed(args.seed + 2)
    old, rollout = [], []
    for _ in range(2):
        prompts = policy.sample_prompts(generator)
        responses, log_probs = engine.generate(prompts.tokens, policy.max_new_tokens)
        sequences = [torch.cat([p, r]) for p, r in zip(prompts.tokens, responses)]
        old += policy.old_log_probs(sequences, prompts.lengths)[0]
        rollout += log_probs
    assert row["k3"] == pytest.approx(raw_mismatch(old, rollout)["raw_k3"], rel=1e-12) and row["k3"] > 1e-5
    _, _, metrics = compute_mis_weights(MisConfig.preset("metrics_only"), train_log_probs=old,
                                        rollout_log_probs=rollout, loss_masks=[torch.ones(t.numel()) for t in old])
    assert row["mis_k3_first_token"] == pytest.approx(float(metrics["mis_k3_first_token"][0][0]))
    assert row["sequences"] == 64 and row["setting"] == "bf16 + fp8 weights" and row["model"] == "tiny"
    out = capsys.readouterr()
    assert "tiny on embedded, bf16 + fp8 weights" in out.out and "measure 2/2" in out.err
    # the analyzer's answer to "does this mismatch need a correction?", on its k3, wrapped under the table
    from miles_mis.analyze import safe_level

    answer = out.out.split("  does this mismatch need a correction?\n", 1)[1]
    assert " ".join(answer.split()) == " ".join(safe_level.sentence(row["k3"], safe_level.load()).split())


def test_measure_help_lists_only_the_flags_that_act(capsys):
    from miles_mis.lab.measure import build_parser

    text = build_parser().format_help()
    for acting in ("--rollout-top-p", "--sampling-mask", "--batches", "--model", "--rollout-dtype", "--seed"):
        assert acting in text, acting
    for inert in ("--steps", "--lr", "--use-tis", "--eps-clip", "--resume", "--wandb-project", "--rollout-staleness"):
        assert f"{inert} " not in text and f"{inert}\n" not in text, inert
    # still accepted, so a train command line measures as it is
    from miles_mis.lab.train import parse_args

    assert parse_args(["--steps", "5", "--use-tis"], build_parser()).steps == 5


def test_measure_refuses_zero_batches():
    from miles_mis.lab.measure import main

    with pytest.raises(ValueError, match="--batches must be >= 1"):
        main(["--batches", "0"])


def test_figure_smoothing_and_panels():
    assert sync_period(DEFAULT_SETTING) == 1 and sync_period([]) == 1 and sync_period(["--rollout-staleness=3"]) == 3
    assert sync_period(["--rollout-dtype", "bf16", "--rollout-staleness", "4", "--lr", "3e-3"]) == 4
    xs, ys = per_period_mean([1, 2, 3, 4, 5, 6, 7], [0.0, 1.0, 2.0, 3.0, 0.0, 2.0, 4.0], 4)
    assert xs == [2.5, 6.0] and ys == [1.5, 2.0]  # the last, partial period: steps 5-7
    assert centred_mean([0.0, 3.0, 6.0, 9.0], 3) == [1.5, 3.0, 6.0, 7.5]
    for period, stated in ((4, "mean per sync period (engine synced every 4 steps)"),
                           (1, "centred 5-step mean (engine synced every step)")):
        panels = figure_panels(period)
        assert [key for key, _, _ in panels] == ["reward", "raw_k3", "raw_ess", "grad_norm"]
        assert all(ylabel for _, _, ylabel in panels)
        for _, title, _ in panels[1:3]:
            assert "π_old (trainer recompute) vs π_rollout (engine)" in title and stated in title


def test_demo_help_shows_defaults():
    from miles_mis.lab.train import build_parser

    text = " ".join(subprocess.run([sys.executable, "-m", "miles_mis.cli", "demo", "--help"], capture_output=True,
                                   text=True, timeout=120).stdout.split())
    for part in ["(default: runs/demo)", f"(default: {DEFAULT_STEPS})", "(default: 0)", "(default: embedded)",
                 f"(default: {' '.join(DEFAULT_SETTING)})"]:
        assert part in text, part
    parser = build_parser()  # every train flag shows its default
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "%(default)" in formatter._get_help_string(action), action.option_strings


def test_resume_continues_exactly(tmp_path):
    flags = ["--use-tis", "--rollout-dtype", "bf16", "--save-interval", "2"]
    straight = lab(tmp_path, *flags, steps=4, name="straight")
    lab(tmp_path, *flags, steps=2, name="resumed")
    resumed = lab(tmp_path, *flags, "--resume", steps=4, name="resumed")
    assert len(resumed) == 4 and len(read(tmp_path / "resumed" / "metrics.jsonl")) == 4
    for a, b in zip(straight, resumed):
        for key in ("reward", "loss", "raw_kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


class _Payload:
    """Unpickling this writes a marker file: what a planted checkpoint would do with weights_only=False."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_refuses_a_checkpoint_that_needs_pickle(tmp_path):
    out = tmp_path / "planted"
    out.mkdir()
    marker = tmp_path / "payload_ran"
    torch.save({"model": _Payload(marker), "step": 1}, out / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"--resume .*checkpoint\.pt: .*weights_only=True"):
        lab(tmp_path, "--resume", steps=2, name="planted")
    assert not marker.exists()


def test_resume_names_a_checkpoint_of_the_wrong_shape(tmp_path):
    out = tmp_path / "wrong"
    out.mkdir()
    torch.save({"model": {}, "step": 1}, out / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"--resume .*checkpoint\.pt: not a checkpoint of this lab run"):
        lab(tmp_path, "--resume", steps=2, name="wrong")


def test_torchrun_cp2_equals_cp1(tmp_path):
    # fp32: a bf16 engine would amplify summation-order differences at each sync
    flags = ["--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp",
             "--rollout-dtype", "fp32", "--rollout-staleness", "2", "--steps", "3", "--quiet",
             "--prompts-per-step", "4", "--sft-steps", "10"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as torchrun sets it: same kernels, same rounding
    one = subprocess.run([sys.executable, "-m", "miles_mis.lab", "train", *flags, "--out-dir", str(tmp_path / "cp1")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    single = read(tmp_path / "cp1" / "metrics.jsonl")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "miles_mis.lab", "train", *flags,
                          "--context-parallel-size", "2", "--out-dir", str(tmp_path / "cp2")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    sharded = read(tmp_path / "cp2" / "metrics.jsonl")
    assert len(sharded) == 3
    # the detector's sign statistics of l are compared only where l is more than rounding: on a step right after a
    # sync the fp32 engine equals the trainer up to ulps, whose signs differ between the two processes' trainers
    signs = ("mis_log_ratio_negative_fraction", "mis_log_ratio_standardized_mean")
    compared = 0
    for a, b in zip(single, sharded):
        for key in a:
            if key == "seconds" or (key in signs and a["raw_k3"] < 1e-10):
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
            compared += key in signs
    assert compared >= 2  # the stale steps, where l is the staleness itself, are compared


def _offline_logs(out_dir) -> list:
    """The transaction logs of the offline W&B runs under ``out_dir``, by folder name (start second, then id)."""
    return sorted((out_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def test_wandb_offline_run_holds_what_metrics_jsonl_holds_and_the_config(tmp_path, monkeypatch):
    """Read back from the run's own transaction log (tests/wandb_reader.py): every logged key and value of every
    step equals metrics.jsonl's, the step axis is the RL step, the config holds the flags and the effective
    mis.yaml; offline, with an unreachable server set, so nothing could have been sent anywhere."""
    pytest.importorskip("wandb")
    import wandb_reader

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: any request would fail
    config = tmp_path / "mis.yaml"
    config.write_text("tis_upper_bound: 1.5\nrs_divergence: {token_atv: 0.3}\n")
    plugin = ["--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp",
              "--custom-config-path", str(config)]
    lab(tmp_path, *plugin, "--wandb-project", "miles-mis-test", steps=2, name="wb")
    out_dir = tmp_path / "wb"
    [log] = _offline_logs(out_dir)
    assert not list((out_dir / "wandb").glob("run-*"))  # offline: no online run folder was made
    rows = read(out_dir / "metrics.jsonl")
    logged = wandb_reader.history(log)
    assert [r["_step"] for r in logged] == [1, 2] == [r["step"] for r in rows]
    for got, want in zip(logged, rows):
        assert set(got) - {"_step"} == set(want)
        assert all(got[key] == pytest.approx(want[key], rel=1e-12) for key in want)
    assert "mis_rs_token_atv_masked_token_fraction" in rows[-1]
    run_config = wandb_reader.config(log)
    assert run_config["mis"]["tis_upper_bound"] == 1.5 and run_config["mis"]["rs_divergence"] == {"token_atv": 0.3}
    assert (run_config["use_tis"] is True and run_config["steps"] == 2
            and run_config["custom_config_path"] == str(config))
    assert (out_dir / "wandb_run_id").read_text().strip() == wandb_reader.run_id(log)


def test_wandb_log_is_complete_when_train_returns_even_if_the_service_is_late(tmp_path, monkeypatch):
    """wandb-core writes the offline log when it handles the run's ``inform_finish``, which ``finish()`` sends without
    waiting: here that message never arrives (the slowest possible service), and the log must still hold every
    step when train() returns (it waits for the service to close the stream)."""
    pytest.importorskip("wandb")
    import wandb_reader
    from wandb.sdk.lib.service import service_connection

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(service_connection.ServiceConnection, "inform_finish", lambda self, run_id: None)
    lab(tmp_path, "--wandb-project", "miles-mis-test", steps=2, name="late")
    [log] = _offline_logs(tmp_path / "late")
    assert wandb_reader.run_id(log) == (tmp_path / "late" / "wandb_run_id").read_text().strip()
    assert [r["_step"] for r in wandb_reader.history(log)] == [1, 2]


def test_wandb_resume_continues_the_same_run(tmp_path, monkeypatch):
    """--resume logs the remaining steps to the run of the same id (a new offline folder; `wandb sync` joins them)."""
    pytest.importorskip("wandb")
    import wandb_reader

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lab(tmp_path, "--wandb-project", "miles-mis-test", "--save-interval", "1", steps=2, name="wb")
    lab(tmp_path, "--wandb-project", "miles-mis-test", "--resume", steps=3, name="wb")
    logs = _offline_logs(tmp_path / "wb")  # (folder names hold the start second: runs of ~1 s can tie, so no order)
    assert len(logs) == 2 and len({wandb_reader.run_id(log) for log in logs}) == 1
    first_id = wandb_reader.run_id(logs[0])
    histories = sorted(([r["_step"] for r in wandb_reader.history(log)], log) for log in logs)
    assert [steps for steps, _ in histories] == [[1, 2], [3]]
    assert wandb_reader.history(histories[1][1])[0]["reward"] == pytest.approx(
        read(tmp_path / "wb" / "metrics.jsonl")[2]["reward"])
    lab(tmp_path, "--wandb-project", "miles-mis-test", steps=1, name="wb")  # not --resume: a new run
    new_id = (tmp_path / "wb" / "wandb_run_id").read_text().strip()
    assert new_id != first_id
    [fresh] = [log for log in _offline_logs(tmp_path / "wb") if wandb_reader.run_id(log) == new_id]
    assert [r["_step"] for r in wandb_reader.history(fresh)] == [1]


# ---------------------------------------------------------------- the batch gate and location metrics from the lab's
# flags
PLUGIN_FLAGS = ["--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"]


def test_mis_set_batch_gate_gates_every_micro_batch_and_leaves_the_weights(tmp_path):
    # k3 of a bf16 engine is ~1e-5 per token: a 1e-9 gate fires on every micro-batch, so no RL step moves the model
    history = lab(tmp_path, *PLUGIN_FLAGS, "--mis-set", "rs_batch_gate={k3: 1e-9}", "--save-interval", "1",
                  "--rollout-dtype", "bf16", steps=2, name="gated")
    assert len(history) == 2
    for row in history:
        assert row["mis_batch_gated"] == 1.0  # per micro-batch: 1 on every sequence, averaged over both minibatches
        assert row["grad_norm"] == 0.0 and row["loss"] == 0.0
        assert row["mis_batch_k3"] > 1e-9  # the statistic that fired, reported every call
    # the checkpoint after 2 RL steps holds exactly the warm-started model (seed 0, 10 SFT steps, as train() builds it)
    from miles_mis.lab.tiny_policy import warm_start

    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=2 * 6 + 4))
    warm_start(model, 10, 6, 0)
    saved = torch.load(tmp_path / "gated" / "checkpoint.pt", weights_only=True)["model"]
    assert saved.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name
    # with a threshold the batch stays below, the same run trains
    ungated = lab(tmp_path, *PLUGIN_FLAGS, "--mis-set", "rs_batch_gate={k3: 1.0}", "--rollout-dtype", "bf16", steps=1,
                  name="ungated")
    assert ungated[0]["grad_norm"] > 0 and ungated[0]["mis_batch_gated"] == 0.0


def test_packed_entry_point_in_the_lab_equals_the_list_entry_point(tmp_path, repo_root):
    flags = ["--use-tis", "--custom-config-path", str(repo_root / "configs" / "seq_mis.yaml"),
             "--rollout-dtype", "bf16", "--rollout-logit-noise", "0.3"]  # noise: sequences leave [0.5, 2], rejected
    runs = [lab(tmp_path, *flags, "--custom-tis-function-path", f"miles_mis.{name}", steps=2, name=name)
            for name in ("compute_mis_weights_with_cp", "compute_mis_weights_packed")]
    listed, packed = runs
    assert any(row["mis_tis_mask_fraction_low"] + row["mis_tis_mask_fraction_high"] > 0 for row in listed)
    for a, b in zip(listed, packed):
        assert a.keys() == b.keys() and "mis_kl" in a
        for key in a:
            if key != "seconds":
                assert a[key] == b[key], (a["step"], key)


def test_mis_set_adaptive_upper_bound_reports_the_bound_it_used(tmp_path):
    history = lab(tmp_path, *PLUGIN_FLAGS, "--mis-set", "tis_upper_bound=auto", "--mis-set",
                  "tis_auto_bounds=[1.5, 8]", "--rollout-dtype", "bf16", steps=2, name="auto")
    for row in history:
        assert 1.5 <= row["mis_tis_upper_bound_effective"] <= 8.0


def test_torchrun_cp2_with_mis_set_equals_cp1(tmp_path):
    # the --mis-set keys reach every rank: the gate's decision and the low-probability metric are CP-exact
    flags = [*PLUGIN_FLAGS, "--mis-set", "rs_batch_gate={k3: 1e-9}", "--mis-set", "metrics_low_prob_threshold=0.3",
             "--rollout-dtype", "fp32", "--rollout-logit-noise", "0.2", "--steps", "2", "--quiet",
             "--prompts-per-step", "4", "--sft-steps", "10"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "miles_mis.lab", "train", *flags, "--out-dir", str(tmp_path / "cp1")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "miles_mis.lab", "train", *flags,
                          "--context-parallel-size", "2", "--out-dir", str(tmp_path / "cp2")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    single, sharded = read(tmp_path / "cp1" / "metrics.jsonl"), read(tmp_path / "cp2" / "metrics.jsonl")
    assert len(sharded) == 2
    for a, b in zip(single, sharded):
        # (the host's metrics under CP are per-rank partial means, summed: 1 up to float32 rounding)
        assert a["mis_batch_gated"] == 1.0 and b["mis_batch_gated"] == pytest.approx(1.0, abs=1e-6)
        assert a["grad_norm"] == b["grad_norm"] == 0.0
        assert a["mis_low_rollout_prob_token_fraction"] > 0
        for key in a:
            if key != "seconds":
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
