"""Geometry3k preprocessing: hiyouga/geometry3k parquet -> Parallax prompt records.

Input schema (per row): `images` (list of {"bytes": binary, "path": str} structs), `problem`
(text containing `<image>`), `answer` (the value, e.g. "48"); `id` is used when present.

A file without one of the columns `images`, `problem` and `answer` is refused before anything is
written (`MissingColumns`, naming them; `python -m tasks` exits 1), and a file that yields no
record at all is an error too (`BadInput`).

Each kept row becomes a PromptRecord with data_source "geometry3k", the problem followed by the
think-then-\\boxed{} instruction, and its images referenced by sha256. Rows are skipped, counted
and logged when: the answer is missing or empty, an image is missing or undecodable, the
`<image>` placeholders outnumber the images, or the prompt is longer than `max_prompt_len`
tokens after image expansion.

    python -m tasks geometry3k --input train.parquet --out data/geo3k --split train --model MODEL_DIR

`find_splits(data_dir)` locates the train and test parquet files of a downloaded copy (the
Hugging Face layout `data/train-00000-of-00001.parquet`, or plain `train.parquet`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from broker.schemas import PromptRecord
from tasks.prompt import INSTRUCTION, expanded_length, render_prompt_ids, with_instruction
from tasks.records import BadImage, ImagePut, RecordWriter, SkipCounter, make_record

log = logging.getLogger(__name__)

DATA_SOURCE = "geometry3k"
REQUIRED_COLUMNS = ("images", "problem", "answer")


class BadInput(ValueError):
    """The input file cannot make a task: missing, without a needed column, or without a usable row."""


class MissingColumns(BadInput):
    """The parquet file lacks columns that every row needs."""


@dataclasses.dataclass
class Geo3kConfig:
    """Options of the Geometry3k preprocessor."""

    input: Path
    """Parquet file in the hiyouga/geometry3k schema."""
    out: Path
    """Task directory to write (records, images, manifest)."""
    split: str = "train"
    """Split name written into the records and the output file name."""
    model: Path | None = None
    """Checkpoint whose processor (tokenizer + image processor) measures prompt lengths; default: tiny."""
    max_prompt_len: int = 2048
    """Longest prompt kept, in tokens after image expansion."""
    instruction: str = INSTRUCTION
    """Appended to each problem."""

    def validate(self) -> None:
        if self.max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {self.max_prompt_len}")


def check_columns(path: Path) -> None:
    """Raise MissingColumns naming what `path` lacks of REQUIRED_COLUMNS (BadInput if there is no file)."""
    if not Path(path).is_file():
        raise BadInput(f"{path}: no such file")
    names = set(pq.ParquetFile(path).schema_arrow.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise MissingColumns(
            f"{path}: missing column(s) {', '.join(missing)} (the hiyouga/geometry3k schema needs"
            f" {', '.join(REQUIRED_COLUMNS)}; found {', '.join(sorted(names)) or 'none'})"
        )


SPLITS = ("train", "test")
"""The splits a run uses: it trains on train and evaluates on test (as EasyR1 and veRL do)."""


def find_splits(data_dir: str | Path) -> dict[str, Path]:
    """{"train": path, "test": path}: the one parquet file of each split under `data_dir` (recursive).

    A split is matched by file name: `<split>.parquet` or `<split>-NNNNN-of-NNNNN.parquet`. A missing
    or ambiguous split is a ValueError that says what was found.
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ValueError(
            f"--task.data-dir {root} is not a directory: download the data set first, e.g. "
            f"`huggingface-cli download hiyouga/geometry3k --repo-type dataset --local-dir {root}`"
        )
    found = {}
    for split in SPLITS:
        matches = sorted(
            p for p in root.rglob("*.parquet") if p.stem == split or p.stem.startswith(f"{split}-")
        )
        if len(matches) != 1:
            listed = ", ".join(str(p.relative_to(root)) for p in sorted(root.rglob("*.parquet"))) or "none"
            problem = "no" if not matches else f"{len(matches)}"
            raise ValueError(
                f"{root} holds {problem} {split} parquet file(s) (found: {listed}); it needs exactly one "
                f"{split}.parquet or {split}-00000-of-00001.parquet (hiyouga/geometry3k layout)"
            )
        found[split] = matches[0]
    return found


def iter_rows(path: Path, batch_size: int = 256) -> Iterator[dict]:
    """Rows of a parquet file as dicts, read in batches (bounded memory)."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        yield from batch.to_pylist()


def row_to_record(
    row: dict,
    index: int,
    split: str,
    processor,
    max_prompt_len: int,
    instruction: str = INSTRUCTION,
    put_image: ImagePut | None = None,
) -> tuple[PromptRecord, dict[str, bytes]] | tuple[None, str]:
    """One row -> (record, blobs), or (None, skip reason: detail)."""
    row_id = str(row.get("id") if row.get("id") is not None else index)
    answer = row.get("answer")
    if answer is None or not str(answer).strip():
        return None, "missing_answer: " + ("no answer" if answer is None else f"blank answer {answer!r}")
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        return None, "missing_problem: " + ("no problem text" if problem is None else "blank problem text")
    images = []
    items = row.get("images") or []
    for i, item in enumerate(items):
        data = item.get("bytes") if isinstance(item, dict) else item
        if not data:
            path = item.get("path") if isinstance(item, dict) else None
            where = f" (path {path})" if path else ""
            return None, f"missing_image: image {i + 1} of {len(items)} has no bytes{where}"
        images.append(bytes(data))
    try:
        record, blobs = make_record(
            prompt_id=f"{DATA_SOURCE}-{split}-{row_id}",
            data_source=DATA_SOURCE,
            problem=with_instruction(problem, instruction),
            images=images,
            ground_truth=str(answer).strip(),
            split=split,
            meta={"row": str(index)},
            put_image=put_image,
        )
    except BadImage as exc:
        return None, f"undecodable_image: {exc}"
    except ValueError as exc:
        return None, f"image_placeholder_mismatch: {exc}"
    n_ids = len(render_prompt_ids(processor, record.problem, len(record.images)))
    length = expanded_length(n_ids, [(r.width, r.height) for r in record.images], processor.image_processor)
    if length > max_prompt_len:
        return None, f"too_long: {length} tokens after image expansion > {max_prompt_len}"
    return record, blobs


def row_name(row: dict, index: int) -> str:
    """How a skip names a row: by its `id`, by its position in the file only when it has none."""
    return f"row id {row['id']}" if row.get("id") is not None else f"row at index {index}"


def preprocess(config: Geo3kConfig, processor=None) -> dict:
    """Convert the parquet file into a task directory; returns the manifest dict.

    Raises MissingColumns before writing anything, and BadInput when no row became a record."""
    check_columns(config.input)
    if processor is None:
        processor = _default_processor(config.model)
    skips = SkipCounter(DATA_SOURCE)
    with RecordWriter(config.out) as writer:
        for index, row in enumerate(iter_rows(config.input)):
            record, result = row_to_record(
                row, index, config.split, processor, config.max_prompt_len, config.instruction
            )
            if record is None:
                reason, _, detail = result.partition(": ")
                skips.skip(reason, row_name(row, index), detail)
                continue
            writer.write(record, result)
        kept = dict(writer.counts)
        writer.close(
            skipped=skips.as_dict(),
            extra={
                "data_source": DATA_SOURCE,
                "input": str(config.input),
                "max_prompt_len": config.max_prompt_len,
            },
        )
    log.info("geometry3k %s: kept %s, skipped %s", config.split, kept, skips.as_dict())
    if not sum(kept.values()):
        raise BadInput(f"{config.input}: no row became a record (skipped: {skips.as_dict()})")
    return {"records": kept, "skipped": skips.as_dict()}


def _default_processor(model: Path | None):
    from policy.builder import build_checkpoint
    from policy.loading import load_processor

    return load_processor(model if model is not None else build_checkpoint("tiny"))
