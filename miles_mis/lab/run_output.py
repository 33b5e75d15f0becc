"""What a lab run shows and leaves besides its metrics file: the per-step progress on stderr (:class:`Progress`),
the W&B run (:func:`start_wandb`, :func:`finish_wandb`) and the closing line naming the files written
(:func:`written_files`)."""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path
from typing import Any

WANDB_ID_FILE = "wandb_run_id"  # in out-dir: the W&B run a --resume continues


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


def start_wandb(args: argparse.Namespace, out_dir: Path):
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


def finish_wandb(wandb_run) -> None:
    """Finish the W&B run with its files complete when this returns. ``finish()`` alone is not enough: its last
    message to the wandb-core service (``inform_finish``, which closes the run's stream and only then writes the
    offline transaction log, buffered until then) is sent without waiting for it, so a reader right after
    ``train()`` could find the log's header only. ``wandb.teardown()`` waits for the service to close every stream
    and exit; the next run starts a new one."""
    import wandb

    wandb_run.finish()
    wandb.teardown()
