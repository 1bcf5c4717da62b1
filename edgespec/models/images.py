"""Images a request carries, checked and decoded before any model sees them.

Every front door (``generate --image``, the SDK, the gRPC ``GenerateRequest.images``, the HTTP
API's ``image_url`` parts) hands the verifier encoded image files as bytes; ``decode_images``
turns them into RGB Pillow images or refuses them with an ``ImageRefused`` (a ``ConfigError``:
the front doors answer it as a bad request) that names the image and what is wrong:

- more than ``MAX_IMAGES`` images, or more than ``MAX_IMAGE_BYTES`` of them in all (what keeps a
  request inside one gRPC message, ``edgespec.wire.convert.MAX_MESSAGE_BYTES``);
- a file that is no image in one of ``FORMATS``, or that is truncated or corrupt;
- an image of more than ``MAX_IMAGE_PIXELS`` pixels, or images of more than
  ``MAX_REQUEST_PIXELS`` together (read from the headers, before any is decoded: a small file
  that decodes to gigabytes is refused without being decoded; eight 75 KB single-colour PNGs of
  4096x4096 pixels each cost a server 6 s of CPU and a gigabyte before the request limit).

Nothing here fetches anything: a remote URL is the HTTP API's to refuse (``verifier_node``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ..config import ConfigError

MAX_IMAGES = 8  # per request
MAX_IMAGE_BYTES = 3 << 20  # encoded bytes of a request's images together (a gRPC message: 4 MiB)
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height of one image
MAX_REQUEST_PIXELS = 2 * 4096 * 4096  # of a request's images together (two 12 MP photos fit)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow may decode


class ImageRefused(ConfigError):
    """An image the verifier will not take; the message names it and says why."""


def check_image_bytes(images: list[bytes]) -> None:
    """Refuse too many images or too many bytes of them (before anything is decoded)."""
    if len(images) > MAX_IMAGES:
        raise ImageRefused(f"{len(images)} images given: a request takes at most {MAX_IMAGES}")
    total = sum(len(b) for b in images)
    if total > MAX_IMAGE_BYTES:
        raise ImageRefused(f"the images are {total} bytes together: a request takes at most "
                           f"{MAX_IMAGE_BYTES} bytes of images ({MAX_IMAGE_BYTES >> 20} MiB); "
                           "send them smaller (resize, or JPEG)")
    for i, b in enumerate(images):
        if not b:
            raise ImageRefused(f"image {i} is empty (0 bytes)")


def decode_image(data: bytes, index: int = 0) -> Any:
    """One encoded image file as an RGB ``PIL.Image.Image`` (ImageRefused if it is none)."""
    return _opened(data, index, decode=True)


def image_pixels(data: bytes, index: int = 0) -> int:
    """An encoded image's pixels, read from its header (ImageRefused, as ``decode_image``)."""
    return _opened(data, index, decode=False)


def _opened(data: bytes, index: int, decode: bool) -> Any:
    from PIL import Image, UnidentifiedImageError

    what = f"image {index}"
    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS)) as img:
            width, height = img.size  # from the header: nothing decoded yet
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageRefused(f"{what} is {width}x{height} pixels: at most "
                                   f"{MAX_IMAGE_PIXELS} pixels are taken (4096x4096)")
            if width < 1 or height < 1:
                raise ImageRefused(f"{what} has no pixels ({width}x{height})")
            if not decode:
                return width * height
            img.load()
            return img.convert("RGB")
    except ImageRefused:
        raise
    except UnidentifiedImageError:
        raise ImageRefused(f"{what} cannot be decoded: it is not an image in one of "
                           f"{', '.join(FORMATS)}") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageRefused(f"{what} cannot be decoded (truncated or corrupt): "
                           f"{str(e)[:120]}") from None


def decode_images(images: list[bytes]) -> list[Any]:
    """A request's encoded images, checked (every header before any is decoded) and decoded in
    order (ImageRefused)."""
    check_image_bytes(images)
    pixels = sum(image_pixels(b, i) for i, b in enumerate(images))
    if pixels > MAX_REQUEST_PIXELS:
        raise ImageRefused(f"the images are {pixels} pixels together: a request takes at most "
                           f"{MAX_REQUEST_PIXELS} (two of 4096x4096, or eight of 2048x2048); "
                           "send them smaller")
    return [decode_image(b, i) for i, b in enumerate(images)]


def read_image_file(path: str | Path) -> bytes:
    """An image file's bytes for a request (``generate --image``, the SDK); ConfigError when it
    cannot be read. Its contents are checked where the request is served."""
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the image {path}: {e.strerror or e}") from None


def image_bytes(image: Any) -> bytes:
    """What a caller gives as an image, as encoded bytes: a path (str or Path), bytes, or a
    ``PIL.Image.Image`` (encoded as PNG, losslessly)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, Path)):
        return read_image_file(image)
    if hasattr(image, "save") and hasattr(image, "size"):  # a Pillow image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise ConfigError(f"an image is a file path, bytes or a PIL image, not "
                      f"{type(image).__name__}")
