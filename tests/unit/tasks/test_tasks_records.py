"""Prompt records: content-addressed images, the blob-store callback, writing and reading task dirs."""

from __future__ import annotations

import hashlib

import pytest
from PIL import Image

from broker.schemas import ImageRef
from tasks.records import (
    BadImage,
    RecordWriter,
    decode_image,
    encode_png,
    image_ref,
    make_record,
    read_image_bytes,
    read_records,
)


def _png(colour=(255, 0, 0), size=(20, 10)):
    return encode_png(Image.new("RGB", size, colour))


def test_image_ref_is_sha256_with_format_and_size():
    data = _png()
    ref = image_ref(data)
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert (ref.format, ref.width, ref.height, ref.nbytes) == ("png", 20, 10, len(data))
    assert decode_image(data).getpixel((0, 0)) == (255, 0, 0)


def test_undecodable_bytes_raise_bad_image():
    with pytest.raises(BadImage):
        image_ref(b"not an image")


def test_make_record_returns_blobs_and_calls_the_store():
    stored = []

    def put(data: bytes) -> ImageRef:
        stored.append(data)
        return image_ref(data)

    a, b = _png(), _png((0, 0, 255))
    record, blobs = make_record(
        prompt_id="p1",
        data_source="t",
        problem="<image><image>which?",
        images=[a, b],
        ground_truth="x",
        put_image=put,
    )
    assert [r.sha256 for r in record.images] == [hashlib.sha256(d).hexdigest() for d in (a, b)]
    assert blobs == {hashlib.sha256(a).hexdigest(): a, hashlib.sha256(b).hexdigest(): b}
    assert stored == [a, b]
    with pytest.raises(ValueError, match="placeholders"):
        make_record(prompt_id="p2", data_source="t", problem="<image><image>", images=[a], ground_truth="x")


def test_store_returning_a_different_sha_is_an_error():
    with pytest.raises(ValueError, match="sha"):
        make_record(
            prompt_id="p",
            data_source="t",
            problem="<image>",
            images=[_png()],
            ground_truth="x",
            put_image=lambda data: ImageRef(sha256="0" * 64),
        )


def test_writer_roundtrip_stores_each_image_once(tmp_path):
    img = _png()
    with RecordWriter(tmp_path) as writer:
        for i in range(3):
            record, blobs = make_record(
                prompt_id=f"p{i}",
                data_source="t",
                problem="<image>q",
                images=[img],
                ground_truth=str(i),
                split="train" if i < 2 else "test",
            )
            writer.write(record, blobs)
        writer.close(skipped={"too_long": 1})
    train = list(read_records(tmp_path, "train"))
    assert [r.prompt_id for r in train] == ["p0", "p1"] and train[1].ground_truth == "1"
    assert [r.prompt_id for r in read_records(tmp_path, "test")] == ["p2"]
    assert len(list((tmp_path / "images").iterdir())) == 1
    assert read_image_bytes(tmp_path, train[0].images[0]) == img
    (tmp_path / "images" / f"{train[0].images[0].sha256}.png").write_bytes(b"tampered")
    with pytest.raises(ValueError, match="sha256"):
        read_image_bytes(tmp_path, train[0].images[0])
