"""prime-rl's trainer token export: ``token_exports/step_<s>/rank_<r>.jsonl``, one JSON line per sequence.

Schema read at PrimeIntellect-ai/prime-rl 559b44772e471d1538537b8805cc77f3824a5e64
(``src/prime_rl/trainer/rl/token_export.py``; enabled with the trainer's ``enable_token_export = true``). Each line
holds ``step``, ``rank``, ``micro_step``, ``micro_sequence_idx`` and per-token lists over the whole sequence:
``loss_mask`` (the sampled, trainable tokens), ``inference_logprobs`` (the engine's), ``trainer_logprobs`` (the
trainer's, at the step's weights, temperature-scaled like the engine's processed log-probs), ``advantages`` and,
optionally, ``rl_weights`` (null = weight 1). Non-finite floats are written as null. The schema version stayed 1
while fields came and went, so the reader goes by the fields present.

An empty ``STABLE`` file marks a step whose ranks have all flushed; a step without it (still being written, or cut
off) is left out with a warning, or read with ``--allow-partial``. A call here is one micro-batch: a
(step, rank, micro_step), in that order.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import torch

from ..reading import CallBatch
from .sequences import Response, call_batch, integer_field, json_lines, left_out_warning, mask_column, number_column, \
    response, same_lengths, warn_once

STEP_DIRECTORY = re.compile(r"step_(\d+)")
RANK_FILE = re.compile(r"rank_(\d+)\.jsonl")
STABLE_MARKER = "STABLE"


def export_files(directory: Path) -> list[Path]:
    """Every ``step_<s>/rank_<r>.jsonl`` under ``directory`` (the run's output dir, its token_exports/ or one step)."""
    candidates = sorted(directory.glob("**/rank_*.jsonl"))
    if directory.name.startswith("step_"):
        candidates += sorted(directory.glob("rank_*.jsonl"))
    return sorted({path for path in candidates if STEP_DIRECTORY.fullmatch(path.parent.name)
                   and RANK_FILE.fullmatch(path.name)})


class PrimeRLReader:
    """The export files of one run, checked by name on construction and read one micro-batch at a time."""

    def __init__(self, directory: Path | str, allow_partial: bool = False, progress: bool = False):
        self.directory = Path(directory)
        self.warnings: list[str] = []
        by_step: dict[int, list[Path]] = defaultdict(list)
        owner: dict[tuple[int, int], Path] = {}
        for path in export_files(self.directory):
            step, rank = _step_of(path), _rank_of(path)
            if (step, rank) in owner:
                raise ValueError(f"step {step} rank {rank} appears twice: {owner[step, rank]} and {path} (exports of "
                                 "two runs? analyse one run's directory)")
            owner[step, rank] = path
            if by_step[step] and by_step[step][0].parent != path.parent:
                raise ValueError(f"step {step} is in two directories: {by_step[step][0].parent} and {path.parent} "
                                 "(exports of two runs? analyse one run's directory)")
            by_step[step].append(path)
        unstable = [step for step, paths in by_step.items() if not (paths[0].parent / STABLE_MARKER).exists()]
        if unstable:
            listed = ", ".join(map(str, sorted(unstable)[:4])) + (" ..." if len(unstable) > 4 else "")
            directories, have = ("directories", "have") if len(unstable) > 1 else ("directory", "has")
            what = f"{len(unstable)} step {directories} (step {listed}) {have} no {STABLE_MARKER} marker " \
                   "(prime-rl writes it once every rank has flushed)"
            if allow_partial:
                self.warnings.append(f"partial export (--allow-partial): {what}; read as they are")
            else:
                self.warnings.append(f"{what}: left out; pass --allow-partial to read them")
                for step in unstable:
                    del by_step[step]
        self._unstable = {by_step[step][0].parent for step in unstable if step in by_step}
        self._cut_lines: list[str] = []  # the half-written last lines of unstable steps read with --allow-partial
        self.files = [path for step in sorted(by_step) for path in sorted(by_step[step], key=_rank_of)]
        if not self.files:
            raise ValueError(f"{self.directory}: the prime-rl export holds no complete step (no step directory has "
                             f"its {STABLE_MARKER} marker); pass --allow-partial to read them anyway")
        self._empty = 0

    def batches(self) -> Iterator[CallBatch]:
        """One CallBatch per (step, rank, micro_step), in that order; one file in memory at a time."""
        for _, batch in self.step_batches():
            yield batch

    def step_batches(self) -> Iterator[tuple[int, CallBatch]]:
        """(the trainer step, its CallBatch) per micro-batch, in ``batches()``' order."""
        call = 0
        self._empty = 0
        for path in self.files:
            step = _step_of(path)
            micro_batches = self._read_file(path)
            if not micro_batches:  # every sequence of this file keeps no token: the step is there, and empty
                micro_batches = {0: []}
            for micro_step, responses in sorted(micro_batches.items()):
                yield step, call_batch(call, responses)
                call += 1
        if self._cut_lines:
            warn_once(self.warnings, f"{len(self._cut_lines)} half-written last line(s) of steps without STABLE "
                                     f"left out, e.g. {self._cut_lines[0]}")
        if self._empty:
            warn_once(self.warnings, left_out_warning(self._empty, "exported sequence", "loss_mask all false, or "
                                                      "rl_weights and ref_kl_weights 0 wherever it is true"))

    def _read_file(self, path: Path) -> dict[int, list[Response]]:
        step, rank = _step_of(path), _rank_of(path)
        by_micro_step: dict[int, list[Response]] = defaultdict(list)
        seen: dict[tuple[int, int], str] = {}
        cut = self._cut_lines if path.parent in self._unstable else None
        for where, record in json_lines(path, cut_last_line=cut):
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a {type(record).__name__}, not a prime-rl token-export record (an object)")
            # multi-run exports (prime-rl June-August 2026) name the directory by export_step, not by the trainer step
            path_step = "export_step" if "export_step" in record else "step"
            for name, expected in ((path_step, step), ("rank", rank)):
                if integer_field(where, record, name) != expected:
                    raise ValueError(f"{where}: the record says {name} {record[name]} but its path says {expected} "
                                     "(renamed or copied over?)")
            micro_step = integer_field(where, record, "micro_step")
            index = integer_field(where, record, "micro_sequence_idx")
            if (micro_step, index) in seen:
                raise ValueError(f"{where}: micro_step {micro_step} micro_sequence_idx {index} also at "
                                 f"{seen[micro_step, index]}")
            seen[micro_step, index] = where
            kept = read_record(where, record, index)
            if kept is None:
                self._empty += 1
            else:
                by_micro_step[micro_step].append(kept)
        return by_micro_step


def read_record(where: str, record: dict, index: int) -> Response | None:
    """One line's response span. The kept tokens are prime-rl's own mismatch mask (train.py at 559b4477): ``loss_mask``
    and, where the weight columns are given, ``rl_weights`` ≠ 0 or ``ref_kl_weights`` ≠ 0; never position 0."""
    columns = {"loss_mask": mask_column(where, record, "loss_mask"),
               "trainer_logprobs": number_column(where, record, "trainer_logprobs", nullable=True),
               "inference_logprobs": number_column(where, record, "inference_logprobs", nullable=True),
               "advantages": number_column(where, record, "advantages", nullable=True),
               "rl_weights": number_column(where, record, "rl_weights", nullable=True),
               "ref_kl_weights": number_column(where, record, "ref_kl_weights", nullable=True)}
    for name in ("loss_mask", "trainer_logprobs", "inference_logprobs"):
        if columns[name] is None:
            raise ValueError(f"{where}: no {name} (a prime-rl token export line has loss_mask, trainer_logprobs "
                             "and inference_logprobs per token)")
    same_lengths(where, columns)
    mask = columns["loss_mask"].clone()
    mask[:1] = 0  # position 0 has no trainer log-prob (the exporter pads it with log(1/V))
    weights = [columns[name] for name in ("rl_weights", "ref_kl_weights") if columns[name] is not None]
    if weights:  # prime-rl's mismatch mask: a loss token of the RL or the reference-KL term; null (NaN) keeps it
        in_a_term = torch.stack([weight.nan_to_num(1.0) != 0 for weight in weights]).any(0)
        mask = mask * in_a_term
    return response(index, columns["trainer_logprobs"], columns["inference_logprobs"], mask, columns["advantages"])


def _step_of(path: Path) -> int:
    return int(STEP_DIRECTORY.fullmatch(path.parent.name).group(1))


def _rank_of(path: Path) -> int:
    return int(RANK_FILE.fullmatch(path.name).group(1))
