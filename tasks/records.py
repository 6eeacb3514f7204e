"""Build, write and read Parallax prompt records (`broker.schemas.PromptRecord`) and their images.

Tasks produce `(record, {sha256: image_bytes})` pairs, so they work without a broker. Where a
blob store exists, pass its `put(bytes) -> ImageRef` as `put_image` and the bytes go there too.

On disk a task directory holds:
    <split>.jsonl         one PromptRecord per line (msgspec JSON)
    images/<sha256>.<fmt> each encoded image once, named by the sha256 of its bytes
    manifest.json         counts per split and the skip reasons
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
from PIL import Image, UnidentifiedImageError

from broker.schemas import ImageRef, PromptRecord

log = logging.getLogger(__name__)

ImagePut = Callable[[bytes], ImageRef]
"""A blob store's `put(bytes) -> ImageRef` (e.g. `broker.images.ImageStore.put`)."""


class BadImage(ValueError):
    """Image bytes that PIL cannot decode."""


def encode_png(image: Image.Image) -> bytes:
    """Lossless PNG bytes of a PIL image (deterministic for the same pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def image_ref(data: bytes) -> ImageRef:
    """Decode `data` enough to learn its format and size; return its content-addressed reference."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            fmt, (width, height) = (img.format or "png").lower(), img.size
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad bytes
        raise BadImage(f"undecodable image ({len(data)} bytes): {_why(exc)}") from exc
    return ImageRef(
        sha256=hashlib.sha256(data).hexdigest(), format=fmt, width=width, height=height, nbytes=len(data)
    )


def decode_image(data: bytes) -> Image.Image:
    """PIL image (RGB) from encoded bytes."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except Exception as exc:  # noqa: BLE001
        raise BadImage(f"undecodable image ({len(data)} bytes): {_why(exc)}") from exc


def _why(exc: Exception) -> str:
    """PIL's reason, without the repr of the in-memory file it names ("cannot identify image file
    <_io.BytesIO object at 0x...>")."""
    if isinstance(exc, UnidentifiedImageError):
        return "not in an image format PIL can read"
    return str(exc) or type(exc).__name__


def make_record(
    *,
    prompt_id: str,
    data_source: str,
    problem: str,
    images: list[bytes],
    ground_truth: str,
    split: str = "train",
    meta: dict[str, str] | None = None,
    put_image: ImagePut | None = None,
) -> tuple[PromptRecord, dict[str, bytes]]:
    """A PromptRecord with its images referenced by sha256, and the image bytes by sha256.

    Raises `BadImage` for undecodable bytes and `ValueError` when the `<image>` placeholders
    outnumber the images.
    """
    if problem.count("<image>") > len(images):
        raise ValueError(
            f"{prompt_id}: {problem.count('<image>')} <image> placeholders but {len(images)} images"
        )
    refs, blobs = [], {}
    for data in images:
        ref = image_ref(data)
        if put_image is not None:
            stored = put_image(data)
            if stored.sha256 != ref.sha256:
                raise ValueError(f"image store returned sha {stored.sha256}, expected {ref.sha256}")
        refs.append(ref)
        blobs[ref.sha256] = data
    record = PromptRecord(
        prompt_id=prompt_id,
        data_source=data_source,
        problem=problem,
        images=refs,
        ground_truth=ground_truth,
        split=split,
        meta=dict(meta or {}),
    )
    return record, blobs


class SkipCounter:
    """Counts skipped records by reason and logs each skip (first few in full, then sampled)."""

    def __init__(self, source: str, log_first: int = 20):
        self.source = source
        self.counts: Counter[str] = Counter()
        self._log_first = log_first

    def skip(self, reason: str, record_id: str, detail: str = "") -> None:
        self.counts[reason] += 1
        total = sum(self.counts.values())
        if total <= self._log_first or total % 1000 == 0:
            log.warning("%s: skipped %s (%s) %s", self.source, record_id, reason, detail[:200])

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


class RecordWriter:
    """Writes records and their images into a task directory (images stored once each)."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        (self.out_dir / "images").mkdir(parents=True, exist_ok=True)
        self._files: dict[str, object] = {}
        self.counts: Counter[str] = Counter()
        self._encoder = msgspec.json.Encoder()

    def write(self, record: PromptRecord, blobs: dict[str, bytes]) -> None:
        for ref in record.images:
            path = self.out_dir / "images" / f"{ref.sha256}.{ref.format}"
            if not path.exists():
                tmp = path.with_suffix(path.suffix + ".tmp")
                tmp.write_bytes(blobs[ref.sha256])
                tmp.replace(path)
        if record.split not in self._files:
            self._files[record.split] = open(self.out_dir / f"{record.split}.jsonl", "wb")  # noqa: SIM115
        self._files[record.split].write(self._encoder.encode(record) + b"\n")
        self.counts[record.split] += 1

    def close(self, skipped: dict[str, int] | None = None, extra: dict | None = None) -> Path:
        """Close the split files and write manifest.json; returns the manifest path."""
        for f in self._files.values():
            f.close()
        manifest = {"records": dict(self.counts), "skipped": skipped or {}, **(extra or {})}
        path = self.out_dir / "manifest.json"
        path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        return path

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._files.values():
            f.close()


def read_records(task_dir: str | Path, split: str = "train") -> Iterator[PromptRecord]:
    """The records of one split of a task directory, in file order."""
    decoder = msgspec.json.Decoder(PromptRecord)
    with open(Path(task_dir) / f"{split}.jsonl", "rb") as f:
        for line in f:
            if line.strip():
                yield decoder.decode(line)


def read_image_bytes(task_dir: str | Path, ref: ImageRef) -> bytes:
    """Encoded bytes of one referenced image of a task directory (sha256 checked)."""
    data = (Path(task_dir) / "images" / f"{ref.sha256}.{ref.format}").read_bytes()
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ValueError(f"image {ref.sha256} on disk does not match its sha256")
    return data
