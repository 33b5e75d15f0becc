"""A tiny decoder-only transformer in plain torch: the trainer's model.

The trainer scores whole sequences with ``forward`` in float32. The rollout engine (engine.py)
decodes token by token with its own code path over a copy of these weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 14
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 32


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        shape = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: ModelConfig = ModelConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """[B, L] token ids -> [B, L, V] float32 logits (position p predicts token p+1)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def sequence_log_probs(model: TinyGPT, sequences: list[Tensor], prompt_lengths: list[int],
                       temperature: float) -> list[Tensor]:
    """Trainer log-probs of every response token (fp32 full forward, logits / T), one tensor per sequence.

    Sequences are right-padded into one batch; sequence i's response token j is scored at position
    prompt_len − 1 + j, as in Megatron.
    """
    lengths = [s.numel() for s in sequences]
    padded = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    for i, s in enumerate(sequences):
        padded[i, :s.numel()] = s
    log_probs = torch.log_softmax(model(padded).float() / temperature, dim=-1)
    out = []
    for i, (s, p) in enumerate(zip(sequences, prompt_lengths)):
        targets = s[p:]
        out.append(log_probs[i, p - 1:s.numel() - 1].gather(1, targets[:, None]).squeeze(1))
    return out
