"""Other stacks' dumps (prime-rl's token export, NeMo RL's train data) read into the analyzer.

The fixtures are written here from each stack's documented schema (miles_mis/analyze/stacks/*.py names the commit
each was read at). The central check: the same sequences written as a miles dump and as the other stack's files give
the same statistics and the same candidate results, token for token."""

import json
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_analyze import write_dump

from miles_mis.analyze import advisor
from miles_mis.analyze.reading import DumpReader
from miles_mis.analyze.stacks import KNOWN_FORMATS, open_dump
from miles_mis.analyze.stacks.nemo_rl import NemoRLReader
from miles_mis.analyze.stacks.prime_rl import PrimeRLReader
from miles_mis.analyze.statistics import compute

VOCAB = 49152


def f32(value):
    """As prime-rl writes a float: rounded to float32, non-finite as null."""
    value = float(torch.tensor(value, dtype=torch.float32))
    return value if math.isfinite(value) else None


def sequence(seed, prompt, response, noise=0.05, masked_every=0):
    """A whole sequence: ``prompt`` context tokens (not trainable) then ``response`` sampled tokens; returns the
    response part as miles would dump it (old, rollout, mask, advantages) and the prompt length."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(response, generator=gen) * 3
    rollout = old + noise * torch.randn(response, generator=gen)
    mask = torch.ones(response)
    if masked_every:
        mask[1::masked_every] = 0  # environment tokens between turns: inside the span, not trained
    advantage = float(torch.randn(1, generator=gen))
    return {"prompt": prompt, "old": old, "rollout": rollout, "mask": mask,
            "advantages": torch.full((response,), advantage)}


def prime_rl_line(step, rank, micro_step, index, seq, export_index, rl_weights=None):
    prompt, n = seq["prompt"], seq["old"].numel()
    length = prompt + n
    trainer = [math.log(1 / VOCAB)] + [-1.5] * (prompt - 1) + seq["old"].tolist()
    engine = [0.0] * prompt + seq["rollout"].tolist()  # the exporter's 0.0 on context tokens
    loss_mask = [False] * prompt + [bool(m) for m in seq["mask"].tolist()]
    advantages = [0.0] * prompt + seq["advantages"].tolist()
    log_ratio = [t - e for t, e in zip(trainer, engine)]
    return {"schema_version": 1, "step": step, "rank": rank, "micro_step": micro_step, "micro_sequence_idx": index,
            "export_sequence_idx": export_index, "env_name": "math",
            "token_ids": list(range(7, 7 + length)), "position_ids": list(range(length)), "loss_mask": loss_mask,
            "advantages": [f32(a) for a in advantages], "inference_logprobs": [f32(e) for e in engine],
            "trainer_logprobs": [f32(t) for t in trainer], "entropy": [f32(1.0)] * length,
            "mismatch_kl": [f32(math.exp(x) - x - 1) for x in log_ratio],
            "log_importance_ratio": [f32(x) for x in log_ratio],
            "importance_ratio": [f32(math.exp(x)) for x in log_ratio],
            "prob_delta": [f32(math.exp(t) - math.exp(e)) for t, e in zip(trainer, engine)],
            "is_masked": [None] * length, "is_masked_high": [None] * length, "is_masked_low": [None] * length,
            "rl_weights": [None] * length if rl_weights is None else rl_weights,
            "ce_weights": [None] * length, "ref_kl_weights": [None] * length}


def write_prime_rl(root, micro_batches, stable=True):
    """micro_batches: {(step, rank): [[seq, ...] per micro_step]} as token_exports/step_<s>/rank_<r>.jsonl."""
    for (step, rank), micro in micro_batches.items():
        directory = root / "token_exports" / f"step_{step}"
        directory.mkdir(parents=True, exist_ok=True)
        lines, export_index = [], 0
        for micro_step, sequences in enumerate(micro):
            for index, seq in enumerate(sequences):
                lines.append(json.dumps(prime_rl_line(step, rank, micro_step, index, seq, export_index),
                                        separators=(",", ":"), allow_nan=False))
                export_index += 1
        (directory / f"rank_{rank}.jsonl").write_text("\n".join(lines) + "\n")
        if stable:
            (directory / "STABLE").touch()
    return root


def nemo_line(index, seq, width):
    """One sample as NeMo RL's log_batched_dict_as_jsonl writes it: each field the sample's row, in a 1-list."""
    prompt, n = seq["prompt"], seq["old"].numel()
    pad = width - prompt - n
    generation = [0.0] * prompt + seq["rollout"].tolist() + [0.0] * pad
    prev = [0.0] + [-1.5] * (prompt - 1) + seq["old"].tolist() + [0.0] * pad
    token_mask = [0] * prompt + [int(m) for m in seq["mask"].tolist()] + [0] * pad
    advantage = float(seq["advantages"][0])
    return {"content": [["question", "answer"]], "rewards": [1.0], "input_lengths": [prompt + n],
            "token_ids": [list(range(prompt + n)) + [0] * pad], "token_loss_mask": [token_mask],
            "sample_loss_mask": [seq.get("sample_loss_mask", 1.0)], "advantages": [[advantage] * width],
            "generation_logprobs": [generation], "prev_logprobs": [prev], "idx": index}


def write_nemo(root, steps):
    """steps: [[seq, ...] per step] as logs/exp_001/train_data_step<N>.jsonl (N from 1)."""
    directory = root / "logs" / "exp_001"
    directory.mkdir(parents=True, exist_ok=True)
    for number, sequences in enumerate(steps, start=1):
        width = max(seq["prompt"] + seq["old"].numel() for seq in sequences) + 3  # right padding
        lines = [json.dumps(nemo_line(i, seq, width), default=str) for i, seq in enumerate(sequences)]
        (directory / f"train_data_step{number}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def write_miles(root, calls):
    """calls: [[seq, ...] per call] as a miles dump of one rank, the response part only."""
    for call, sequences in enumerate(calls):
        rows = [(seq["old"], seq["rollout"], seq["mask"]) for seq in sequences]
        out = write_dump(root, {0: rows}, call=call)
        dumped = torch.load(out / f"rank_0_call_{call}.pt", weights_only=True)
        for row, seq in zip(dumped["samples"], sequences):
            row["advantages"] = seq["advantages"]
        torch.save(dumped, out / f"rank_0_call_{call}.pt")
    return root


def as_float32(seq):
    """The values a JSON writer that rounds to float32 keeps (the miles side gets the same numbers)."""
    return {**seq, **{name: seq[name].float() for name in ("old", "rollout", "advantages")}}


def analysis(reader):
    """Statistics and every candidate's figures, as the analyze pipeline computes them."""
    statistics = compute(reader.batches())
    evaluator = advisor.CandidateEvaluator(advisor.candidate_grid(statistics))
    for batch in reader.batches():
        evaluator.update(batch)
    results = evaluator.results()
    return statistics, results, advisor.recommend(statistics, results).name


def assert_same_analysis(a, b):
    (stats_a, results_a, name_a), (stats_b, results_b, name_b) = a, b
    for key in set(stats_a) | set(stats_b):
        if key != "files":
            assert stats_a[key] == stats_b[key], key
    assert results_a == results_b
    assert name_a == name_b


def mixed_sequences(seed, count, noise=0.05):
    rng = random.Random(seed)
    return [as_float32(sequence(seed * 100 + i, prompt=rng.randint(1, 9), response=rng.randint(3, 40), noise=noise,
                                masked_every=rng.choice([0, 0, 3])))
            for i in range(count)]


# --------------------------------------------------------------------------- the same report as a miles dump

@pytest.mark.parametrize("noise", [0.02, 0.6])
def test_prime_rl_export_gives_the_miles_dump_analysis(tmp_path, noise):
    sequences = mixed_sequences(1, 24, noise)
    # two steps, two ranks, two micro-steps each: calls in (step, rank, micro_step) order
    micro_batches = {(step, rank): [sequences[i:i + 3] for i in (base, base + 3)]
                     for k, (step, rank) in enumerate([(1, 0), (1, 1), (2, 0), (2, 1)]) for base in [6 * k]}
    write_prime_rl(tmp_path / "prime", micro_batches)
    calls = [micro for key in sorted(micro_batches) for micro in micro_batches[key]]
    write_miles(tmp_path / "miles", calls)
    prime = open_dump(tmp_path / "prime")
    assert prime.format.name == "prime-rl token export"
    assert len(prime.reader.files) == 4
    assert_same_analysis(analysis(prime.reader), analysis(DumpReader(tmp_path / "miles")))


@pytest.mark.parametrize("noise", [0.02, 0.6])
def test_nemo_rl_train_data_gives_the_miles_dump_analysis(tmp_path, noise):
    steps = [mixed_sequences(2, 10, noise), mixed_sequences(3, 7, noise)]
    write_nemo(tmp_path / "nemo", steps)
    write_miles(tmp_path / "miles", steps)
    nemo = open_dump(tmp_path / "nemo")
    assert nemo.format.name == "NeMo RL train data"
    assert_same_analysis(analysis(nemo.reader), analysis(DumpReader(tmp_path / "miles")))


# --------------------------------------------------------------------------- the response span, by hand

def test_prime_rl_span_starts_at_the_first_trained_token(tmp_path):
    seq = as_float32(sequence(5, prompt=3, response=4))
    seq["mask"] = torch.tensor([1.0, 1.0, 0.0, 1.0])
    write_prime_rl(tmp_path, {(0, 0): [[seq]]})
    (batch,) = list(PrimeRLReader(tmp_path).batches())
    assert batch.response_lengths == [4]
    assert torch.equal(batch.old_log_probs[0], seq["old"])
    assert torch.equal(batch.rollout_log_probs[0], seq["rollout"])
    assert batch.loss_masks[0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert batch.positions[0].tolist() == [0, 1, 2, 3]
    assert batch.lags == [None]
    assert torch.equal(batch.advantages[0], seq["advantages"])


def test_prime_rl_rl_weights_zero_leave_a_token_out(tmp_path):
    seq = as_float32(sequence(6, prompt=2, response=3))
    line = prime_rl_line(0, 0, 0, 0, seq, 0, rl_weights=[None, None, 1.0, 0.0, 0.5])
    directory = tmp_path / "token_exports" / "step_0"
    directory.mkdir(parents=True)
    (directory / "rank_0.jsonl").write_text(json.dumps(line) + "\n")
    (directory / "STABLE").touch()
    (batch,) = list(PrimeRLReader(tmp_path).batches())
    assert batch.loss_masks[0].tolist() == [1.0, 0.0, 1.0]


def test_prime_rl_null_log_probs_become_nonfinite_tokens_that_are_counted(tmp_path):
    seq = as_float32(sequence(7, prompt=2, response=5))
    line = prime_rl_line(0, 0, 0, 0, seq, 0)
    line["inference_logprobs"][3] = None  # the exporter writes NaN/inf as null
    directory = tmp_path / "token_exports" / "step_0"
    directory.mkdir(parents=True)
    (directory / "rank_0.jsonl").write_text(json.dumps(line) + "\n")
    (directory / "STABLE").touch()
    statistics = compute(PrimeRLReader(tmp_path).batches())
    assert statistics["tokens"] == 5
    assert statistics["nonfinite_fraction"] == pytest.approx(1 / 5)


def test_nemo_rl_span_is_cut_at_input_lengths_and_filtered_samples_are_counted(tmp_path):
    kept = as_float32(sequence(8, prompt=4, response=5))
    filtered = {**as_float32(sequence(9, prompt=2, response=6)), "sample_loss_mask": 0.0}
    write_nemo(tmp_path, [[kept, filtered]])
    reader = NemoRLReader(tmp_path)
    (batch,) = list(reader.batches())
    assert batch.indices == [0]
    assert batch.response_lengths == [5]  # the 3 pad columns are cut away
    assert torch.equal(batch.old_log_probs[0], kept["old"])
    assert torch.equal(batch.rollout_log_probs[0], kept["rollout"])
    assert reader.warnings == ["1 sample keeps no token (token_loss_mask 0 everywhere, or sample_loss_mask 0: "
                               "filtered by the run): left out"]


def test_nemo_rl_fractional_sample_loss_mask_weighs_its_tokens_as_nemo_rl_does(tmp_path):
    """NeMo RL writes 0 or 1 (at 7ea279ab); another value is kept as the token's mask weight, the product
    token_loss_mask × sample_loss_mask its own token means use, and read as a miles dump with those masks is."""
    sequences = mixed_sequences(4, 6, noise=0.3)
    sequences[1] = {**sequences[1], "sample_loss_mask": 0.5}
    sequences[4] = {**sequences[4], "sample_loss_mask": 0.25}
    write_nemo(tmp_path / "nemo", [sequences])
    weighted = [{**seq, "mask": seq["mask"].float() * seq.get("sample_loss_mask", 1.0)} for seq in sequences]
    write_miles(tmp_path / "miles", [weighted])
    reader = NemoRLReader(tmp_path / "nemo")
    (batch,) = list(reader.batches())
    assert float(batch.loss_masks[1].max()) == 0.5 and float(batch.loss_masks[4].max()) == 0.25
    assert_same_analysis(analysis(reader), analysis(DumpReader(tmp_path / "miles")))


def test_nemo_rl_nan_tokens_in_the_file_are_read_as_nonfinite(tmp_path):
    # Python's json writes the NaN token, as NeMo RL's logger does
    path = _nemo_line_file(tmp_path, 10, lambda line: line["generation_logprobs"][0].__setitem__(3, float("nan")))
    assert "NaN" in path.read_text()
    statistics = compute(NemoRLReader(tmp_path).batches())
    assert statistics["nonfinite_fraction"] == pytest.approx(1 / 4)


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(1, 6), mask=st.lists(st.booleans(), min_size=1, max_size=12))
def test_span_matches_a_token_by_token_reading(tmp_path_factory, prompt, mask):
    """The reader's span equals the slow reading: from the first token whose loss_mask is true, to the end."""
    root = tmp_path_factory.mktemp("span")
    seq = as_float32(sequence(11, prompt=prompt, response=len(mask)))
    seq["mask"] = torch.tensor([float(m) for m in mask])
    write_prime_rl(root, {(0, 0): [[seq]]})
    batches = list(PrimeRLReader(root).batches())
    whole_mask = [False] * prompt + mask
    first = next((i for i, m in enumerate(whole_mask) if m), None)
    if first is None:
        assert batches == [] or batches[0].calls == []
        return
    (batch,) = batches
    expected = mask[first - prompt:]
    assert batch.loss_masks[0].tolist() == [float(m) for m in expected]
    assert batch.old_log_probs[0].tolist() == seq["old"][first - prompt:].tolist()


# --------------------------------------------------------------------------- completeness and ordering

def test_a_prime_rl_step_without_stable_is_left_out_with_a_warning(tmp_path):
    write_prime_rl(tmp_path, {(1, 0): [mixed_sequences(4, 2)]})
    write_prime_rl(tmp_path, {(2, 0): [mixed_sequences(5, 3)]}, stable=False)
    reader = PrimeRLReader(tmp_path)
    assert [path.parent.name for path in reader.files] == ["step_1"]
    assert sum(len(batch.calls) for batch in reader.batches()) == 2
    assert "1 step directory (step 2) has no STABLE marker" in reader.warnings[0]
    partial = PrimeRLReader(tmp_path, allow_partial=True)
    assert sum(len(batch.calls) for batch in partial.batches()) == 5
    assert partial.warnings[0].startswith("partial export (--allow-partial)")
    write_prime_rl(tmp_path, {(3, 0): [mixed_sequences(2, 2)]}, stable=False)
    assert "2 step directories (step 2, 3) have no STABLE marker" in PrimeRLReader(tmp_path).warnings[0]


def test_prime_rl_calls_run_in_step_rank_micro_step_order(tmp_path):
    a, b, c, d, e = (mixed_sequences(20 + i, 1) for i in range(5))
    write_prime_rl(tmp_path, {(10, 1): [a], (2, 0): [b, c], (10, 0): [d], (2, 1): [e]})
    batches = list(PrimeRLReader(tmp_path).batches())
    assert [batch.calls[0] for batch in batches] == [0, 1, 2, 3, 4]
    expected = [b, c, e, d, a]  # step 2 (rank 0: micro 0, 1; rank 1), then step 10 (rank 0, rank 1)
    for batch, sequences in zip(batches, expected):
        assert torch.equal(batch.old_log_probs[0], sequences[0]["old"])


# --------------------------------------------------------------------------- one-line errors

def _prime_line_file(tmp_path, change):
    seq = as_float32(sequence(12, prompt=2, response=3))
    line = prime_rl_line(3, 1, 0, 0, seq, 0)
    change(line)
    directory = tmp_path / "token_exports" / "step_3"
    directory.mkdir(parents=True)
    (directory / "rank_1.jsonl").write_text(json.dumps(line) + "\n")
    (directory / "STABLE").touch()
    return directory / "rank_1.jsonl"


@pytest.mark.parametrize("change, message", [
    (lambda line: line.pop("trainer_logprobs"), "rank_1.jsonl:1: no trainer_logprobs"),
    (lambda line: line["inference_logprobs"].pop(), "inference_logprobs has 4 tokens but loss_mask has 5"),
    (lambda line: line.update(step=4), "the record says step 4 but its path says 3"),
    (lambda line: line.update(rank=0), "the record says rank 0 but its path says 1"),
    (lambda line: line["loss_mask"].__setitem__(2, 0.5), "loss_mask[2] is 0.5; expected 0/1 or true/false"),
    (lambda line: line["trainer_logprobs"].__setitem__(1, "x"), "trainer_logprobs[1] is 'x'; expected numbers or null"),
    (lambda line: line.update(micro_step="0"), "micro_step is '0', expected an integer"),
])
def test_bad_prime_rl_lines_are_one_line_naming_the_line(tmp_path, change, message):
    _prime_line_file(tmp_path, change)
    with pytest.raises(ValueError) as error:
        list(PrimeRLReader(tmp_path).batches())
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_repeated_prime_rl_sequence_is_named(tmp_path):
    path = _prime_line_file(tmp_path, lambda line: None)
    path.write_text(path.read_text() * 2)
    with pytest.raises(ValueError, match=r"rank_1.jsonl:2: micro_step 0 micro_sequence_idx 0 also at .*:1$"):
        list(PrimeRLReader(tmp_path).batches())


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = _prime_line_file(tmp_path, lambda line: None)
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"rank_1.jsonl:2: not a JSON line"):
        list(PrimeRLReader(tmp_path).batches())


def _nemo_line_file(tmp_path, seed, change, prompt=2, response=4):
    """A one-sample NeMo RL step file whose line ``change`` edits (the parsed dict, in place) before it is written."""
    write_nemo(tmp_path, [[as_float32(sequence(seed, prompt=prompt, response=response))]])
    path = next(tmp_path.glob("**/train_data_step1.jsonl"))
    line = json.loads(path.read_text())
    change(line)
    path.write_text(json.dumps(line) + "\n")
    return path


def test_nemo_rl_without_a_trainer_recompute_is_refused(tmp_path):
    _nemo_line_file(tmp_path, 13, lambda line: line.update(prev_logprobs=[[0.0] * len(line["prev_logprobs"][0])]))
    with pytest.raises(ValueError, match="prev_logprobs are 0 on every generated token.*force_on_policy_ratio"):
        list(NemoRLReader(tmp_path).batches())


def test_nemo_rl_files_from_before_token_masks_are_refused(tmp_path):
    def old_form(line):
        for name in ("token_ids", "token_loss_mask", "sample_loss_mask", "advantages"):
            line.pop(name)

    _nemo_line_file(tmp_path, 14, old_form)
    with pytest.raises(ValueError, match=r"train_data_step1.jsonl:1: no token_loss_mask"):
        list(NemoRLReader(tmp_path).batches())


@pytest.mark.parametrize("change, message", [
    (lambda line: line.update(rewards=1.0), "rewards is not a one-element list"),
    (lambda line: line.update(input_lengths=[99]), "input_lengths is 99, expected an integer in [0, 12]"),
    (lambda line: line.update(idx="0"), "idx is '0', expected the sample's integer row"),
    (lambda line: line.update(sample_loss_mask=[-1.0]), "sample_loss_mask is -1.0, expected a finite number >= 0"),
])
def test_bad_nemo_rl_lines_are_one_line_naming_the_line(tmp_path, change, message):
    _nemo_line_file(tmp_path, 15, change, prompt=3, response=6)
    with pytest.raises(ValueError) as error:
        list(NemoRLReader(tmp_path).batches())
    assert message in str(error.value) and "train_data_step1.jsonl:1" in str(error.value)


def test_an_unknown_directory_names_every_known_format(tmp_path):
    (tmp_path / "notes.jsonl").write_text("{}\n")
    with pytest.raises(ValueError) as error:
        open_dump(tmp_path)
    text = str(error.value)
    assert "no dump of a known format" in text and "\n" not in text
    for fmt in KNOWN_FORMATS:
        assert fmt.name in text


def test_two_stacks_under_one_directory_are_refused(tmp_path):
    write_nemo(tmp_path, [mixed_sequences(16, 2)])
    write_prime_rl(tmp_path, {(0, 0): [mixed_sequences(17, 2)]})
    with pytest.raises(ValueError, match="holds dumps of prime-rl token export and of NeMo RL train data"):
        open_dump(tmp_path)


def test_two_runs_of_one_stack_are_refused(tmp_path):
    write_nemo(tmp_path / "a", [mixed_sequences(18, 2)])
    write_nemo(tmp_path / "b", [mixed_sequences(19, 2)])
    with pytest.raises(ValueError, match="step 1 appears twice"):
        open_dump(tmp_path)


def test_every_format_says_what_it_lacks():
    miles, prime, nemo = KNOWN_FORMATS
    assert miles.lacks == ()
    assert any("version lag" in item for item in prime.lacks) and any("version lag" in item for item in nemo.lacks)
    assert "559b4477" in prime.schema and "7ea279ab" in nemo.schema


# --------------------------------------------------------------------------- the command line

def test_analyze_on_a_prime_rl_export_says_the_format_and_what_it_lacks(tmp_path, capsys):
    from cli_answers import analyze_cli, one_line_error

    write_prime_rl(tmp_path / "run", {(1, 0): [mixed_sequences(30, 6, 0.1)], (2, 0): [mixed_sequences(31, 6, 0.1)]})
    code, out, err = analyze_cli(capsys, tmp_path / "run")
    assert code == 0, err
    assert "Read as a prime-rl token export (token_exports/step_<s>/rank_<r>.jsonl" in out
    assert "It lacks each sequence's version lag" in out and "## Recommendation" in out
    config = tmp_path / "lagged.yaml"
    config.write_text("use_tis: true\nrs_max_lag: 2\n")
    message = one_line_error(*analyze_cli(capsys, tmp_path / "run", "--config", config)[::2])
    assert message.startswith(f"--config {config}: rs_max_lag need") and "prime-rl and NeMo RL do not" in message


def test_admit_and_analyze_read_a_nemo_rl_log_directory(tmp_path, capsys):
    from cli_answers import analyze_cli

    write_nemo(tmp_path, [mixed_sequences(32, 5, 0.05), mixed_sequences(33, 5, 0.05)])
    code, out, err = analyze_cli(capsys, tmp_path / "logs" / "exp_001")
    assert code == 0, err
    assert "Read as a NeMo RL train data" in out and "a call is one step's whole batch" in out


def test_a_long_sequence_dump_cites_the_sequence_weight_rows_in_its_report(tmp_path, capsys):
    """Long responses with a small per-token mismatch: most products ∏ρ leave [0.5, 2], and the report's evidence
    cites the published sequence-weight rows (NeMo RL 2269)."""
    from cli_answers import analyze_cli

    long = [as_float32(sequence(40 + i, prompt=3, response=400, noise=0.2)) for i in range(6)]
    write_miles(tmp_path, [long])
    code, out, err = analyze_cli(capsys, tmp_path)
    assert code == 0, err
    assert "of the sequences' product ratio ∏ρ = exp(Σ l) leaves [0.5, 2] here" in out
    assert "NVIDIA-NeMo/RL" in out


# --------------------------------------------------------------------------- prime-rl's finer points

def _one_prime_line(tmp_path, line, stable=True, step=0):
    directory = tmp_path / "token_exports" / f"step_{step}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "rank_0.jsonl"
    path.write_text(path.read_text() + json.dumps(line) + "\n" if path.exists() else json.dumps(line) + "\n")
    if stable:
        (directory / "STABLE").touch()
    return path


def test_prime_rl_keeps_its_own_mismatch_mask_rl_or_reference_kl_weight(tmp_path):
    """prime-rl's mismatch mask: loss_mask and (rl_weights ≠ 0 or ref_kl_weights ≠ 0); null weights keep the token."""
    seq = as_float32(sequence(50, prompt=2, response=4))
    line = prime_rl_line(0, 0, 0, 0, seq, 0, rl_weights=[None, None, 1.0, 0.0, 0.0, None])
    line["ref_kl_weights"] = [None, None, 0.0, 1.0, 0.0, 0.0]
    _one_prime_line(tmp_path, line)
    (batch,) = list(PrimeRLReader(tmp_path).batches())
    assert batch.loss_masks[0].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_prime_rl_position_zero_is_never_a_trained_token(tmp_path):
    """Its trainer log-prob is the exporter's pad log(1/V), not a log-prob: kept, it alone would read as k3 ≈ 2.4."""
    seq = as_float32(sequence(51, prompt=1, response=3))
    line = prime_rl_line(0, 0, 0, 0, seq, 0)
    line["loss_mask"][0] = True
    _one_prime_line(tmp_path, line)
    (batch,) = list(PrimeRLReader(tmp_path).batches())
    assert batch.response_lengths == [3]  # the span starts after position 0
    assert torch.equal(batch.old_log_probs[0], seq["old"])


def test_prime_rl_multi_run_exports_check_export_step_against_the_path(tmp_path):
    seq = as_float32(sequence(52, prompt=2, response=3))
    line = {**prime_rl_line(117, 0, 0, 0, seq, 0), "export_step": 5, "run_id": "r1"}  # trainer step 117
    _one_prime_line(tmp_path, line, step=5)
    (batch,) = list(PrimeRLReader(tmp_path).batches())
    assert torch.equal(batch.old_log_probs[0], seq["old"])


def test_a_half_written_last_line_of_an_unstable_step_is_counted_with_allow_partial(tmp_path):
    seq = as_float32(sequence(53, prompt=2, response=3))
    path = _one_prime_line(tmp_path, prime_rl_line(0, 0, 0, 0, seq, 0), stable=False)
    path.write_text(path.read_text() + json.dumps(prime_rl_line(0, 0, 0, 1, seq, 1))[:40] + "\n")
    reader = PrimeRLReader(tmp_path, allow_partial=True)
    assert sum(len(batch.calls) for batch in reader.batches()) == 1
    assert any("1 half-written last line(s) of steps without STABLE left out" in w for w in reader.warnings)
    (path.parent / "STABLE").touch()  # a finished step holds no cut line: the same line is an error there
    with pytest.raises(ValueError, match=r"rank_0.jsonl:2: not a JSON line"):
        list(PrimeRLReader(tmp_path).batches())


def test_a_number_beyond_float_range_is_one_line(tmp_path):
    seq = as_float32(sequence(54, prompt=2, response=3))
    line = prime_rl_line(0, 0, 0, 0, seq, 0)
    path = _one_prime_line(tmp_path, line)
    first = json.dumps(line["trainer_logprobs"][0])
    text = path.read_text()
    assert text.count(f'"trainer_logprobs": [{first},') == 1
    path.write_text(text.replace(f'"trainer_logprobs": [{first},', '"trainer_logprobs": [' + "9" * 400 + ","))
    with pytest.raises(ValueError, match=r"rank_0.jsonl:1: trainer_logprobs holds a number beyond the float range"):
        list(PrimeRLReader(tmp_path).batches())


def test_the_left_out_warning_agrees_with_its_count():
    from miles_mis.analyze.stacks.sequences import left_out_warning, warn_once

    assert left_out_warning(1, "sample", "why") == "1 sample keeps no token (why): left out"
    assert left_out_warning(3, "exported sequence", "why") == "3 exported sequences keep no token (why): left out"
    warnings = ["a"]
    warn_once(warnings, "b")
    warn_once(warnings, "a")
    assert warnings == ["a", "b"]
