"""``miles-mis analyze DUMP_DIR``: read miles policy-loss dumps and say which correction the engine needs.

miles writes ``<dump_dir>/policy_loss_debug/rank_<r>_call_<c>.pt`` when run with ``--dump-details``:
per sequence (``index``) the trainer's π_old (``old_log_probs``), the engine's ``rollout_log_probs``, the
local loss mask and the full ``response_length``, as this rank's context-parallel shard. Shards of one
(call, index) are joined across ranks (every statistic here is a sum or a per-token value, so their order
does not matter).

Nothing is taken on trust: files are loaded with ``weights_only=True`` (a file that needs pickle code is
refused), every field is checked, each (rank, call) must appear once, every call must have every rank, and
the shards of a sequence must add up to its ``response_length`` (``allow_partial`` turns the last two into a
warning). Every problem is a one-line ``ValueError`` naming the file (and the sample where it applies).

The report has the mismatch itself (token KL, k3, χ², tails of ρ = π_old/π_rollout, catastrophic and
non-finite tokens, response lengths), every shipped preset simulated on the dumped tokens (kept
fraction, ESS, bias of the bounded weights) and a recommendation from the rules in
``recommend`` (heuristics, stated with their reasons). When more than ``NONFINITE_LIMIT`` of the valid
tokens have NaN/inf log-probs there is no recommendation: the log-probs are broken.
"""

from __future__ import annotations

import math
import pickle
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..core import LOG_PROB_BOUND
from ..config import MisConfig, preset_files
from ..plugin import _tensor_problem, compute_mis_weights

CANDIDATES = ("token_tis", "mis", "token_icepop", "geo_rs", "k3_rs", "seq_mis")
NONFINITE_LIMIT = 0.5  # above this fraction of valid tokens with NaN/inf log-probs: broken, no recommendation
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
    old: Tensor
    rollout: Tensor
    mask: Tensor


@dataclass
class Dump:
    train_log_probs: list = field(default_factory=list)  # π_old per sequence
    rollout_log_probs: list = field(default_factory=list)
    loss_masks: list = field(default_factory=list)
    files: int = 0
    warnings: list[str] = field(default_factory=list)  # shown at the top of the report


# --------------------------------------------------------------------------- loading
def load_dumps(directory: Path, allow_partial: bool = False) -> Dump:
    """All sequences of all calls, shards of one (call, sequence) joined across ranks, every file checked."""
    files = _dump_files(Path(directory))
    shards = {path: _read_file(path) for path in files}
    by_rank_call = _unique_rank_calls(shards)
    sequences = _group_sequences(shards)
    missing = _missing_ranks(by_rank_call) + _short_sequences(sequences)
    if missing and not allow_partial:
        raise ValueError(f"{directory}: incomplete dump: {_listing(missing)}; pass --allow-partial to analyse what "
                         "is there")
    dump = Dump(files=len(files))
    if missing:
        dump.warnings.append(f"partial dump (--allow-partial), the statistics cover only what is there: "
                             f"{_listing(missing)}")
    unchecked = sum(1 for parts in sequences.values() if parts[0].response_length is None)
    if unchecked:
        dump.warnings.append(f"{unchecked} sequences carry no response_length: their completeness was checked by "
                             "rank coverage only")
    _join(sequences, dump)
    if not any(bool((mask != 0).any()) for mask in dump.loss_masks):
        raise ValueError(f"{directory}: the dumps hold no valid token (every local_loss_mask is 0): nothing to "
                         "analyse")
    return dump


def _join(sequences: dict[tuple[int, int], list[Shard]], dump: Dump) -> None:
    """One tensor per sequence and field, its shards in rank order (the statistics do not depend on it)."""
    for key in sorted(sequences):
        parts = sorted(sequences[key], key=lambda shard: shard.rank)
        dump.train_log_probs.append(torch.cat([shard.old for shard in parts]))
        dump.rollout_log_probs.append(torch.cat([shard.rollout for shard in parts]))
        dump.loss_masks.append(torch.cat([shard.mask for shard in parts]))


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
    match = _FILE_NAME.fullmatch(path.name)
    if not match:
        raise ValueError(f"{path}: file name is not rank_<r>_call_<c>.pt with integers r and c")
    rank, call = int(match.group(1)), int(match.group(2))
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
    return Shard(path, rank, call, index, response_length, old, rollout, mask)


def _token_tensor(where: str, sample: dict, name: str) -> Tensor:
    value = sample.get(name)
    if value is None:
        hint = ": the rollout must keep per-token log-probs" if name == "rollout_log_probs" else ""
        raise ValueError(f"{where} has no {name}{hint}")
    if not isinstance(value, Tensor):
        raise ValueError(f"{where}: {name} is a {type(value).__name__}, not a tensor")
    if value.is_nested or value.layout != torch.strided or value.is_quantized or value.is_meta:
        raise ValueError(f"{where}: {name} {_tensor_problem(value, None, log_probs=name != 'local_loss_mask')}")
    if value.dim() != 1:
        raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected one dimension (tokens)")
    if value.is_complex() or (value.dtype == torch.bool and name != "local_loss_mask"):
        raise ValueError(f"{where}: {name} has dtype {value.dtype}, expected real numbers")
    return value.float()


# --------------------------------------------------------------------------- completeness
def _unique_rank_calls(shards: dict[Path, list[Shard]]) -> dict[tuple[int, int], Path]:
    """(rank, call) -> its file; two files for one (rank, call) (two runs under one directory) are an error."""
    owner: dict[tuple[int, int], Path] = {}
    for path, parts in shards.items():
        key = (parts[0].rank, parts[0].call)
        if key in owner:
            raise ValueError(f"rank {key[0]} call {key[1]} appears twice: {owner[key]} and {path} (dumps of two "
                             "runs? analyse one run's directory)")
        owner[key] = path
    return owner


def _group_sequences(shards: dict[Path, list[Shard]]) -> dict[tuple[int, int], list[Shard]]:
    """(call, index) -> its shards; shards that disagree on the sequence's response_length are an error."""
    sequences: dict[tuple[int, int], list[Shard]] = defaultdict(list)
    for parts in shards.values():
        for shard in parts:
            sequences[(shard.call, shard.index)].append(shard)
    for (call, index), parts in sequences.items():
        lengths = {shard.response_length for shard in parts}
        if len(lengths) > 1:
            a, b = parts[0], next(s for s in parts if s.response_length != parts[0].response_length)
            raise ValueError(f"call {call} sequence {index}: {a.path} says response_length {a.response_length} "
                             f"but {b.path} says {b.response_length}: different sequences (dumps of two runs, or "
                             "ranks of different data-parallel groups)")
    return sequences


def _missing_ranks(by_rank_call: dict[tuple[int, int], Path]) -> list[str]:
    """'call c lacks rank r' for every call without a rank that other calls have."""
    ranks = sorted({rank for rank, _ in by_rank_call})
    problems = []
    for call in sorted({call for _, call in by_rank_call}):
        lacking = [str(rank) for rank in ranks if (rank, call) not in by_rank_call]
        if lacking:
            problems.append(f"call {call} lacks rank{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}")
    return problems


def _short_sequences(sequences: dict[tuple[int, int], list[Shard]]) -> list[str]:
    """Sequences whose shards hold fewer tokens than their response_length (too many is an error)."""
    problems = []
    for call, index in sorted(sequences):
        parts = sequences[(call, index)]
        expected = parts[0].response_length
        held = sum(shard.old.numel() for shard in parts)
        if expected is None or held == expected:
            continue
        files = ", ".join(str(shard.path) for shard in parts)
        if held > expected:
            raise ValueError(f"call {call} sequence {index}: its shards hold {held} tokens, more than its "
                             f"response_length {expected} ({files}): different sequences joined (dumps of two "
                             "runs, or ranks of different data-parallel groups)")
        problems.append(f"call {call} sequence {index} holds {held} of its {expected} response tokens ({files})")
    return problems


def _listing(problems: list[str]) -> str:
    shown = "; ".join(problems[:_LISTED])
    return shown + (f"; and {len(problems) - _LISTED} more" if len(problems) > _LISTED else "")


# --------------------------------------------------------------------------- statistics
def _is_log_prob(values: Tensor) -> Tensor:
    """As the plugin: NaN, ±inf and fill values (|log p| ≥ LOG_PROB_BOUND) are not log-probs ("non-finite")."""
    return values.abs() < LOG_PROB_BOUND


def mismatch_summary(dump: Dump) -> dict[str, float | None]:
    """Token- and sequence-level mismatch statistics over valid tokens (None: no finite token to compute it on)."""
    train = torch.cat(dump.train_log_probs).double()
    rollout = torch.cat(dump.rollout_log_probs).double()
    mask = torch.cat(dump.loss_masks) != 0  # nonzero = valid, as in the plugin
    finite = _is_log_prob(train) & _is_log_prob(rollout)
    usable = mask & finite
    ell = (train - rollout)[usable]
    rho = ell.clamp(-20, 20).exp()
    seq_sums = torch.tensor([float((t.double() - r.double())[(m != 0) & _is_log_prob(t) & _is_log_prob(r)].sum())
                             for t, r, m in zip(dump.train_log_probs, dump.rollout_log_probs, dump.loss_masks)])
    lengths = torch.tensor([float((m != 0).sum()) for m in dump.loss_masks])
    valid = max(int(mask.sum()), 1)
    count = int(usable.sum())

    def mean(values: Tensor) -> float | None:
        return float(values.sum()) / count if count else None

    return {
        "sequences": float(len(dump.loss_masks)),
        "valid tokens": float(mask.sum()),
        "mean response length": float(lengths.mean()) if lengths.numel() else 0.0,
        "non-finite token fraction": float((mask & ~finite).sum()) / valid,
        "non-finite engine log-prob fraction": float((mask & ~_is_log_prob(rollout)).sum()) / valid,
        "non-finite trainer log-prob fraction": float((mask & ~_is_log_prob(train)).sum()) / valid,
        "token KL k1 (mean log pi_rollout - log pi_old)": mean(-ell),
        "token KL k3": mean(rho - ell.clamp(-20, 20) - 1),
        "chi2 token (mean rho^2 - 1)": None if not count else mean(rho.square()) - 1.0,
        "max abs(log ratio)": float(ell.abs().max()) if count else None,
        "fraction rho > 2": mean((rho > 2).double()),
        "fraction rho < 0.5": mean((rho < 0.5).double()),
        "catastrophic fraction (rho < 1e-4)": mean((rho < 1e-4).double()),
        "sequences with abs(sum log ratio) > log 2": float((seq_sums.abs() > math.log(2)).float().mean())
        if seq_sums.numel() else 0.0,
    }


def logprobs_broken(summary: dict[str, float | None]) -> bool:
    """More than NONFINITE_LIMIT of the valid tokens have NaN/inf log-probs: nothing to recommend from."""
    return summary["non-finite token fraction"] > NONFINITE_LIMIT


def simulate_presets(dump: Dump, names=CANDIDATES) -> dict[str, dict[str, float | None]]:
    """Each preset run (use_tis on) over the dumped tokens: kept fraction, ESS, weight stats, bias proxy."""
    files = preset_files()
    valid = sum(float((m != 0).sum()) for m in dump.loss_masks)
    out = {}
    for name in names:
        if name not in files:
            continue
        config = MisConfig.preset(name, use_tis=True)
        weights, masks, metrics = compute_mis_weights(config, train_log_probs=dump.train_log_probs,
                                                      rollout_log_probs=dump.rollout_log_probs,
                                                      loss_masks=dump.loss_masks)
        kept = torch.cat(masks) != 0
        w = torch.cat(weights)
        raw = torch.cat(metrics["mis_tis_weight_before_bound"])
        after = torch.cat(metrics["mis_tis_weight_after_bound"])
        changed = ((after - raw).abs() > 1e-6 * raw.abs().clamp(min=1)) & kept
        ess = torch.cat(metrics["mis_ess"])
        out[name] = {
            "kept token fraction": float(kept.sum()) / max(valid, 1.0),
            "ESS": _finite(float(ess[0])) if ess.numel() else None,
            "mean final weight (kept)": _finite(float(w[kept].mean())) if kept.any() else None,
            "bounded-weight fraction (bias)": float(changed.sum()) / max(float(kept.sum()), 1.0),
        }
    return out


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------- recommendation and report
def recommend(summary: dict[str, float | None],
              presets: dict[str, dict[str, float | None]]) -> tuple[str | None, list[str]]:
    """A preset and the reasons, from simple, stated rules (heuristics, not a guarantee); None when the
    log-probs are broken (more than NONFINITE_LIMIT of the valid tokens non-finite)."""
    reasons = []
    if logprobs_broken(summary):
        return None, [_broken_reason(summary)]
    if summary["non-finite token fraction"] > 0:
        reasons.append(f"{summary['non-finite token fraction']:.2e} of valid tokens have NaN/inf log-probs: an "
                       "engine bug (SGLang serialises NaN as null, miles #2662); every miles_mis config rejects those "
                       "sequences, but fix the engine")
    k3 = summary["token KL k3"]
    tails = summary["fraction rho > 2"] + summary["fraction rho < 0.5"]
    if summary["catastrophic fraction (rho < 1e-4)"] > 0:
        reasons.append("tokens with rho < 1e-4 exist: use a veto; mis.yaml vetoes them and rejects token tails")
        return "mis", reasons
    if k3 < 1e-4 and tails < 1e-3:
        reasons.append(f"token k3 = {k3:.1e} and {tails:.1e} of ratios outside [0.5, 2]: the engine agrees with the "
                       "trainer; token_tis is cheap insurance (or metrics_only to monitor)")
        return "token_tis", reasons
    if tails >= 1e-3 and presets.get("mis", {}).get("kept token fraction", 0) >= 0.95:
        reasons.append(f"{tails:.1e} of token ratios outside [0.5, 2]: heavy token tails; mis.yaml rejects them and "
                       f"keeps {presets['mis']['kept token fraction']:.1%} of tokens")
        return "mis", reasons
    if tails >= 1e-3:
        reasons.append(f"{tails:.1e} of token ratios outside [0.5, 2], too many to reject: IcePop zeroes their "
                       "weight but keeps the denominators")
        return "token_icepop", reasons
    if summary["sequences with abs(sum log ratio) > log 2"] > 0.05 and summary["mean response length"] > 512:
        reasons.append("long responses whose product ratios leave [0.5, 2]: sequence-level IS would reject or clip "
                       "them; stay at token level (token_tis)")
    else:
        reasons.append(f"moderate mismatch (token k3 = {k3:.1e}) without heavy tails: token truncated IS")
    return "token_tis", reasons


def _broken_reason(summary: dict[str, float | None]) -> str:
    engine = summary["non-finite engine log-prob fraction"]
    trainer = summary["non-finite trainer log-prob fraction"]
    whose = " and ".join(name for name, fraction in (("the engine's", engine), ("the trainer's", trainer))
                         if fraction > 0)
    return (f"{whose} log-probs are broken: {summary['non-finite token fraction']:.1%} of valid tokens are NaN/inf "
            f"(engine {engine:.1%}, trainer {trainer:.1%}; the limit is {NONFINITE_LIMIT:.0%}). No correction can be "
            "judged on the rest: fix the log-probs first (SGLang serialises NaN as null, miles #2662)")


def _cell(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4g}"


def report(directory: Path, allow_partial: bool = False) -> str:
    dump = load_dumps(directory, allow_partial=allow_partial)
    summary = mismatch_summary(dump)
    broken = logprobs_broken(summary)
    presets = {} if broken else simulate_presets(dump)
    choice, reasons = recommend(summary, presets)
    lines = [f"# miles_mis analysis of {directory}", ""]
    lines += [f"**warning: {warning}**" for warning in dump.warnings] + ([""] if dump.warnings else [])
    lines += [f"{dump.files} dump files, {int(summary['sequences'])} sequences, {int(summary['valid tokens'])} valid "
              "tokens (pi_old = the trainer's recompute, against the engine's log-probs).", "", "## Mismatch", "",
              "| statistic | value |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in summary.items()]
    lines += ["", "## Presets on these tokens (use_tis on)", ""]
    if broken:
        lines += ["Not simulated: the log-probs are broken (see below)."]
    elif presets:
        columns = list(next(iter(presets.values())))
        lines += ["| preset | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(_cell(v[c]) for c in columns) + " |" for name, v in presets.items()]
    if choice is None:
        lines += ["", "## Recommendation: none", ""] + [f"- {reason}" for reason in reasons]
        return "\n".join(lines) + "\n"
    lines += ["", f"## Recommendation: `{choice}`", ""] + [f"- {reason}" for reason in reasons]
    lines += ["", f"Use it with `--use-tis --custom-tis-function-path miles_mis.compute_mis_weights_with_cp "
              f"--custom-config-path configs/{choice}.yaml`."]
    return "\n".join(lines) + "\n"
