"""`vips`: the libvips backend (pyvips), the default for production.

This is the only module that imports pyvips, and the registry imports it lazily, so libvips
(its thread pool, its caches) is first touched in a worker after fork.

Per job: sniff the loader from the first bytes (allowlist), read the header only, check the
limits, then one thumbnail to the base the largest variant needs, from which every variant
is derived (`vips_variants`). A still JPEG is decoded by libjpeg-turbo at the M/8 scale of
`[derive] shrink_on_load` (`jpegscale`, `geometry.jpeg_eighths`) and resized, or, where
that decoder declines it (CMYK, a warning), opened by jpegload at its shrink
(`geometry.jpeg_shrink`); a still WebP at `webp_scale`; `thumbnail_image` does the rest
(for libjpeg-turbo's pixels without an ICC profile only the orientation is left: autorot).
PNG, GIF, TIFF, AVIF and animated WebP go through `thumbnail_source` (HEIC through
pi-heif, `decode_heif`). Either way: EXIF autorotation, colour management to sRGB (embedded
profile, or libvips' built-in CMYK profile for unprofiled CMYK), 16-bit to 8-bit, a
lanczos3 resize, and streaming, so memory stays near one base-sized buffer plus a few
scanlines of input. Every loader reads the original's bytes in place (a memory source,
`vips_variants.read_in_place`): none copies the whole file first, as the `*_buffer` loaders do.

One job past 450 lines: decoding with libvips, in the one module that imports pyvips.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from typing import Any

import pyvips

from derivd.handlers import heif, previews
from derivd.handlers.analysis import Small, analyse, rgba_of, whole_blocks
from derivd.handlers.base import (
    Analysis,
    CorruptContent,
    Derivation,
    DeriveSpec,
    MissingEncoder,
    Permanent,
    UnsupportedContent,
    check_declared_size,
    check_input_size,
    decoding,
    encoding,
)
from derivd.handlers.geometry import base_size, jpeg_eighths
from derivd.handlers.jpegcheck import check_jpeg
from derivd.handlers.jpegscale import decode_scaled
from derivd.handlers.sniff import (
    TIFF_BITS_PER_SAMPLE,
    TIFF_PHOTOMETRIC,
    TIFF_SAMPLES_PER_PIXEL,
    accepted_format,
    gif_screen,
    input_format,
    tiff_tags,
)
from derivd.handlers.vips_variants import (
    checked_base,
    derive_variants,
    from_scaled,
    load_base,
    open_shrunk,
    read_in_place,
    source_loader,
)

# The loaders we accept, by nickname (what find_load_buffer reports), and the loader class
# families to leave unblocked. Everything else libvips could read (svg, matrix, csv, vips,
# raw, fits, ...) is refused twice: by the allowlist, and by blocking its operation class.
ALLOWED_LOADERS = frozenset(
    {
        "jpegload_buffer",
        "uhdrload_buffer",  # UltraHDR: a JPEG with a gain map; we keep its SDR base image
        "pngload_buffer",
        "gifload_buffer",
        "webpload_buffer",
        "tiffload_buffer",
        "heifload_buffer",  # HEIC and AVIF
    }
)
_ALLOWED_FAMILIES = (
    "VipsForeignLoadJpeg",
    "VipsForeignLoadUhdr",
    "VipsForeignLoadPng",
    "VipsForeignLoadNsgif",
    "VipsForeignLoadWebp",
    "VipsForeignLoadTiff",
    "VipsForeignLoadHeif",
)

# EXIF orientations that turn the stored image sideways.
_SIDEWAYS = frozenset({5, 6, 7, 8})

_CACHE_MAX_MEM = 0  # a worker handles one image at a time: nothing worth caching


_M_ARENA_MAX = -8  # glibc mallopt parameter


def limit_malloc_arenas(arenas: int = 1) -> None:
    """Cap glibc's per-thread malloc arenas before libvips starts its threads.

    Each libvips worker thread otherwise gets an arena of its own, and freed image
    buffers stay mapped there: measured on a 24 MP JPEG, peak RSS 96 MiB with default
    arenas, 72 MiB with one. A no-op where the C library is not glibc.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, arenas)


def log_problems_only() -> None:
    """Hand libvips' INFO and DEBUG lines to GLib's default handler, not to Python.

    pyvips routes every level of libvips' log into Python logging, and libvips logs ~10
    INFO lines a derive ("threadpool completed with 1 workers", "reducev: 9 point mask"):
    each one a call from C into Python that takes the GIL, often from a libvips thread,
    to build a line the `pyvips` logger then drops (`derivd.logs`). GLib's handler
    drops them in C unless G_MESSAGES_DEBUG asks for them; MESSAGE and above still reach
    Python as before. Uses pyvips' own callback and handler id (its exit hook removes that
    id), and leaves everything as it was where a pyvips lacks them.
    """
    callback = getattr(pyvips, "_log_handler_cb", None)
    handler_id = getattr(pyvips, "_log_handler_id", None)
    if callback is None or not handler_id:
        return
    levels = pyvips.GLogLevelFlags
    problems = (levels.LEVEL_MESSAGE | levels.LEVEL_WARNING | levels.LEVEL_CRITICAL
                | levels.LEVEL_ERROR | levels.FLAG_FATAL | levels.FLAG_RECURSION)  # fmt: skip
    glib = pyvips.glib_lib
    glib.g_log_remove_handler(b"VIPS", handler_id)
    pyvips._log_handler_id = glib.g_log_set_handler(b"VIPS", problems, callback, pyvips.ffi.NULL)


def configure(concurrency: int) -> None:
    """Tune libvips for a long-lived worker that derives one image at a time."""
    limit_malloc_arenas()
    log_problems_only()
    # The operation cache would keep decoded originals alive between unrelated jobs.
    pyvips.cache_set_max(0)
    pyvips.cache_set_max_mem(_CACHE_MAX_MEM)
    pyvips.cache_set_max_files(0)
    pyvips.concurrency_set(max(1, concurrency))
    # Defence in depth behind the allowlist: no loader outside it can even run.
    pyvips.block_untrusted_set(True)
    pyvips.operation_block_set("VipsForeignLoad", True)
    for family in _ALLOWED_FAMILIES:
        pyvips.operation_block_set(family, False)


def sniff_loader(original: bytes) -> str:
    """The nickname of the libvips loader for these bytes, or UnsupportedContent.

    `vips_foreign_find_load_buffer` only runs each loader's magic-number test; nothing is
    parsed beyond the first bytes.
    """
    if not original:
        raise UnsupportedContent("empty input")
    found = pyvips.vips_lib.vips_foreign_find_load_buffer(original, len(original))
    if found == pyvips.ffi.NULL:
        pyvips.vips_lib.vips_error_clear()
        if accepted_format(original):
            raise CorruptContent("accepted format by its magic, but unreadable")
        raise UnsupportedContent("not a recognised image format")
    class_name = pyvips.ffi.string(found).decode()
    nickname: str = pyvips.nickname_find(pyvips.type_from_name(class_name))
    if nickname not in ALLOWED_LOADERS:
        raise UnsupportedContent(f"format not accepted ({nickname})")
    return nickname


class Header:
    """What the limits need, read without decoding pixels; and the relabelled bytes of an
    8-bit CIELAB TIFF (`cielab8_as_rgb`), which the decode reads too."""

    def __init__(self, image: Any, original: bytes, loader: str, relabelled: bytes | None
                 ) -> None:  # fmt: skip
        self.width: int = image.width
        self.height: int = image.height
        # libnsgif may report the first frame's size for an absurd logical screen; count
        # the screen, as Pillow (which allocates it) does, so both backends agree.
        screen = gif_screen(original)
        if screen is not None:
            self.width, self.height = max(self.width, screen[0]), max(self.height, screen[1])
        self.frames: int = _int_field(image, "n-pages", 1)
        # Only an embedded profile or CMYK needs a LittleCMS transform; doing it for every
        # image doubles the time of a plain sRGB JPEG (bench/derive.py).
        self.icc: bytes | None = (
            image.get("icc-profile-data") if image.get_typeof("icc-profile-data") else None
        )
        self.needs_icc = self.icc is not None or image.interpretation == "cmyk"
        self.loader = loader  # the sniffed nickname (jpegload_buffer, ...), not the source one
        self.relabelled = relabelled
        orientation = _int_field(image, "orientation", 1)
        self.orientation = orientation if 1 <= orientation <= 8 else 1

    @property
    def upright(self) -> tuple[int, int]:
        """(width, height) once EXIF orientation is applied."""
        if self.orientation in _SIDEWAYS:
            return self.height, self.width
        return self.width, self.height


def _int_field(image: Any, name: str, default: int) -> int:
    if image.get_typeof(name) == 0:
        return default
    value = image.get(name)
    return value if isinstance(value, int) else default


def read_header(original: bytes, loader: str) -> Header:
    try:
        # Loaders are lazy: this parses the header and allocates no pixel memory.
        relabelled = cielab8_as_rgb(original)
        image = read_in_place(source_loader(loader), relabelled or original,
                              access="sequential", fail_on="error")  # fmt: skip
    except pyvips.Error as e:
        raise CorruptContent(f"unreadable header: {_first_line(e)}") from None
    return Header(image, original, loader, relabelled)


def decode_base(original: bytes, size: tuple[int, int], header: Header, all_frames: bool,
                shrink_on_load: str = "fast") -> tuple[Any, int]:  # fmt: skip
    """The decoded base every variant is derived from, and its page height (see
    `vips_variants.load_base`); 8-bit CIELAB TIFF takes its own path (`cielab8_as_rgb`)."""
    relabelled = header.relabelled
    if relabelled is None:
        scaled = None if all_frames else turbo_scaled(original, header, size, shrink_on_load)
        if scaled is None:
            check_jpeg(original)  # libvips publishes what libjpeg only warns about
        if scaled is not None and header.icc is None:
            return checked_base(scaled, size)  # resized and upright: the base (`from_scaled`)
        if scaled is None and not all_frames:
            scaled = open_shrunk(original, header.loader, header.upright, size, shrink_on_load)
        return load_base(original, size, header.needs_icc, all_frames, scaled)
    image = lab_to_srgb(read_in_place("tiffload_source", relabelled, access="sequential",
                                      fail_on="error"))  # fmt: skip
    return checked_base(image.thumbnail_image(size[0], height=size[1], size="force"), size)


def turbo_scaled(original: bytes, header: Header, size: tuple[int, int], mode: str
                 ) -> Any | None:  # fmt: skip
    """A still JPEG decoded by libjpeg-turbo at M/8 (`jpegscale`) and resized to `size`
    (`from_scaled`): upright already when it has no ICC profile, else carrying the
    header's orientation and profile for `thumbnail_image` to apply, as it does for
    jpegload's image. None for anything else, and for a JPEG that decoder does not take:
    `open_shrunk` opens those through libvips' own loaders (JPEG, WebP); `off` is
    libvips' full decode, the reference."""
    if header.loader != "jpegload_buffer" or mode == "off":
        return None
    eighths = jpeg_eighths(header.upright, size, mode)
    scaled = decode_scaled(original, (header.width, header.height), eighths)
    if scaled is None:
        return None
    stored_way = (size[1], size[0]) if header.orientation in _SIDEWAYS else size
    return from_scaled(scaled, stored_way, header.orientation, header.icc)


_CIELAB, _RGB = 8, 2  # TIFF PhotometricInterpretation values


def cielab8_as_rgb(original: bytes) -> bytes | None:
    """An 8-bit, 3-sample CIELAB TIFF relabelled as RGB; None for anything else.

    libvips 8.18 refuses these ("bad labq format": its TIFF loader packs them into LabQ
    and then rejects its own packing). Read as RGB the same samples load, and
    `lab_to_srgb` gives them their meaning back. Only the first IFD, the page we derive.
    """
    tags = tiff_tags(original)
    photometric = tags.get(TIFF_PHOTOMETRIC)
    if photometric is None or photometric[0] != _CIELAB:
        return None
    if tags.get(TIFF_BITS_PER_SAMPLE, (1, 0))[0] != 8:
        return None
    if tags.get(TIFF_SAMPLES_PER_PIXEL, (1, 0))[0] != 3:
        return None
    where = photometric[1]
    order = "<" if original[:2] == b"II" else ">"
    return original[:where] + struct.pack(order + "H", _RGB) + original[where + 2 :]


def lab_to_srgb(image: Any) -> Any:
    """8-bit TIFF CIELAB samples (L* 0-255 for 0-100, a* and b* signed bytes) to sRGB.

    TIFF CIELAB is relative to D50 (Adobe's TIFF notes; libtiff's default white point), as
    an ICC PCS is; `icc_export` takes it as that PCS. `colourspace` would assume libvips'
    own D65 Lab and shift every colour by ~3 levels (measured on tests/imagegen's scene).
    """
    lightness = image[0] * (100 / 255)
    # Flipping the top bit turns a two's complement byte into an offset-128 one.
    a, b = ((image[band] ^ 128).cast("short") - 128 for band in (1, 2))
    lab = lightness.bandjoin([a, b]).copy(interpretation="lab")
    return lab.icc_export(output_profile="srgb", intent="relative")


# The libvips saver each output format needs.
_SAVERS = {"webp": "webpsave_buffer", "avif": "heifsave_buffer", "jpeg": "jpegsave_buffer",
           "png": "pngsave_buffer"}  # fmt: skip


def check_encoders(spec: DeriveSpec) -> None:
    """MissingEncoder, one line, when a configured variant needs a saver this libvips
    lacks, or (an animated AVIF, written by Pillow) an encoder Pillow lacks."""
    formats = {fmt for v in spec.variants for fmt in v.formats}
    missing = sorted(f for f in formats if not pyvips.type_find("VipsOperation", _SAVERS[f]))
    if any(v.animated and "avif" in v.formats for v in spec.variants):
        from derivd.handlers.pillow import missing_encoders as pillow_missing  # Pillow: only here

        missing += [f"{f} (animated, via Pillow)" for f in pillow_missing({"avif"})]
    if missing:
        raise MissingEncoder(f"backend vips: libvips {pyvips.version(0)}.{pyvips.version(1)} "
                             f"cannot write {', '.join(missing)}")  # fmt: skip


class Decoded:
    """The original decoded once: the base in memory, its page height, the original's
    upright size and its frame count."""

    def __init__(self, base: Any, page_height: int, upright: tuple[int, int], frames: int
                 ) -> None:  # fmt: skip
        # Rendered now, so a truncated or corrupt original fails here, in the decode, and
        # never inside an encoder (where it would be a processing fault). The base is at
        # most the size the largest variant needs.
        self.base = base.copy_memory()
        self.page_height = page_height
        self.upright = upright
        self.frames = frames


def decode_original(original: bytes, spec: DeriveSpec) -> Decoded:
    """Everything that parses the user's bytes, to the decoded base."""
    if heif.is_heif(original):
        return decode_heif(original, spec)
    if input_format(original) == "avif":
        heif.check_avif(original, spec)  # the box-level limits HEIC gets (heifload: none)
    loader = sniff_loader(original)
    header = read_header(original, loader)
    check_declared_size(header.width, header.height, header.frames, spec)
    upright = header.upright
    all_frames = header.frames > 1 and any(v.animated for v in spec.variants)
    try:
        base, page_height = decode_base(original, base_size(*upright, spec.variants), header,
                                        all_frames, spec.shrink_on_load)  # fmt: skip
        return Decoded(base, page_height, upright, header.frames)
    except pyvips.Error as e:
        # Truncated or corrupt pixel data (fail_on="error"): never publish a
        # half-decoded image. The message is for the log only.
        raise _decode_failure(e) from None


def decode_heif(original: bytes, spec: DeriveSpec) -> Decoded:
    """HEIC/HEIF: pi-heif decodes (handlers/heif.py: this libvips has no HEVC decoder),
    libvips takes the pixels from memory and shrinks and colour-manages them as
    `thumbnail_source` does for the other formats."""
    header = heif.read_header(original, spec)
    pixels = heif.decode(header)
    upright = (header.width, header.height)
    size = base_size(*upright, spec.variants)
    image = pyvips.Image.new_from_memory(pixels.data, pixels.width, pixels.height,
                                         pixels.bands, "uchar")  # fmt: skip
    image = image.copy(interpretation="srgb" if pixels.bands >= 3 else "b-w")
    icc = pixels.icc
    if icc:
        image.set_type(pyvips.GValue.blob_type, "icc-profile-data", icc)
    thumb = image.thumbnail_image(
        size[0], height=size[1], size="force", no_rotate=True,
        **({"output_profile": "srgb", "intent": "relative"} if icc else {}),
    )  # fmt: skip
    base, page_height = checked_base(thumb, size)
    return Decoded(base, page_height, upright, header.frames)


def decode_preview(preview: previews.Preview, spec: DeriveSpec) -> Decoded:
    """A PDF's page or a video's frame (`previews`): 8-bit sRGB pixels in memory, brought
    to the base as `decode_heif` brings libheif's."""
    image = pyvips.Image.new_from_memory(preview.pixels, *preview.size, 3, "uchar")
    size = base_size(*preview.upright, spec.variants)
    thumb = image.copy(interpretation="srgb").thumbnail_image(
        size[0], height=size[1], size="force", no_rotate=True)  # fmt: skip
    base, page_height = checked_base(thumb, size)
    return Decoded(base, page_height, preview.upright, preview.frames)


def _first_frame(decoded: Decoded) -> Any:
    """The base's first page (the base itself unless frames are stacked)."""
    base, page_height = decoded.base, decoded.page_height
    return base if page_height == base.height else base.crop(0, 0, base.width, page_height)


def small_copy(decoded: Decoded) -> Small:
    """The analysis' intermediate: the first frame, RGBA, at most SMALL_EDGE px."""
    small = _box_shrunk(_first_frame(decoded))
    if small.format != "uchar":
        small = small.cast("uchar")
    return Small(small.width, small.height, rgba_of(bytes(small.write_to_memory()), small.bands))


def _box_shrunk(image: Any) -> Any:
    """`image` (8-bit sRGB, already the base) box-shrunk by `whole_blocks`: each pixel
    the mean of a block. A fractional factor would add a lanczos3 reduce to the exact size
    (the base of sharp's task, 720 x 588: 1.10 -> 0.60 CPU ms with the crop). Alpha is
    premultiplied around it, as thumbnail_image does."""
    blocks = whole_blocks(image.width, image.height)
    if (blocks.across, blocks.down) == (1, 1):
        return image
    alpha = image.hasalpha()
    whole = image.crop(0, 0, blocks.width, blocks.height)  # libvips would round its size
    source = whole.premultiply() if alpha else whole
    small = source.shrink(blocks.across, blocks.down)
    return small.unpremultiply() if alpha else small


def analysis_of(decoded: Decoded, fmt: str) -> Analysis:
    return analyse(
        small_copy(decoded), width=decoded.upright[0], height=decoded.upright[1], fmt=fmt,
        frames=decoded.frames, has_alpha=_transparent(decoded),
    )  # fmt: skip


def _transparent(decoded: Decoded) -> bool:
    """Whether any pixel of the first frame is less than opaque (libvips gives every GIF
    an alpha band: its presence alone says nothing)."""
    if not decoded.base.hasalpha():
        return False
    first = _first_frame(decoded)
    return bool(first[first.bands - 1].min() < 255)


class VipsHandler:
    name = "vips"

    def __init__(self, spec: DeriveSpec) -> None:
        self.spec = spec
        check_encoders(spec)
        configure(spec.concurrency)

    def derive(self, original: bytes, spec: DeriveSpec) -> Derivation:
        check_input_size(original, spec)
        with decoding():
            preview = previews.preview_of(original, spec)
            decoded = decode_original(original, spec) if preview is None else (
                decode_preview(preview, spec))  # fmt: skip
        fmt = input_format(original) or "unknown"
        with encoding():
            variants = derive_variants(decoded.base, decoded.page_height, decoded.upright, spec)
            return Derivation(variants, previews.analysed(analysis_of(decoded, fmt), preview))


# libtiff's words for a codec this build lacks (LZMA in the bundled libtiff, JPEG 2000 in
# TIFF): the file may well be valid, we cannot read it.
_MISSING_CODEC = ("compression support is not configured", "decoding is not implemented")


def _decode_failure(error: pyvips.Error) -> Permanent:
    detail = getattr(error, "detail", "") or str(error)
    if any(words in detail for words in _MISSING_CODEC):
        return UnsupportedContent(f"codec not in this libvips: {_first_line(error)}")
    return CorruptContent(f"decode failed: {_first_line(error)}")


def _first_line(error: pyvips.Error) -> str:
    detail = (getattr(error, "detail", "") or str(error)).strip()
    return detail.splitlines()[0][:200] if detail else "libvips error"
