"""Loading an image a request names, under the operator's media policy: the encoded bytes of a data: URL or of
the request itself, a file inside --allowed-media-path, an http(s) URL only with --allow-media-urls. Sizes are
bounded before anything is decoded (--max-image-bytes for the encoded file, --max-image-pixels read from its
header before the pixels are), so a small file that decodes to a huge image is refused cheaply. Every refusal is
InvalidRequest naming the part (`where`), and never a host path: a developer sees which part to fix."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.request
import warnings
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from scheduler.vision.media_policy import MediaPolicy
from tandem.errors import InvalidRequest


def load_image(policy: MediaPolicy, where: str, *, data: bytes | None = None, path: str | None = None,
               url: str | None = None) -> Image.Image:
    """The decoded image (RGB or with its alpha; pixels loaded). Exactly one source is given."""
    if url is not None:
        if url.startswith("data:"):
            data = _data_url(url, where, policy)
        elif url.startswith("file://"):
            path = url[len("file://"):]
        elif url.startswith(("http://", "https://")):
            if not policy.allow_media_urls:
                raise InvalidRequest(f"{where}: image URLs are not fetched by this server (it runs without "
                                     "--allow-media-urls): send the image as a base64 data: URL")
            data = _fetch(url, where, policy)
        else:
            raise InvalidRequest(f"{where}: the image URL must be a data: URL (base64), a file:// URL or an "
                                 "http(s) URL")
    if path is not None:
        data = _read_file(path, where, policy)
    if data is None:
        raise InvalidRequest(f"{where}: no image given")
    if len(data) > policy.max_image_bytes:
        raise InvalidRequest(f"{where}: the image file has {len(data)} bytes; at most {policy.max_image_bytes} "
                             "(--max-image-bytes)")
    return _decode(data, where, policy)


def _data_url(url: str, where: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise InvalidRequest(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) > policy.max_image_bytes * 4 // 3 + 4:
        raise InvalidRequest(f"{where}: the image file is over {policy.max_image_bytes} bytes (--max-image-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the data: URL's payload is not valid base64") from None


def _read_file(path: str, where: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_media_path
    if root is None:
        raise InvalidRequest(f"{where}: local image files are not read by this server (it runs without "
                             "--allowed-media-path): send the image as a base64 data: URL")
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise InvalidRequest(f"{where}: the image file does not exist or cannot be read") from None
    if not real.is_relative_to(root.resolve()) or not real.is_file():
        raise InvalidRequest(f"{where}: the image file is outside the allowed media directory "
                             "(--allowed-media-path)")
    size = real.stat().st_size
    if size > policy.max_image_bytes:
        raise InvalidRequest(f"{where}: the image file has {size} bytes; at most {policy.max_image_bytes} "
                             "(--max-image-bytes)")
    try:
        return real.read_bytes()
    except OSError:
        raise InvalidRequest(f"{where}: the image file cannot be read") from None


def _fetch(url: str, where: str, policy: MediaPolicy) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=policy.fetch_timeout_s) as resp:  # noqa: S310 (operator opted in)
            data = resp.read(policy.max_image_bytes + 1)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{where}: the image URL could not be fetched ({type(exc).__name__})") from None
    return data


def _decode(data: bytes, where: str, policy: MediaPolicy) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            w, h = image.size  # (from the header: nothing decoded yet)
            if w * h > policy.max_image_pixels:
                raise InvalidRequest(f"{where}: the image is {w}x{h} = {w * h} pixels; at most "
                                     f"{policy.max_image_pixels} (--max-image-pixels)")
            image.load()
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError,
            Image.DecompressionBombWarning):
        raise InvalidRequest(f"{where}: not an image this server can decode (PNG, JPEG, WebP, GIF, BMP, ...)") from None
    return image
