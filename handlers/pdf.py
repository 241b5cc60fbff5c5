"""PDF previews through PDFium (pypdfium2, whose wheels carry the library).

Per job: open the document (the empty user password is tried, as a viewer does; a
document that needs another is `unsupported_content`), read the page count, load the
previewed page (`[derive] pdf_page`, the last one of a shorter document) and its size in
points with `/Rotate` applied, check every limit, then render that page once, on white,
at the scale the largest variant needs (`render_size`: a page is vector, so unlike a
photo it is drawn at the size asked for, up as well as down), never at a fixed DPI.

PDFium aborts the whole process when an allocation fails, so nothing is rendered whose
size was not checked first: every compressed stream's inflated size (`inflates_past`: a
zip bomb), the page's own size (`MAX_PAGE_POINTS`, and at least a point a side), the
bitmap's pixels (`[derive] max_pixels`) and its bytes against the worker's memory.
What is left (a font or an image inside the page that PDFium decodes at its own size)
is bounded by the worker being the sandbox: a crash costs that attempt only, and a
file that crashes every attempt is rejected after `[queue] max_attempts`.

Forms are not initialised (no JavaScript, no XFA); PDFium has no network access and
substitutes missing fonts from the system's or its own, downloading nothing.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import replace
from functools import cache
from typing import Any

from derivd.handlers.base import (
    CorruptContent,
    DeriveSpec,
    ResourceLimit,
    UnsupportedContent,
    VariantSpec,
)
from derivd.handlers.geometry import scale_of
from derivd.handlers.preview_picture import Preview

# ISO 32000-1, Annex C: a page is at most 14 400 units a side. Plots and posters past it
# exist, so ten times that; beyond it a page is a bomb or junk (2^31 points).
MAX_PAGE_POINTS = 144_000.0
MIN_PAGE_POINTS = 1.0
_BYTES_PER_PIXEL = 4  # PDFium's bitmap rows (BGR padded to 4 bytes) and its own buffers
# The most one compressed stream may inflate to without a memory budget: a Flate stream
# of spaces grows ~1000-fold, and PDFium inflates a content or object stream whole.
MAX_STREAM_BYTES = 256 * 1024 * 1024
_STREAM_START = re.compile(rb"(?<!end)stream\r?\n")
_INFLATE_STEP = 16 * 1024 * 1024
_FPDF_ERR_PASSWORD = 4  # FPDF_GetLastError after a load that needs a password
_WHITE = (255, 255, 255, 255)


@cache
def pdfium() -> Any:
    """pypdfium2, imported with the first PDF a worker gets (PDFium is initialised at
    import: never in the supervisor, and not in a worker that only sees photos)."""
    try:
        import pypdfium2
    except ImportError:  # a build without it cannot decode PDFs: the format's outcome
        raise UnsupportedContent("PDF previews need pypdfium2, not installed") from None
    return pypdfium2


def render_size(page: tuple[float, float], variants: tuple[VariantSpec, ...]) -> tuple[int, int]:
    """The page, `page` points (as displayed), in pixels at the scale the most demanding
    variant needs: each variant's scale as if upscaling were allowed (vector pages are
    drawn at any size), the largest of them; 1 px per point without variants."""
    width, height = page
    scales = [scale_of(width, height, replace(v, upscale=True)) for v in variants]
    scale = max(scales, default=1.0)
    return max(1, round(width * scale)), max(1, round(height * scale))


def check_page(page: tuple[float, float], size: tuple[int, int], spec: DeriveSpec) -> None:
    """The limits of one render, before PDFium allocates anything for it."""
    if not all(MIN_PAGE_POINTS <= side <= MAX_PAGE_POINTS for side in page):
        raise ResourceLimit(f"page of {page[0]:g} x {page[1]:g} pt (sides from "
                            f"{MIN_PAGE_POINTS:g} to {MAX_PAGE_POINTS:g} pt)")  # fmt: skip
    pixels = size[0] * size[1]
    if pixels > spec.max_pixels:
        raise ResourceLimit(f"page render {size[0]}x{size[1]} > max_pixels {spec.max_pixels}")
    budget = spec.previews.memory_bytes // 2  # the other half: PDFium's own, the encoders
    if budget and pixels * _BYTES_PER_PIXEL > budget:
        raise ResourceLimit(f"page render {size[0]}x{size[1]} needs more than half the "
                            "worker's memory ([supervisor] max_worker_rss_mb)")  # fmt: skip


def stream_cap(spec: DeriveSpec) -> int:
    """What one stream may inflate to: a quarter of the worker's memory, else the constant."""
    return spec.previews.memory_bytes // 4 or MAX_STREAM_BYTES


def inflates_past(original: bytes, cap: int) -> bool:
    """Whether any zlib stream in the file inflates to more than `cap` bytes: a zip bomb
    in a content or object stream, found before PDFium inflates it whole. Every
    `stream` keyword is tried (no parsing: a bomb need not be where the xref says); bytes
    that are not zlib stop at their first block."""
    view = memoryview(original)
    for found in _STREAM_START.finditer(original):
        inflater, pending, total = zlib.decompressobj(), view[found.end() :], 0
        try:
            while pending and not inflater.eof:
                total += len(inflater.decompress(pending, _INFLATE_STEP))
                if total > cap:
                    return True
                pending = memoryview(inflater.unconsumed_tail)
        except zlib.error:
            continue
    return False


def render(original: bytes, spec: DeriveSpec) -> Preview:
    """The previewed page, checked and rendered (see the module's docstring)."""
    if inflates_past(original, stream_cap(spec)):
        raise ResourceLimit(f"a stream inflates past {stream_cap(spec)} bytes")
    library = pdfium()
    try:
        document = library.PdfDocument(original)
    except library.PdfiumError as error:
        if getattr(error, "err_code", None) == _FPDF_ERR_PASSWORD:
            raise UnsupportedContent("PDF needs a password") from None
        raise CorruptContent(f"unreadable PDF: {error}"[:200]) from None
    try:
        return _render_page(library, document, spec)
    finally:
        document.close()


def _render_page(library: Any, document: Any, spec: DeriveSpec) -> Preview:
    pages = len(document)
    if pages > spec.previews.max_pages:
        raise ResourceLimit(f"{pages} pages > max_pages {spec.previews.max_pages}")
    if pages < 1:
        raise CorruptContent("PDF without pages")
    number = min(spec.previews.pdf_page, pages)
    try:
        page = document[number - 1]
    except library.PdfiumError as error:
        raise CorruptContent(f"unreadable page {number}: {error}"[:200]) from None
    try:
        width, height = page.get_size()  # points, /Rotate applied
        size = render_size((width, height), spec.variants)
        check_page((width, height), size, spec)
        bitmap = page.render(scale=size[0] / width, fill_color=_WHITE, rev_byteorder=True,
                             may_draw_forms=False, draw_annots=True)  # fmt: skip
        # height x width x 3, RGB, PDFium's row padding left out; pypdfium2 rounds each
        # side up, so a side may hold one partial pixel more than `size`: cut off.
        array = bitmap.to_numpy()[: size[1], : size[0]]
        rendered, pixels = (int(array.shape[1]), int(array.shape[0])), array.tobytes()
        bitmap.close()
    finally:
        page.close()
    media = {"pages": pages, "page": number,
             "page_size": [round(width, 2), round(height, 2)]}  # fmt: skip
    shown = (max(1, round(width)), max(1, round(height)))
    return Preview(pixels, rendered, rendered, shown, "pdf", pages, media)
