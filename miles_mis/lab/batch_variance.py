"""Batch variance of generation: the same requests, with the same per-request seeds, decoded in two batch
compositions (benchmarks/lab_real_model.py variance; ``miles-mis measure --batch-term``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..analyze.estimators import k3_terms


def decode_in_batches(engine, prompts: list[Tensor], seeds: list[int], max_new_tokens: int,
                      size: int) -> tuple[list[Tensor], list[Tensor]]:
    """The requests decoded ``size`` at a time, each with its own seed (``VllmEngine.generate_arriving``, every
    request of a batch arriving together): (tokens, log-probs) per request, in order."""
    tokens, log_probs = [], []
    for start in range(0, len(prompts), size):
        chunk = slice(start, start + size)
        t, lp = engine.generate_arriving(prompts[chunk], seeds[chunk], max_new_tokens, [0] * len(prompts[chunk]))
        tokens += t
        log_probs += lp
    return tokens, log_probs


def compare_generations(reference: tuple[list[Tensor], list[Tensor]], other: tuple[list[Tensor], list[Tensor]]) -> dict:
    """Two generations of the same requests, each (tokens, log-probs) per request: how many responses are identical,
    and the log-prob difference d = reference − other on each response's common prefix (its tokens before the first
    that differs): max and mean |d| and k3 = mean(e^d − d − 1) over those tokens (0 when none is shared)."""
    identical, compared, differences = 0, 0, [torch.zeros(0, dtype=torch.float64)]
    for ref_tokens, ref_lp, got_tokens, got_lp in zip(*reference, *other):
        shared = min(len(ref_tokens), len(got_tokens))
        prefix = int((ref_tokens[:shared] == got_tokens[:shared]).long().cumprod(0).sum())
        identical += int(prefix == len(ref_tokens) == len(got_tokens))
        compared += prefix
        differences.append(ref_lp[:prefix].double() - got_lp[:prefix].double())
    difference = torch.cat(differences)
    return {"identical_responses": identical, "prefix_tokens": compared,
            "max_abs": float(difference.abs().max()) if compared else 0.0,
            "mean_abs": float(difference.abs().mean()) if compared else 0.0,
            "k3": float(k3_terms(difference).mean()) if compared else 0.0}
