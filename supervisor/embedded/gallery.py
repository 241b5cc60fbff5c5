"""The demo's gallery: `<state_dir>/demo/index.html`, each sample original beside its
placeholder and representative colour (the analysis an app gets at `ready`) and its
variants (dimensions, format, bytes, saving against the original), rejected ones with
their error code.

The page is self-contained in its folder: every image it shows is copied next to it
(read back from the store by key and version, so it works for `fs` and `s3` alike), and
an original a browser cannot display (TIFF) is shown through a PNG preview, labelled so.
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
from derivd.embedded.thumbhash import png_data_uri
from derivd.queue.db import StoredVariant
from derivd.storage.base import Storage

# What browsers display as is; anything else gets a PNG preview.
BROWSER_FORMATS = {"JPEG", "PNG", "GIF", "WEBP", "AVIF"}


@dataclass(frozen=True)
class Sample:
    path: Path  # the original as generated
    status: str
    error_code: str | None
    variants: Sequence[StoredVariant]
    original: Original | None = None  # the analysis (derivd.client.result), once ready


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


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
        "<title>derivd demo</title><style>"
        "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#1d2430}"
        ".card{display:flex;gap:1.2em;align-items:flex-end;flex-wrap:wrap;background:#fff;"
        "border:1px solid #e3e6ea;padding:.8em;margin:0 0 1em}"
        "figure{margin:0}img{max-width:360px;max-height:240px;display:block;"
        "background:repeating-conic-gradient(#eee 0 25%,#fff 0 50%) 0 0/16px 16px}"
        "figcaption{font-size:12px;color:#4a5360}.rejected{color:#a11818;font-weight:600}"
        ".swatch{display:inline-block;width:.9em;height:.9em;vertical-align:-.1em;"
        "border:1px solid #0003;margin-right:.3em}"
        "</style></head><body>"
        f"<h1>derivd demo</h1><p>{ready} of {len(samples)} samples ready; each original "
        "(left) beside the variants derivd made from it.</p>" + "".join(cards) + "</body></html>\n",
        encoding="utf-8",
    )
    return page


def _card(folder: Path, n: int, sample: Sample, storage: Storage) -> str:
    original = sample.path.read_bytes()
    shown, note = _displayable(folder, n, sample.path, original)
    parts = [
        f'<section class="card" data-status="{esc(sample.status)}">',
        _figure(shown, f"original: {sample.path.name}", note + _describe_bytes(original)),
    ]
    if sample.original is not None:
        parts.append(_analysis(sample.original))
    if sample.status == "rejected":
        parts.append(f'<p class="rejected">rejected: {esc(sample.error_code)}</p>')
    elif sample.status != "ready":
        parts.append(f'<p class="rejected">{esc(sample.status)}</p>')
    for variant in sample.variants:
        data = storage.get(variant.key, variant.version)
        ext = variant.key.rsplit(".", 1)[-1].lower()
        name = f"files/{n:03d}-{_safe(variant.name)}-{_safe(variant.format)}.{_safe(ext)}"
        (folder / name).write_bytes(data)
        caption = (
            f"{variant.width}x{variant.height} {variant.format}, {_describe_bytes(data)}, "
            f"{_saving(len(data), len(original))}"
        )
        parts.append(_figure(name, f"{variant.name}", caption))
    parts.append("</section>")
    return "".join(parts)


def _displayable(folder: Path, n: int, path: Path, data: bytes) -> tuple[str, str]:
    """(relative file name, caption prefix) of what the page shows for an original."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, size = image.format or "?", image.size
            if fmt not in BROWSER_FORMATS:
                preview = f"files/{n:03d}-original-preview.png"
                image.convert("RGBA" if "A" in image.getbands() else "RGB").save(
                    folder / preview, "PNG"
                )
                return preview, f"{size[0]}x{size[1]} {fmt.lower()} (shown as PNG), "
    except Exception:  # a broken sample (the demo makes two): shown as a broken image
        fmt, size = None, None
    name = f"files/{n:03d}-original{_safe(path.suffix.lower())}"
    (folder / name).write_bytes(data)
    shape = f"{size[0]}x{size[1]} {fmt.lower()}, " if size and fmt else ""
    return name, shape


def _analysis(original: Original) -> str:
    """What an app paints before the variants load: the ThumbHash placeholder, decoded
    here into a PNG data URI and stretched to the original's displayed aspect, and the
    representative colour as a swatch."""
    width = 120
    height = max(1, round(width * original.height / original.width))
    try:
        src = png_data_uri(original.placeholder)
    except (ValueError, IndexError):  # a malformed hash: show the colour alone
        src = ""
    picture = (
        f'<img class="placeholder" src="{esc(src)}" alt="placeholder" '
        f'width="{width}" height="{height}">'
        if src
        else ""
    )
    return (
        f'<figure class="analysis">{picture}<figcaption><b>placeholder</b><br>'
        f'<span class="swatch" style="background:{esc(original.colour)}"></span>'
        f"{esc(original.colour)}<br>{original.width}x{original.height} "
        f"{esc(original.format)}</figcaption></figure>"
    )


def _figure(src: str, title: str, caption: str) -> str:
    return (
        f'<figure><img src="{esc(src)}" alt="{esc(title)}" loading="lazy">'
        f"<figcaption><b>{esc(title)}</b><br>{esc(caption)}</figcaption></figure>"
    )


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
