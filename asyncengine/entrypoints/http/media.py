"""Images of a request: where they may come from, fetching them, decoding them; off the loop.

An image arrives as a URL: ``data:`` (inline, base64), ``http(s)://`` (fetched by the
server) or ``file://`` (read under ``--allowed-local-media-path`` only). What the operator
allows (``config/multimodal.py``):

* http(s) hosts: the names in ``--allowed-media-domains`` when given (any address they
  resolve to); otherwise any host whose every address is public. A loopback, private,
  link-local, multicast or reserved address is never connected to unless its host name is
  listed: the check is made on the addresses the connection really uses (a resolver that
  filters them), so a name that resolves differently the second time gains nothing.
* Redirects are followed by hand, at most ``MAX_REDIRECTS``, each target checked as the
  first URL was. The whole fetch, redirects included, ends at ``--media-fetch-timeout``.
* At most ``--max-media-bytes`` are read (inline images too), and an image's header must
  show at most ``--max-image-pixels`` before its pixels are decoded (decompression bombs).
* The decoders are Pillow's for PNG, JPEG, GIF (its first frame), WebP and BMP; a corrupt or
  truncated file is refused.

Every refusal is a :class:`MediaError` (a ``ValueError``), which the handlers answer with a
400. Decoding runs on a worker thread (``anyio.to_thread``) and fetching is asynchronous, so
the engine's loop never waits on either; both happen before the request is queued.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import anyio.to_thread
from aiohttp.abc import AbstractResolver

from asyncengine.config import parse_size
from asyncengine.core.multimodal import ImageItem

if TYPE_CHECKING:
    from asyncengine.config.multimodal import MultiModalConfig

MAX_REDIRECTS = 5
#: Pillow's format names that are decoded.
FORMATS = frozenset({"PNG", "JPEG", "GIF", "WEBP", "BMP"})
_CHUNK = 64 * 1024


class MediaError(ValueError):
    """An image the server will not take (the message says why; a 400)."""


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: frozenset[str] | None  # None: any host with public addresses
    local_root: Path | None  # file:// URLs under it; None: none
    max_bytes: int
    timeout: float
    max_pixels: int
    limit: int  # images per prompt

    @classmethod
    def of(cls, mc: MultiModalConfig) -> MediaPolicy:
        root = mc.allowed_local_media_path
        return cls(frozenset(mc.allowed_media_domains) if mc.allowed_media_domains else None,
                   Path(root).resolve() if root else None,
                   parse_size(mc.max_media_bytes, "max_media_bytes"), mc.media_fetch_timeout,
                   mc.max_image_pixels, mc.image_limit)


def check_count(n: int, policy: MediaPolicy) -> None:
    if n > policy.limit:
        raise MediaError(f"{n} images in one prompt: at most {policy.limit} "
                         "(--limit-mm-per-prompt)")


async def load_images(urls: list[str], policy: MediaPolicy) -> list[ImageItem]:
    """Fetch (or read) and decode the images, all at once; MediaError if any is refused
    (the first refusal in order; the others are cancelled)."""
    check_count(len(urls), policy)
    out: list[ImageItem | None] = [None] * len(urls)
    errors: list[MediaError | None] = [None] * len(urls)

    async def one(i: int, url: str) -> None:
        try:
            data = await read_url(url, policy)
            out[i] = await anyio.to_thread.run_sync(decode_image, data, policy)
        except MediaError as e:
            errors[i] = e
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for i, url in enumerate(urls):
            tg.start_soon(one, i, url)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return out  # type: ignore[return-value]


async def read_url(url: str, policy: MediaPolicy) -> bytes:
    """The bytes behind an image URL, within the policy."""
    if not isinstance(url, str) or not url:
        raise MediaError("an image URL must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, policy)
    if scheme in ("http", "https"):
        return await _fetch(url, policy)
    if scheme == "file":
        return await anyio.to_thread.run_sync(_read_file, url, policy)
    raise MediaError(f"unsupported image URL scheme {scheme or url[:16]!r} (data:, http(s): "
                     "or file:)")


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        raise MediaError("a data: image URL must be base64: data:image/png;base64,...")
    media_type = head[:-len(";base64")].split(";")[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"a data: URL of type {media_type!r} is not an image")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes "
                         "(--max-media-bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: image URL is not valid base64") from None


def _read_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.local_root is None:
        raise MediaError("file: image URLs are not allowed (--allowed-local-media-path)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError("a file: image URL must name a local path (file:///...)")
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(policy.local_root):
        raise MediaError("the file: image URL is outside --allowed-local-media-path")
    try:
        if path.stat().st_size > policy.max_bytes:
            raise MediaError(f"the image is larger than {policy.max_bytes} bytes "
                             "(--max-media-bytes)")
        return path.read_bytes()
    except OSError:
        raise MediaError("the file: image URL names no readable file") from None


# -- http(s) -----------------------------------------------------------------------------------
def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _check_target(url: str, policy: MediaPolicy) -> urllib.parse.SplitResult:
    """The URL's scheme and host against the policy (its addresses are checked on connect)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise MediaError("the image URL is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not host:
        raise MediaError("an image URL must be http(s) with a host (redirects too)")
    if policy.allowed_domains is not None:
        if host not in policy.allowed_domains:
            raise MediaError(f"the image URL's host {host!r} is not in --allowed-media-domains")
        return parts
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return parts
    if not _public(str(literal)):
        raise MediaError(f"the image URL's address {host} is not public (list its name in "
                         "--allowed-media-domains to allow it)")
    return parts


class _PublicResolver(AbstractResolver):
    """Resolves names to their public addresses only (the hosts were not listed)."""

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()
        self.refused: str | None = None  # a host it found only non-public addresses for

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        found = await self._inner.resolve(host, port, family)
        public = [a for a in found if _public(a["host"])]
        if not public:
            self.refused = host
            raise OSError(f"{host} has no public address")
        return public

    async def close(self) -> None:
        await self._inner.close()


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    resolver = None if policy.allowed_domains is not None else _PublicResolver()
    connector = aiohttp.TCPConnector(resolver=resolver, force_close=True)
    try:
        with anyio.fail_after(policy.timeout):
            async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
                for _ in range(MAX_REDIRECTS + 1):
                    _check_target(url, policy)
                    async with session.get(url, allow_redirects=False) as resp:
                        if resp.status in (301, 302, 303, 307, 308):
                            target = resp.headers.get("Location")
                            if not target:
                                raise MediaError("the image URL redirects nowhere")
                            url = urllib.parse.urljoin(url, target)
                            continue
                        if resp.status != 200:
                            raise MediaError(f"fetching the image URL answered HTTP "
                                             f"{resp.status}")
                        return await _read_body(resp, policy)
                raise MediaError(f"the image URL redirects more than {MAX_REDIRECTS} times")
    except TimeoutError:
        raise MediaError(f"fetching the image URL took longer than {policy.timeout:g} s "
                         "(--media-fetch-timeout)") from None
    except (aiohttp.ClientError, OSError) as e:
        if resolver is not None and resolver.refused is not None:
            raise MediaError(f"the image URL's host {resolver.refused!r} has no public address "
                             "(list it in --allowed-media-domains to allow it)") from None
        raise MediaError(f"cannot fetch the image URL: {e}") from None


async def _read_body(resp: aiohttp.ClientResponse, policy: MediaPolicy) -> bytes:
    too_big = MediaError(f"the image is larger than {policy.max_bytes} bytes "
                         "(--max-media-bytes)")
    if (resp.content_length or 0) > policy.max_bytes:
        raise too_big
    body = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > policy.max_bytes:
            raise too_big
    return bytes(body)


# -- decoding (on a worker thread) -------------------------------------------------------------
def decode_image(data: bytes, policy: MediaPolicy) -> ImageItem:
    """Decode ``data`` as an RGB image within the pixel limit (run off the loop)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise MediaError(f"the image is larger than {policy.max_bytes} bytes "
                         "(--max-media-bytes)")
    try:
        img = Image.open(io.BytesIO(data), formats=sorted(FORMATS))
    except Image.DecompressionBombError:
        raise MediaError(f"the image has more than {policy.max_pixels} pixels "
                         "(--max-image-pixels)") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise MediaError("the image cannot be decoded (PNG, JPEG, GIF, WebP or BMP)") from None
    width, height = img.size
    if width < 1 or height < 1 or width * height > policy.max_pixels:
        raise MediaError(f"the image is {width}x{height} pixels: at most {policy.max_pixels} "
                         "pixels (--max-image-pixels)")
    try:
        img.load()
        rgb = img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, EOFError):
        raise MediaError(f"the {img.format} image is corrupt or truncated") from None
    # The hash of the pixels: one picture sent as PNG or BMP, inline or by URL, is one image.
    h = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return ImageItem(rgb, h.digest())
