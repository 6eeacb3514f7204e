"""What the experiment trackers wrote, read back the way their own tools read it (tests of trackers/).

`jsonl_series(run_dir)`: {key: [(step, value)]} of metrics.jsonl, what the trackers must match.
`tensorboard_scalars(logdir)`: {tag: [(step, value)]} through TensorBoard's own EventAccumulator (which
applies purge steps, as the TensorBoard UI does). `wandb_records(run_dir)`: the protobuf records of every
offline W&B run under `<run_dir>/wandb/`, in the order written; `wandb_history(records)` their
{key: [(step, value)]}. wandb 0.31 reads and writes its `.wandb` files in its Go core only, so this reads
the file format itself: a LevelDB log (32 KiB blocks of records with a 7-byte header, after a 7-byte file
header) whose records are `wandb.proto.wandb_internal_pb2.Record` messages, the format `wandb sync` uploads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version 0
RECORD_HEADER = struct.Struct("<IHB")  # checksum, length, type: 1 full, 2 first, 3 middle, 4 last


def jsonl_series(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value)]} of metrics.jsonl, the reference every tracker must match."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in ("time", "step"):
                series.setdefault(key, []).append((int(row["step"]), value))
    return series


def tensorboard_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_files(run_dir: str | Path) -> list[Path]:
    """The `.wandb` file of each offline run under `<run_dir>/wandb/`, oldest first."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))


def wandb_records(path: str | Path) -> list:
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(path).read_bytes()
    ident, magic, version = FILE_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    records, pending, pos = [], b"", FILE_HEADER.size
    while pos + RECORD_HEADER.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER.size:  # the block's tail is padding
            pos += left_in_block
            continue
        _, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if kind == 0:  # zero-filled rest of a block
            pos += left_in_block
            continue
        start = pos + RECORD_HEADER.size
        pending += data[start : start + length]
        pos = start + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value)]} of the history records (W&B's own `_step`, `_timestamp`... left out)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                out.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return out


def wandb_run(records):
    """The run record (project, display name, tags, config) of a run's records."""
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")
