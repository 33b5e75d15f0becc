"""``miles-mis train``: GRPO on a verifiable task, with a rollout engine that disagrees with the trainer.

The model, its task and its engine are the ``--model`` policy (policy.py: the tiny GPT sorting digits, or
SmolLM2-135M-Instruct adding numbers in a chat prompt); the loop below is the same for both. One step: the engine
samples ``--group-size`` responses for each of ``--prompts-per-step`` prompts and
returns their log-probs; the trainer (fp32) recomputes π_old; rewards give GRPO group advantages; then
``--num-minibatches`` optimizer steps run the reference host's policy loss (``miles_mis.reference_host``) with
the plugin loaded through ``--custom-tis-function-path`` / ``--custom-config-path`` exactly as miles
would. Under ``torchrun ... --context-parallel-size C`` every rank runs the whole model, but the log-probs
handed to the host and plugin are this rank's zigzag shards and the gradients are summed over the group.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import reference_host
from ..parallel.cp_layout import zigzag_layout
from . import centering_loss, flags, schedule
from .dump import PolicyLossDumper, policy_loss_record
from .policy import make_policy
from .rollout_collection import Rollout, collect_rollout
from .run_output import Progress, finish_wandb, start_wandb, written_files

PLUGIN = "miles_mis.compute_mis_weights_with_cp"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles-mis train", description=__doc__,
                                     formatter_class=reference_host.HelpFormatter)
    flags.add_policy_loss_flags(parser)
    flags.add_lab_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The lab's flags, validated (``parser``: build_parser() or one with the same flags, as ``miles-mis measure``)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    reference_host.merge_config_file(args, parser)  # the lab's flags in the YAML are checked like the host's
    reference_host.validate_args(args)
    flags.check_lab_args(args)
    return args


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


def start_run(args: argparse.Namespace) -> LabRun:
    """The model (warm-started unless resuming), optimizer, rollout engine and prompt stream; a resumed run's state."""
    if centering_loss.enabled(args) and args.context_parallel_size > 1:
        raise ValueError("score_centering: true with --context-parallel-size > 1: the lab's score centering is"
                         " single-process (the adapters' CP layout is tested on gloo): use --context-parallel-size 1")
    cp = CPContext(args.context_parallel_size)
    # before the warm start: a fresh run into a directory holding another run's dumps fails at once
    dumper = PolicyLossDumper(args.dump_details, cp.rank, args.dump_interval, resume=args.resume)
    policy = make_policy(args)  # seeded from --seed; the tiny model warm-started unless resuming
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    # the versions a batch can come from
    keep = max(args.rollout_staleness, args.async_max_lag + 1, getattr(args, "rollout_lag", 0) + 1)
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


def load_checkpoint(path: Path) -> dict:
    """A lab checkpoint, loaded without unpickling code (tensors, numbers, lists and dicts only)."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--resume {path}: not a lab checkpoint that loads without executing code "
                         f"(weights_only=True): {first}") from None


# --------------------------------------------------------------------------- the loop
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
    wandb_run = start_wandb(args, out_dir) if writer else None
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
        finish_wandb(wandb_run)
    return run.history


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
    if centering_loss.enabled(args):  # the score-centered loss replaces the host's policy loss
        loss, metrics = centering_loss.policy_loss(run.policy, args, rollout, idx)
        return {k: _scalar(v) for k, v in metrics.items()}, _optimizer_step(run, loss, len(idx), args.grad_clip)
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
    loss, metrics = reference_host.policy_loss(args, batch, current, parallel_state=cp.state)
    run.dumper.call(step + 1, lambda: policy_loss_record(args, batch, current, shard(batch["loss_masks"])))
    grad_norm = _optimizer_step(run, loss, len(idx), args.grad_clip)
    values = torch.tensor([_scalar(v) for v in metrics.values()], dtype=torch.float64)
    if cp.size > 1:  # per-batch fractions are the same on every rank; the rest are partial sums
        partial = torch.tensor([k != "opsm_fraction" for k in metrics], dtype=torch.float64)
        values = cp.all_reduce(values * partial) + values * (1 - partial)
    return dict(zip(metrics, values.tolist())), grad_norm


def _optimizer_step(run: LabRun, loss: torch.Tensor, num_samples: int, grad_clip: float) -> float:
    """Backward of the host's loss (a sum over the samples: divided by their number), the gradients summed over the
    CP group, clipped to ``grad_clip``; one optimizer step. Returns the gradient norm before clipping."""
    run.optimizer.zero_grad()
    (loss / num_samples).backward()
    trained = run.policy.parameters()
    for p in trained:
        if p.grad is not None:
            run.cp.all_reduce(p.grad)
    grad_norm = torch.nn.utils.clip_grad_norm_(trained, grad_clip)
    run.optimizer.step()
    return float(grad_norm)


# --------------------------------------------------------------------------- pieces
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


def _scalar(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


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
