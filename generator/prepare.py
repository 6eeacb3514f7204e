"""Batch preparation: the prompt records of one generate call become engine requests.

    pool = make_pool(config.prepare_threads)                  # None for 0: everything in this thread
    prepared = prepare_batch(records, image_store, tokenizer, pool)
    # one Prepared per record, in order: .request, or the .reason (+ .detail) to dead-letter it with

Every image blob of the batch is fetched once, in this thread (transports are not thread-safe),
and its sha256 check and PNG/JPEG decode run on `pool` (`ImageStore.start_open_many`; hashlib and
PIL release the GIL); meanwhile this thread renders the chat-templated prompt ids. With vLLM's
engine core in its own process this preparation is the generator's exposed CPU time per batch.
The pool gets no more threads than the process has CPUs: more were slower and noisier
(`python -m bench.generator --mode prep`; results in bench/results/generator_prep.json).

Reasons (a record's first bad image decides between the first two; the third needs good images):
    image_missing          a blob is not in the store (expired or never stored)
    image_undecodable      a blob fails its sha256 check or does not decode
    image_too_large        a blob above the byte cap, or a header declaring more pixels than the
                           pixel cap (`ImageStore.max_pixels`): refused before decoding
    image_count_mismatch   the rendered prompt does not keep one image pad per image
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

from broker.images import ImageMissing, ImageStore, ImageTooLarge
from broker.schemas import PromptRecord
from generator.inputs import Request


@dataclass
class Prepared:
    """One record's engine request, or why it has none."""

    request: Request | None = None
    reason: str = ""
    """A rejection reason (generator.inputs.REASONS) when request is None."""
    detail: str = ""


def make_pool(threads: int) -> ThreadPoolExecutor | None:
    """A pool of `threads` preparation threads, at most one per CPU this process may run on; None for 0."""
    if threads <= 0:
        return None
    return ThreadPoolExecutor(min(threads, usable_cpus()), thread_name_prefix="prepare")


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def prepare_batch(
    records: Sequence[PromptRecord], images: ImageStore, tokenizer, pool: Executor | None = None
) -> list[Prepared]:
    """One Prepared per record, in order; one bad record never fails the others."""
    opened = images.start_open_many([ref for record in records for ref in record.images], pool)
    rendered = [_render(tokenizer, record) for record in records]  # while the pool decodes
    decoded = iter(opened())
    return [
        _prepared(record, [next(decoded) for _ in record.images], ids)
        for record, ids in zip(records, rendered)
    ]


def _render(tokenizer, record: PromptRecord) -> list[int] | ValueError:
    from tasks.prompt import render_prompt_ids

    try:
        return render_prompt_ids(tokenizer, record.problem, len(record.images))
    except ValueError as exc:
        return exc


def _prepared(record: PromptRecord, images: list, ids: list[int] | ValueError) -> Prepared:
    bad = next((image for image in images if isinstance(image, Exception)), None)
    if isinstance(bad, ImageMissing):
        return Prepared(reason="image_missing", detail=str(bad))
    if isinstance(bad, ImageTooLarge):
        return Prepared(reason="image_too_large", detail=str(bad))
    if bad is not None:
        return Prepared(reason="image_undecodable", detail=str(bad))
    if isinstance(ids, ValueError):
        return Prepared(reason="image_count_mismatch", detail=str(ids))
    return Prepared(Request(ids, images, split=record.split, prompt_id=record.prompt_id))
