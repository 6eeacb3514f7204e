"""Content-addressed image blobs: images travel once, messages carry `ImageRef`s.

    store = ImageStore(transport, Names(namespace))
    ref = store.put(png_bytes)          # stored under sha256, expiry refreshed
    pil = store.open(ref)               # fetched, sha256-verified, decoded
    pils = store.open_many(refs, pool)  # a batch: each blob fetched once, verified + decoded on `pool`

The same bytes are stored once (the key is their sha256); every `put` refreshes the expiry
(at most every `ttl_s / 4` per process, so a hot image costs no traffic). `get` raises
`ImageMissing` when the blob expired or was never stored and `ImageCorrupt` when the bytes do
not hash to the reference. `open_many` returns such errors per entry instead of raising, so one bad
image never fails the others.

Caps of our own, checked before any pixel is decoded: a blob above `max_bytes` (the transport's
`max_blob_bytes`) and an image whose header declares more than `max_pixels` pixels (default
`MAX_PIXELS`: four times the largest image a Qwen-VL processor keeps, which resizes anything larger
down to its `max_pixels`) raise `ImageTooLarge`, naming the size. A 200 KB PNG can declare
13000 x 13000 pixels (500 MB decoded): PIL's own bomb check only stops twice its 89 M-pixel default.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

from broker.names import Names
from broker.schemas import ImageRef
from broker.transport import Transport

DEFAULT_TTL_S = 24 * 3600.0
PROCESSOR_MAX_PIXELS = 16_777_216
"""The largest `max_pixels` of the Qwen-VL image processors' defaults (Qwen3-VL: 4096 x 4096; Qwen2.5-VL:
12,845,056): no larger image reaches the model unresized."""
MAX_PIXELS = 4 * PROCESSOR_MAX_PIXELS
"""Default pixel cap per image (a margin of 4 over the processor's)."""
FETCH_CHUNK = 64
"""Blobs fetched per round trip by open_many (bounds one reply: 64 x ~100 KB images)."""
_RECENT_MAX = 10_000


class ImageError(RuntimeError):
    """An image could not be stored or fetched."""


class ImageMissing(ImageError):
    """The referenced blob is not in the store (expired or never stored)."""


class ImageCorrupt(ImageError):
    """The stored bytes do not match the reference's sha256."""


class ImageTooLarge(ImageError):
    """The blob's bytes, or the pixels its header declares, exceed the store's caps."""


class ImageStore:
    """Puts and gets encoded images by sha256 through a transport's blob store."""

    def __init__(
        self,
        transport: Transport,
        names: Names | None = None,
        ttl_s: float | None = DEFAULT_TTL_S,
        *,
        max_pixels: int = MAX_PIXELS,
        max_bytes: int | None = None,
    ):
        self.transport = transport
        self.names = names or Names()
        self.ttl_s = ttl_s
        self.max_pixels = max_pixels
        """Images whose header declares more pixels are refused before decoding (ImageTooLarge)."""
        options = getattr(transport, "options", None)
        self.max_bytes = max_bytes or (options.max_blob_bytes if options is not None else 16 * 1024 * 1024)
        """Blobs above this size are refused before hashing or decoding (ImageTooLarge)."""
        self._refreshed: OrderedDict[str, float] = OrderedDict()

    def put(self, data: bytes) -> ImageRef:
        """Store encoded image bytes (png, jpeg, ...) once and return their reference."""
        fmt, width, height = _probe(data)
        sha = hashlib.sha256(data).hexdigest()
        if not self._recently_refreshed(sha):
            self.transport.put_blob(self.names.blob(sha), data, ttl_s=self.ttl_s)
            self._mark_refreshed(sha)
        return ImageRef(sha256=sha, format=fmt, width=width, height=height, nbytes=len(data))

    def put_image(self, image, format: str = "png") -> ImageRef:
        """Encode a PIL image (PNG by default) and store it."""
        buf = io.BytesIO()
        image.save(buf, format=format.upper())
        return self.put(buf.getvalue())

    def get(self, ref: ImageRef) -> bytes:
        """The verified bytes of `ref`."""
        data = self._fetch(ref)
        self._check_bytes(ref.sha256, data)
        return _verified(ref.sha256, data)

    def open(self, ref: ImageRef, mode: str | None = "RGB"):
        """The decoded PIL image of `ref` (converted to `mode` unless None)."""
        return _decode(self.get(ref), mode, self.max_pixels, ref.sha256)

    def open_many(
        self, refs: Sequence[ImageRef], pool: Executor | None = None, mode: str | None = "RGB"
    ) -> list:
        """One entry per ref, in order: what `open(ref)` returns, or the ImageError / OSError / ValueError it
        would raise (as an object: one bad image never fails the others; other exceptions do raise).

        Each distinct blob is fetched once, FETCH_CHUNK per round trip (`Transport.get_blobs`), in this
        thread (a transport is not thread-safe); its sha256 check and decode run on `pool` (hashlib and
        PIL's decoders release the GIL), or here without one.
        Refs to the same blob share one image object: treat it as read-only (vLLM and the prompt checker
        only read pixels)."""
        return self.start_open_many(refs, pool, mode)()

    def start_open_many(
        self, refs: Sequence[ImageRef], pool: Executor | None = None, mode: str | None = "RGB"
    ) -> Callable[[], list]:
        """`open_many` in two halves: fetch every blob and start the decodes now; the returned function
        waits for them and gives open_many's list (the caller works meanwhile)."""
        distinct = list({ref.sha256: ref for ref in refs}.values())
        started: dict[str, Future] = {}
        for at in range(0, len(distinct), FETCH_CHUNK):
            chunk = distinct[at : at + FETCH_CHUNK]
            blobs = self.transport.get_blobs([self.names.blob(ref.sha256) for ref in chunk])
            for ref, data in zip(chunk, blobs, strict=True):
                started[ref.sha256] = self._start_decode(ref, data, pool, mode)

        def results() -> list:
            done = {sha: future.result() for sha, future in started.items()}
            return [done[ref.sha256] for ref in refs]

        return results

    def _start_decode(
        self, ref: ImageRef, data: bytes | None, pool: Executor | None, mode: str | None
    ) -> Future:
        if data is None:
            return _done(_missing(ref))
        try:
            self._check_bytes(ref.sha256, data)
        except ImageTooLarge as exc:
            return _done(exc)
        if pool is None:
            return _done(_decode_or_error(ref.sha256, data, mode, self.max_pixels))
        return pool.submit(_decode_or_error, ref.sha256, data, mode, self.max_pixels)

    def _check_bytes(self, sha: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            raise ImageTooLarge(
                f"image {sha[:16]}... refused: {len(data):,} bytes, above the cap of {self.max_bytes:,}"
            )

    def _fetch(self, ref: ImageRef) -> bytes:
        """The stored bytes of `ref`, unverified; ImageMissing if there are none."""
        data = self.transport.get_blob(self.names.blob(ref.sha256))
        if data is None:
            raise _missing(ref)
        return data

    def _recently_refreshed(self, sha: str) -> bool:
        if self.ttl_s is None:
            return sha in self._refreshed
        at = self._refreshed.get(sha)
        return at is not None and time.monotonic() - at < self.ttl_s / 4

    def _mark_refreshed(self, sha: str) -> None:
        self._refreshed[sha] = time.monotonic()
        self._refreshed.move_to_end(sha)
        while len(self._refreshed) > _RECENT_MAX:
            self._refreshed.popitem(last=False)


def _missing(ref: ImageRef) -> ImageMissing:
    return ImageMissing(f"image {ref.sha256[:16]}... is not in the blob store (expired or never stored)")


def _probe(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) from the image header; ImageError if it is not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return (image.format or "").lower(), image.width, image.height
    except (UnidentifiedImageError, OSError) as exc:
        raise ImageError(f"not a decodable image ({len(data)} bytes): {exc}") from None


def _verified(sha: str, data: bytes) -> bytes:
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha:
        raise ImageCorrupt(f"image {sha[:16]}...: stored bytes hash to {actual[:16]}...")
    return data


def _decode(data: bytes, mode: str | None, max_pixels: int = MAX_PIXELS, sha: str = ""):
    """The decoded image; ImageTooLarge, from the header alone, when it declares more than `max_pixels`."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))  # reads the header only
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ImageTooLarge(
            f"image {sha[:16]}... refused: {width} x {height} = {width * height:,} pixels, above the cap "
            f"of {max_pixels:,}"
        )
    image.load()
    return image.convert(mode) if mode and image.mode != mode else image


def _decode_or_error(sha: str, data: bytes, mode: str | None, max_pixels: int = MAX_PIXELS):
    """The decoded image of verified bytes, or the error `open` would raise for them."""
    from PIL import Image

    try:
        return _decode(_verified(sha, data), mode, max_pixels, sha)
    except Image.DecompressionBombError as exc:  # a hostile or absurd size: this image only, not the batch
        return ImageError(f"image {sha[:16]}... refused: {exc}")
    except (ImageError, OSError, ValueError) as exc:
        return exc


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
