"""A tiny decoder-only transformer in plain torch: the trainer's model.

The trainer scores whole sequences with ``forward`` in float32. The rollout engine (engine.py)
decodes token by token with its own code path over a copy of these weights.

With ``moe_experts`` E > 0 each block's MLP is a routed mixture of E experts (top ``moe_top_k``, gates a
softmax over the chosen router logits, as Mixtral/DeepSeek-style MoE layers). The trainer's router runs in
float32; the engine runs its own in the engine dtype, so near-tie tokens can go to different experts: the MoE
routing mismatch. ``routing`` replays given expert choices instead (router replay, the R3 idea).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import kept_set


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 14
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 32
    moe_experts: int = 0  # 0: a dense MLP per block; E > 0: a routed mixture of E experts
    moe_top_k: int = 2  # experts per token (with moe_experts > 0)

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one expert: the dense MLP's 4·d shared among the experts a token uses (at least 16)."""
        return max(16, 4 * self.d_model * self.moe_top_k // max(self.moe_experts, 1))


NO_CHOICE = -1  # in a routing tensor: no recorded expert choice here, the router picks


def choose_experts(router_logits: Tensor, top_k: int, replay: Tensor | None = None) -> Tensor:
    """[..., E] router logits -> [..., k] expert indices: the top k, or the replayed choices where recorded."""
    own = router_logits.topk(top_k, dim=-1).indices
    if replay is None:
        return own
    return torch.where(replay[..., :1] >= 0, replay, own)


def mix_experts(x: Tensor, router_logits: Tensor, choices: Tensor, fc_weight: Tensor, fc_bias: Tensor,
                out_weight: Tensor, out_bias: Tensor) -> Tensor:
    """Σ_{e ∈ choices} g_e · expert_e(x), g = softmax of the chosen router logits, expert_e(x) =
    W_out,e · gelu(W_fc,e · x + b_fc,e) + b_out,e. Every expert is evaluated densely (E is small here) and
    the gates are scattered into an [..., E] mixing vector: the same arithmetic at every position."""
    gates = torch.softmax(router_logits.gather(-1, choices), dim=-1)
    mixing = torch.zeros_like(router_logits).scatter(-1, choices, gates).to(x.dtype)
    hidden = F.gelu(torch.einsum("...d,ehd->...eh", x, fc_weight) + fc_bias)
    outputs = torch.einsum("...eh,edh->...ed", hidden, out_weight) + out_bias
    return torch.einsum("...e,...ed->...d", mixing, outputs)


class MoE(nn.Module):
    """The routed MLP of a block (the trainer's: router in float32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        experts, width, hidden = cfg.moe_experts, cfg.d_model, cfg.expert_hidden
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.fc_weight = nn.Parameter(torch.randn(experts, hidden, width) / math.sqrt(width))
        self.fc_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.out_weight = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(hidden))
        self.out_bias = nn.Parameter(torch.zeros(experts, width))

    def forward(self, x: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor]:
        logits = self.router(x).float()
        choices = choose_experts(logits, self.top_k, replay)
        return mix_experts(x, logits, choices, self.fc_weight, self.fc_bias, self.out_weight, self.out_bias), choices


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.moe_experts:
            self.moe = MoE(cfg)
        else:
            self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
            self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(output, the expert choices [B, L, k] of a MoE block, else None)."""
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        shape = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, width))
        if not hasattr(self, "moe"):
            return x + self.out(F.gelu(self.fc(self.ln2(x)))), None
        mixed, choices = self.moe(self.ln2(x), replay)
        return x + mixed, choices


class TinyGPT(nn.Module):
    def __init__(self, cfg: ModelConfig = ModelConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: Tensor, routing: Tensor | None = None) -> Tensor:
        """[B, L] token ids -> [B, L, V] float32 logits (position p predicts token p+1).

        ``routing``: [n_layers, B, L, k] expert choices to replay (NO_CHOICE where none was recorded)."""
        return self.forward_with_routing(tokens, routing)[0]

    def forward_with_routing(self, tokens: Tensor, routing: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(logits, the expert choices used [n_layers, B, L, k], or None for a dense model)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        used = []
        for layer, block in enumerate(self.blocks):
            x, choices = block(x, None if routing is None else routing[layer])
            used.append(choices)
        return self.head(self.ln_f(x)), (torch.stack(used) if self.cfg.moe_experts else None)


def right_padded(sequences: list[Tensor]) -> Tensor:
    """[B, max length] token ids, each sequence left-aligned, zeros after it (causal attention never reads them)."""
    padded = torch.zeros(len(sequences), max(s.numel() for s in sequences), dtype=torch.long)
    for i, s in enumerate(sequences):
        padded[i, :s.numel()] = s
    return padded


def padded_logits(model: TinyGPT, sequences: list[Tensor], routing: list[Tensor] | None = None) -> Tensor:
    """The fp32 logits [B, L_max, V] of the right-padded sequences, the engine's expert choices replayed (``routing``
    as in ``sequence_log_probs``)."""
    padded = right_padded(sequences)
    replay = None
    if routing is not None:
        layers, _, top_k = routing[0].shape
        replay = torch.full((layers, *padded.shape, top_k), NO_CHOICE, dtype=torch.long)
        for i, choices in enumerate(routing):
            replay[:, i, :choices.shape[1]] = choices
    return model(padded, replay).float()


def sequence_log_probs(model: TinyGPT, sequences: list[Tensor], prompt_lengths: list[int],
                       temperature: float, routing: list[Tensor] | None = None, kept: list | None = None,
                       recompute: tuple[int, float] | None = None) -> list[Tensor] | tuple[list[Tensor], list]:
    """Trainer log-probs of every response token (fp32 full forward, logits / T), one tensor per sequence.

    Sequences are right-padded into one batch; sequence i's response token j is scored at position
    prompt_len − 1 + j, as in Megatron. ``routing``: per sequence, the engine's expert choices
    [n_layers, L_i − 1, k] to replay (router replay); the last position, which the engine never ran, uses
    the trainer's own router (its output scores nothing). ``kept``: per sequence, the kept sets (kept_set.KeptSets)
    to score over instead of the whole vocabulary; ``recompute`` (top-k, top-p): also return the trainer's own sets
    of the response tokens, (log-probs over them, sets).
    """
    logits = padded_logits(model, sequences, routing) / temperature
    if kept is None and recompute is None:
        log_probs = torch.log_softmax(logits, dim=-1)
        return [log_probs[i, p - 1:s.numel() - 1].gather(1, s[p:, None]).squeeze(1)
                for i, (s, p) in enumerate(zip(sequences, prompt_lengths))]
    out, sets = [], []
    for i, (s, p) in enumerate(zip(sequences, prompt_lengths)):
        rows, targets = logits[i, p - 1:s.numel() - 1], s[p:]
        own = kept[i] if kept is not None else kept_set.recompute_sets(rows.detach(), targets, *recompute)
        sets.append(own)
        out.append(kept_set.score(rows, targets, own))
    return (out, sets) if recompute is not None else out


@torch.no_grad()
def routing_disagreement(model: TinyGPT, sequences: list[Tensor], routing: list[Tensor]) -> float:
    """Fraction of (layer, position) routing decisions where the trainer's own float32 router picks another set
    of experts than the engine recorded (over every position the engine ran)."""
    padded = right_padded(sequences)
    _, own = model.forward_with_routing(padded)
    differ = total = 0
    for i, engine_choices in enumerate(routing):
        mine = own[:, i, :engine_choices.shape[1]].sort(-1).values
        differ += int((mine != engine_choices.sort(-1).values).any(-1).sum())
        total += engine_choices.shape[0] * engine_choices.shape[1]
    return differ / max(total, 1)
