"""Images a request carries, from the URL a client sent to decoded RGB pixels, with the bounds that refuse them.

A client names an image by a `data:` URL (OpenAI's `image_url`; Anthropic's base64 `image` source and Ollama's
`images` are turned into one), or by a `file://` URL under the one directory the node's admin allowed. Nothing
is ever fetched over the network: an `http(s)://` URL is refused, so a request can never make a node reach a
host on its behalf. The API node reads and checks every image (a 400 there, in the API's own error shape, rather
than a failure on a runner) and sends it on as a `data:` URL, so the runner's node needs no access to its files.

Bounds: MAX_IMAGE_BYTES of encoded image, MAX_IMAGE_PIXELS of decoded image (checked from the header before any
pixel is decoded: a small PNG can claim a gigapixel) and MAX_IMAGES per request.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES = 16
_DATA_PREFIX = "data:"

if TYPE_CHECKING:
    from PIL.Image import Image


class ImageRefused(ValueError):
    """An image the node will not read: its message says why, for the client's 400."""


def image_bytes(url: str, allowed_dir: Path | None = None) -> bytes:
    """The encoded image a URL names: a data: URL's payload, or a file under allowed_dir (file:// URLs are refused
    when no directory is allowed); anything else is refused, network URLs above all."""
    if url.startswith(_DATA_PREFIX):
        return _data_url_bytes(url)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        return _file_bytes(url, allowed_dir)
    if scheme in ("http", "https"):
        raise ImageRefused("image URLs are not fetched (no network fetch): send the image as a data: URL")
    raise ImageRefused("an image must be a data: URL (base64) or a file:// URL under the allowed directory")


def decode_base64(text: str) -> bytes:
    """A base64 image (Anthropic's source.data, Ollama's images[i]), bounded before and after decoding."""
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageRefused(f"image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("image is not valid base64") from None
    return _bounded(data)


def data_url(data: bytes) -> str:
    """The data: URL an image travels in to the runner (the format is read from the bytes, not the URL)."""
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()


def _data_url_bytes(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageRefused("a data: image URL must be base64 (data:image/png;base64,...)")
    return decode_base64(payload)


def _file_bytes(url: str, allowed_dir: Path | None) -> bytes:
    if allowed_dir is None:
        raise ImageRefused("file:// image URLs are off on this node (no image directory is allowed)")
    root = allowed_dir.resolve()
    path = Path(unquote(urlparse(url).path)).resolve()  # symlinks and .. resolved before the check
    if not path.is_relative_to(root):
        raise ImageRefused(f"file:// images must be under {root}")
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ImageRefused(f"image is larger than {MAX_IMAGE_BYTES} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise ImageRefused(f"cannot read image file: {exc.strerror}") from None


def _bounded(data: bytes) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRefused(f"image is larger than {MAX_IMAGE_BYTES} bytes")
    if not data:
        raise ImageRefused("image is empty")
    return data


def open_image(data: bytes) -> Image:
    """Decoded RGB pixels; ImageRefused when the bytes are not an image Pillow reads or it has too many pixels
    (Pillow is imported only when an image comes)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ImageRefused(f"image is {width}x{height}: more than {MAX_IMAGE_PIXELS} pixels")
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        if isinstance(exc, ImageRefused):
            raise
        raise ImageRefused(f"image cannot be decoded: {exc}") from None


def check_image(url: str, allowed_dir: Path | None = None) -> str:
    """The API node's check of one image URL: read it, decode it (bounded), and return the data: URL it travels in."""
    data = image_bytes(url, allowed_dir)
    open_image(data)
    return url if url.startswith(_DATA_PREFIX) else data_url(data)
