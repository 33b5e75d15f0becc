"""Read an offline W&B run back: the records of its ``run-<id>.wandb`` transaction log.

wandb (0.2x and later) writes no summary or config files in offline mode; everything it would send is in the
transaction log. Its layout is public and stable: a 7-byte header (``:W&B``, the magic 0xBEE1 little-endian, version
0), then LevelDB's log format (32 KiB blocks; each chunk a 7-byte header of CRC-32C, a 2-byte little-endian length
and a type: 1 full, 2 first, 3 middle, 4 last; a block's tail shorter than a header is padding), each assembled
record one ``wandb.proto.wandb_internal_pb2.Record`` (the protocol buffers wandb ships).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_HEADER = 7
_FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)


def records(path: Path) -> list:
    """Every record of the transaction log at ``path``, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if not data.startswith(_FILE_HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    out, pending, offset = [], b"", len(_FILE_HEADER)
    while offset + _HEADER <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < _HEADER:  # the block's tail: padding
            offset += room
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        chunk = data[offset + _HEADER:offset + _HEADER + length]
        offset += _HEADER + length
        if kind == 0 and length == 0:  # zero fill (a preallocated, unwritten tail)
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _items(updates) -> dict:
    """key -> decoded JSON value of a list of wandb items (a nested key joined by '/')."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def history(path: Path) -> list[dict]:
    """The logged rows: {"_step": the step given to ``log``, key: value, ...}, wandb's own ``_`` keys left out."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {k: v for k, v in _items(record.history.item).items() if not k.startswith("_")}
            rows.append(dict(row, _step=record.history.step.num))
    return rows


def config(path: Path) -> dict:
    """The run's config: the run record's, updated by every later config record."""
    out: dict = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(_items(record.run.config.update))
        elif kind == "config":
            out.update(_items(record.config.update))
    return {k: v for k, v in out.items() if k != "_wandb"}


def run_id(path: Path) -> str:
    """The run id the log belongs to (a log without its run record is an error naming the file: wandb-core writes
    the log when it closes the run's stream, so a log read before that holds only its header)."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.run_id
    raise ValueError(f"{path}: no run record ({Path(path).stat().st_size} bytes): the log is incomplete, read before "
                     "wandb-core closed the run's stream")
