"""The demo's gallery: `<state_dir>/demo/index.html`, each sample original beside its
placeholder and representative colour (the analysis an app gets at `ready`) and its
variants (dimensions, format, bytes, saving against the original), rejected ones with
their error code.

The page is self-contained in its folder: every image it shows is copied next to it
(read back from the store by key and version, so it works for `fs` and `s3` alike), and
an original a browser cannot display (TIFF) is shown through a PNG preview, labelled so.
Variants are shown at their real size (only one wider than the window shrinks to fit),
so a thumbnail looks like a thumbnail beside its preview; originals, often larger than a
screen, are scaled to fit ORIGINAL_BOX and say so; a sample that is no image at all gets
a labelled empty frame, never a broken image.

A card is a list of `Figure`s (the original, then the variants): to show more about an
original, add a figure or a part after it in `_card`.
"""

from __future__ import annotations

import html
import io
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from derivd.client import Original
from derivd.ops.thumbhash_decoder import png_data_uri
from derivd.queue.db import StoredVariant
from derivd.storage.base import Storage

# What browsers display as is; anything else gets a PNG preview.
BROWSER_FORMATS = {"JPEG", "PNG", "GIF", "WEBP", "AVIF"}
# The largest an original is shown (CSS px); variants are shown at their real size.
ORIGINAL_BOX = (480, 360)
# How wide a placeholder is painted (CSS px), at the original's aspect ratio.
PLACEHOLDER_WIDTH = 120


@dataclass(frozen=True)
class Sample:
    path: Path  # the original as generated
    status: str
    error_code: str | None
    variants: Sequence[StoredVariant]
    original: Original | None = None  # the analysis (derivd.client.result), once ready


@dataclass(frozen=True)
class Figure:
    """One picture of a card: the file beside the page (None: nothing a browser can
    show), shown at `shown` CSS px; `kind` and `name` label it for readers and tests."""

    kind: str  # "original", "placeholder" or "variant"
    name: str
    caption: str
    src: str | None = None
    shown: tuple[int, int] = (0, 0)
    swatch: str | None = None  # a colour (#rrggbb) painted before the caption


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


STYLE = (
    "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#1d2430}"
    ".card{display:flex;gap:1.2em;align-items:flex-end;flex-wrap:wrap;background:#fff;"
    "border:1px solid #e3e6ea;padding:.8em;margin:0 0 1em}"
    "figure{margin:0;max-width:100%}img{display:block;max-width:100%;height:auto;"
    "background:repeating-conic-gradient(#eee 0 25%,#fff 0 50%) 0 0/16px 16px}"
    "figure{min-width:0}"
    ".nothing{display:flex;align-items:center;justify-content:center;width:160px;"
    "height:120px;border:1px dashed #b8bec6;color:#6b7480;font-size:12px;text-align:center}"
    "figcaption{font-size:12px;color:#4a5360}.rejected{color:#a11818;font-weight:600}"
    ".swatch{display:inline-block;width:.9em;height:.9em;vertical-align:-.1em;"
    "border:1px solid #0003;margin-right:.3em}"
)


def write_gallery(folder: Path, samples: Sequence[Sample], storage: Storage) -> Path:
    """Write folder/index.html and the images it shows; returns the page's path."""
    if folder.exists():
        shutil.rmtree(folder)  # a gallery of this run only: no stale images
    (folder / "files").mkdir(parents=True)
    cards = [_card(folder, n, sample, storage) for n, sample in enumerate(samples, 1)]
    ready = sum(s.status == "ready" for s in samples)
    page = folder / "index.html"
    page.write_text(
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>derivd demo</title><style>{STYLE}</style></head><body>"
        f"<h1>derivd demo</h1><p>{ready} of {len(samples)} samples ready; each original "
        "(left, scaled to fit) beside the variants derivd made from it, at their real "
        "size.</p>" + "".join(cards) + "</body></html>\n",
        encoding="utf-8",
    )
    return page


def _card(folder: Path, n: int, sample: Sample, storage: Storage) -> str:
    original = sample.path.read_bytes()
    parts = [_figure(_original(folder, n, sample.path, original))]
    if sample.original is not None:
        parts.append(_figure(_placeholder(sample.original)))
    if sample.status == "rejected":
        parts.append(f'<p class="rejected">rejected: {esc(sample.error_code)}</p>')
    elif sample.status != "ready":
        parts.append(f'<p class="rejected">{esc(sample.status)}</p>')
    parts += [
        _figure(_variant(folder, n, variant, storage, len(original))) for variant in sample.variants
    ]
    return f'<section class="card" data-status="{esc(sample.status)}">{"".join(parts)}</section>'


def _variant(
    folder: Path, n: int, variant: StoredVariant, storage: Storage, original_size: int
) -> Figure:
    data = storage.get(variant.key, variant.version)
    ext = variant.key.rsplit(".", 1)[-1].lower()
    name = f"files/{n:03d}-{_safe(variant.name)}-{_safe(variant.format)}.{_safe(ext)}"
    (folder / name).write_bytes(data)
    caption = (
        f"{variant.width}x{variant.height} {variant.format}, {_describe_bytes(data)}, "
        f"{_saving(len(data), original_size)}"
    )
    return Figure("variant", variant.name, caption, name, (variant.width, variant.height))


def _original(folder: Path, n: int, path: Path, data: bytes) -> Figure:
    """The original as the page shows it: as is, through a PNG preview, or (no image a
    browser could show) an empty frame that says so."""
    title = f"original: {path.name}"
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, size = (image.format or "?").lower(), image.size
            name, note = f"files/{n:03d}-original{_safe(path.suffix.lower())}", ""
            if image.format not in BROWSER_FORMATS:
                name, note = f"files/{n:03d}-original-preview.png", " (shown as PNG)"
                image.convert("RGBA" if "A" in image.getbands() else "RGB").save(
                    folder / name, "PNG"
                )
            else:
                (folder / name).write_bytes(data)
    except Exception:  # not an image (the demo makes one on purpose), or unreadable
        return Figure("original", title, f"not an image, {_describe_bytes(data)}")
    shown = fit(size, ORIGINAL_BOX)
    scale = f", shown at {shown[0] / size[0]:.0%}" if shown != size else ""
    caption = f"{size[0]}x{size[1]} {fmt}{note}, {_describe_bytes(data)}{scale}"
    return Figure("original", title, caption, name, shown)


def _placeholder(original: Original) -> Figure:
    """What an app paints before the variants load: the ThumbHash placeholder (decoded
    into a PNG data URI) stretched to the original's displayed aspect, and the
    representative colour (a hash that does not decode: an empty frame, and the colour)."""
    width = PLACEHOLDER_WIDTH
    height = max(1, round(width * original.height / original.width))
    try:
        src: str | None = png_data_uri(original.placeholder)
    except (ValueError, IndexError):
        src = None
    caption = f"{original.colour}, {original.width}x{original.height} {original.format}"
    return Figure("placeholder", "placeholder", caption, src, (width, height), original.colour)


def fit(size: tuple[int, int], box: tuple[int, int]) -> tuple[int, int]:
    """`size` scaled down (never up) to fit `box`, keeping its aspect ratio."""
    scale = min(1.0, box[0] / size[0], box[1] / size[1]) if size[0] and size[1] else 1.0
    return max(1, round(size[0] * scale)), max(1, round(size[1] * scale))


def _figure(figure: Figure) -> str:
    label = f' data-kind="{esc(figure.kind)}" data-name="{esc(figure.name)}"'
    if figure.src is None:
        picture = (
            '<div class="nothing" role="img" aria-label="nothing to show">nothing to show</div>'
        )
    else:
        width, height = figure.shown
        picture = (
            f'<img src="{esc(figure.src)}" alt="{esc(figure.name)}" width="{width}" '
            f'height="{height}"{_within_window(width, height)} loading="lazy">'
        )
    swatch = (
        f'<span class="swatch" style="background:{esc(figure.swatch)}"></span>'
        if figure.swatch
        else ""
    )
    return (
        f"<figure{label}>{picture}<figcaption><b>{esc(figure.name)}</b><br>"
        f"{swatch}{esc(figure.caption)}</figcaption></figure>"
    )


def _within_window(width: int, height: int) -> str:
    """A style that shows a picture at its size but never wider or taller than the window
    (the demo's `preview:1600` in a 1280 x 800 one), scaled down whole: a width known
    before the image loads, the height following from the width and height attributes."""
    if width <= 1 or height <= 1:
        return ""
    return f' style="width:min({width}px,100%,calc((100vh - 5em) * {width / height:.4f}))"'


def _describe_bytes(data: bytes) -> str:
    size = len(data)
    return f"{size / 1024:.1f} KiB" if size >= 1024 else f"{size} B"


def _saving(size: int, original: int) -> str:
    """How much smaller than the original (or larger, for a tiny one)."""
    if not original:
        return ""
    ratio = 1 - size / original
    return f"{ratio:.0%} smaller" if ratio >= 0 else f"{-ratio:.0%} larger"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
