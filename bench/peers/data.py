"""Each peer's dataset, made from the prompt records Parallax itself trains on, so all systems see the same
prompts.

    python -m bench.peers.data --out DIR [--prompts 640] [--image-side 448]

The records are those bench.e2e's GPU runs write through the launcher (`python -m tasks synthetic --task
colour --image-size 448`, the launcher's task options otherwise): the same text, the same PNG bytes, in the
same order. Written into DIR:

  trl.parquet    `prompt` (one user message, its text), `image` (PNG bytes), `solution`: a dataset
                 TRL's GRPOTrainer takes (it puts the image before the text, as Parallax's prompt does);
  verl.parquet   verl's RLHF dataset schema: `data_source`, `prompt` (the user message with `<image>`
                 where the image goes), `images` (PNG bytes), `ability`, `reward_model` (`ground_truth`),
                 `extra_info`;
  manifest.json  how many prompts, the image side, the task options.

Only pyarrow and the project are needed: no peer has to be installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tasks.prompt import IMAGE_PLACEHOLDER

SPLIT = "train"


def task_config(prompts: int, image_side: int):
    """The synthetic task's options as the launcher passes them for bench.e2e's GPU runs (deploy/plan.py
    TaskOptions with `--task.task colour --task.image-size SIDE`)."""
    from deploy.plan import TaskOptions
    from tasks.synthetic import SyntheticConfig

    options = TaskOptions(task="colour", image_size=image_side, train=prompts, test=0)
    fields = {f.name for f in dataclasses.fields(SyntheticConfig)}
    values = {k: v for k, v in dataclasses.asdict(options).items() if k in fields}
    return SyntheticConfig(**values)


def records(prompts: int, image_side: int) -> list[tuple[object, list[bytes]]]:
    """(PromptRecord, its images' PNG bytes in order) for the first `prompts` training prompts."""
    from tasks.synthetic import generate

    config = task_config(prompts, image_side)
    out = []
    for record, blobs in generate(config, SPLIT, prompts):
        out.append((record, [blobs[ref.sha256] for ref in record.images]))
    return out


def user_text(problem: str) -> str:
    """The problem's text without its image placeholders (the images go before it)."""
    if not problem.startswith(IMAGE_PLACEHOLDER):
        raise ValueError(f"expected the images first in {problem[:40]!r}")
    return problem.replace(IMAGE_PLACEHOLDER, "")


def trl_rows(items) -> list[dict]:
    """TRL rows: a conversational prompt of one user message and one image (TRL adds the image block)."""
    rows = []
    for record, images in items:
        if len(images) != 1:
            raise ValueError(f"{record.prompt_id}: TRL's `image` column takes one image, not {len(images)}")
        rows.append(
            {
                "prompt": [{"role": "user", "content": user_text(record.problem)}],
                "image": {"bytes": images[0], "path": None},
                "solution": record.ground_truth,
            }
        )
    return rows


def verl_rows(items) -> list[dict]:
    """verl rows (its RLHF dataset: `<image>` in the message marks each image of `images`)."""
    rows = []
    for index, (record, images) in enumerate(items):
        rows.append(
            {
                "data_source": record.data_source,
                "prompt": [{"role": "user", "content": record.problem}],
                "images": [{"bytes": data, "path": None} for data in images],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": record.ground_truth},
                "extra_info": {"split": SPLIT, "index": index, "prompt_id": record.prompt_id},
            }
        )
    return rows


def write_parquet(rows: list[dict], path: Path) -> None:
    """Rows as parquet; image structs typed as `datasets.Image` stores them (bytes, path: string)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.Table.from_pylist(rows[:1]).schema
    for i, field in enumerate(schema):
        if field.name == "image":
            schema = schema.set(i, pa.field("image", image))
        elif field.name == "images":
            schema = schema.set(i, pa.field("images", pa.list_(image)))
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def build(out: Path, prompts: int, image_side: int) -> dict:
    """Write both peers' datasets and the manifest into `out`; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    items = records(prompts, image_side)
    write_parquet(trl_rows(items), out / "trl.parquet")
    write_parquet(verl_rows(items), out / "verl.parquet")
    manifest = {
        "prompts": len(items),
        "image_side": image_side,
        "first_prompt_id": items[0][0].prompt_id,
        "task": {k: str(v) for k, v in dataclasses.asdict(task_config(prompts, image_side)).items()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.data", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=640, help="prompts to write (128 a step)")
    parser.add_argument("--image-side", type=int, default=448)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.prompts, args.image_side)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
