"""The rollout engine: incremental decoding with a KV cache over its own copy of the weights.

It is a different numeric path from the trainer, as SGLang is from Megatron: token-by-token attention
written out by hand instead of a fused full-sequence kernel, computed in ``dtype`` (bf16/fp16/fp32),
over weights copied at each sync, optionally int8-quantised (per output row, symmetric, as low-precision
rollout does), and synced only every K steps (staleness, as in async training). A synthetic Gaussian
logit noise can be added for stress tests; it is labelled synthetic wherever it appears.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .model import TinyGPT
from .task import EOS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quantize_int8(weight: Tensor) -> Tensor:
    """Symmetric per-row int8 fake quantisation: round(w / s)·s with s = max|w_row| / 127."""
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return (weight / scale).round().clamp(-127, 127) * scale


class RolloutEngine:
    def __init__(self, model: TinyGPT, dtype: str = "bf16", weight_quant: str = "none",
                 temperature: float = 1.0, logit_noise: float = 0.0, seed: int = 0):
        if dtype not in DTYPES:
            raise ValueError(f"--rollout-dtype={dtype!r} is invalid: allowed values are {', '.join(DTYPES)}")
        if weight_quant not in ("none", "int8"):
            raise ValueError(f"--rollout-weight-quant={weight_quant!r} is invalid: allowed values are none, int8")
        if temperature <= 0:
            raise ValueError(f"--rollout-temperature={temperature} is invalid: allowed values are > 0")
        self.cfg = model.cfg
        self.dtype = DTYPES[dtype]
        self.weight_quant = weight_quant
        self.temperature = temperature
        self.logit_noise = logit_noise  # SYNTHETIC: Gaussian noise added to the engine's logits
        self.generator = torch.Generator().manual_seed(seed)
        self.weights: dict[str, Tensor] = {}
        self.sync(model)

    def sync(self, model: TinyGPT) -> None:
        """Copy the trainer's weights (quantising matrices when asked) in the engine dtype."""
        self.weights = {}
        for name, value in model.state_dict().items():
            value = value.detach().clone().float()
            if self.weight_quant == "int8" and value.dim() == 2:
                value = quantize_int8(value)
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

    def _step(self, tokens: Tensor, position: int, cache: list[dict]) -> Tensor:
        """One token per sequence -> float32 logits [N, V]; appends this position's K, V to the cache."""
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
            hidden = F.gelu(self._linear(self._layer_norm(x, f"{prefix}.ln2"), f"{prefix}.fc"))
            x = x + self._linear(hidden, f"{prefix}.out")
        return self._linear(self._layer_norm(x, "ln_f"), "head").float()

    @torch.no_grad()
    def generate(self, prompts: Tensor, max_new_tokens: int) -> tuple[list[Tensor], list[Tensor]]:
        """Sample a response per prompt (until EOS). Returns (responses, per-token log-probs), the
        log-probs of the sampled tokens under the engine's own distribution softmax(logits / T)."""
        count, prompt_len = prompts.shape
        cache = [{} for _ in range(self.cfg.n_layers)]
        for position in range(prompt_len - 1):
            self._step(prompts[:, position], position, cache)
        current = prompts[:, -1]
        tokens, log_probs = [], []
        done = torch.zeros(count, dtype=torch.bool)
        lengths = torch.full((count,), max_new_tokens)
        for step in range(max_new_tokens):
            logits = self._step(current, prompt_len - 1 + step, cache)
            if self.logit_noise > 0:  # SYNTHETIC mismatch
                logits = logits + self.logit_noise * torch.randn(logits.shape, generator=self.generator)
            step_log_probs = torch.log_softmax(logits / self.temperature, dim=-1)
            current = torch.multinomial(step_log_probs.exp(), 1, generator=self.generator).squeeze(1)
            tokens.append(current)
            log_probs.append(step_log_probs.gather(1, current[:, None]).squeeze(1))
            finished_now = (current == EOS) & ~done
            lengths = torch.where(finished_now, torch.full_like(lengths, step + 1), lengths)
            done |= current == EOS
            if bool(done.all()):
                break
        tokens = torch.stack(tokens, 1)
        log_probs = torch.stack(log_probs, 1)
        return ([tokens[i, :lengths[i]] for i in range(count)], [log_probs[i, :lengths[i]] for i in range(count)])
