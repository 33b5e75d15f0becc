"""What a host passes about asynchronous samples, validated: each sequence's lag and the current policy.

Lags (how many weight versions behind the trainer each sequence was generated; miles_mis.correction.staleness uses them)
come in one of two forms, both optional keyword arguments of the entry points:

- ``version_lags``: B integers ≥ 0 (a list, a tuple or an integer tensor);
- ``weight_versions`` with ``current_weight_version``, as miles records them: per sequence its
  ``Sample.weight_versions`` (a list with one version per generation call, each a string such as "12" or an int;
  or a single version), and the trainer's version (an int or a digit string). λ_i = current − min(numeric
  versions of i): a multi-turn sample is as stale as its oldest generation call (miles' ``oldest_weight_version``),
  and non-numeric entries (SGLang's "default" before any weight push) are skipped, as miles skips them.

The current policy π_θ's log-probs arrive as ``cur_log_probs`` (slime PR 2084) or ``current_log_probs`` (slime PR
1912), in ``train_log_probs``' layout; with ``tis_policy: current`` they replace π_old in the ratio, detached.
Every failure is an ``InputError`` naming the sequence, raised before any collective (the entry points carry it to
their peers).
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .packing import InputError, long_tensor

LAG_KWARGS = ("version_lags", "weight_versions", "current_weight_version")
CURRENT_KWARGS = ("cur_log_probs", "current_log_probs")
_SEE = "docs/staleness.md"


def lags(kwargs: Mapping[str, Any], num_seqs: int, device: Any = "cpu") -> Tensor | None:
    """[B] int64 lags from the host's keyword arguments, or None when it passes none (``lag_list`` is the same as
    Python ints)."""
    values = lag_list(kwargs, num_seqs)
    return None if values is None else long_tensor(values, device)


def lag_list(kwargs: Mapping[str, Any], num_seqs: int) -> list[int] | None:
    """The lags as Python ints, validated, or None when the host passes none."""
    given, versions, current = (kwargs.get(name) for name in LAG_KWARGS)
    if given is not None and (versions is not None or current is not None):
        raise InputError("version_lags is given with weight_versions/current_weight_version: pass the lags in one "
                         f"form ({_SEE})")
    if given is not None:
        values = _lag_list(given)
    elif versions is not None or current is not None:
        values = _lags_of_versions(versions, current)
    else:
        return None
    if len(values) != num_seqs:
        name = "version_lags" if given is not None else "weight_versions"
        raise InputError(f"{name} has {len(values)} entries but the batch has {num_seqs} sequences: one per sequence")
    return values


def _lag_list(values: Any) -> list[int]:
    if isinstance(values, Tensor):
        if values.is_floating_point() or values.is_complex() or values.ndim != 1 or values.dtype == torch.bool:
            raise InputError(f"version_lags is a {values.dtype} tensor of shape {tuple(values.shape)}: expected B "
                             "integers >= 0")
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InputError(f"version_lags is a {type(values).__name__}: expected B integers >= 0, one per sequence")
    values = list(values)
    if set(map(type, values)) <= {int} and (not values or min(values) >= 0):  # the fast path: plain ints
        return values
    out = []  # the slow path names the first bad entry
    for i, value in enumerate(values):
        if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise InputError(f"sequence {i}: version_lags[{i}]={value!r} is invalid: allowed values are integers "
                             ">= 0 (weight versions behind the trainer)", i)
        out.append(int(value))
    return out


def _version_number(value: Any, where: str) -> int | None:
    """A version as an int: an int ≥ 0, a whole float (12.0, as a JSON round trip leaves it), a 0-d integer tensor,
    or a string of digits; None for a non-numeric string ("default"), which miles skips. Anything else (a negative
    or fractional number, a bool, another type) is an error naming ``where``."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, str):
        return int(value.strip()) if value.strip().isdigit() else None
    number = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or number < 0:
        raise InputError(f"{where}={value!r} is invalid: a weight version is an integer >= 0 or a string of digits "
                         "(non-numeric strings such as 'default' are skipped)")
    return number


def _lags_of_versions(versions: Any, current: Any) -> list[int]:
    if current is None:
        raise InputError("weight_versions is given without current_weight_version: the lag of a sample is the "
                         f"trainer's version minus the sample's; pass the trainer's version too ({_SEE})")
    try:
        trainer = _version_number(current, "current_weight_version")
    except InputError:
        trainer = None
    if trainer is None:
        raise InputError(f"current_weight_version={current!r} is invalid: allowed values are an integer >= 0 or a "
                         "string of digits (the trainer's weight version)")
    if versions is None:
        raise InputError("current_weight_version is given without weight_versions: pass each sequence's versions "
                         f"too ({_SEE})")
    if isinstance(versions, (str, bytes)) or not isinstance(versions, Sequence):
        raise InputError(f"weight_versions is a {type(versions).__name__}: expected one entry per sequence (its "
                         "list of weight versions, as miles' Sample.weight_versions)")
    out = []
    for i, entry in enumerate(versions):
        calls = entry if isinstance(entry, (list, tuple)) else [entry]
        try:
            numbers_ = [n for n in (_version_number(v, f"weight_versions[{i}]") for v in calls) if n is not None]
        except InputError as error:
            raise InputError(f"sequence {i}: {error}", i) from None
        if not numbers_:
            raise InputError(f"sequence {i}: weight_versions[{i}]={entry!r} holds no numeric version (miles skips "
                             "non-numeric ones such as 'default'), so its lag is unknown", i)
        lag = trainer - min(numbers_)
        if max(numbers_) > trainer:  # any call newer than the trainer, not only the oldest one
            raise InputError(f"sequence {i}: weight_versions[{i}]={entry!r} is newer than current_weight_version="
                             f"{current!r}: a sample cannot come from weights the trainer has not made yet", i)
        out.append(lag)
    return out


def current_policy(kwargs: Mapping[str, Any]) -> Any:
    """The current policy's log-probs the host passed (``cur_log_probs`` or ``current_log_probs``), or None."""
    first, second = (kwargs.get(name) for name in CURRENT_KWARGS)
    if first is not None and second is not None and first is not second:
        raise InputError("cur_log_probs and current_log_probs are both given: they name the same input (the current "
                         "policy's log-probs); pass one")
    return first if first is not None else second


def require_current(current: Any, entry_kwarg: str = "cur_log_probs or current_log_probs") -> None:
    """``tis_policy: current`` without the current policy's log-probs: the error every rank raises."""
    if current is None:
        raise InputError(f"tis_policy: current needs the current policy's log-probs, but the host passed no "
                         f"{entry_kwarg} (tis_policy: old uses train_log_probs; {_SEE})")


def detached_list(current: Any, train_log_probs: Any) -> list[Tensor]:
    """The per-sequence current log-probs, detached, checked against ``train_log_probs``' layout: a list of B 1-D
    tensors, or one flat tensor of this rank's tokens (split by ``train_log_probs``' lengths)."""
    if isinstance(current, Tensor):
        current = _split_flat(current, train_log_probs)
    if not isinstance(current, (list, tuple)):
        raise InputError(f"cur_log_probs is a {type(current).__name__}: expected a list of B 1-D tensors in "
                         "train_log_probs' layout, or one flat tensor of this rank's tokens")
    if train_log_probs is not None and len(current) != len(train_log_probs):
        raise InputError(f"cur_log_probs has {len(current)} sequences but train_log_probs has {len(train_log_probs)}")
    try:  # the fast path: one map per check; the sequences are walked only to name a bad one
        lengths = list(map(Tensor.numel, current))
    except (AttributeError, TypeError):
        i = next(i for i, value in enumerate(current) if not isinstance(value, Tensor))
        raise InputError(f"sequence {i}: cur_log_probs[{i}] is a {type(current[i]).__name__}, not a tensor",
                         i) from None
    try:
        expected = None if train_log_probs is None else list(map(Tensor.numel, train_log_probs))
    except (AttributeError, TypeError):
        expected = None  # pack_sequences names the bad train_log_probs entry
    if expected is not None and lengths != expected:
        i = next(i for i, (n, e) in enumerate(zip(lengths, expected)) if n != e)
        raise InputError(f"sequence {i}: cur_log_probs[{i}] has {lengths[i]} tokens but train_log_probs[{i}] has "
                         f"{expected[i]}: the current policy's log-probs have train_log_probs' layout (this rank's "
                         "CP shard)", i)
    return list(map(Tensor.detach, current))


def _split_flat(current: Tensor, train_log_probs: Any) -> list[Tensor]:
    """A flat [N] current-policy tensor split into train_log_probs' per-sequence lengths."""
    try:
        lengths = list(map(Tensor.numel, train_log_probs))
    except (AttributeError, TypeError):
        lengths = None
    if current.ndim != 1 or lengths is None or current.numel() != sum(lengths):
        expected = "" if lengths is None else f" ({sum(lengths)} tokens, train_log_probs' this rank's tokens)"
        raise InputError(f"cur_log_probs is a tensor of shape {tuple(current.shape)}: expected one flat 1-D tensor "
                         f"of this rank's tokens{expected}, or a list of B 1-D tensors")
    return list(current.split(lengths))
