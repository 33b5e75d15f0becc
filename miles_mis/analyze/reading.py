"""Reading miles ``--dump-details`` dumps: discovery, validation, and streaming one call at a time.

miles writes ``DIR/policy_loss_debug/rank_<r>_call_<c>.pt`` per policy-loss call and rank: per sequence
(``index``) the trainer's π_old (``old_log_probs``), the engine's ``rollout_log_probs``, the local loss mask,
``advantages``, and the whole sequence's ``total_length`` / ``response_length``, as this rank's
context-parallel shard. The call counter grows across training steps, so calls order the dump in time.

Nothing is taken on trust: files are loaded with ``weights_only=True`` (a file that needs pickle code is
refused), every field is checked, each (rank, call) must appear once, every call must have every rank, and
the shards of a sequence must add up to its ``response_length`` (``allow_partial`` turns the last two into
warnings). Every problem is a one-line ``ValueError`` naming the file (and the sample where it applies).

Streaming: ``DumpReader.batches()`` reads the files of one call at a time and yields that call's sequences,
joined across ranks and put back in response order (the CP shards follow Megatron's zigzag layout,
``miles_mis.parallel.cp_layout``), so memory is bounded by one call whatever the size of the dump.
"""

from __future__ import annotations

import pickle
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from ..inputs.packing import tensor_problem
from ..parallel.cp_layout import zigzag_layout

_FILE_NAME = re.compile(r"rank_(\d+)_call_(\d+)\.pt")
_LOG_PROB_FIELDS = ("old_log_probs", "rollout_log_probs")
_LISTED = 4  # problems spelled out in one error / warning line before "and N more"


@dataclass(frozen=True)
class Shard:
    """One sample of one dump file: this rank's context-parallel piece of one sequence."""

    path: Path
    rank: int
    call: int
    index: int
    response_length: int | None  # the whole sequence's, as miles' batch["response_lengths"]
    total_length: int | None
    old: Tensor
    rollout: Tensor
    mask: Tensor
    advantages: Tensor | None
    version_lag: int | None = None  # weight versions behind the trainer (the lab's dumps; not in miles')


@dataclass(frozen=True)
class CallBatch:
    """Sequences of one or more calls, each joined across its CP ranks, tokens in response order."""

    calls: list[int]  # per sequence: its call (calls order the dump in time)
    indices: list[int]  # per sequence: its sample index in that call
    response_lengths: list[int]  # per sequence: the full response length
    old_log_probs: list[Tensor]  # per sequence, float32: π_old (the trainer's recompute)
    rollout_log_probs: list[Tensor]  # the engine's log-probs
    loss_masks: list[Tensor]  # float32, nonzero = valid token
    advantages: list[Tensor | None]  # None where the dump has none
    positions: list[Tensor]  # int64 response-relative position of each token; -1 where unknown
    lags: list[int | None]  # per sequence: its version lag (None where the dump has none)

    @staticmethod
    def join(batches: list["CallBatch"]) -> "CallBatch":
        fields = CallBatch.__dataclass_fields__
        return CallBatch(**{name: [v for batch in batches for v in getattr(batch, name)] for name in fields})


class DumpReader:
    """The dump files of one run, checked by name on construction and read one call at a time."""

    def __init__(self, directory: Path | str, allow_partial: bool = False, progress: bool = False):
        self.directory = Path(directory)
        self.allow_partial = allow_partial
        self.progress = progress
        self.files = _dump_files(self.directory)
        self.warnings: list[str] = []
        owner = _unique_rank_calls(self.files)
        self.ranks = sorted({rank for rank, _ in owner})
        self.calls = sorted({call for _, call in owner})
        missing = _missing_ranks(owner)
        if missing and not allow_partial:
            raise ValueError(f"{self.directory}: incomplete dump: {_listing(missing)}; pass --allow-partial to "
                             "analyse what is there")
        if missing:
            self.warnings.append(f"partial dump (--allow-partial), the statistics cover only what is there: "
                                 f"{_listing(missing)}")
        self._files_by_call: dict[int, list[tuple[int, Path]]] = defaultdict(list)
        for (rank, call), path in sorted(owner.items()):
            self._files_by_call[call].append((rank, path))
        self._warned: set[str] = set()

    def batches(self) -> Iterator[CallBatch]:
        """One CallBatch per call, in call order; the files of one call are read, then dropped."""
        done = 0
        for call in self.calls:
            shards = [shard for _, path in self._files_by_call[call] for shard in _read_file(path)]
            batch = self._join_call(call, shards)
            done += len(self._files_by_call[call])
            if self.progress:
                _progress(done, len(self.files))
            yield batch
        if self.progress and sys.stderr.isatty():
            print(file=sys.stderr)

    def load_all(self) -> CallBatch:
        """Every call in memory as one batch (the in-memory path; small dumps and tests)."""
        return CallBatch.join(list(self.batches()))

    # ------------------------------------------------------------------ joining
    def _join_call(self, call: int, shards: list[Shard]) -> CallBatch:
        sequences: dict[int, list[Shard]] = defaultdict(list)
        for shard in shards:
            sequences[shard.index].append(shard)
        columns: dict[str, list] = defaultdict(list)
        for index in sorted(sequences):
            parts = sorted(sequences[index], key=lambda shard: shard.rank)
            self._check_lengths(call, index, parts)
            positions = self._positions(parts)
            order = torch.argsort(positions, stable=True)
            advantages = [part.advantages for part in parts]
            columns["calls"].append(call)
            columns["indices"].append(index)
            held = sum(part.old.numel() for part in parts)
            columns["response_lengths"].append(parts[0].response_length if parts[0].response_length is not None
                                                else held)
            for name, field in (("old_log_probs", "old"), ("rollout_log_probs", "rollout"), ("loss_masks", "mask")):
                columns[name].append(torch.cat([getattr(part, field) for part in parts]).index_select(0, order))
            columns["advantages"].append(None if any(a is None for a in advantages)
                                         else torch.cat(advantages).index_select(0, order))
            columns["positions"].append(positions.index_select(0, order))
            lags = {part.version_lag for part in parts}
            if len(lags) > 1:
                raise ValueError(f"call {call}, sample {index}: its CP ranks' dumps disagree on version_lag "
                                 f"({sorted(lags, key=str)})")
            columns["lags"].append(lags.pop())
        return CallBatch(**columns)

    def _check_lengths(self, call: int, index: int, parts: list[Shard]) -> None:
        lengths = {shard.response_length for shard in parts}
        if len(lengths) > 1:
            a, b = parts[0], next(s for s in parts if s.response_length != parts[0].response_length)
            raise ValueError(f"call {call} sequence {index}: {a.path} says response_length {a.response_length} "
                             f"but {b.path} says {b.response_length}: different sequences (dumps of two runs, or "
                             "ranks of different data-parallel groups)")
        expected = parts[0].response_length
        held = sum(shard.old.numel() for shard in parts)
        if expected is None:
            self._warn_once("no_response_length", "some sequences carry no response_length: their completeness was "
                                                  "checked by rank coverage only")
            return
        files = ", ".join(str(shard.path) for shard in parts)
        if held > expected:
            raise ValueError(f"call {call} sequence {index}: its shards hold {held} tokens, more than its "
                             f"response_length {expected} ({files}): different sequences joined (dumps of two "
                             "runs, or ranks of different data-parallel groups)")
        if held < expected:
            problem = f"call {call} sequence {index} holds {held} of its {expected} response tokens ({files})"
            if not self.allow_partial:
                raise ValueError(f"{self.directory}: incomplete dump: {problem}; pass --allow-partial to analyse "
                                 "what is there")
            self._warn_once("short", f"partial dump (--allow-partial): some sequences hold fewer tokens than their "
                                     f"response_length, e.g. {problem}")

    def _positions(self, parts: list[Shard]) -> Tensor:
        """Response positions of the shards' tokens (concatenated in rank order): the thd zigzag layout of
        Megatron's context parallelism over the dump's ranks; -1 where the shards do not follow it."""
        cp_size = len(self.ranks)
        lengths = [part.old.numel() for part in parts]
        first = parts[0]
        if cp_size == 1:
            return torch.arange(lengths[0])
        if first.total_length is None or first.response_length is None:
            self._warn_once("positions", "token positions unknown for some sequences (no total_length / "
                                         "response_length): they are left out of the by-position statistics")
            return torch.full((sum(lengths),), -1, dtype=torch.long)
        out = []
        for part, length in zip(parts, lengths):
            layout = zigzag_layout(torch.tensor([first.total_length]), torch.tensor([first.response_length]),
                                   self.ranks.index(part.rank), cp_size, "thd")
            local = layout.positions(torch.zeros(1, dtype=torch.long))
            if local.numel() != length:
                self._warn_once("layout", "some shards do not follow the thd zigzag layout (bshd, or another CP "
                                          "size): their tokens are left out of the by-position statistics")
                return torch.full((sum(lengths),), -1, dtype=torch.long)
            out.append(local)
        return torch.cat(out)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warnings.append(message)


def _progress(done: int, total: int) -> None:
    """A bar over files on stderr when it is a terminal, else nothing (the report is on stdout)."""
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    print(f"\rreading dumps [{'#' * filled}{'.' * (width - filled)}] {done}/{total} files", end="",
          file=sys.stderr, flush=True)


def _unique_rank_calls(files: list[Path]) -> dict[tuple[int, int], Path]:
    """(rank, call) -> its file, from the names; two files for one (rank, call) (two runs under one directory)
    are an error naming both."""
    owner: dict[tuple[int, int], Path] = {}
    for path in files:
        key = _name_identity(path)
        if key in owner:
            raise ValueError(f"rank {key[0]} call {key[1]} appears twice: {owner[key]} and {path} (dumps of two "
                             "runs? analyse one run's directory)")
        owner[key] = path
    return owner


def _name_identity(path: Path) -> tuple[int, int]:
    match = _FILE_NAME.fullmatch(path.name)
    if not match:
        raise ValueError(f"{path}: file name is not rank_<r>_call_<c>.pt with integers r and c")
    return int(match.group(1)), int(match.group(2))


def _dump_files(directory: Path) -> list[Path]:
    if not directory.exists():
        raise ValueError(f"{directory} does not exist")
    if not directory.is_dir():
        raise ValueError(f"{directory} is a file, not a directory: pass the --dump-details directory (the one "
                         "holding policy_loss_debug/)")
    files = sorted(directory.glob("**/rank_*_call_*.pt"))
    if not files:
        raise ValueError(f"{directory}: no miles dumps (policy_loss_debug/rank_<r>_call_<c>.pt); run miles with "
                         "--dump-details DIR to write them")
    return files


def _read_file(path: Path) -> list[Shard]:
    payload = _load_payload(path)
    if not isinstance(payload, dict):
        raise ValueError(f"{path}: holds a {type(payload).__name__}, not a miles policy-loss dump (a dict with "
                         "'samples')")
    samples = payload.get("samples")
    if not isinstance(samples, list):
        keys = ", ".join(sorted(map(str, payload))) or "none"
        raise ValueError(f"{path}: not a miles policy-loss dump: no 'samples' list (keys: {keys})")
    if not samples:
        raise ValueError(f"{path}: holds no samples (an empty 'samples' list)")
    rank, call = _file_identity(path, payload)
    shards = [_read_sample(path, rank, call, position, sample) for position, sample in enumerate(samples)]
    seen = {}
    for position, shard in enumerate(shards):
        if shard.index in seen:
            raise ValueError(f"{path}: samples {seen[shard.index]} and {position} both have index {shard.index}")
        seen[shard.index] = position
    return shards


def _load_payload(path: Path):
    """torch.load without pickle code: a file that needs it is refused, any unreadable file named."""
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file (0 bytes)")
    try:
        with warnings.catch_warnings():  # torch's deprecation notes about a file's contents are not the user's
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        needs = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if needs:
            raise ValueError(f"{path}: refused: loading it needs pickle code ({needs.group(1)}), which could run "
                             "anything; miles' dumps hold only tensors, numbers, lists and dicts") from None
        raise ValueError(f"{path}: not a torch.save file ({_first_line(error.__context__ or error)})") from None
    except EOFError:
        raise ValueError(f"{path}: ends early (truncated file?)") from None
    except Exception as error:  # zip, OS and format errors alike: one line naming the file
        raise ValueError(f"{path}: unreadable ({type(error).__name__}: {_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    line = text.splitlines()[0].strip() if text else type(error).__name__
    return line if len(line) <= 160 else line[:157] + "..."


def _file_identity(path: Path, payload: dict) -> tuple[int, int]:
    """(rank, call) from the file name; the payload's own rank/call, where present, must agree."""
    rank, call = _name_identity(path)
    for key, expected in (("rank", rank), ("call", call)):
        if key in payload and _as_int(payload[key]) != expected:
            raise ValueError(f"{path}: the file says {key} {payload[key]!r} but its name says {key} {expected} "
                             "(renamed or copied over?)")
    return rank, call


def _as_int(value) -> int | None:
    """A Python or 0-d integer tensor value as int; None for anything else (bools included)."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _read_sample(path: Path, rank: int, call: int, position: int, sample) -> Shard:
    where = f"{path}: sample {position}"
    if not isinstance(sample, dict):
        raise ValueError(f"{where} is a {type(sample).__name__}, not a dict")
    index = _as_int(sample.get("index"))
    if index is None:
        raise ValueError(f"{where} has no integer 'index' (got {sample.get('index')!r})")
    response_length = None
    if sample.get("response_length") is not None:
        response_length = _as_int(sample["response_length"])
        if response_length is None or response_length < 0:
            raise ValueError(f"{where}: response_length {sample['response_length']!r} is not an integer >= 0")
    old, rollout = (_token_tensor(where, sample, name) for name in _LOG_PROB_FIELDS)
    mask = _token_tensor(where, sample, "local_loss_mask")
    for name, tensor in (("rollout_log_probs", rollout), ("local_loss_mask", mask)):
        if tensor.numel() != old.numel():
            raise ValueError(f"{where}: {name} has {tensor.numel()} tokens but old_log_probs has {old.numel()}")
    if not bool(torch.isfinite(mask).all()):
        raise ValueError(f"{where}: local_loss_mask has NaN/inf values")
    total_length = _as_int(sample.get("total_length")) if sample.get("total_length") is not None else None
    advantages = sample.get("advantages")
    if not (isinstance(advantages, Tensor) and advantages.dim() == 1 and advantages.numel() == old.numel()
            and advantages.layout == torch.strided and not advantages.is_meta and not advantages.is_quantized
            and not advantages.is_nested and not advantages.is_complex()):
        advantages = None  # optional: the advisor's signal shift needs it, nothing else does
    lag = sample.get("version_lag")
    if lag is not None:
        lag = _as_int(lag)
        if lag is None or lag < 0:
            raise ValueError(f"{where}: version_lag {sample['version_lag']!r} is not an integer >= 0")
    return Shard(path, rank, call, index, response_length, total_length, old, rollout, mask,
                 None if advantages is None else advantages.float(), lag)


def _token_tensor(where: str, sample: dict, name: str) -> Tensor:
    value = sample.get(name)
    if value is None:
        hint = ": the rollout must keep per-token log-probs" if name == "rollout_log_probs" else ""
        raise ValueError(f"{where} has no {name}{hint}")
    if not isinstance(value, Tensor):
        raise ValueError(f"{where}: {name} is a {type(value).__name__}, not a tensor")
    if value.is_nested or value.layout != torch.strided or value.is_quantized or value.is_meta:
        raise ValueError(f"{where}: {name} "
                         f"{tensor_problem(value, None, 'masks' if name == 'local_loss_mask' else 'log-probs')}")
    if value.dim() != 1:
        raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected one dimension (tokens)")
    if value.is_complex() or (value.dtype == torch.bool and name != "local_loss_mask"):
        raise ValueError(f"{where}: {name} has dtype {value.dtype}, expected real numbers")
    return value.float()


# --------------------------------------------------------------------------- completeness

def _missing_ranks(by_rank_call: dict[tuple[int, int], Path]) -> list[str]:
    """'call c lacks rank r' for every call without a rank that other calls have."""
    ranks = sorted({rank for rank, _ in by_rank_call})
    problems = []
    for call in sorted({call for _, call in by_rank_call}):
        lacking = [str(rank) for rank in ranks if (rank, call) not in by_rank_call]
        if lacking:
            problems.append(f"call {call} lacks rank{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}")
    return problems



def _listing(problems: list[str]) -> str:
    shown = "; ".join(problems[:_LISTED])
    return shown + (f"; and {len(problems) - _LISTED} more" if len(problems) > _LISTED else "")


