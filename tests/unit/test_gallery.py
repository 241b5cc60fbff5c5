"""The demo gallery paints each original's placeholder and colour: the ThumbHash
decoder (derivd.ops.thumbhash_decoder), the page it feeds, and the page in a real browser."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from fixtures.pages import browser, screenshot
from PIL import Image

from derivd.client import Original
from derivd.ops import thumbhash_decoder
from derivd.ops.gallery import Sample, write_gallery
from derivd.storage.fs import FsStorage

TEAL = (32, 160, 150)


def flat_hash(rgb: tuple[int, int, int], *, landscape: bool, short: int = 3) -> bytes:
    """A ThumbHash of one flat colour (every AC scale 0), laid out as the reference
    encoder writes it: the 24-bit header (L, P, Q means, L scale, alpha flag), the 16-bit
    one (the short side's term count, P and Q scales, orientation), then AC nibbles."""
    r, g, b = (c / 255 for c in rgb)
    lum, p, q = (r + g + b) / 3, (r + g) / 2 - b, r - g
    h24 = round(63 * lum) | round(31.5 + 31.5 * p) << 6 | round(31.5 + 31.5 * q) << 12
    h16 = short | int(landscape) << 15
    return bytes([h24 & 255, h24 >> 8 & 255, h24 >> 16, h16 & 255, h16 >> 8]) + bytes(20)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def test_a_flat_hash_decodes_to_its_colour_at_its_aspect() -> None:
    wide = flat_hash(TEAL, landscape=True)
    assert thumbhash_decoder.aspect_ratio(wide) == 7 / 3
    w, h, rgba = thumbhash_decoder.to_rgba(wide)
    assert (w, h) == (32, 14)
    pixels = {rgba[i : i + 4] for i in range(0, len(rgba), 4)}
    assert len(pixels) == 1  # flat: no AC term contributes
    (pixel,) = pixels
    assert all(abs(got - want) <= 6 for got, want in zip(pixel[:3], TEAL, strict=True)), pixel
    assert pixel[3] == 255
    tall_w, tall_h, _ = thumbhash_decoder.to_rgba(flat_hash(TEAL, landscape=False, short=5))
    assert (tall_w, tall_h) == (23, 32)  # 5/7 of 32, rounded


def test_the_data_uri_is_a_png_of_the_placeholder(tmp_path: Path) -> None:
    uri = thumbhash_decoder.png_data_uri(b64(flat_hash(TEAL, landscape=True)).rstrip("="))
    assert uri.startswith("data:image/png;base64,")
    png = tmp_path / "p.png"
    png.write_bytes(base64.b64decode(uri.split(",", 1)[1]))
    with Image.open(png) as image:
        assert (image.format, image.size, image.mode) == ("PNG", (32, 14), "RGBA")


def gallery(tmp_path: Path, placeholder: str) -> Path:
    """A gallery of one ready sample whose analysis says portrait, `placeholder`, and a
    colour (red) unlike the placeholder's."""
    sample = tmp_path / "photo.png"
    Image.new("RGB", (60, 80), (200, 200, 200)).save(sample)
    original = Original(600, 800, "png", 1, False, "#ff0000", placeholder, 0)
    samples = [Sample(sample, "ready", None, (), original), Sample(sample, "queued", None, ())]
    return write_gallery(tmp_path / "demo", samples, FsStorage(tmp_path / "store"))


def test_the_gallery_shows_each_placeholder_and_colour(tmp_path: Path) -> None:
    placeholder = b64(flat_hash(TEAL, landscape=False, short=5))
    page = gallery(tmp_path, placeholder).read_text()
    assert page.count('data-kind="placeholder"') == 1  # the queued sample has no analysis
    figure = page.split('data-kind="placeholder"', 1)[1].split("</figure>", 1)[0]
    assert f'src="{thumbhash_decoder.png_data_uri(placeholder)}"' in figure
    assert 'width="120" height="160"' in figure  # the original's aspect (600x800)
    assert '<span class="swatch" style="background:#ff0000"></span>#ff0000' in figure


def test_a_malformed_placeholder_leaves_the_colour(tmp_path: Path) -> None:
    page = gallery(tmp_path, "AAAA").read_text()
    figure = page.split('data-kind="placeholder"', 1)[1].split("</figure>", 1)[0]
    assert "<img" not in figure and "nothing to show" in figure and "#ff0000" in figure


@pytest.mark.skipif(browser() is None, reason="no chromium for the browser check")
def test_a_browser_paints_the_placeholder(tmp_path: Path) -> None:
    """Headless Chromium renders the page: the placeholder's teal covers its 120 x 160
    box (nothing else on the page is teal)."""
    page = gallery(tmp_path, b64(flat_hash(TEAL, landscape=False, short=5)))
    shot = tmp_path / "shot.png"
    screenshot(page.as_uri(), tmp_path / "chromium", shot)
    with Image.open(shot) as image:
        rgb = image.convert("RGB").tobytes()
    pixels = zip(rgb[0::3], rgb[1::3], rgb[2::3], strict=True)
    teal = sum(all(abs(a - b) <= 8 for a, b in zip(px, TEAL, strict=True)) for px in pixels)
    assert teal >= 0.9 * 120 * 160, teal
