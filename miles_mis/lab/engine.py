"""The rollout engine: incremental decoding with a KV cache over its own copy of the weights.

It is a different numeric path from the trainer, as SGLang is from Megatron: token-by-token attention
written out by hand instead of a fused full-sequence kernel, computed in ``dtype`` (bf16/fp16/fp32),
over weights copied at each sync, optionally quantised (int8: symmetric per output row; fp8: e4m3 with a
per-row scale, as fp8 rollout does), and synced only every K steps (staleness, as in async training).
A MoE model's router runs in the engine dtype too, so near-tie tokens may pick other experts than the
trainer's float32 router; the engine records its choices for router replay. Sampling may be truncated
(top-k, top-p), and the engine reports either the log-probs of the full temperature-scaled distribution
(what SGLang and vLLM return by default) or those of the truncated distribution it actually sampled from.
A synthetic Gaussian logit noise can be added for stress tests; it is labelled synthetic wherever it appears.

With ``top_logprobs_num`` K > 0 (``--rollout-top-logprobs-num``) the engine also records each response token's
score-centering candidates (``last_candidates``): the K most likely tokens of the distribution whose log-probs it
reports, with those log-probs, exactly as the vLLM engine's (vllm_engine.py): under ``full`` the temperature-scaled
distribution, under ``processed`` with top-k/top-p the truncated one, whose candidates are its support ("support
mode"; a support larger than K is an error, :func:`support_overflow`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .candidates import candidate_slots, check_top_logprobs_num, support_overflow
from .kept_set import KeptSets, truncation_keep
from .model import TinyGPT, choose_experts, mix_experts
from .task import EOS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHT_QUANTS = ("none", "int8", "fp8")
LOGPROB_SOURCES = ("full", "processed")
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


def quantize_int8(weight: Tensor) -> Tensor:
    """Symmetric per-row int8 fake quantisation: round(w / s)·s with s = max|w_row| / 127."""
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return (weight / scale).round().clamp(-127, 127) * scale


def quantize_fp8(weight: Tensor) -> Tensor:
    """fp8 e4m3 fake quantisation with a per-row scale: cast(w / s, e4m3)·s, s = max|w_row| / 448, so each
    row's largest weight maps to e4m3's largest value. e4m3 keeps 3 mantissa bits: a relative rounding
    error of at most 2⁻⁴ for normal values (plus the subnormal floor, 2⁻⁹·s absolute)."""
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (weight / scale).to(torch.float8_e4m3fn).float() * scale


def truncate_distribution(probs: Tensor, top_k: int, top_p: float) -> Tensor:
    """The sampling distribution after top-k then top-p truncation (kept_set.truncation_keep), renormalised
    ([N, V] -> [N, V])."""
    if top_k <= 0 and top_p >= 1.0:
        return probs
    kept = probs * truncation_keep(probs, top_k, top_p)
    return kept / kept.sum(-1, keepdim=True)


class RolloutEngine:
    def __init__(self, model: TinyGPT, dtype: str = "bf16", weight_quant: str = "none",
                 temperature: float = 1.0, logit_noise: float = 0.0, seed: int = 0, top_k: int = 0,
                 top_p: float = 1.0, logprob_source: str = "full", top_logprobs_num: int = 0):
        if dtype not in DTYPES:
            raise ValueError(f"--rollout-dtype={dtype!r} is invalid: allowed values are {', '.join(DTYPES)}")
        if weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"--rollout-weight-quant={weight_quant!r} is invalid: allowed values are "
                             f"{', '.join(WEIGHT_QUANTS)}")
        if temperature <= 0:
            raise ValueError(f"--rollout-temperature={temperature} is invalid: allowed values are > 0")
        if top_k < 0 or not 0.0 < top_p <= 1.0:
            raise ValueError(f"--rollout-top-k={top_k} / --rollout-top-p={top_p} is invalid: allowed values are "
                             "top-k >= 0 (0 = off) and top-p in (0, 1] (1 = off)")
        if logprob_source not in LOGPROB_SOURCES:
            raise ValueError(f"--rollout-logprob-source={logprob_source!r} is invalid: allowed values are "
                             f"{', '.join(LOGPROB_SOURCES)}")
        check_top_logprobs_num(top_logprobs_num)
        self.top_logprobs_num = top_logprobs_num
        self.last_candidates: list[tuple[Tensor, Tensor]] | None = None  # per response (ids, log-probs) [R, K]
        self.cfg = model.cfg
        self.dtype = DTYPES[dtype]
        self.weight_quant = weight_quant
        self.temperature = temperature
        self.top_k, self.top_p, self.logprob_source = top_k, top_p, logprob_source
        self.logit_noise = logit_noise  # SYNTHETIC: Gaussian noise added to the engine's logits
        self.generator = torch.Generator().manual_seed(seed)
        self.weights: dict[str, Tensor] = {}
        self.sync(model)

    def sync(self, model: TinyGPT) -> None:
        """Copy the trainer's weights (quantising matrices, experts' included, when asked) in the engine dtype."""
        quantize = {"int8": quantize_int8, "fp8": quantize_fp8}.get(self.weight_quant)
        self.weights = {}
        for name, value in model.state_dict().items():
            value = value.detach().clone().float()
            if quantize is not None and value.dim() >= 2:
                value = quantize(value)
            self.weights[name] = value.to(self.dtype)

    def state_dict(self) -> dict:
        return {"weights": self.weights, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.weights = state["weights"]
        self.generator.set_state(state["generator"])

    # ------------------------------------------------------------------ decoding
    def _linear(self, x: Tensor, name: str) -> Tensor:
        bias = self.weights.get(f"{name}.bias")
        return F.linear(x, self.weights[f"{name}.weight"], bias)

    def _layer_norm(self, x: Tensor, name: str) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weights[f"{name}.weight"], self.weights[f"{name}.bias"])

    def _mlp(self, x: Tensor, prefix: str) -> tuple[Tensor, Tensor | None]:
        """The block's MLP in the engine dtype: (output, expert choices [N, k] of a MoE block, else None)."""
        if f"{prefix}.moe.router.weight" not in self.weights:
            return self._linear(F.gelu(self._linear(x, f"{prefix}.fc")), f"{prefix}.out"), None
        w = {name: self.weights[f"{prefix}.moe.{name}"] for name in ("fc_weight", "fc_bias", "out_weight",
                                                                     "out_bias")}
        logits = self._linear(x, f"{prefix}.moe.router")  # in the engine dtype: ties break differently
        choices = choose_experts(logits, self.cfg.moe_top_k)
        return mix_experts(x, logits, choices, w["fc_weight"], w["fc_bias"], w["out_weight"], w["out_bias"]), choices

    def _step(self, tokens: Tensor, position: int, cache: list[dict]) -> Tensor:
        """One token per sequence -> float32 logits [N, V]; appends this position's K, V to the cache (and, for a
        MoE model, each layer's expert choices [N, k] to ``layer_cache["choices"]``)."""
        w = self.weights
        x = w["tok.weight"][tokens] + w["pos.weight"][position]
        heads, width = self.cfg.n_heads, self.cfg.d_model
        head_dim = width // heads
        for layer, layer_cache in enumerate(cache):
            prefix = f"blocks.{layer}"
            q, k, v = self._linear(self._layer_norm(x, f"{prefix}.ln1"), f"{prefix}.qkv").split(width, dim=-1)
            q, k, v = (t.view(-1, heads, 1, head_dim) for t in (q, k, v))
            layer_cache["k"] = k if "k" not in layer_cache else torch.cat([layer_cache["k"], k], dim=2)
            layer_cache["v"] = v if "v" not in layer_cache else torch.cat([layer_cache["v"], v], dim=2)
            scores = (q @ layer_cache["k"].transpose(-1, -2)) / math.sqrt(head_dim)
            attn = torch.softmax(scores, dim=-1) @ layer_cache["v"]
            x = x + self._linear(attn.reshape(-1, width), f"{prefix}.proj")
            mixed, choices = self._mlp(self._layer_norm(x, f"{prefix}.ln2"), prefix)
            x = x + mixed
            if choices is not None:
                layer_cache.setdefault("choices", []).append(choices)
        return self._linear(self._layer_norm(x, "ln_f"), "head").float()

    @torch.no_grad()
    def generate(self, prompts: Tensor, max_new_tokens: int) -> tuple[list[Tensor], list[Tensor]]:
        """Sample a response per prompt (until EOS). Returns (responses, per-token log-probs): the log-probs of
        the sampled tokens under softmax(logits / T) (``logprob_source`` full) or under the truncated
        distribution sampled from (processed). The sets sampled from (top-k/top-p) are in ``last_kept``. A MoE
        engine's expert choices of the last call are in
        ``last_routing``: per response, [n_layers, prompt_len + len − 1, k] (every position it ran). With
        ``top_logprobs_num`` K > 0, ``last_candidates``: per response (ids [len, K] int64, log-probs [len, K]
        float32), the K most likely tokens of the reported distribution in decreasing order (unused slots -1 /
        -inf: past its support, or past the vocabulary); else None."""
        count, prompt_len = prompts.shape
        cache = [{} for _ in range(self.cfg.n_layers)]
        for position in range(prompt_len - 1):
            self._step(prompts[:, position], position, cache)
        current = prompts[:, -1]
        tokens, log_probs, keeps, ranked = [], [], [], []
        truncating = self.top_k > 0 or self.top_p < 1.0
        done = torch.zeros(count, dtype=torch.bool)
        lengths = torch.full((count,), max_new_tokens)
        for step in range(max_new_tokens):
            logits = self._step(current, prompt_len - 1 + step, cache)
            if self.logit_noise > 0:  # SYNTHETIC mismatch
                logits = logits + self.logit_noise * torch.randn(logits.shape, generator=self.generator)
            step_log_probs = torch.log_softmax(logits / self.temperature, dim=-1)
            sampling = truncate_distribution(step_log_probs.exp(), self.top_k, self.top_p)
            current = torch.multinomial(sampling, 1, generator=self.generator).squeeze(1)
            if truncating:  # the sampling mask: exactly the set sampled from
                keeps.append(truncation_keep(step_log_probs.exp(), self.top_k, self.top_p))
            tokens.append(current)
            reported = step_log_probs if self.logprob_source == "full" else sampling.log()
            log_probs.append(reported.gather(1, current[:, None]).squeeze(1))
            if self.top_logprobs_num:  # [count, requested]: values, ids, in decreasing order
                ranked.append(reported.topk(self._requested(truncating), dim=-1))
            finished_now = (current == EOS) & ~done
            lengths = torch.where(finished_now, torch.full_like(lengths, step + 1), lengths)
            done |= current == EOS
            if bool(done.all()):
                break
        tokens = torch.stack(tokens, 1)
        log_probs = torch.stack(log_probs, 1)
        self.last_kept = None  # per response, its sampling masks (KeptSets); None when nothing truncates
        if truncating:
            keep = torch.stack(keeps, 1)  # [count, steps, V]
            self.last_kept = [KeptSets.from_mask(keep[i, :int(lengths[i])], tokens[i, :int(lengths[i])])
                              for i in range(count)]
        self.last_candidates = self._candidates(ranked, lengths, truncating) if self.top_logprobs_num else None
        self.last_routing = None
        if self.cfg.moe_experts:  # [n_layers, count, positions run, k] -> per response, the positions it used
            routing = torch.stack([torch.stack(layer_cache["choices"], 1) for layer_cache in cache])
            self.last_routing = [routing[:, i, :prompt_len - 1 + int(lengths[i])] for i in range(count)]
        return ([tokens[i, :lengths[i]] for i in range(count)], [log_probs[i, :lengths[i]] for i in range(count)])

    def _requested(self, truncating: bool) -> int:
        """Ranked entries per token: K, and in support mode one more, the witness that a support fits in K (finite:
        it does not); at most the vocabulary."""
        support_mode = self.logprob_source == "processed" and truncating
        return min(self.top_logprobs_num + support_mode, self.cfg.vocab_size)

    def _candidates(self, ranked: list, lengths: Tensor, truncating: bool) -> list[tuple[Tensor, Tensor]]:
        """Each response's candidates from the steps' ranked (values, ids) of the reported distribution; in support
        mode a finite witness (the K+1-th entry) at a response token is an error (:func:`support_overflow`)."""
        k = self.top_logprobs_num
        values = torch.stack([r.values for r in ranked], 1)  # [count, steps, requested]
        ids = torch.stack([r.indices for r in ranked], 1)
        count, steps, requested = values.shape
        if requested > k:  # support mode with K < V
            in_response = torch.arange(steps) < lengths[:, None]  # the steps after a response's EOS are not its own
            overflowing = torch.isfinite(values[..., k]) & in_response
            if bool(overflowing.any()):
                raise ValueError(support_overflow(k, int(overflowing.sum()), int(lengths.sum()), self.top_k,
                                                  self.cfg.vocab_size))
        ids, values = candidate_slots(ids[..., :k].reshape(count * steps, -1),
                                      values[..., :k].reshape(count * steps, -1), k)
        ids, values = ids.view(count, steps, k), values.view(count, steps, k)
        return [(ids[i, :int(n)], values[i, :int(n)]) for i, n in enumerate(lengths)]
