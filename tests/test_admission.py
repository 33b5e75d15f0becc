"""`miles-mis admit`: the model-admission check (prime-rl's rule: every step's token-mean k3 below 0.015), its
drift and verdict, from dumps of every format the analyzer reads and on the lab's tiny model."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from test_stack_readers import mixed_sequences, write_miles, write_nemo, write_prime_rl

from miles_mis.analyze.admission import StepMismatch, admit, drift, step_mismatch
from miles_mis.analyze.admit_command import NOT_ADMITTED, check_dumps, render
from miles_mis.analyze.reading import CallBatch
from miles_mis.cli import main


def batch_of(sequences):
    """A CallBatch of (old, rollout, mask) triples."""
    n = len(sequences)
    return CallBatch(calls=[0] * n, indices=list(range(n)), response_lengths=[s[0].numel() for s in sequences],
                     old_log_probs=[s[0] for s in sequences], rollout_log_probs=[s[1] for s in sequences],
                     loss_masks=[s[2] for s in sequences], advantages=[None] * n,
                     positions=[torch.arange(s[0].numel()) for s in sequences], lags=[None] * n)


def k3(ell):
    return math.exp(ell) - 1 - ell


# --------------------------------------------------------------------------- one step, by hand

def test_step_k3_is_the_token_mean_pooled_over_calls_and_the_sequence_mean_beside_it():
    # call 1: one sequence, ℓ = (0.1, −0.2) on kept tokens and a masked token; call 2: one token, ℓ = 0.3
    first = (torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.1, -1.8, -9.0]), torch.tensor([1.0, 1.0, 0.0]))
    second = (torch.tensor([-0.7]), torch.tensor([-1.0]), torch.tensor([1.0]))
    step = step_mismatch(4, [batch_of([first]), batch_of([second])])
    ells = [0.1, -0.2, 0.3]
    assert step.step == 4 and step.sequences == 2 and step.tokens == 3 and step.nonfinite_tokens == 0
    assert step.k3 == pytest.approx(sum(map(k3, ells)) / 3, rel=1e-6)
    assert step.k3_sequence_mean == pytest.approx(((k3(0.1) + k3(-0.2)) / 2 + k3(0.3)) / 2, rel=1e-6)
    assert step.kl == pytest.approx(-(0.1 - 0.2 + 0.3) / 3, rel=1e-5)
    assert step.max_abs_log_ratio == pytest.approx(0.3, rel=1e-5)


def test_nonfinite_tokens_are_counted_and_left_out_of_every_mean():
    seq = (torch.tensor([-1.0, float("nan"), -0.5]), torch.tensor([-1.2, -1.0, float("-inf")]), torch.ones(3))
    step = step_mismatch(0, [batch_of([seq])])
    assert step.tokens == 1 and step.nonfinite_tokens == 2
    assert step.k3 == pytest.approx(k3(0.2), rel=1e-6)
    empty = step_mismatch(1, [batch_of([(torch.tensor([float("nan")]), torch.tensor([-1.0]), torch.ones(1))])])
    assert empty.k3 is None and empty.k3_sequence_mean is None and empty.kl is None


# --------------------------------------------------------------------------- drift and verdict

@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 0.05, allow_subnormal=False), min_size=3, max_size=30))
def test_drift_slope_and_interval_equal_scipys_regression(values):
    steps = [(3 * i + 1, value) for i, value in enumerate(values)]
    result = drift(steps)
    reference = stats.linregress([s for s, _ in steps], values)
    # scipy's standard error is 0/0 = NaN for a constant series; the residuals are all 0, so the interval is a point
    stderr = 0.0 if len(set(values)) == 1 else reference.stderr
    half = stats.t.ppf(0.975, len(values) - 2) * stderr
    assert result.slope == pytest.approx(reference.slope, rel=1e-9, abs=1e-15)
    assert result.slope_low == pytest.approx(reference.slope - half, rel=1e-7, abs=1e-12)
    assert result.slope_high == pytest.approx(reference.slope + half, rel=1e-7, abs=1e-12)
    assert result.growing == (reference.slope - half > 0)


def test_drift_quarters_and_too_few_steps():
    result = drift([(s, 0.001 * s) for s in range(1, 9)])  # exactly linear: a zero-width interval above 0
    assert result.growing and result.slope == pytest.approx(0.001)
    assert result.first_quarter_k3 == pytest.approx(0.0015) and result.last_quarter_k3 == pytest.approx(0.0075)
    assert drift([(0, 0.1), (1, 0.2)]) is None
    assert drift([(5, 0.1), (5, 0.2), (5, 0.3)]) is None


def _step(step, value):
    return StepMismatch(step, 1, 1 if value is not None else 0, 0, value, value, 0.0, 0.1)


def test_admitted_only_when_every_required_step_is_measured_finite_and_below():
    assert admit([_step(0, 0.01), _step(1, 0.0149)], required_steps=2).admitted
    assert not admit([_step(0, 0.01), _step(1, 0.0149)]).admitted  # 2 of prime-rl's 20
    refused = admit([_step(0, 0.01), _step(1, 0.015), _step(2, 0.2)], required_steps=3)
    assert not refused.admitted and refused.above == [1, 2]  # at the bar is not below it
    empty = admit([_step(0, 0.001), _step(1, None)], required_steps=2)
    assert not empty.admitted and empty.empty == [1] and empty.above == []
    broken = admit([_step(0, 0.001), StepMismatch(1, 1, 5, 1, 0.001, 0.001, 0.0, 0.1)], required_steps=2)
    assert not broken.admitted and broken.nonfinite == [1]
    assert admit([_step(0, 0.02)], threshold=0.05, required_steps=1).admitted


@pytest.mark.parametrize("threshold", [0, -1, math.inf, math.nan, "0.1", True])
def test_a_bad_threshold_is_one_line(threshold):
    with pytest.raises(ValueError, match="threshold must be a finite number > 0"):
        admit([_step(0, 0.01)], threshold)


# --------------------------------------------------------------------------- from each format's dumps

def _steps_of(per_step_noise, seed=0):
    return [mixed_sequences(seed + 10 * i, 4, noise) for i, noise in enumerate(per_step_noise)]


def test_each_format_gives_the_same_steps(tmp_path):
    steps = _steps_of([0.01, 0.05, 0.4, 0.02])
    write_miles(tmp_path / "miles", steps)
    write_nemo(tmp_path / "nemo", steps)
    write_prime_rl(tmp_path / "prime", {(i + 1, 0): [seqs[:2], seqs[2:]] for i, seqs in enumerate(steps)})
    miles = check_dumps(tmp_path / "miles")
    nemo = check_dumps(tmp_path / "nemo")
    prime = check_dumps(tmp_path / "prime")
    expected = [step_mismatch(i, [batch_of([(s["old"], s["rollout"], s["mask"]) for s in seqs])]).k3
                for i, seqs in enumerate(steps)]
    for report in (miles, nemo, prime):
        assert [s["k3"] for s in report["steps"]] == pytest.approx(expected, rel=1e-12)
    assert [s["step"] for s in nemo["steps"]] == [1, 2, 3, 4]  # NeMo RL numbers its files from 1
    assert [s["step"] for s in prime["steps"]] == [1, 2, 3, 4]
    assert [s["step"] for s in miles["steps"]] == [0, 1, 2, 3]
    assert not miles["admitted"] and miles["above"] == [2]


def test_calls_per_step_groups_a_miles_dump_and_is_refused_where_the_format_names_steps(tmp_path):
    steps = _steps_of([0.01, 0.02, 0.03, 0.04])
    write_miles(tmp_path / "miles", steps)
    grouped = check_dumps(tmp_path / "miles", calls_per_step=2)
    pairs = [steps[0] + steps[1], steps[2] + steps[3]]
    pooled = [step_mismatch(j, [batch_of([(s["old"], s["rollout"], s["mask"]) for s in pair])])
              for j, pair in enumerate(pairs)]
    assert [s["k3"] for s in grouped["steps"]] == pytest.approx([p.k3 for p in pooled], rel=1e-12)
    write_nemo(tmp_path / "nemo", steps)
    with pytest.raises(ValueError, match="--calls-per-step: a NeMo RL train data names each call's step"):
        check_dumps(tmp_path / "nemo", calls_per_step=2)
    with pytest.raises(ValueError, match="--calls-per-step must be an integer >= 1, got 0"):
        check_dumps(tmp_path / "miles", calls_per_step=0)


def test_the_cli_prints_the_verdict_writes_json_and_exits_by_it(tmp_path, capsys):
    write_miles(tmp_path / "low", _steps_of([0.005] * 20))
    assert main(["admit", str(tmp_path / "low"), "--json", str(tmp_path / "low.json")]) == 0
    out = capsys.readouterr().out
    assert "ADMITTED: all 20 steps below 0.015" in out
    assert "each call is taken as one step" in out and "Published new-model checks" in out
    report = json.loads((tmp_path / "low.json").read_text())
    assert report["admitted"] and len(report["steps"]) == 20 and report["format"]["name"].startswith("miles")
    write_miles(tmp_path / "high", _steps_of([0.005, 0.3, 0.005]))
    assert main(["admit", str(tmp_path / "high"), "--required-steps", "3"]) == NOT_ADMITTED
    assert "NOT ADMITTED: step 1 at or above 0.015." in capsys.readouterr().out


def test_fewer_steps_than_required_are_not_admitted(tmp_path, capsys):
    write_miles(tmp_path, _steps_of([0.005] * 5))
    assert main(["admit", str(tmp_path)]) == NOT_ADMITTED
    assert "NOT ADMITTED: only 5 of the 20 required steps were measured" in capsys.readouterr().out
    assert main(["admit", str(tmp_path), "--required-steps", "5"]) == 0


def test_nonfinite_log_probs_on_trained_tokens_are_not_admitted(tmp_path, capsys):
    steps = _steps_of([0.005] * 3)
    steps[1][0]["rollout"][2] = float("nan")
    write_miles(tmp_path, steps)
    assert main(["admit", str(tmp_path), "--required-steps", "3"]) == NOT_ADMITTED
    out = capsys.readouterr().out
    assert "NOT ADMITTED: step 1 with NaN/inf log-probs on trained tokens" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step"))
    assert header.split()[:4] == ["step", "seqs", "tokens", "non-finite"]  # the table's column


def test_miles_steps_follow_the_call_numbers_and_a_short_step_is_said(tmp_path):
    """Calls 0, 2, 3 (call 1 not dumped) with 2 calls a step: steps 0 (call 0 alone) and 1 (calls 2, 3)."""
    steps = _steps_of([0.01, 0.02, 0.03, 0.04])
    write_miles(tmp_path, steps)
    (tmp_path / "policy_loss_debug" / "rank_0_call_1.pt").unlink()
    report = check_dumps(tmp_path, calls_per_step=2)
    assert [s["step"] for s in report["steps"]] == [0, 1]
    assert report["steps"][0]["sequences"] == len(steps[0]) and report["steps"][1]["sequences"] == 8
    assert any("1 step(s) hold fewer than --calls-per-step 2 calls (step 0)" in w for w in report["warnings"])


def test_a_growing_mismatch_is_said_to_grow(tmp_path):
    report = check_dumps(write_miles(tmp_path, _steps_of([0.01, 0.02, 0.03, 0.04, 0.05, 0.06], seed=3)))
    assert report["drift"]["growing"]
    assert "the mismatch GROWS over the steps" in render(report)


def test_an_unknown_directory_is_one_line_from_the_cli(tmp_path, capsys):
    assert main(["admit", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no dump of a known format" in err and err.count("\n") == 1


# --------------------------------------------------------------------------- on the lab's model

def test_admit_on_the_tiny_model_judges_the_batches_measure_generates(tmp_path, capsys):
    """Learning rate 0: the batches are the initial weights' rollouts, as `measure` makes them; each step's k3 is
    the token mean of its batch, recomputed here from the dumps it wrote."""
    flags = ["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8", "--prompts-per-step", "4", "--sft-steps",
             "5", "--batches", "3", "--dump-details", str(tmp_path / "dumps")]
    status = main(["admit", *flags, "--json", str(tmp_path / "admit.json")])
    report = json.loads((tmp_path / "admit.json").read_text())
    assert status == NOT_ADMITTED and not report["admitted"]  # 3 of the 20 required steps
    assert len(report["steps"]) == 3 and "learning rate 0" in report["source"]
    again = check_dumps(tmp_path / "dumps")
    assert [s["k3"] for s in again["steps"]] == [s["k3"] for s in report["steps"]]
    assert all(s["k3"] > 0 for s in report["steps"])  # fp8 weights against a float32 trainer: a real mismatch
    assert "tiny on embedded, bf16 + fp8 weights" in capsys.readouterr().out


# --------------------------------------------------------------------------- the command line's two forms

def test_both_forms_have_help_with_defaults(capsys):
    for argv in (["admit", "--help"], ["admit", "somewhere", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "--threshold" in out and "0.015" in out and "--required-steps" in out
    main_help = capsys.readouterr()
    assert main_help.err == ""


@pytest.mark.parametrize("flags", [["--threshold", "0.02"], ["--router-replay"], ["--allow-partial"],
                                   ["--json", "out.json", "--router-replay"]])
def test_a_directory_after_a_flag_is_told_to_come_first(tmp_path, capsys, flags):
    """After a flag with a value or a flag without one (``--router-replay`` is the lab form's, ``--allow-partial``
    the dump form's), a directory is told to come first."""
    assert main(["admit", *flags, str(tmp_path)]) == 1
    assert f"error: {tmp_path}: put the dump directory first" in capsys.readouterr().err


def test_a_json_path_in_a_missing_folder_is_one_line_before_the_work(tmp_path, capsys):
    write_miles(tmp_path / "dump", _steps_of([0.005]))
    assert main(["admit", str(tmp_path / "dump"), "--json", str(tmp_path / "no" / "a.json")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: --json {tmp_path / 'no' / 'a.json'}: the folder {tmp_path / 'no'} does not exist\n"


def test_admit_on_a_nemo_rl_log_directory_and_an_empty_prime_rl_step(tmp_path, capsys):
    write_nemo(tmp_path / "nemo", _steps_of([0.005, 0.01]))
    assert main(["admit", str(tmp_path / "nemo" / "logs" / "exp_001"), "--required-steps", "2"]) == 0
    assert "(NeMo RL train data), 2 steps" in capsys.readouterr().out
    steps = _steps_of([0.005, 0.005])
    for seq in steps[1]:
        seq["mask"] = torch.zeros_like(seq["mask"])  # step 2 keeps no token: it must show, empty, not vanish
    write_prime_rl(tmp_path / "prime", {(1, 0): [steps[0]], (2, 0): [steps[1]]})
    report = check_dumps(tmp_path / "prime", required_steps=2)
    assert [s["step"] for s in report["steps"]] == [1, 2] and report["empty"] == [2] and not report["admitted"]
