"""Previews of originals that are not images: a PDF's page, a video's frame (DESIGN.md
"Previews"), for both backends.

A backend asks `preview_of` first. For an image it answers None and the backend decodes
as before; for a PDF (`derivd.handlers.pdf`) or a video (`derivd.handlers.video`) it
hands back one still picture, 8-bit sRGB, upright, at (about) the size the largest
variant needs, decoded once; the backend derives every variant and the analysis from it
as it would from a photo's decoded base, and `analysed` adds what the document or the
container said (`Analysis.media`). A kind `[derive] accept` leaves out is
`unsupported_content` before any parser reads the bytes.

The kind comes from the first bytes, as a format does for images: an accepted image
magic wins (a JPEG that also holds a PDF is a JPEG), then `%PDF-` at offset 0, then an
ISO-BMFF movie (an `ftyp` box outside the HEIF image brands, or the first box of an old
QuickTime file) or an EBML header (Matroska, WebM).
"""

from __future__ import annotations

from dataclasses import replace

from derivd.handlers.base import Analysis, DeriveSpec, UnsupportedContent
from derivd.handlers.matroska import EBML_MAGIC
from derivd.handlers.preview_picture import Preview
from derivd.handlers.sniff import accepted_format

__all__ = ["Preview", "analysed", "kind_of", "preview_of"]

# Top-level boxes a QuickTime movie without `ftyp` may start with.
_QUICKTIME_FIRST = frozenset({b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})


def kind_of(original: bytes) -> str:
    """`image`, `pdf` or `video` by the first bytes; bytes nobody recognises are `image`
    (the image backends then say what they are not)."""
    if accepted_format(original) is not None:
        return "image"
    if original.startswith(b"%PDF-"):
        return "pdf"
    box = original[4:8]
    if box == b"ftyp" or box in _QUICKTIME_FIRST or original.startswith(EBML_MAGIC):
        return "video"
    return "image"


def preview_of(original: bytes, spec: DeriveSpec) -> Preview | None:
    """The preview of a PDF or a video, None for an image; `unsupported_content` for a
    kind `[derive] accept` leaves out. Raises the outcome of a document or a container
    past a limit, damaged, or one this build cannot decode."""
    kind = kind_of(original)
    if kind not in spec.previews.accept:
        raise UnsupportedContent(f"{kind} originals are not accepted ([derive] accept)")
    if kind == "pdf":
        from derivd.handlers import pdf  # PDFium: mapped by the first PDF a worker gets

        return pdf.render(original, spec)
    if kind == "video":
        from derivd.handlers import video  # ffmpeg's libraries: by the first video

        return video.still(original, spec)
    return None


def analysed(analysis: Analysis, preview: Preview | None) -> Analysis:
    """A backend's analysis of the preview's pixels, with the original's own size, format,
    frames and media facts; unchanged for an image."""
    if preview is None:
        return analysis
    width, height = preview.shown
    return replace(analysis, width=width, height=height, format=preview.format,
                   frames=preview.frames, media=preview.media)  # fmt: skip
