"""broker.images: content-addressed image blobs through both transports."""

from __future__ import annotations

import hashlib
import io

import pytest
from PIL import Image

import broker
from broker.images import ImageCorrupt, ImageError, ImageMissing, ImageStore
from broker.schemas import ImageRef


def _png(color=(200, 30, 30), size=(32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def store(broker_url, names):
    transport = broker.connect(broker_url)
    yield ImageStore(transport, names, ttl_s=60)
    transport.close()


def test_put_get_open_round_trip(store):
    data = _png()
    ref = store.put(data)
    assert (ref.format, ref.width, ref.height, ref.nbytes) == ("png", 32, 24, len(data))
    assert store.put(data) == ref  # same bytes, same reference, stored once
    assert store.get(ref) == data
    image = store.open(ref)
    assert image.size == (32, 24) and image.getpixel((0, 0)) == (200, 30, 30)


def test_put_image_encodes_pil(store):
    ref = store.put_image(Image.new("RGB", (8, 8), (0, 0, 255)))
    assert store.open(ref).getpixel((3, 3)) == (0, 0, 255)


def test_missing_blob_is_a_clear_error(store):
    with pytest.raises(ImageMissing, match="not in the blob store"):
        store.get(ImageRef(sha256="cd" * 32))


def test_corrupt_blob_fails_the_sha256_check(store):
    real = _png()
    ref = ImageRef(sha256=hashlib.sha256(real).hexdigest())
    store.transport.put_blob(store.names.blob(ref.sha256), real[:-4] + b"XXXX", ttl_s=60)  # bytes went bad
    with pytest.raises(ImageCorrupt, match="hash to"):
        store.get(ref)


def test_put_stores_once_and_does_not_overwrite(store):
    ref = store.put(_png())
    store.transport.put_blob(store.names.blob(ref.sha256), b"other bytes", ttl_s=60)
    assert store.get(ref) == _png()


def test_non_image_bytes_are_refused(store):
    with pytest.raises(ImageError, match="not a decodable image"):
        store.put(b"definitely not a png")
