"""docs/metrics.md's "Names in other stacks" table names exactly the ``mis_`` metrics the plugin emits, and its
verl paragraph's hand case holds: ``mis_batch_kl`` is the token-weighted mean (verl's ``kl``), ``mis_kl`` the mean over
sequences of each sequence's token mean."""

import math
import re
from pathlib import Path

import pytest
import torch

import miles_mis
from miles_mis.cli.example_batch import make_example_batch
from miles_mis.cli.reporting import reduce_metrics
from miles_mis.config import DIVERGENCE_OPTIONS
from miles_mis.correction.mismatch_location import BUCKET_NAMES
from miles_mis.correction.staleness import BUCKETS
from miles_mis.hosts.score_centering import METRICS as SCORE_CENTERING_METRICS

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
SECTION = "## Names in other stacks"
# what each placeholder of the table's names stands for, from the code's own lists
PLACEHOLDERS = {"<a>_<b>": BUCKET_NAMES, "<opt>": DIVERGENCE_OPTIONS, "<b>": BUCKETS}


def table_cells() -> list[str]:
    """The first cell of every row of the first table under SECTION."""
    text = DOC.read_text(encoding="utf-8")
    assert text.count(SECTION) == 1, f"{DOC.name} needs exactly one '{SECTION}' section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `mis_")]
    assert rows, f"no table rows under '{SECTION}'"
    return [row.split("|")[1] for row in rows]


def expand(name: str) -> set[str]:
    """A table name with its placeholders replaced by every value they stand for."""
    for placeholder, values in PLACEHOLDERS.items():
        if placeholder in name:
            return set().union(*(expand(name.replace(placeholder, value, 1)) for value in values))
    return {name}


def documented_names() -> list[str]:
    """Every concrete name the table's first column stands for (a name twice in it appears twice here)."""
    names = []
    for cell in table_cells():
        for name in re.findall(r"`(mis_[^`]+)`", cell):
            names.extend(sorted(expand(name)))
    return names


def emitted_names() -> set[str]:
    """Every name the plugin returns, over calls that switch each optional stage and input on, plus the score
    centering adapters' names (their registry: they need logits, not a hook call)."""
    batch = make_example_batch(num_seqs=6, max_len=32, seed=1)
    lists = {key: batch[key] for key in ("train_log_probs", "rollout_log_probs", "loss_masks")}
    thresholds = {option: [0.5, 2.0] if option.endswith("k1") else [-0.5, 0.5] if option.endswith("tv")
                  and not option.endswith("atv") else 0.5 for option in DIVERGENCE_OPTIONS}
    advantages = [torch.linspace(-1.0, 1.0, len(x)) for x in batch["train_log_probs"]]
    sizes = [torch.ones(len(x), dtype=torch.long) for x in batch["train_log_probs"]]
    rollout_ids = [0, 0, 1, 2, 2, 3]  # every sample carries its rollout's count, one token more than it holds here
    rollout_tokens = [sum(int(m.sum()) for m, j in zip(batch["loss_masks"], rollout_ids) if j == i) + 1
                      for i in rollout_ids]
    calls = [
        (dict(use_tis=False), {}),
        (dict(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True), {}),
        (dict(use_tis=True, tis_mode="clip"), {}),
        (dict(use_tis=True, tis_mode="mask"), {}),
        (dict(use_tis=True, tis_mode="icepop"), {}),
        (dict(use_tis=True, rs_divergence=thresholds), {"advantages": advantages}),
        (dict(use_tis=True, rs_batch_gate={"k3": 1.0}), {}),
        (dict(use_tis=True, tis_upper_bound="auto"), {}),
        (dict(use_tis=True, tis_upper_bound_by_lag=[2.0, 1.5], rs_max_lag=3), {"version_lags": [0, 1, 2, 3, 4, 5]}),
        (dict(use_tis=True), {"rollout_ids": rollout_ids, "rollout_mask_sums": rollout_tokens}),
        (dict(use_tis=True), {"sampling_mask_sizes": sizes}),
        (dict(use_tis=True, tis_policy="current"), {"cur_log_probs": batch["train_log_probs"]}),
    ]
    names = set(SCORE_CENTERING_METRICS)
    for config, extra in calls:
        names |= set(miles_mis.compute_mis_weights(miles_mis.MisConfig(**config), **lists, **extra)[2])
    return names


def test_placeholders_expand_to_the_code_lists():
    assert expand("mis_lag_<b>_k3") == {"mis_lag_0_k3", "mis_lag_1_k3", "mis_lag_2_k3", "mis_lag_3plus_k3"}
    assert "mis_k3_position_1024_8192" in expand("mis_k3_position_<a>_<b>")
    assert len(expand("mis_rs_<opt>_mean")) == len(DIVERGENCE_OPTIONS) == 24


def test_the_table_names_exactly_the_emitted_metrics():
    documented, emitted = documented_names(), emitted_names()
    repeated = sorted({name for name in documented if documented.count(name) > 1})
    assert not repeated, f"named in more than one row: {repeated}"
    assert sorted(emitted - set(documented)) == [], "emitted but missing from the table"
    assert sorted(set(documented) - emitted) == [], "in the table but never emitted"
    assert len(emitted) == 209  # 89 fixed names + 24 divergence options x 5 (a new metric changes this on purpose)


@pytest.fixture
def two_sequences():
    """Sequence 0: one token with ℓ = log π_train − log π_rollout = −0.2; sequence 1: three tokens with ℓ = 0."""
    rollout = [torch.tensor([math.log(0.5)]), torch.full((3,), math.log(0.8))]
    train = [rollout[0] - 0.2, rollout[1].clone()]
    return {"train_log_probs": train, "rollout_log_probs": rollout, "loss_masks": [torch.ones(1), torch.ones(3)]}


def reduced(lists: dict) -> dict[str, float]:
    metrics = miles_mis.compute_mis_weights(miles_mis.MisConfig(use_tis=False), **lists)[2]
    return reduce_metrics({name: torch.cat(values) for name, values in metrics.items()}, lists["loss_masks"])


def test_verl_kl_is_the_batch_kl_not_the_per_sequence_kl(two_sequences):
    values = reduced(two_sequences)
    k3 = math.exp(-0.2) + 0.2 - 1.0  # the 1-token sequence's k3; the other's is 0
    chi2 = math.exp(-0.4) - 1.0  # its ρ² − 1
    # ours: each sequence weighs 1 (the mean of 0.2 and 0)
    assert values["mis_kl"] == pytest.approx(0.1, rel=1e-6)
    assert values["mis_k3_kl"] == pytest.approx(k3 / 2, rel=1e-5)
    assert values["mis_chi2_token"] == pytest.approx(chi2 / 2, rel=1e-5)
    assert values["mis_log_ppl_diff"] == pytest.approx(0.1, rel=1e-6)  # verl's log_ppl_diff: the same mean
    # verl's kl, k3_kl: each token weighs 1 (0.2 over 4 tokens)
    assert values["mis_batch_kl"] == pytest.approx(0.05, rel=1e-6)
    assert values["mis_batch_k3"] == pytest.approx(k3 / 4, rel=1e-5)
    # perplexities: the mean over sequences of exp(−mean log π_train), as verl's training_ppl
    assert values["mis_training_ppl"] == pytest.approx((2 * math.exp(0.2) + 1.25) / 2, rel=1e-6)


def test_a_sequence_without_valid_token_counts_zero_in_the_perplexity(two_sequences):
    lists = {key: value + [torch.full((2,), math.log(0.3))] for key, value in two_sequences.items()
             if key != "loss_masks"}
    lists["loss_masks"] = two_sequences["loss_masks"] + [torch.zeros(2)]
    values = reduced(lists)
    # (2·e^0.2 + 1.25 + 0) / 3, where verl's training_ppl counts exp(0) = 1 for the empty row
    assert values["mis_training_ppl"] == pytest.approx((2 * math.exp(0.2) + 1.25) / 3, rel=1e-6)
    assert values["mis_batch_kl"] == pytest.approx(0.05 * 2 / 3, rel=1e-6)  # a batch value × share of non-empty
