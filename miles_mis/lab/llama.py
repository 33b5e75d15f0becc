"""The Llama architecture in plain torch, float32: the trainer of the lab's real pretrained model.

The same layers as transformers' ``LlamaForCausalLM`` (checked against it in tests/test_lab_real_model.py), under
the same parameter names, so a state dict goes to vLLM and to transformers unchanged:

    h = embed(tokens)
    per block:  h = h + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))),  n = rms_norm(h)
                h = h + down_proj(silu(gate_proj(n)) · up_proj(n)),                      n = rms_norm(h)
    logits = rms_norm(h) @ embedᵀ        (tied embeddings)

rms_norm(x) = x / sqrt(mean(x²) + ε) · w; rope rotates each (i, i + d/2) pair of a head by position · θ^(−2i/d);
attention is causal, with grouped key/value heads (each K/V head serves n_heads / n_kv_heads query heads).

Two things a CPU trainer needs, and why:

- ``trunk`` / ``head_from``: when only the top K blocks train, the frozen blocks below them compute the same
  hidden states for a sequence at every optimizer step (their weights and inputs do not change). The lab runs
  them once per rollout batch (with π_old) and the minibatch steps start from the cached output.
- ``token_log_probs``: only the sampled tokens' log-probs are needed, log p(y) = z_y − logsumexp(z), so the
  [tokens, 49152] logits exist for one chunk of positions at a time, and only at response positions; a
  [B, T, V] log-softmax is never formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0

    @classmethod
    def from_hf_config(cls, config: dict) -> "LlamaShape":
        """The shape from a transformers ``config.json`` (a dict); refuses what this module does not implement."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default" or config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError(f"config.json: a Llama variant this trainer does not implement (rope {rope}, "
                             f"attention_bias {config.get('attention_bias')}, mlp_bias {config.get('mlp_bias')})")
        if not config.get("tie_word_embeddings", False):
            raise ValueError("config.json: tie_word_embeddings is false; this trainer implements the tied head only")
        heads = config["num_attention_heads"]
        return cls(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                   intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
                   num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   rms_norm_eps=config["rms_norm_eps"],
                   rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of [B, H, L, D] (transformers' layout: pairs (i, i + D/2))."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        width, heads, kv_heads, head = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_proj = nn.Linear(width, heads * head, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head, bias=False)
        self.o_proj = nn.Linear(heads * head, width, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, length, _ = x.shape
        s = self.shape
        q = self.q_proj(x).view(batch, length, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        groups = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # right-padded batches need no mask: a causal query never reads the padding after its own sequence
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """``model.*`` of transformers' LlamaForCausalLM: embeddings, blocks, final norm."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, shape: LlamaShape = LlamaShape()):
        super().__init__()
        self.shape = shape
        self.model = Decoder(shape)
        half = torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim
        self.register_buffer("inv_freq", (1.0 / shape.rope_theta ** half).float(), persistent=False)

    def rope(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin [L, D] of positions 0..L−1 (computed as transformers does: float32 outer product)."""
        angles = torch.outer(torch.arange(length, dtype=torch.float32), self.inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def trunk(self, tokens: Tensor, num_layers: int) -> Tensor:
        """[B, L] token ids -> the hidden states [B, L, d] entering block ``num_layers`` (0: the embeddings)."""
        x = self.model.embed_tokens(tokens)
        cos, sin = self.rope(tokens.shape[1])
        for block in self.model.layers[:num_layers]:
            x = block(x, cos, sin)
        return x

    def head_from(self, hidden: Tensor, first_layer: int) -> Tensor:
        """Hidden states entering block ``first_layer`` -> the final-norm output [B, L, d] (before the head)."""
        cos, sin = self.rope(hidden.shape[1])
        for block in self.model.layers[first_layer:]:
            hidden = block(hidden, cos, sin)
        return self.model.norm(hidden)

    def forward(self, tokens: Tensor) -> Tensor:
        """[B, L] -> float32 logits [B, L, V] (for tests and small inputs; the lab uses ``token_log_probs``)."""
        return self.head_from(self.trunk(tokens, 0), 0) @ self.model.embed_tokens.weight.t()

    def token_log_probs(self, normed: Tensor, targets: Tensor, temperature: float = 1.0, chunk: int = 512) -> Tensor:
        """log softmax(normed · Eᵀ / T)[target] for [N, d] final-norm outputs and [N] targets, ``chunk`` rows at a
        time: log p(y) = z_y − logsumexp(z), z = normed · Eᵀ / T."""
        weight = self.model.embed_tokens.weight
        out = []
        for start in range(0, normed.shape[0], chunk):
            logits = (normed[start:start + chunk] @ weight.t()) / temperature
            picked = logits.gather(1, targets[start:start + chunk, None]).squeeze(1)
            out.append(picked - torch.logsumexp(logits, dim=-1))
        return torch.cat(out) if out else normed.new_zeros(0)

    def kept_token_log_probs(self, normed: Tensor, targets: Tensor, temperature: float, kept, recompute,
                             chunk: int = 512):
        """``token_log_probs`` over kept sets (kept_set.score): the given ``kept`` KeptSets of the N rows, or with
        ``recompute`` (top-k, top-p) the trainer's own; (log-probs [N], the sets used), ``chunk`` rows at a time."""
        from .kept_set import KeptSets, recompute_sets, score

        weight = self.model.embed_tokens.weight
        out, used = [], []
        for start in range(0, normed.shape[0], chunk):
            end = min(start + chunk, normed.shape[0])
            logits = (normed[start:end] @ weight.t()) / temperature
            sets = kept.rows(start, end) if kept is not None else recompute_sets(logits.detach(), targets[start:end],
                                                                                 *recompute)
            used.append(sets)
            out.append(score(logits, targets[start:end], sets))
        return (torch.cat(out) if out else normed.new_zeros(0)), KeptSets.cat(used)
