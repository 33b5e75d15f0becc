"""All torch.distributed code of miles_mis lives here.

The context-parallel (CP) group comes from the host's ``parallel_state`` kwarg (``.cp.group``,
``.cp.rank``, ``.cp.size``); without it, from Megatron-core's ``parallel_state`` when that is
initialised; otherwise CP size is 1 and no collective is issued.

Fail together: a rank never raises alone before a collective its peers are waiting in. Every exchange starts with
``agree``: one all-gather of a fixed-size header per rank (error flag, sequence index and message of a local failure,
batch size, the per-sequence table's schema (fingerprint), local token and token-rejection counts, the effective config
as text and its fingerprint, and a few float64 payload slots). Every rank decodes every header and takes the same
decision: if any rank failed or the ranks disagree, every rank raises (the failing rank its own error, the others a
``PeerFailure`` naming that rank and its message). Only then is the O(B) per-sequence table exchanged
(``exchange_seq_stats``), with the ranks' token-level rejections riding in the same collective
(miles_mis.parallel.rejection_wire, sized from the counts in the headers), so a CP call makes at most two collectives
and never a mismatched one. The data-parallel normalisation (``dp_sum``) carries its numbers in the header's payload:
one collective.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

# per-sequence columns appended to the stats, compared across CP ranks (the lag only when the host passes lags)
LENGTH_COLUMNS = ("response_length", "total_length", "span", "version_lag", "rollout_group")
_MAGIC = 0x6D69736D6973  # "mismis": a header from another miles_mis version (or not ours) is detected
# magic, error flag, error sequence, batch size, table schema fingerprint, local tokens, rejected local tokens,
# fingerprint
_INTS = "<8q"
# the batch-sum vector of miles_mis.correction.mismatch_location (16) + the adaptive bound's histogram (195), and the
# DP exchanges' numbers (at most that histogram)
PAYLOAD_SLOTS = 224
_FLOATS = f"<{PAYLOAD_SLOTS}d"
MESSAGE_BYTES, CONFIG_BYTES = 512, 1536
HEADER_BYTES = struct.calcsize(_INTS) + struct.calcsize(_FLOATS) + MESSAGE_BYTES + CONFIG_BYTES


class PeerFailure(ValueError):
    """Raised on every rank whose peer failed or disagreed, so that no rank waits in a collective."""


class CollectiveError(RuntimeError):
    """The collective itself failed (a peer process exited, the group is broken)."""


@dataclass(frozen=True)
class Group:
    rank: int = 0
    size: int = 1
    group: Any = None


SINGLE = Group()


def _group_info(info: Any, what: str) -> Group:
    size = int(getattr(info, "size", 1))
    rank = int(getattr(info, "rank", 0))
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"parallel_state.{what} has rank={rank}, size={size}: need size >= 1 and 0 <= rank < size")
    return Group(rank, size, getattr(info, "group", None)) if size > 1 else SINGLE


def _megatron():
    # Only consult Megatron when the host already imported and initialised it: importing costs seconds.
    mpu = sys.modules.get("megatron.core.parallel_state")
    try:
        if mpu is not None and mpu.model_parallel_is_initialized():
            return mpu
    except (AssertionError, RuntimeError, AttributeError):
        pass
    return None


def resolve_cp_group(parallel_state: Any = None) -> Group:
    """The CP group of this call: from the host's kwarg, else Megatron-core, else size 1."""
    if parallel_state is not None:
        cp = getattr(parallel_state, "cp", None)
        if cp is None:
            raise ValueError("parallel_state has no 'cp' attribute: expected an object with "
                             "parallel_state.cp.rank, .cp.size and .cp.group")
        return _group_info(cp, "cp")
    mpu = _megatron()
    if mpu is None or mpu.get_context_parallel_world_size() <= 1:
        return SINGLE
    return Group(mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size(),
                 mpu.get_context_parallel_group())


def resolve_tp_group(parallel_state: Any = None) -> Group:
    """The tensor-parallel group (the ranks holding slices of the vocabulary): ``tp`` of the host's parallel state,
    else Megatron-core's tensor-model-parallel group, else size 1."""
    if parallel_state is not None and getattr(parallel_state, "tp", None) is not None:
        return _group_info(parallel_state.tp, "tp")
    mpu = _megatron()
    if mpu is None or mpu.get_tensor_model_parallel_world_size() <= 1:
        return SINGLE
    return Group(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                 mpu.get_tensor_model_parallel_group())


def resolve_dp_group(parallel_state: Any = None) -> Group:
    """The data-parallel group (without CP): ``effective_dp``/``intra_dp``/``dp`` of the host's
    parallel state, else Megatron-core's data-parallel group, else size 1."""
    if parallel_state is not None:
        for name in ("effective_dp", "intra_dp", "dp"):
            info = getattr(parallel_state, name, None)
            if info is not None:
                return _group_info(info, name)
    mpu = _megatron()
    if mpu is None:
        if parallel_state is not None:  # a distributed host whose DP group we cannot see: do not guess size 1
            raise ValueError("tis_batch_normalize_scope: dp needs the data-parallel group: parallel_state has no "
                             "effective_dp, intra_dp or dp attribute and Megatron-core is not initialised; use "
                             "tis_batch_normalize_scope: micro_batch, or pass the group")
        return SINGLE
    size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    if size <= 1:
        return SINGLE
    return Group(mpu.get_data_parallel_rank(with_context_parallel=False), size,
                 mpu.get_data_parallel_group(with_context_parallel=False))


# --------------------------------------------------------------------------- agreement (fixed size)
@dataclass(frozen=True)
class Header:
    """One rank's header, as every rank decodes it."""

    error: bool
    error_sequence: int
    batch_size: int
    table_schema: int  # the per-sequence table's schema fingerprint (correction.TableSchema.fingerprint)
    tokens: int  # this rank's local response tokens (-1 when it failed)
    rejected: int  # of them, removed by a token-level stage (0 when the config rejects no single token)
    fingerprint: int
    payload: tuple[float, ...]
    message: str
    config_text: str
    magic_ok: bool = True


def config_fingerprint(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def encode_header(*, error: BaseException | None = None, batch_size: int = -1, table_schema: int = -1,
                  tokens: int = -1, rejected: int = 0, config_text: str = "", payload: Sequence[float] = ()) -> bytes:
    message = "" if error is None else describe_error(error)
    sequence = getattr(error, "sequence_index", -1) if error is not None else -1
    values = list(payload) + [0.0] * (PAYLOAD_SLOTS - len(payload))
    return (struct.pack(_INTS, _MAGIC, int(error is not None), int(sequence), int(batch_size), int(table_schema),
                        int(tokens), int(rejected), config_fingerprint(config_text))
            + struct.pack(_FLOATS, *values)
            + _fixed(message, MESSAGE_BYTES) + _fixed(config_text, CONFIG_BYTES))


def decode_header(blob: bytes) -> Header:
    ints_size, floats_size = struct.calcsize(_INTS), struct.calcsize(_FLOATS)
    magic, error, sequence, batch_size, table_schema, tokens, rejected, fingerprint = struct.unpack(
        _INTS, blob[:ints_size])
    payload = struct.unpack(_FLOATS, blob[ints_size:ints_size + floats_size])
    text = blob[ints_size + floats_size:]
    return Header(bool(error), sequence, batch_size, table_schema, tokens, rejected, fingerprint, payload,
                  _unfixed(text[:MESSAGE_BYTES]), _unfixed(text[MESSAGE_BYTES:]), magic == _MAGIC)


def _fixed(text: str, size: int) -> bytes:
    """UTF-8, cut at a character boundary with "..." when too long, zero-padded to ``size`` bytes."""
    data = text.encode("utf-8")
    if len(data) > size:
        data = data[:size - 3].decode("utf-8", errors="ignore").encode("utf-8") + b"..."
    return data + b"\0" * (size - len(data))


def _unfixed(data: bytes) -> str:
    return data.rstrip(b"\0").decode("utf-8", errors="replace")


def describe_error(error: BaseException) -> str:
    """One line for a peer: the message, with the exception type unless it is a ValueError."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"


def agree(group: Group, name: str, *, error: BaseException | None = None, batch_size: int = -1, table_schema: int = -1,
          tokens: int = -1, rejected: int = 0, config_text: str = "", payload: Sequence[float] = ()) -> list[Header]:
    """One all-gather of a fixed-size header over ``group`` (``name`` "cp" or "dp" for messages).

    Raises on every rank, with one message naming the rank and what is wrong, when any rank reports an
    error (the rank that failed re-raises ``error`` itself), when the ranks' configs differ (the keys and
    each rank's value), or when they disagree on the batch size or the per-sequence table's schema. Returns every
    header.
    """
    blob = encode_header(error=error, batch_size=batch_size, table_schema=table_schema, tokens=tokens,
                         rejected=rejected, config_text=config_text, payload=payload)
    device = collective_device(group)
    local = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
    gathered = local.new_empty(group.size * HEADER_BYTES)
    _all_gather(gathered, local, group, name)
    data = bytes(gathered.cpu().tolist())
    headers = [decode_header(data[r * HEADER_BYTES:(r + 1) * HEADER_BYTES]) for r in range(group.size)]
    me = f"{name} rank {group.rank} of {group.size}"
    if not all(h.magic_ok for h in headers):
        odd = [r for r, h in enumerate(headers) if not h.magic_ok]
        raise PeerFailure(f"{name} rank(s) {odd} sent a header this miles_mis does not know (a different miles_mis "
                          f"version on some ranks?); {me} stops too")
    failed = [r for r, h in enumerate(headers) if h.error]
    if failed:
        if error is not None:
            raise error
        details = "; ".join(f"{name} rank {r}" + (f" at sequence {headers[r].error_sequence}"
                                                   if headers[r].error_sequence >= 0 else "")
                            + f": {headers[r].message}" for r in failed)
        raise PeerFailure(f"{details} ({me} stops too, so that no rank waits in a collective)")
    if len({h.fingerprint for h in headers}) > 1:
        raise PeerFailure(f"{name} ranks disagree on the effective config: {_config_difference(headers, name)} "
                          f"(every rank of a {name} group must run the same correction; {me} stops)")
    for field, label in (("batch_size", "the number of sequences"),
                         ("table_schema", "the per-sequence table's columns")):
        values = [getattr(h, field) for h in headers]
        if len(set(values)) > 1:
            raise PeerFailure(f"{name} ranks disagree on {label}: "
                              + ", ".join(f"{name} rank {r} has {v}" for r, v in enumerate(values)))
    return headers


def _config_difference(headers: list[Header], name: str) -> str:
    """The keys whose values differ, with each rank's value (from the config texts)."""
    parsed = [dict(line.split("=", 1) for line in h.config_text.splitlines() if "=" in line) for h in headers]
    keys = sorted(set().union(*parsed))
    differing = [k for k in keys if len({p.get(k, "<missing>") for p in parsed}) > 1]
    if not differing:
        return "the configs differ beyond what the header can show (fingerprints differ)"
    return "; ".join(f"{key}: " + ", ".join(f"{name} rank {r} has {p.get(key, '<missing>')}"
                                            for r, p in enumerate(parsed)) for key in differing)


def collective_device(group: Group) -> torch.device:
    """Where this group's collectives take tensors: the current CUDA device for NCCL, else the CPU."""
    import torch.distributed as dist

    try:
        backend = dist.get_backend(group.group)
    except (RuntimeError, ValueError):
        backend = None
    if backend is not None and "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(output: Tensor, tensor: Tensor, group: Group, name: str) -> None:
    import torch.distributed as dist

    # all_gather_single is the new name (torch >= 2.13) of all_gather_into_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        all_gather(output, tensor, group=group.group)
    except RuntimeError as error:  # gloo: "Connection closed by peer" when a rank exited, and the like
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CollectiveError(f"the {name} exchange failed on {name} rank {group.rank} of {group.size} (a peer "
                              f"process exited or the process group is broken): {first}") from error


# --------------------------------------------------------------------------- the O(B) exchange
def exchange_seq_stats(stats: Tensor, lengths: Tensor, cp: Group, extra: Tensor | None = None,
                       names: Sequence[str] = LENGTH_COLUMNS) -> tuple[Tensor, Tensor | None]:
    """All-gather every CP rank's per-sequence table: [B, K] stats + [B, 3] lengths (response, total, span; then the
    lag and the rollout group, when the host passes them: ``names`` names the columns) -> [C, B, K] float64, and
    with it ``extra``, E bytes per rank (uint8 [E]: the token rejections of miles_mis.parallel.rejection_wire) ->
    [C, E].

    One collective of B·(K+3)·8 + E bytes per rank. Call only after ``agree`` (same B, K and E on every rank:
    E is computed from the headers). Raises on every rank when the ranks disagree on any sequence's lengths
    (the comparison runs on the gathered, identical data), before anything reads ``extra``.
    """
    num_seqs, num_stats = stats.shape
    extra = torch.zeros(0, dtype=torch.uint8) if extra is None else extra
    if num_seqs == 0:  # agreed: every rank has B = 0 (so no token), nothing to exchange
        return stats.new_zeros((cp.size, 0, num_stats), dtype=torch.float64), extra.new_zeros((cp.size, 0))
    table = torch.cat([stats.double(), lengths.to(device=stats.device, dtype=torch.float64)], dim=1).contiguous()
    table_bytes = table.numel() * 8
    send = torch.cat([table.view(-1).view(torch.uint8), extra.to(stats.device)])
    gathered = send.new_empty((cp.size, send.numel()))  # ranks concatenated along dim 0
    _all_gather(gathered.view(-1), send, cp, "cp")
    extra_out = gathered[:, table_bytes:]
    gathered = gathered[:, :table_bytes].contiguous().view(torch.float64).view(cp.size, num_seqs, table.shape[1])
    seq_lengths = gathered[:, :, num_stats:]
    differs = (seq_lengths != seq_lengths[:1]).any(dim=2).any(dim=0)
    if bool(differs.any()):
        i = int(differs.nonzero()[0])
        values = "; ".join(f"cp rank {r}: " + ", ".join(f"{name}={int(v)}" for name, v in
                                                        zip(names, seq_lengths[r, i].tolist()))
                           for r in range(cp.size))
        raise PeerFailure(f"sequence {i}: context-parallel ranks disagree on its lengths ({values})")
    return gathered[:, :, :num_stats], extra_out


def dp_reduce(values: Tensor, group: Group, config_text: str, reduce: Sequence[str]) -> Tensor:
    """Combine a few numbers over the data-parallel group, each by "sum" or "max" (``reduce``), inside the
    agreement header: one collective, and a failed or differently configured DP rank makes every rank raise."""
    if group.size == 1:
        return values
    headers = agree(group, "dp", config_text=config_text, payload=values.detach().double().cpu().tolist())
    total = [(max if how == "max" else sum)(h.payload[i] for h in headers) for i, how in enumerate(reduce)]
    return torch.tensor(total, dtype=torch.float64).to(device=values.device, dtype=values.dtype)


def dp_sum(values: Tensor, group: Group, config_text: str) -> Tensor:
    """Sum a few numbers (at most PAYLOAD_SLOTS) over the data-parallel group inside the agreement header:
    one collective, and a failed or differently configured DP rank makes every rank raise."""
    if group.size == 1:
        return values
    headers = agree(group, "dp", config_text=config_text, payload=values.detach().double().cpu().tolist())
    total = [sum(h.payload[i] for h in headers) for i in range(values.numel())]
    return torch.tensor(total, dtype=torch.float64).to(device=values.device, dtype=values.dtype)


def all_reduce_sum(values: Tensor, group: Group) -> Tensor:
    """Sum a small tensor over a group (used for data-parallel batch normalisation)."""
    if group.size == 1:
        return values
    import torch.distributed as dist

    out = values.detach().double().clone()
    dist.all_reduce(out, group=group.group)
    return out.to(values.dtype)


def all_reduce_max(values: Tensor, group: Group) -> Tensor:
    """The elementwise maximum of a tensor over a group (the tensor-parallel log-normaliser's shift)."""
    if group.size == 1:
        return values
    import torch.distributed as dist

    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group.group)
    return out
