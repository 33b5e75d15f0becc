"""Score centering through the hosts' custom-loss seam: ``miles_mis.hosts.miles_loss.policy_loss`` (and slime's) with
``score_centering: true``, on the host doubles' batches (tests/host_doubles.py: CP-local logits, log-probs and
advantages, full masks, miles' reducer). Compared with a slow per-token reference written from the formula
(docs/math.md "Score centering"): loss, the logits' gradient and every ``mis_sc_*`` metric, at cp 1, 2 and 3, thd and
bshd, TP 2 on gloo; the settings and inputs it refuses, and a bad input on one CP rank failing every rank."""

import math
from types import SimpleNamespace

import pytest
import torch
from cp_harness import spawn
from host_doubles import Double, installed, make_batch, host_args

from miles_mis.hosts import MILES, SLIME, policy_loss
from miles_mis.parallel.cp_layout import logits_rows
from miles_mis.parallel.distributed import PeerFailure

K, VOCAB = 3, 11
WEIGHTINGS = {"none": {}, "tis": {"score_centering_tis_clip": 1.3}, "mis": {"score_centering_mis_low": 0.8,
                                                                              "score_centering_mis_high": 1.25}}


def with_candidates(batch, full_logits, seed):
    """The engine's top-K candidates of every response token: q = softmax(z + noise), its K largest ids, some rows
    with unused slots; the sampled token's rollout log-prob from the same q (the batch's own ones are CP-local)."""
    gen = torch.Generator().manual_seed(seed + 100)
    starts = [0] + torch.tensor(batch["total_lengths"]).cumsum(0).tolist()
    ids, log_probs, rollout_full = [], [], []
    for i, (total, response) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
        rows = full_logits.detach()[starts[i] + total - response - 1:starts[i] + total - 1]
        log_q = torch.log_softmax(rows + 0.4 * torch.randn(rows.shape, generator=gen), dim=-1)
        top = log_q.topk(K, dim=-1)
        sample_ids, sample_log_q = top.indices.clone(), top.values.clone()
        if response:
            sample_ids[0, 1:], sample_log_q[0, 1:] = -1, float("-inf")  # a row with one candidate
        ids.append(sample_ids)
        log_probs.append(sample_log_q)
        sampled = batch["unconcat_tokens"][i][total - response:]
        rollout_full.append(log_q.gather(1, sampled[:, None].long()).squeeze(1))
    batch["rollout_topk_token_ids"], batch["rollout_topk_log_probs"] = ids, log_probs
    return rollout_full


def reference(batch, full_logits, rollout_full, weighting, temperature=1.0, tis_clip=2.0, low=0.5, high=5.0):
    """Σ_i (1 / max(Σ m_i, 1)) Σ_t m_t loss_t, token by token, candidate by candidate, in float64; the metrics
    likewise. The loss's gradient flows into ``full_logits``."""
    f = {"none": lambda r: 1.0, "tis": lambda r: min(r, tis_clip),
         "mis": lambda r: r if low <= r <= high else 0.0}[weighting]
    starts = [0] + torch.tensor(batch["total_lengths"]).cumsum(0).tolist()
    loss, metrics = 0.0, {name: 0.0 for name in ("correction", "P", "Q", "rho", "w")}
    for i, (total, response) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
        mask = batch["loss_masks"][i].double()
        scale = 1.0 / max(float(mask.sum()), 1.0)
        for j in range(response):
            if mask[j] == 0:
                continue
            row = starts[i] + total - response - 1 + j
            log_p = torch.log_softmax(full_logits[row].double() / temperature, dim=-1)
            values = log_p.detach()
            y = int(batch["unconcat_tokens"][i][total - response + j])
            log_q_y = float(rollout_full[i][j])
            used = [(int(h), float(lq)) for h, lq in zip(batch["rollout_topk_token_ids"][i][j],
                                                         batch["rollout_topk_log_probs"][i][j]) if h >= 0]
            P = sum(math.exp(float(values[h])) for h, _ in used)
            Q = sum(math.exp(lq) for _, lq in used)
            rho = max(1 - Q, 1e-6) / max(1 - P, 1e-6)
            alpha = rho * f(1 / rho)
            w = f(math.exp(float(values[y]) - log_q_y))
            correction = 0.0
            for h, lq in used:
                p_h, q_h = math.exp(float(values[h])), math.exp(lq)
                c_h = q_h * f(p_h / q_h) - alpha * p_h
                correction = correction + c_h * log_p[h]
            advantage = float(batch["advantages_full"][i][j])
            loss = loss + scale * (-advantage * (w * log_p[y] - correction))
            for name, value in (("correction", float(correction)), ("P", P), ("Q", Q), ("rho", rho), ("w", w)):
                metrics[name] += scale * value
    return loss, metrics


def prepared(seed, rank=0, cp=1, fmt="thd"):
    batch, full_logits, logits, local = make_batch(seed, rank, cp, fmt, vocab=VOCAB)
    full, _, _, _ = make_batch(seed, 0, 1, fmt, vocab=VOCAB)  # the whole responses' advantages (cp 1)
    batch["advantages_full"] = full["advantages"]
    rollout_full = with_candidates(batch, full_logits, seed)
    batch["rollout_log_probs"] = [r.index_select(0, ix) for r, ix in zip(rollout_full, local)]
    return batch, full_logits, logits, rollout_full


def run_adapter(batch, logits, weighting, double, host=MILES, **flags):
    args = host_args(loss_type="custom_loss", score_centering=True, score_centering_is=weighting,
                     qkv_format="thd" if batch["max_seq_lens"] is None else "bshd", **WEIGHTINGS[weighting], **flags)
    reduce = double.reducer(args, batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], None,
                            False, batch["max_seq_lens"])
    with installed(double):
        return policy_loss(host, args, batch, logits, reduce)


def bounds(weighting):
    values = WEIGHTINGS[weighting]
    return dict(tis_clip=values.get("score_centering_tis_clip", 2.0), low=values.get("score_centering_mis_low", 0.5),
                high=values.get("score_centering_mis_high", 5.0))


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
@pytest.mark.parametrize("weighting", ["none", "tis", "mis"])
@pytest.mark.parametrize("host", [MILES, SLIME], ids=["miles", "slime"])
def test_one_rank_equals_the_token_by_token_reference(weighting, fmt, host):
    batch, full_logits, logits, rollout_full = prepared(3, fmt=fmt)
    loss, log = run_adapter(batch, logits, weighting, Double(host.name), host)
    (grad,) = torch.autograd.grad(loss, full_logits)
    want, metrics = reference(batch, full_logits, rollout_full, weighting, **bounds(weighting))
    (want_grad,) = torch.autograd.grad(want, full_logits)
    assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, want_grad.float(), atol=1e-6)
    assert float(grad.abs().sum()) > 0
    for name, key in (("mis_sc_correction", "correction"), ("mis_sc_train_head_mass", "P"),
                      ("mis_sc_rollout_head_mass", "Q"), ("mis_sc_tail_ratio", "rho"),
                      ("mis_sc_importance_weight", "w")):
        assert float(log[name]) == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), name
    assert float(log["pg_loss"]) == float(log["loss"]) == float(loss)


def test_the_weightings_differ_on_this_batch():
    """The bounds are set so that each f acts: the three losses are different numbers."""
    batch, _, logits, _ = prepared(3)
    losses = {w: float(run_adapter(batch, logits, w, Double("miles"))[0]) for w in WEIGHTINGS}
    assert len(set(losses.values())) == 3


def test_temperature_divides_the_logits():
    batch, full_logits, logits, rollout_full = prepared(5)
    loss, _ = run_adapter(batch, logits, "none", Double("miles"), rollout_temperature=0.7)
    want, _ = reference(batch, full_logits, rollout_full, "none", temperature=0.7)
    assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-6)


def _cp_worker(rank, size, fmt, weighting, tp):
    import torch.distributed as dist

    cp = 1 if tp else size
    batch, full_logits, logits, rollout_full = prepared(7, rank if not tp else 0, cp, fmt)
    double = Double("miles", rank if not tp else 0, cp, dist.group.WORLD if not tp else None)
    flags = {}
    if tp:  # each rank its slice of a vocabulary padded to 12 columns
        padded = torch.cat([logits, logits.new_zeros(*logits.shape[:-1], 1)], dim=-1)
        width = padded.shape[-1] // size
        logits = padded[..., rank * width:(rank + 1) * width]
        flags["vocab_size"] = VOCAB
        double.get_parallel_state = lambda: SimpleNamespace(cp=SimpleNamespace(rank=0, size=1, group=None),
                                                            tp=SimpleNamespace(rank=rank, size=size,
                                                                               group=dist.group.WORLD))
    loss, log = run_adapter(batch, logits, weighting, double, **flags)
    (grad,) = torch.autograd.grad(loss, full_logits)
    if tp:  # the loss is the same on every TP rank, the gradient each rank's columns'
        grads = [torch.zeros_like(grad) for _ in range(size)]
        dist.all_gather(grads, grad)
        grad = sum(grads)
        values = torch.stack([loss.detach()] + [log[k] for k in sorted(log)])
    else:
        dist.all_reduce(grad)
        values = torch.stack([loss.detach()] + [log[k] for k in sorted(log)])
        dist.all_reduce(values)
    one_batch, one_full, one_logits, _ = prepared(7, 0, 1, fmt)
    want, want_log = run_adapter(one_batch, one_logits, weighting, Double("miles"))
    (want_grad,) = torch.autograd.grad(want, one_full)
    want_values = torch.stack([want.detach()] + [want_log[k] for k in sorted(want_log)])
    assert torch.allclose(values, want_values, rtol=1e-5, atol=1e-6), (values, want_values)
    assert torch.allclose(grad, want_grad, atol=1e-6)
    dist.barrier()  # leave together: a rank tearing gloo down while its peer still works can abort the peer


@pytest.mark.parametrize("size, fmt, weighting", [(2, "thd", "mis"), (3, "thd", "tis"), (2, "bshd", "none")])
def test_cp_ranks_sum_to_cp1(size, fmt, weighting):
    spawn(_cp_worker, size, fmt, weighting, False)


def test_tp2_vocabulary_slices_equal_one_rank():
    spawn(_cp_worker, 2, "thd", "mis", True)


def _fail_worker(rank, size):
    import torch.distributed as dist

    batch, _, logits, _ = prepared(7, rank, size)
    if rank == 1:  # only this rank's shard is bad
        batch["rollout_log_probs"][2] = batch["rollout_log_probs"][2].clone().fill_(float("nan"))
    with pytest.raises((ValueError, PeerFailure)) as caught:
        run_adapter(batch, logits, "none", Double("miles", rank, size, dist.group.WORLD))
    text = str(caught.value)
    assert "sequence 2: rollout_log_probs[2] holds nan" in text
    assert (rank == 1) != isinstance(caught.value, PeerFailure)
    dist.barrier()  # leave together (as above)


def test_a_bad_input_on_one_cp_rank_fails_every_rank():
    spawn(_fail_worker, 2)


@pytest.mark.parametrize("cp, fmt", [(1, "thd"), (1, "bshd"), (2, "thd"), (3, "thd"), (2, "bshd"), (4, "bshd")])
def test_logits_rows_are_the_doubles_response_rows(cp, fmt):
    """The rows the loss reads equal the rows the host double's own log-probs read, rank by rank."""
    from host_doubles import held_positions, response_rows

    batch, _, _, _ = make_batch(11, 0, 1, fmt, num_samples=8)
    totals, responses, spans = batch["total_lengths"], batch["response_lengths"], batch["max_seq_lens"]
    for rank in range(cp):
        want, offset = [], 0
        for i, (total, response) in enumerate(zip(totals, responses)):
            held = held_positions(spans[i] if fmt == "bshd" else total, total, rank, cp, fmt == "bshd")
            want += [offset + row for row, _ in response_rows(total, response, held)]
            offset += len(held)
        got = logits_rows(torch.tensor(totals), torch.tensor(responses), rank, cp, fmt,
                          None if spans is None else torch.tensor(spans))
        assert got.tolist() == want


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("rollout_topk_token_ids"), "the batch holds no rollout_topk_token_ids: record them"),
    (lambda b: b.pop("rollout_topk_log_probs"), "the batch holds no rollout_topk_log_probs"),
    (lambda b: b["rollout_topk_token_ids"][2].__setitem__((1, 1), b["rollout_topk_token_ids"][2][1, 0]),
     "sequence 2, response token 1: rollout_topk_token_ids holds id"),
    (lambda b: b["rollout_log_probs"][1].__setitem__(0, 0.5), "sequence 1: rollout_log_probs[1] holds 0.5"),
    (lambda b: b["advantages"].pop(), "advantages has 5 sequences but the batch has 6"),
])
def test_bad_inputs_are_one_line_errors(change, message):
    batch, _, logits, _ = prepared(3)
    change(batch)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        run_adapter(batch, logits, "none", Double("miles"))


@pytest.mark.parametrize("flags, message", [
    ({"use_tis": True}, "score_centering: true with --use-tis"),
    ({"tis_mode": "mask"}, "tis_mode configure the hook's correction"),
    ({"entropy_coef": 0.01}, "with --entropy-coef 0.01"),
    ({"use_kl_loss": True, "kl_loss_coef": 0.1}, "with --kl-loss-coef 0.1"),
    ({"allgather_cp": True}, "with --allgather-cp"),
    ({"score_centering_is": "clip"}, "score_centering_is='clip' is invalid: allowed values are none, tis, mis"),
])
def test_settings_it_cannot_honour_are_refused(flags, message):
    batch, _, logits, _ = prepared(3)
    args = dict(WEIGHTINGS["none"])
    with pytest.raises(ValueError, match=message):
        merged = {"score_centering_is": "none", **args, **flags}
        a = host_args(loss_type="custom_loss", score_centering=True, **merged)
        with installed(Double("miles")):
            policy_loss(MILES, a, batch, logits, lambda x: x.sum())


def test_kl_loss_at_coefficient_zero_runs():
    batch, _, logits, _ = prepared(3)
    loss, _ = run_adapter(batch, logits, "none", Double("miles"), use_kl_loss=True, kl_loss_coef=0.0)
    assert math.isfinite(float(loss))


def test_the_hook_refuses_score_centering_and_names_the_adapter():
    from miles_mis import compute_mis_weights_with_cp

    batch, _, _, _ = prepared(3)
    args = host_args(score_centering=True, use_tis=True)
    with pytest.raises(ValueError, match="runs in the custom-loss adapters.*miles_mis.hosts.miles_loss.policy_loss"):
        compute_mis_weights_with_cp(args, pg_loss=torch.zeros(sum(len(x) for x in batch["log_probs"])),
                                    train_log_probs=batch["log_probs"], rollout_log_probs=batch["rollout_log_probs"],
                                    loss_masks=batch["loss_masks"], total_lengths=batch["total_lengths"],
                                    response_lengths=batch["response_lengths"])


def test_score_centering_false_is_the_hosts_own_loss():
    """score_centering: false (as a YAML may say) leaves the adapter on the host's policy loss."""
    batch, _, logits, _ = prepared(3)
    args = host_args(loss_type="custom_loss", score_centering=False, get_mismatch_metrics=True)
    double = Double("miles")
    reduce = double.reducer(args, batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], None, False)
    with installed(double):
        _, log = policy_loss(MILES, args, batch, logits, reduce)
    assert "mis_sc_correction" not in log and "pg_clipfrac" in log


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
@pytest.mark.parametrize("weighting", ["none", "tis", "mis"])
def test_the_adapter_equals_the_reference_hosts_oracle(weighting, fmt):
    """miles_mis.reference_host.score_centering_loss, written one token at a time from miles' source (no code shared
    with miles_mis.centering): the same loss, gradient and sc_* metrics under miles' names."""
    from miles_mis.reference_host import score_centering_loss as oracle

    batch, full_logits, logits, _ = prepared(9, fmt=fmt)
    loss, log = run_adapter(batch, logits, weighting, Double("miles"))
    (grad,) = torch.autograd.grad(loss, full_logits, retain_graph=True)  # the oracle reads the same logits
    args = host_args(score_centering_is=weighting, qkv_format=fmt, rollout_temperature=1.0, **WEIGHTINGS[weighting])
    reduce = Double("miles").reducer(args, batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                     None, False, batch["max_seq_lens"])
    want, want_log = oracle(args, batch, logits, reduce)
    (want_grad,) = torch.autograd.grad(want, full_logits)
    assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad.double(), want_grad.double(), atol=1e-6)
    for name in ("correction", "train_head_mass", "rollout_head_mass", "tail_ratio", "importance_weight"):
        assert float(log[f"mis_sc_{name}"]) == pytest.approx(float(want_log[f"sc_{name}"]), rel=1e-5, abs=1e-6), name
