"""``--model tiny``: the lab's TinyGPT (model.py) on sort/reverse (task.py), the embedded or the vLLM engine.

The policy interface is in policy.py. Every weight trains; the model starts from a supervised warm start.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor

from . import task, vllm_engine
from .engine import RolloutEngine
from .model import ModelConfig, TinyGPT, padded_logits, sequence_log_probs
from .prompts import Prompts


def warm_start(model: TinyGPT, steps: int, num_digits: int, seed: int, lr: float = 3e-3, kind: str = "sort") -> None:
    """Teacher-forced cross-entropy on the task: the 'pretrained model' RL starts from."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        prompts = task.make_prompts(64, num_digits, generator)
        sequences = torch.stack([torch.cat([p, task.target(p, kind)]) for p in prompts])
        logits = model(sequences[:, :-1])
        start = prompts.shape[1] - 1
        loss = torch.nn.functional.cross_entropy(logits[:, start:].reshape(-1, logits.shape[-1]),
                                                 sequences[:, start + 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def make_tiny_engine(args: argparse.Namespace, model: TinyGPT):
    """The rollout engine for the tiny model (``--engine``), synced with ``model``."""
    if args.engine == "vllm":
        return vllm_engine.VllmEngine(model, args.rollout_dtype, args.rollout_weight_quant, args.rollout_temperature,
                                      seed=args.seed + 1,
                                      top_k=args.rollout_top_k, top_p=args.rollout_top_p,
                                      logprob_source=args.rollout_logprob_source,
                                      max_batch=args.prompts_per_step * args.group_size,
                                      top_logprobs_num=getattr(args, "rollout_top_logprobs_num", 0))
    return RolloutEngine(model, args.rollout_dtype, args.rollout_weight_quant, args.rollout_temperature,
                         args.rollout_logit_noise, seed=args.seed + 1, top_k=args.rollout_top_k,
                         top_p=args.rollout_top_p, logprob_source=args.rollout_logprob_source,
                         top_logprobs_num=getattr(args, "rollout_top_logprobs_num", 0))


class TinyPolicy:
    """The lab's TinyGPT (model.py) on sort/reverse (task.py); every weight trains."""

    name = "tiny"

    def __init__(self, args: argparse.Namespace):
        self.args = args
        torch.manual_seed(args.seed)
        self.model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=2 * args.num_digits + 4,
                                         n_heads=args.n_heads, moe_experts=args.moe_experts,
                                         moe_top_k=args.moe_top_k))
        if args.sft_steps and not args.resume:
            warm_start(self.model, args.sft_steps, args.num_digits, args.seed, kind=args.task)
        self.max_new_tokens = args.num_digits + 2

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def make_engine(self):
        return make_tiny_engine(self.args, self.model)

    def sample_prompts(self, generator: torch.Generator) -> Prompts:
        prompts = task.make_prompts(self.args.prompts_per_step, self.args.num_digits, generator)
        prompts = prompts.repeat_interleave(self.args.group_size, dim=0)
        return Prompts(prompts, list(prompts))

    def rewards(self, prompts: Prompts, responses: list[Tensor]) -> Tensor:
        return torch.tensor([task.reward(p, r, self.args.task) for p, r in zip(prompts.problems, responses)])

    def old_log_probs(self, sequences: list[Tensor], prompt_lengths: list[int], routing: list[Tensor] | None = None,
                      kept: list | None = None, recompute: tuple[int, float] | None = None) -> tuple[list[Tensor], Any]:
        """π_old (over the ``kept`` sets, or, with ``recompute`` (top-k, top-p), over the trainer's own sets, which
        are left in ``last_kept``)."""
        with torch.no_grad():
            out = sequence_log_probs(self.model, sequences, prompt_lengths, self.args.rollout_temperature, routing,
                                     kept, recompute)
        if recompute is not None:
            out, self.last_kept = out
        return out, None

    def log_probs(self, sequences: list[Tensor], prompt_lengths: list[int], routing: list[Tensor] | None = None,
                  features: Any = None, kept: list | None = None) -> list[Tensor]:
        return sequence_log_probs(self.model, sequences, prompt_lengths, self.args.rollout_temperature, routing,
                                  kept)

    def response_logits(self, sequences: list[Tensor], prompt_lengths: list[int], routing: list[Tensor] | None = None,
                        features: Any = None) -> list[Tensor]:
        """Per sequence, the raw logits at the positions that score its response tokens ([response_length, V],
        differentiable; not divided by T): what score centering reads."""
        logits = padded_logits(self.model, sequences, routing)
        return [logits[i, p - 1:s.numel() - 1] for i, (s, p) in enumerate(zip(sequences, prompt_lengths))]

    def select_features(self, features: Any, indices: list[int]) -> Any:
        return None


def check_args(args: argparse.Namespace) -> None:
    """The tiny model's defaults for the model-dependent flags (heads: 4, or 2 for vLLM's CPU attention), and
    one-line refusals of the real model's flags and of what vLLM cannot serve."""
    args.engine = args.engine or "embedded"
    args.task = args.task or "sort"
    args.num_digits = 6 if args.num_digits is None else args.num_digits
    args.sft_steps = 30 if args.sft_steps is None else args.sft_steps
    args.lr = 1e-3 if args.lr is None else args.lr
    if args.task not in task.TASKS:
        raise ValueError(f"--task {args.task} is not available with --model tiny: allowed values are "
                         f"{', '.join(task.TASKS)}")
    if args.train_layers is not None:
        raise ValueError("--train-layers is not available with --model tiny: every weight of the tiny model "
                         "trains")
    if args.max_new_tokens is not None:
        raise ValueError("--max-new-tokens is not available with --model tiny: the response budget is "
                         "--num-digits + 2")
    if args.n_heads is None:
        args.n_heads = 2 if args.engine == "vllm" else 4
    if args.n_heads < 1 or ModelConfig.d_model % args.n_heads:
        raise ValueError(f"--n-heads {args.n_heads} is invalid: allowed values divide d_model "
                         f"{ModelConfig.d_model} (1, 2, 4, 8, 16, 32, 64)")
    if args.engine == "vllm":
        vllm_engine.check_args(args, embedded_engine=True)
        head_size = ModelConfig.d_model // args.n_heads
        if head_size not in vllm_engine.HEAD_SIZES:
            raise ValueError(f"--n-heads {args.n_heads} is not available with --model tiny --engine vllm: head size "
                             f"{head_size} is not one vLLM's CPU attention takes "
                             f"({', '.join(map(str, vllm_engine.HEAD_SIZES[:4]))}, ...); use --n-heads 1 or 2")
