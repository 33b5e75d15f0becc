"""Which stack wrote a dump directory, told from its files, and the reader for it.

Every reader has the same face: ``files`` (what it will read), ``warnings`` (what the report must say) and
``batches()`` (one ``CallBatch`` per call, in time order). ``DumpFormat`` carries what the report says of the
format: where its schema was read, what a call is, and what the format lacks (said in the report, never guessed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..reading import DumpReader
from .nemo_rl import NemoRLReader, step_files
from .prime_rl import PrimeRLReader, export_files


@dataclass(frozen=True)
class DumpFormat:
    name: str
    files: str  # the layout, as the user would look for it
    schema: str  # where the schema was read
    call: str  # what one call (the advisor's unit, a micro-batch in training) is in this format
    lacks: tuple[str, ...]  # inputs the format does not record, and what follows for the report

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "files": self.files, "schema": self.schema, "call": self.call,
                "lacks": list(self.lacks)}


MILES = DumpFormat(
    "miles / slime --dump-details", "policy_loss_debug/rank_<r>_call_<c>.pt",
    "miles' policy-loss dump (the lab writes the same layout, with each sequence's version_lag)",
    "one policy-loss call: a micro-batch, its context-parallel shards joined", ())
PRIME_RL = DumpFormat(
    "prime-rl token export", "token_exports/step_<s>/rank_<r>.jsonl (enable_token_export = true)",
    "PrimeIntellect-ai/prime-rl@559b4477 src/prime_rl/trainer/rl/token_export.py",
    "one micro-batch: a (step, rank, micro_step)",
    ("each sequence's version lag: prime-rl trains asynchronously, so the exported engine–trainer gap holds the "
     "policy lag as well as the numerics, and configs with lag keys cannot be evaluated",
     "the sampling mask (kept set) and truncation marks"))
NEMO_RL = DumpFormat(
    "NeMo RL train data", "train_data_step<N>.jsonl (written every step by the GRPO driver)",
    "NVIDIA-NeMo/RL@7ea279ab nemo_rl/algorithms/grpo.py, nemo_rl/utils/logger.py",
    "one step's whole batch (the file does not record micro-batches, so batch-level gates see more sequences "
    "than in training)",
    ("each sequence's version lag (configs with lag keys cannot be evaluated)",
     "the sampling mask (kept set) and truncation marks"))
KNOWN_FORMATS = (MILES, PRIME_RL, NEMO_RL)


@dataclass(frozen=True)
class OpenedDump:
    reader: Any  # DumpReader, PrimeRLReader or NemoRLReader
    format: DumpFormat


def open_dump(directory: Path | str, allow_partial: bool = False, progress: bool = False) -> OpenedDump:
    """The reader of the one format found under ``directory``; one line naming the known formats when none is."""
    directory = Path(directory)
    if not directory.exists():
        raise ValueError(f"{directory} does not exist")
    if not directory.is_dir():
        raise ValueError(f"{directory} is a file, not a directory: pass the directory holding the dumps (miles' "
                         "--dump-details directory, prime-rl's output directory, NeMo RL's log directory)")
    found = [fmt for fmt, present in ((MILES, any(directory.glob("**/rank_*_call_*.pt"))),
                                      (PRIME_RL, bool(export_files(directory))),
                                      (NEMO_RL, bool(step_files(directory)))) if present]
    if not found:
        known = "; ".join(f"{fmt.name} ({fmt.files})" for fmt in KNOWN_FORMATS)
        raise ValueError(f"{directory}: no dump of a known format; looked for {known}")
    if len(found) > 1:
        raise ValueError(f"{directory}: holds dumps of {' and of '.join(fmt.name for fmt in found)}: analyse one "
                         "stack's directory at a time")
    reader_type = {MILES: DumpReader, PRIME_RL: PrimeRLReader, NEMO_RL: NemoRLReader}[found[0]]
    return OpenedDump(reader_type(directory, allow_partial=allow_partial, progress=progress), found[0])
