"""Host inputs: validation and packing into the core's ``PackedBatch``.

The entry points in ``miles_mis.plugin`` hand what the host passed to this module before any arithmetic:
``pack_sequences`` checks miles' per-sequence lists (and, under context parallelism, that this rank holds
the zigzag shards the layout gives it) and concatenates this rank's tokens; ``pack_flat`` checks the flat
[N] tensors and ``cu_seqlens`` of hosts that already hold packed tokens; ``check_pg_loss`` checks the loss
against the packed tokens. Every failure is an ``InputError`` naming the first bad sequence where there is
one. The cheap whole-batch checks run first, with a fixed number of tensor operations whatever the batch
size; the sequences are walked one by one only after a check failed, to name the culprit.
"""

from __future__ import annotations

import array
import numbers
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..parallel import distributed
from ..config import host_setting
from ..parallel.cp_layout import QKV_FORMATS, LocalLayout, zigzag_layout
from ..tensors import ops
from ..tensors.packed_batch import PackedBatch


class InputError(ValueError):
    """Invalid host input; ``sequence_index`` is the first bad sequence (-1 when not about one)."""

    def __init__(self, message: str, sequence_index: int = -1):
        super().__init__(message)
        self.sequence_index = sequence_index


@dataclass(frozen=True)
class PackedInputs:
    """A rank's validated tokens, and what rebuilding the full-length output masks needs."""

    batch: PackedBatch  # this rank's tokens
    full_masks: Tensor  # [Σ response_lengths] the input masks concatenated (input dtype)
    response_lengths: list[int]
    local_positions: Tensor | None  # indices of the local tokens in full_masks; None = all, in order (cp 1)
    length_table: Tensor | None  # [B, 3] response, total, span lengths, exchanged to check CP agreement
    # the names of length_table's columns (the lag and the rollout group are appended when the host passes them)
    length_names: tuple[str, ...] = ("response_length", "total_length", "span")


# --------------------------------------------------------------------------- host settings
def qkv_format_of(args: Any) -> str:
    """The host's ``qkv_format`` ("thd" when not set), checked against the allowed values."""
    value = host_setting(args, "qkv_format") or "thd"
    if value not in QKV_FORMATS:
        raise ValueError(f"qkv_format={value!r} is invalid: allowed values are {', '.join(QKV_FORMATS)}")
    return value


# --------------------------------------------------------------------------- per-sequence lists
def pack_sequences(train_log_probs, rollout_log_probs, loss_masks, *, total_lengths=None, response_lengths=None,
                   max_seq_lens=None, cp: distributed.Group = distributed.SINGLE,
                   qkv_format: str = "thd", train_name: str = "train_log_probs") -> PackedInputs:
    """Validate the host's per-sequence lists and concatenate this rank's tokens.

    At CP size 1 the log-probs are whole responses; at CP size C > 1 they are this rank's zigzag
    shards, whose lengths must match the layout computed from total/response lengths. ``train_name``: what
    messages call the first list (``cur_log_probs`` when the current policy's log-probs take its place).
    """
    _check_list_arguments(train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                          max_seq_lens, cp, train_name)
    # Cheap whole-list checks first (numel, not .shape, which is slow on views; 1-D is checked on the
    # concatenated result); the sequences are walked only to name the first bad one.
    lists = ((train_name, train_log_probs), ("rollout_log_probs", rollout_log_probs),
             ("loss_masks", loss_masks))
    try:  # map over the unbound method: ~25% faster than a comprehension at B in the thousands
        local_lengths = list(map(Tensor.numel, train_log_probs))
        full_lengths = list(map(Tensor.numel, loss_masks))
    except (AttributeError, TypeError):  # not a tensor: name the first one
        _raise_first_bad(lists)
    response_lengths = _int_list("response_lengths", response_lengths)
    total_lengths = _int_list("total_lengths", total_lengths)
    if response_lengths is not None:
        _check_response_lengths(response_lengths, full_lengths, total_lengths)
    layout = length_table = None
    if cp.size > 1:
        layout, length_table = _zigzag_shards(local_lengths, full_lengths, total_lengths, max_seq_lens, cp,
                                              qkv_format)
    elif local_lengths != full_lengths:
        i = next(i for i, (n, e) in enumerate(zip(local_lengths, full_lengths)) if n != e)
        _raise_shape_error(i, lists)
    train, rollout, full_masks = _concatenate(lists, local_lengths)
    full_masks = full_masks.to(train.device)
    _check_masks_finite(full_masks, loss_masks)
    return _local_tokens(train, rollout, full_masks, local_lengths, full_lengths, layout, length_table)


def _require_log_probs(train_log_probs, rollout_log_probs) -> None:
    """Both log-probs must be given (a host without rollout log-probs cannot measure the mismatch)."""
    if rollout_log_probs is None:
        raise InputError("rollout_log_probs is None: the host must return rollout log-probs from the engine "
                         "(miles: the rollout must keep per-token log-probs) to measure or correct the mismatch")
    if train_log_probs is None:
        raise InputError("train_log_probs is None: the host must pass the trainer's recomputed log-probs (miles skips "
                         "its old-policy forward under --use-rollout-logprobs unless --get-mismatch-metrics is set: "
                         "drop --use-rollout-logprobs or add --get-mismatch-metrics)")


def _check_list_arguments(train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                          max_seq_lens, cp: distributed.Group, train_name: str = "train_log_probs") -> None:
    """The arguments of ``pack_sequences`` as a whole: lists, one entry per sequence in each, lengths under CP."""
    _require_log_probs(train_log_probs, rollout_log_probs)
    for name, values in ((train_name, train_log_probs), ("rollout_log_probs", rollout_log_probs),
                         ("loss_masks", loss_masks)):
        if not isinstance(values, (list, tuple)):
            raise InputError(f"{name} is a {type(values).__name__}: expected a list of B 1-D tensors, one per sequence")
    counts = {train_name: len(train_log_probs), "rollout_log_probs": len(rollout_log_probs),
              "loss_masks": len(loss_masks)}
    for name, values in (("response_lengths", response_lengths), ("total_lengths", total_lengths),
                         ("max_seq_lens", max_seq_lens)):
        if values is not None:
            counts[name] = len(values)
    if len(set(counts.values())) > 1:
        raise InputError("inputs disagree on the number of sequences: "
                         + ", ".join(f"{name} has {n}" for name, n in counts.items()))
    if cp.size > 1 and (total_lengths is None or response_lengths is None):
        raise InputError("total_lengths and response_lengths are required with context parallel size > 1")


def _check_response_lengths(response_lengths: list[int], full_lengths: list[int],
                            total_lengths: list[int] | None) -> None:
    """The host's response lengths are the masks' lengths, and each total length exceeds its response length."""
    if response_lengths != full_lengths:
        i = next(i for i, (r, n) in enumerate(zip(response_lengths, full_lengths)) if r != n)
        raise InputError(f"sequence {i}: response_lengths[{i}]={response_lengths[i]} but loss_masks[{i}] has "
                         f"{full_lengths[i]} elements (loss masks are full response length)", i)
    if total_lengths is not None and any(map(operator.le, total_lengths, response_lengths)):  # the fast test
        short = [i for i, (t, r) in enumerate(zip(total_lengths, response_lengths)) if t <= r and r]
        if short:
            i = short[0]
            raise InputError(f"sequence {i}: total_lengths[{i}]={total_lengths[i]} must exceed "
                             f"response_lengths[{i}]={response_lengths[i]} (the prompt has at least 1 token)", i)


def _zigzag_shards(local_lengths: list[int], full_lengths: list[int], total_lengths: list[int], max_seq_lens,
                   cp: distributed.Group, qkv_format: str) -> tuple[LocalLayout, Tensor]:
    """This rank's zigzag layout, after checking that it holds the shard lengths the layout gives it, and the
    [B, 3] (response, total, span) length table the CP peers compare."""
    spans = None
    if qkv_format == "bshd":
        if max_seq_lens is None:
            raise InputError("max_seq_lens is required when qkv_format is 'bshd'")
        spans = torch.tensor(_int_list("max_seq_lens", max_seq_lens), dtype=torch.long)
        too_long = (spans < torch.tensor(total_lengths)).nonzero()
        if too_long.numel():
            i = int(too_long[0])
            raise InputError(f"sequence {i}: max_seq_lens[{i}]={int(max_seq_lens[i])} is smaller than "
                             f"total_lengths[{i}]={int(total_lengths[i])}", i)
    totals = torch.tensor(total_lengths, dtype=torch.long)
    responses = torch.tensor(full_lengths, dtype=torch.long)
    layout = zigzag_layout(totals, responses, cp.rank, cp.size, qkv_format, spans)
    expected = layout.local_lengths.tolist()
    if local_lengths != expected:
        i = next(i for i, (n, e) in enumerate(zip(local_lengths, expected)) if n != e)
        raise InputError(f"sequence {i}: train_log_probs has {local_lengths[i]} tokens on cp rank {cp.rank} of "
                         f"{cp.size}, but the zigzag layout ({qkv_format}, total_length={int(totals[i])}, "
                         f"response_length={full_lengths[i]}) gives this rank {expected[i]}", i)
    return layout, torch.stack([responses, totals, totals if spans is None else spans], 1).double()


def _concatenate(lists, local_lengths: list[int]) -> list[Tensor]:
    """The three lists each joined into one flat tensor (detached); an InputError naming the first bad
    sequence when they cannot be joined into plain 1-D tensors or a log-prob sequence is not floating point."""
    flat = None
    try:
        if local_lengths == list(map(Tensor.numel, lists[1][1])):
            flat = [ops.without_history(torch.cat(list(seq))) if len(seq) else torch.zeros(0) for _, seq in lists]
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):  # mixed dims/devices, odd tensors
        flat = None
    if flat is None or not all(_plain_1d(f) for f in flat):
        _raise_first_bad(lists)
        bad = next((i for i, (a, b) in enumerate(zip(lists[0][1], lists[1][1])) if a.shape != b.shape), None)
        if bad is None:
            raise InputError("the per-sequence tensors could not be joined (" + ", ".join(
                f"{name}: {f.dtype} {f.layout} on {f.device}" for (name, _), f in zip(lists, flat or ())) + ")")
        _raise_shape_error(bad, lists)
    for _, seq in lists[:2]:  # torch.cat promotes an integer sequence among floats: test each dtype
        if not all(dtype.is_floating_point for dtype in set(map(_DTYPE, seq))):
            _raise_first_bad(lists)
    return flat


def _check_masks_finite(full_masks: Tensor, loss_masks) -> None:
    """A floating-point mask holds finite values only (the cheap sum first, the exact test if it is not finite)."""
    if (full_masks.is_floating_point() and bool(_may_hold_nonfinite(full_masks))
            and not bool(torch.isfinite(full_masks).all())):
        i = next(i for i, m in enumerate(loss_masks) if not bool(torch.isfinite(m).all()))
        raise InputError(f"sequence {i}: loss_masks[{i}] holds a non-finite value: masks are finite weights "
                         "(nonzero = trained token)", i)


def _local_tokens(train: Tensor, rollout: Tensor, full_masks: Tensor, local_lengths: list[int],
                  full_lengths: list[int], layout: LocalLayout | None, length_table: Tensor | None) -> PackedInputs:
    """The packed batch of this rank's tokens: under CP, the local mask values are picked out of the full
    masks by the layout, and each token carries its position in its response."""
    device = train.device
    positions = None
    if layout is None:
        local_mask = full_masks
    else:
        response_offsets = torch.cumsum(torch.tensor([0] + full_lengths[:-1], dtype=torch.long), 0)
        positions = layout.positions(response_offsets).to(device)
        local_mask = full_masks.index_select(0, positions)
    seq_lengths = long_tensor(local_lengths, device)
    response_positions = None
    if positions is not None:  # each local token's position in its response: its index minus its response's start
        local_seq = torch.repeat_interleave(seq_lengths, output_size=positions.numel())  # sequence of each token
        response_positions = positions - response_offsets.to(device).index_select(0, local_seq)
    batch = PackedBatch.from_flat(train, rollout.to(device), local_mask, seq_lengths, positions=response_positions)
    return PackedInputs(batch, full_masks, full_lengths, positions, length_table)


# --------------------------------------------------------------------------- flat tensors and cu_seqlens
def pack_flat(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens,
              train_name: str = "train_log_probs") -> PackedBatch:
    """Validate the packed path's flat [N] tensors and [B+1] offsets; the ``PackedBatch`` they describe.
    ``train_name``: what the errors call the numerator's log-probs (the host's current-policy input under
    ``tis_policy: current``).

    A fixed number of tensor operations whatever B (no loop over sequences); the values of ``cu_seqlens``
    and the finiteness of the mask are checked together, with one device-to-host read. Only a failing
    check does more work, to name the first bad sequence or token.
    """
    _require_log_probs(train_log_probs, rollout_log_probs)
    flat = ((train_name, train_log_probs), ("rollout_log_probs", rollout_log_probs),
            ("loss_mask", loss_mask), ("cu_seqlens", cu_seqlens))
    device = train_log_probs.device if isinstance(train_log_probs, Tensor) and not train_log_probs.is_meta else None
    for name, value in flat:
        if isinstance(value, (list, tuple)):
            raise InputError(f"{name} is a {type(value).__name__}: the packed entry point takes one flat tensor "
                             "(per-sequence lists: compute_mis_weights)")
        if name == "cu_seqlens" and isinstance(value, Tensor) and not _integer_dtype(value.dtype):
            raise InputError(f"cu_seqlens has dtype {value.dtype}: expected integer offsets (int32, as flash-attention "
                             "and Megatron hold them, or int64)")
        shape = ("a 1-D [B+1] tensor of offsets" if name == "cu_seqlens"
                 else "a flat 1-D [N] tensor (the B responses concatenated)")
        kind = {"loss_mask": "masks", "cu_seqlens": "offsets"}.get(name, "log-probs")
        problem = tensor_problem(value, device, kind, device_of=train_name,
                                  one_device="all inputs on one device", shape=shape)
        if problem:
            raise InputError(f"{name} {problem}")
    num_tokens = train_log_probs.numel()
    if rollout_log_probs.numel() != num_tokens or loss_mask.numel() != num_tokens:
        raise InputError(f"{train_name} has {num_tokens} tokens, rollout_log_probs has "
                         f"{rollout_log_probs.numel()}, loss_mask has {loss_mask.numel()}: the flat tensors "
                         "must have equal lengths")
    if cu_seqlens.numel() == 0:
        raise InputError("cu_seqlens is empty: expected B+1 offsets, [0] for no sequence")
    cu_seqlens = cu_seqlens.long()  # int32 (or another integer type) widened; no copy when already int64

    seq_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    suspect = cu_seqlens[0].ne(0).logical_or_(cu_seqlens[-1].ne(num_tokens)).logical_or_((seq_lengths < 0).any())
    if loss_mask.is_floating_point():
        suspect = suspect | _may_hold_nonfinite(loss_mask)
    if bool(suspect):  # the one read of a value; the exact checks below run only when something is off
        _check_packed_exactly(cu_seqlens, seq_lengths, loss_mask, num_tokens)
    return PackedBatch.from_flat(train_log_probs.detach(), rollout_log_probs.detach(), loss_mask.detach(),
                                 seq_lengths)


def _integer_dtype(dtype: torch.dtype) -> bool:
    """A real integer dtype (bool is not an offset)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_packed_exactly(cu_seqlens: Tensor, seq_lengths: Tensor, loss_mask: Tensor, num_tokens: int) -> None:
    """Name the first failing check of ``pack_flat`` (called only when the cheap combined check is suspect)."""
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0:
        raise InputError(f"cu_seqlens[0]={first}: the offsets start at 0")
    decreasing = (seq_lengths < 0).nonzero()
    if decreasing.numel():
        i = int(decreasing[0])
        raise InputError(f"sequence {i}: cu_seqlens decreases from cu_seqlens[{i}]={int(cu_seqlens[i])} to "
                         f"cu_seqlens[{i + 1}]={int(cu_seqlens[i + 1])}: the offsets must be non-decreasing", i)
    if last != num_tokens:
        raise InputError(f"cu_seqlens[-1]={last} but the flat tensors hold {num_tokens} tokens: the last offset "
                         "is the number of tokens N")
    nonfinite = (~torch.isfinite(loss_mask)).nonzero()
    if nonfinite.numel():
        token = int(nonfinite[0])
        i = int(torch.searchsorted(cu_seqlens, nonfinite[0], right=True)) - 1
        raise InputError(f"sequence {i}: loss_mask[{token}]={loss_mask[token].item()} is not finite: masks are "
                         "finite weights (nonzero = trained token)", i)
    # else: finite mask values whose sum overflowed (|values| near the float32 limit): nothing is wrong


# --------------------------------------------------------------------------- the loss
def check_pg_loss(pg_loss: Tensor, batch: PackedBatch) -> None:
    """``pg_loss`` is a floating-point [N] tensor on the log-probs' device, one value per local token."""
    num_tokens = batch.train_log_probs.numel()
    problem = tensor_problem(pg_loss, batch.train_log_probs.device, "loss")
    if problem is None and pg_loss.numel() != num_tokens:
        problem = (f"has shape {tuple(pg_loss.shape)} but the {batch.num_seqs} sequences hold {num_tokens} "
                   f"local tokens: expected shape ({num_tokens},)")
    if problem is not None:
        problem = problem.replace("sequence 0 is on", "the log-probs are on")
        raise InputError(f"pg_loss {problem}")


# --------------------------------------------------------------------------- shared checks
def _may_hold_nonfinite(mask: Tensor) -> Tensor:
    """0-d bool: True if a value of a floating-point mask may be NaN/±inf (the sum is; an overflowing sum of
    finite values also is, so True must be confirmed by ``torch.isfinite``). A sum reads the mask once and
    writes nothing: 10-20x cheaper than ``torch.isfinite(mask).all()`` on CPU."""
    return ~torch.isfinite(mask.sum(dtype=torch.float64 if mask.dtype == torch.float64 else torch.float32))


def long_tensor(values: list[int], device) -> Tensor:
    """An int64 tensor of Python ints, through an array buffer: 3-4x faster than torch.tensor(list) at B in
    the thousands (it reads each element as a Python object)."""
    if not values:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64).to(device)



def _int_list(name: str, values) -> list[int] | None:
    """Host lengths as a list of Python ints (they may arrive as a list, a tuple or an integer tensor)."""
    if values is None:
        return None
    if isinstance(values, Tensor):
        if values.is_floating_point() or values.is_complex() or values.ndim != 1:
            raise InputError(f"{name} is a {values.dtype} tensor of shape {tuple(values.shape)}: expected B integers")
        return values.tolist()
    values = list(values)
    if set(map(type, values)) <= {int}:
        return values
    for i, v in enumerate(values):  # the slow path names the first bad entry
        is_integer = isinstance(v, numbers.Integral) or (isinstance(v, Tensor) and v.numel() == 1
                                                         and not v.is_floating_point())
        if isinstance(v, bool) or not is_integer:
            raise InputError(f"sequence {i}: {name}[{i}]={v!r} is not an integer", i)
    return [int(v) for v in values]


def _plain_1d(tensor: Tensor) -> bool:
    return (not tensor.is_nested and tensor.layout == torch.strided and not tensor.is_quantized
            and not tensor.is_meta and tensor.ndim == 1 and not tensor.is_complex())


_DTYPE = operator.attrgetter("dtype")
_REAL = {"log-probs": "log-probs are real", "masks": "masks are real", "loss": "the loss is real",
         "offsets": "offsets are integers"}


def tensor_problem(value: Any, device: Any, kind: str, device_of: str = "sequence 0",
                    one_device: str = "every sequence on one device", shape: str = "a 1-D tensor") -> str | None:
    """What is wrong with one per-sequence entry (or one flat tensor of the packed path, or pg_loss), or None.
    ``kind``: "log-probs", "masks", "loss" or "offsets" (what the messages call it)."""
    if not isinstance(value, Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.is_nested:
        return "is a nested tensor: plain 1-D tensors only"
    if value.layout != torch.strided:
        return f"is a {str(value.layout).replace('torch.', '')} tensor: dense tensors only"
    if value.is_quantized:
        return f"is a quantized tensor ({value.dtype}): dense float tensors only"
    if value.is_meta:
        return "is on the meta device (it has no values)"
    if device is not None and value.device != device:
        return f"is on {value.device} but {device_of} is on {device}: {one_device}"
    if value.is_complex():
        return f"has dtype {value.dtype}: {_REAL[kind]}"
    if kind == "log-probs" and not value.is_floating_point():
        return f"has dtype {value.dtype}: log-probs are floating point (a {value.dtype} tensor is not a log-prob)"
    if kind == "loss" and not value.is_floating_point():
        return f"has dtype {value.dtype}: the loss is floating point (the weights would be cast to it)"
    if value.ndim != 1:
        return f"has shape {tuple(value.shape)}: expected {shape}"
    return None


def _raise_first_bad(lists) -> None:
    """Raise an InputError naming the first sequence whose entry is not a plain 1-D tensor (no-op if none)."""
    first_device = {}
    for name, seq in lists:
        head = seq[0] if len(seq) else None
        first_device[name] = head.device if isinstance(head, Tensor) and not head.is_meta else None
    for i in range(max(len(seq) for _, seq in lists)):
        for name, seq in lists:
            problem = tensor_problem(seq[i], first_device[name], "masks" if name == "loss_masks" else "log-probs")
            if problem:
                raise InputError(f"sequence {i}: {name}[{i}] {problem}", i)


def _raise_shape_error(i: int, lists) -> None:
    """Raise an InputError for sequence ``i`` whose three entries do not have the lengths they must have."""
    _raise_first_bad(lists)
    shapes = [tuple(seq[i].shape) for _, seq in lists]
    raise InputError(f"sequence {i}: {lists[0][0]} has shape {shapes[0]}, rollout_log_probs has shape "
                     f"{shapes[1]}, loss_masks has shape {shapes[2]}; the log-probs must be 1-D of equal length, "
                     "and at context parallel size 1 as long as the mask", i)
