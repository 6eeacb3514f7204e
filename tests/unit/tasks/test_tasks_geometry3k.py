"""Geometry3k preprocessing on a parquet fixture written in the hiyouga/geometry3k schema."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tasks.geometry3k import Geo3kConfig, find_splits, preprocess
from tasks.records import read_image_bytes, read_records
from tests.fixtures.geometry3k import SCHEMA, image_item, problems, write_split

_img = image_item


@pytest.fixture
def geo3k_parquet(tmp_path):
    rows = [
        {"images": [_img()], "problem": "<image>Find x.", "answer": "48", "id": "0"},
        {
            "images": [_img(colour=(9, 9, 9))],
            "problem": "<image>Find the area.",
            "answer": "12\\sqrt{3}",
            "id": "1",
        },
        {
            "images": [{"bytes": b"\x89PNG broken", "path": "y.png"}],
            "problem": "<image>Find y.",
            "answer": "3",
            "id": "2",
        },
        {"images": [_img()], "problem": "<image>Find z.", "answer": None, "id": "3"},
        {"images": [_img()], "problem": "<image>Find w.", "answer": "  ", "id": "4"},
        {"images": [_img(size=(2000, 2000))], "problem": "<image>Huge.", "answer": "5", "id": "5"},
        {"images": [_img()], "problem": "<image><image>Two placeholders.", "answer": "7", "id": "6"},
        {
            "images": [{"bytes": None, "path": "lost.png"}],
            "problem": "<image>No bytes.",
            "answer": "1",
            "id": "7",
        },
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return path


def test_preprocess_keeps_good_rows_and_counts_skips(geo3k_parquet, tmp_path, tiny_processor):
    out = tmp_path / "geo3k"
    # tiny processor caps images at 224x224 = 64 tokens, so use a limit the huge image cannot meet otherwise
    config = Geo3kConfig(input=geo3k_parquet, out=out, split="train", max_prompt_len=120)
    manifest = preprocess(config, processor=_processor_with_max_pixels(tiny_processor, 1024 * 1024))
    assert manifest["records"] == {"train": 2}
    assert manifest["skipped"] == {
        "image_placeholder_mismatch": 1,
        "missing_answer": 2,
        "missing_image": 1,
        "too_long": 1,
        "undecodable_image": 1,
    }
    records = list(read_records(out, "train"))
    assert [r.prompt_id for r in records] == ["geometry3k-train-0", "geometry3k-train-1"]
    assert records[1].ground_truth == "12\\sqrt{3}"
    assert (
        records[0].problem.startswith("<image>Find x. You FIRST think") and "\\boxed{}" in records[0].problem
    )
    assert records[0].data_source == "geometry3k" and records[0].split == "train"
    assert Image.open(__import__("io").BytesIO(read_image_bytes(out, records[0].images[0]))).size == (120, 90)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["skipped"]["missing_answer"] == 2 and on_disk["records"] == {"train": 2}


def _processor_with_max_pixels(processor, max_pixels):
    import copy

    clone = copy.deepcopy(processor)
    clone.image_processor.size = {**dict(clone.image_processor.size), "longest_edge": max_pixels}
    return clone


def test_cli_writes_records(geo3k_parquet, tmp_path, tiny_model_dir):
    out = tmp_path / "cli"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks",
            "geometry3k",
            "--input",
            str(geo3k_parquet),
            "--out",
            str(out),
            "--split",
            "test",
            "--model",
            str(tiny_model_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert len(list(read_records(out, "test"))) == 3  # the huge image fits: the tiny processor shrinks it
    assert "undecodable_image" in run.stderr


def test_find_splits_in_the_hugging_face_layout(tmp_path):
    train = write_split(tmp_path, "train", problems(2))
    test = write_split(tmp_path, "test", problems(1, seed=1))
    write_split(tmp_path, "validation", problems(1, seed=2))
    assert find_splits(tmp_path) == {"train": train, "test": test}


def test_find_splits_says_what_is_missing(tmp_path):
    write_split(tmp_path, "train", problems(2))
    with pytest.raises(
        ValueError, match=r"holds no test parquet file\(s\) \(found: data/train-00000-of-00001"
    ):
        find_splits(tmp_path)
    with pytest.raises(ValueError, match="is not a directory: download the data set first"):
        find_splits(tmp_path / "nowhere")


@pytest.mark.parametrize("dropped", ["answer", "problem", "images"])
def test_a_parquet_missing_a_column_exits_1_naming_it_and_writes_nothing(tmp_path, dropped):
    path = tmp_path / "bad.parquet"
    rows = [{"images": [_img()], "problem": "<image>Find x.", "answer": "48", "id": "0"}]
    table = pa.Table.from_pylist(rows, schema=SCHEMA).drop_columns([dropped])
    pq.write_table(table, path)
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "tasks", "geometry3k", "--input", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert f"missing column(s) {dropped}" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists(), "nothing may be written for an input that cannot make a task"


def test_a_parquet_without_any_usable_row_is_an_error(tmp_path, tiny_processor):
    from tasks.geometry3k import BadInput

    path = tmp_path / "empty.parquet"
    rows = [{"images": [_img()], "problem": "<image>Find z.", "answer": None, "id": "3"}]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    with pytest.raises(BadInput, match="no row became a record.*missing_answer"):
        preprocess(Geo3kConfig(input=path, out=tmp_path / "out"), processor=tiny_processor)


def test_a_skipped_row_is_named_by_its_id_with_a_reason_and_no_buffer_repr(tmp_path, tiny_processor, caplog):
    good = problems(1, seed=7)  # id "7-0"
    rows = [
        {**good[0], "id": "q-17", "images": [{"bytes": b"\x89PNG broken", "path": "y.png"}]},
        {**good[0], "id": "q-18", "answer": None},
        {**good[0], "id": "q-19", "answer": "  "},
        {**good[0], "id": "q-20", "problem": ""},
        {**good[0], "id": None, "images": [{"bytes": None, "path": "lost.png"}]},
        good[0],
    ]
    path = write_split(tmp_path, "train", rows)
    with caplog.at_level("WARNING", logger="tasks.records"):
        preprocess(Geo3kConfig(input=path, out=tmp_path / "out"), processor=tiny_processor)
    skips = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert [m.split(" (")[0] for m in skips] == [
        "geometry3k: skipped row id q-17",
        "geometry3k: skipped row id q-18",
        "geometry3k: skipped row id q-19",
        "geometry3k: skipped row id q-20",
        "geometry3k: skipped row at index 4",  # no id: its position in the file
    ]
    for message in skips:
        reason, _, detail = message.partition(") ")
        assert detail.strip(), f"no reason given: {message!r}"
        assert "BytesIO" not in message and "object at 0x" not in message, message
    assert skips[0].endswith("undecodable image (11 bytes): not in an image format PIL can read")
    assert skips[1].endswith("(missing_answer) no answer") and skips[2].endswith("blank answer '  '")
    assert skips[4].endswith("image 1 of 1 has no bytes (path lost.png)")
