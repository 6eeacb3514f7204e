"""broker.images: content-addressed image blobs through both transports."""

from __future__ import annotations

import hashlib
import io

import pytest
from PIL import Image

import broker
from broker.images import MAX_PIXELS, ImageCorrupt, ImageError, ImageMissing, ImageStore, ImageTooLarge
from broker.schemas import ImageRef
from tests.fixtures.models import noisy_png, png_declaring


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


@pytest.fixture
def pool():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def _noise_png(seed: int, size=(40, 30)) -> bytes:
    return noisy_png(seed, size)


@pytest.mark.parametrize("with_pool", [False, True])
def test_open_many_gives_what_open_gives_in_order(store, pool, with_pool):
    refs = [store.put(_noise_png(seed, size=(40 + seed, 30))) for seed in range(6)]
    gray = store.put_image(Image.new("L", (16, 16), 77))  # converted to RGB like open does
    refs.insert(3, gray)
    opened = store.open_many(refs, pool if with_pool else None)
    assert len(opened) == len(refs)
    for ref, image in zip(refs, opened):
        expected = store.open(ref)
        assert image.mode == "RGB" and image.size == expected.size
        assert image.tobytes() == expected.tobytes()
    assert opened[3].getpixel((5, 5)) == (77, 77, 77)
    assert store.open_many(refs[:2], pool, mode=None)[0].mode == store.open(refs[0], mode=None).mode
    assert store.open_many([], pool) == []


def test_open_many_fetches_each_blob_once_in_few_round_trips(store, pool, monkeypatch):
    import broker.images

    monkeypatch.setattr(broker.images, "FETCH_CHUNK", 2)
    a, b, c = (store.put(_noise_png(seed)) for seed in (1, 2, 3))
    calls = []
    get_blobs = store.transport.get_blobs
    store.transport.get_blobs = lambda keys: calls.append(list(keys)) or get_blobs(keys)
    try:
        first, second, third, fourth = store.open_many([a, b, a, c], pool)
    finally:
        store.transport.get_blobs = get_blobs
    blob = store.names.blob
    assert calls == [[blob(a.sha256), blob(b.sha256)], [blob(c.sha256)]]  # distinct blobs, 2 per trip
    assert first.tobytes() == third.tobytes() == store.open(a).tobytes() != second.tobytes()
    assert fourth.tobytes() == store.open(c).tobytes()


@pytest.mark.parametrize("with_pool", [False, True])
def test_open_many_returns_bad_images_as_errors_and_decodes_the_rest(store, pool, with_pool):
    good = [store.put(_noise_png(seed)) for seed in range(3)]
    missing = ImageRef(sha256="ab" * 32)
    real = _noise_png(9)
    corrupt = ImageRef(sha256=hashlib.sha256(real).hexdigest())
    store.transport.put_blob(store.names.blob(corrupt.sha256), real[:-4] + b"XXXX", ttl_s=60)
    not_png = b"\x89PNG\r\n\x1a\n but the rest is garbage"
    undecodable = ImageRef(sha256=hashlib.sha256(not_png).hexdigest())
    store.transport.put_blob(store.names.blob(undecodable.sha256), not_png, ttl_s=60)
    refs = [good[0], missing, good[1], corrupt, undecodable, good[2], missing]
    out = store.open_many(refs, pool if with_pool else None)
    assert isinstance(out[1], ImageMissing) and "not in the blob store" in str(out[1]) and out[6] is out[1]
    assert isinstance(out[3], ImageCorrupt) and "hash to" in str(out[3])
    assert isinstance(out[4], OSError)  # what open raises for it (PIL's UnidentifiedImageError)
    with pytest.raises(type(out[4])):
        store.open(undecodable)
    for i, ref in ((0, good[0]), (2, good[1]), (5, good[2])):
        assert out[i].tobytes() == store.open(ref).tobytes()


def test_open_many_refuses_a_decompression_bomb_alone(store, pool, monkeypatch):
    small, huge = store.put(_noise_png(1, size=(8, 8))), store.put(_png(size=(120, 120)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # 120 x 120 = 14,400 > 2 x limit: PIL refuses it
    out = store.open_many([huge, small], pool)
    assert isinstance(out[0], ImageError) and "refused" in str(out[0])
    assert out[1].size == (8, 8)


def test_an_image_bomb_is_refused_from_its_header_before_decoding(store, pool, monkeypatch):
    """A 13000 x 13000 PNG of a few hundred bytes: 507 MB of pixels that PIL's own check lets through."""
    bomb = png_declaring(13000, 13000)
    assert len(bomb) < 1000 and 13000 * 13000 > MAX_PIXELS
    ref, small = store.put(bomb), store.put(_png(size=(8, 8)))  # put reads the header only
    assert (ref.width, ref.height) == (13000, 13000)
    from PIL import ImageFile

    load = ImageFile.ImageFile.load

    def no_bomb(image):
        assert image.size != (13000, 13000), "decoded the bomb"
        return load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_bomb)
    with pytest.raises(ImageTooLarge, match="13000 x 13000 = 169,000,000 pixels, above the cap"):
        store.open(ref)
    out = store.open_many([ref, small], pool)
    assert isinstance(out[0], ImageTooLarge) and isinstance(out[1], Image.Image)


def test_images_above_the_stores_caps_are_refused(store):
    ref = store.put(_png(size=(64, 64)))
    pixels = ImageStore(store.transport, store.names, max_pixels=64 * 63)
    with pytest.raises(ImageTooLarge, match="pixels"):
        pixels.open(ref)
    small_bytes = ImageStore(store.transport, store.names, max_bytes=ref.nbytes - 1)
    with pytest.raises(ImageTooLarge, match="bytes"):
        small_bytes.get(ref)
    assert isinstance(small_bytes.open_many([ref])[0], ImageTooLarge)
    assert store.open(ref).size == (64, 64)
