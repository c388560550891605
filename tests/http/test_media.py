"""Fetching and decoding images (``entrypoints/http/media.py``) against a local aiohttp
server: domains, redirects, timeouts, size and pixel limits, bad files; never the internet."""

from __future__ import annotations

import base64
import io
from dataclasses import replace
from pathlib import Path

import anyio
import pytest

from asyncengine.config import EngineConfig
from asyncengine.entrypoints.http.media import MediaError, MediaPolicy, load_images, read_url


def png(width: int = 8, height: int = 6, color=(200, 30, 40), fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def policy(**kw) -> MediaPolicy:
    return MediaPolicy.of(EngineConfig.from_dict(kw).multimodal)


def run(fn, *args):
    return anyio.run(fn, *args)


def test_data_urls_decode_and_hash_by_pixels():
    p = policy()
    a = run(load_images, [data_url(png()), data_url(png(fmt="BMP"), "image/bmp")], p)
    assert [im.image.size for im in a] == [(8, 6), (8, 6)]
    assert a[0].hash == a[1].hash  # same pixels, two encodings
    b = run(load_images, [data_url(png(color=(1, 2, 3)))], p)
    assert b[0].hash != a[0].hash


@pytest.mark.parametrize("url, why", [
    ("data:image/png;base64,!!!!", "base64"),
    ("data:text/plain;base64,aGk=", "not an image"),
    ("data:image/png,rawbytes", "base64"),
    ("ftp://example.com/a.png", "scheme"),
    ("file:///etc/passwd", "not allowed"),
    ("http://127.0.0.1/a.png", "not public"),
    ("http://[::1]/a.png", "not public"),
    ("http://10.0.0.1/a.png", "not public"),
    ("http://169.254.169.254/latest", "not public"),
])
def test_refused_urls(url, why):
    with pytest.raises(MediaError, match=why):
        run(read_url, url, policy())


@pytest.mark.parametrize("data, why", [
    (b"not an image at all", "cannot be decoded"),
    (png(64, 64)[:60], "corrupt or truncated|cannot be decoded"),
    (png(fmt="GIF")[:-20], "corrupt or truncated|cannot be decoded"),
    (png(fmt="WEBP")[:40], "corrupt or truncated|cannot be decoded"),
    (png(fmt="JPEG")[:80], "corrupt or truncated|cannot be decoded"),
])
def test_corrupt_images(data, why):
    with pytest.raises(MediaError, match=why):
        run(load_images, [data_url(data)], policy())


def test_limits_on_pixels_bytes_and_count():
    with pytest.raises(MediaError, match="max-image-pixels"):
        run(load_images, [data_url(png(100, 100))], policy(max_image_pixels=9999))
    with pytest.raises(MediaError, match="max-media-bytes"):
        run(load_images, [data_url(png(100, 100))], policy(max_media_bytes="50B"))
    with pytest.raises(MediaError, match="limit-mm-per-prompt"):
        run(load_images, [data_url(png())] * 3, policy(limit_mm_per_prompt='{"image": 2}'))
    # bombs: small PNGs whose headers say 8000 x 8000 (past the default limit) and
    # 14000 x 14000 (past Pillow's own)
    from PIL import Image

    for side in (8000, 14000):
        buf = io.BytesIO()
        Image.new("1", (side, side)).save(buf, format="PNG")
        assert len(buf.getvalue()) < 100_000
        with pytest.raises(MediaError, match="max-image-pixels"):
            run(load_images, [data_url(buf.getvalue())], policy())


def test_file_urls_only_under_the_allowed_path(tmp_path: Path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png())
    (tmp_path / "b.png").write_bytes(png())
    p = policy(allowed_local_media_path=str(inside))
    assert run(load_images, [(inside / "a.png").as_uri()], p)[0].image.size == (8, 6)
    for url in ((tmp_path / "b.png").as_uri(), f"file://{inside}/../b.png",
                (inside / "missing.png").as_uri()):
        with pytest.raises(MediaError):
            run(read_url, url, p)


@pytest.fixture(scope="module")
def media_server():
    """A local server: /img, /slow (sleeps), /big (streams past the limit), /delayed,
    /redirect?to=URL (``tests/vision_utils.serve_media``)."""
    from tests.vision_utils import serve_media

    with serve_media(png()) as urls:
        yield urls


def test_fetch_from_an_allowed_domain(media_server):
    base, _ = media_server
    p = policy(allowed_media_domains=["127.0.0.1"])
    assert run(load_images, [f"{base}/img"], p)[0].image.size == (8, 6)
    # the same address by another name is not allowed
    with pytest.raises(MediaError, match="allowed-media-domains"):
        run(read_url, f"{media_server[1]}/img", p)
    # nor is a loopback address by any unlisted name, without the flag
    with pytest.raises(MediaError, match="public"):
        run(read_url, f"{media_server[1]}/img", policy())


def test_redirects_are_checked_again(media_server):
    base, other = media_server
    p = policy(allowed_media_domains=["127.0.0.1"])
    ok = f"{base}/redirect?to=/img"
    assert run(load_images, [ok], p)[0].image.size == (8, 6)
    with pytest.raises(MediaError, match="allowed-media-domains"):
        run(read_url, f"{base}/redirect?to={other}/img", p)
    with pytest.raises(MediaError, match="http"):
        run(read_url, f"{base}/redirect?to=file:///etc/passwd", p)


def test_slow_and_big_fetches_end(media_server):
    import time

    base, _ = media_server
    p = replace(policy(allowed_media_domains=["127.0.0.1"]), timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(MediaError, match="media-fetch-timeout"):
        run(read_url, f"{base}/slow", p)
    assert time.monotonic() - t0 < 2
    p = policy(allowed_media_domains=["127.0.0.1"], max_media_bytes="1MiB")
    with pytest.raises(MediaError, match="max-media-bytes"):
        run(read_url, f"{base}/big", p)


def test_several_images_are_fetched_at_once(media_server):
    import time

    base, _ = media_server
    p = policy(allowed_media_domains=["127.0.0.1"])
    t0 = time.monotonic()
    got = run(load_images, [f"{base}/delayed?i={i}" for i in range(4)], p)
    assert len(got) == 4 and time.monotonic() - t0 < 1.2  # not 4 x 0.4 s
    with pytest.raises(MediaError, match="HTTP 404"):  # one refused: the call is
        run(load_images, [f"{base}/delayed", f"{base}/missing"], p)


def test_bad_flags():
    for kw, flag in (({"limit_mm_per_prompt": "[1]"}, "--limit-mm-per-prompt"),
                     ({"limit_mm_per_prompt": '{"image": -1}'}, "--limit-mm-per-prompt"),
                     ({"limit_mm_per_prompt": '{"smell": 1}'}, "--limit-mm-per-prompt"),
                     ({"allowed_local_media_path": "/no/such/dir"}, "--allowed-local-media-path"),
                     ({"media_fetch_timeout": 0}, "--media-fetch-timeout"),
                     ({"max_media_bytes": "lots"}, "--max-media-bytes"),
                     ({"mm_encoder_cache": 0}, "--mm-encoder-cache"),
                     ({"max_num_encoder_input_tokens": 0}, "--max-num-encoder-input-tokens"),
                     ({"mm_processor_kwargs": '{"crop": 1}'},
                      "--mm-processor-kwargs: unknown key 'crop'"),
                     ({"mm_processor_kwargs": {"do_pan_and_scan": "yes"}},
                      "--mm-processor-kwargs: do_pan_and_scan must be true or false")):
        with pytest.raises(ValueError, match=flag):
            EngineConfig.from_dict(kw)
