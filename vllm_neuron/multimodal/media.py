"""Media from where requests point: PIL images, raw bytes, data: URLs, file:// paths under the allowed
folder, http(s) URLs (http_fetch.py: public or allow-listed hosts only, redirects checked, a timeout and a
size limit). Every problem is a ValueError naming it (the server turns it into a 400)."""
from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from vllm_neuron import envs
from vllm_neuron.multimodal import http_fetch

IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp", "image/tiff")


@dataclass(frozen=True)
class MediaAccess:
    """Where media URLs may point: file:// under `allowed_local_media_path` (None: no file:// at all), http(s)
    to `allowed_media_domains` only (None: any public host; see http_fetch.py)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None


def load_image(source, access: MediaAccess = MediaAccess()):
    """A PIL image (RGB) from a PIL image, bytes, or a data:/file:/http(s): URL."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return _decode_image(bytes(source), "the image bytes")
    if isinstance(source, str):
        return _decode_image(fetch_url(source, IMAGE_MEDIA_TYPES, access), _describe(source))
    raise ValueError(f"an image must be a PIL image, bytes or a URL string, got {type(source).__name__}")


def _describe(url: str) -> str:
    return "the data: URL image" if url.startswith("data:") else f"the image at {url[:200]!r}"


def _decode_image(data: bytes, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot decode {what} as an image: {e}") from None
    return img.convert("RGB")


def fetch_url(url: str, media_types: tuple[str, ...], access: MediaAccess) -> bytes:
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, media_types)
    if scheme == "file":
        return _local_file(url, access.allowed_local_media_path)
    if scheme in ("http", "https"):
        return http_fetch.fetch(url, allowed_domains=access.allowed_media_domains,
                                timeout_s=envs.VLLM_IMAGE_FETCH_TIMEOUT, max_bytes=envs.VLLM_MEDIA_MAX_BYTES,
                                allow_redirects=envs.VLLM_MEDIA_URL_ALLOW_REDIRECTS)
    raise ValueError(f"media URL scheme {scheme!r} is not supported; use data:, file: (under "
                     "--allowed-local-media-path) or http(s):")


def _data_url(url: str, media_types: tuple[str, ...]) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ValueError("a data: URL needs a ',' before its payload (data:<media type>;base64,<data>)")
    parts = header.split(";")
    media_type = parts[0].strip().lower()
    if media_type not in media_types:
        raise ValueError(f"media type {media_type or '(none)'!r} of the data: URL is not supported; supported: "
                         f"{list(media_types)}")
    if "base64" not in parts[1:]:
        raise ValueError("only base64 data: URLs are supported (data:<media type>;base64,<data>)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the data: URL payload is not valid base64: {e}") from None


def _local_file(url: str, allowed: str | None) -> bytes:
    if not allowed:
        raise ValueError("file: media URLs are refused: the server was not started with --allowed-local-media-path")
    path = os.path.realpath(unquote(urlparse(url).path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"the file {path!r} is outside the allowed local media folder (--allowed-local-media-path)")
    if not os.path.isfile(path):
        raise ValueError(f"the media file {path!r} does not exist")
    if os.path.getsize(path) > envs.VLLM_MEDIA_MAX_BYTES:
        raise ValueError(f"the media file {path!r} is larger than {envs.VLLM_MEDIA_MAX_BYTES} bytes")
    with open(path, "rb") as f:
        return f.read()
