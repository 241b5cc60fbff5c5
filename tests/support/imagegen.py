"""Test inputs generated in memory: every mode and format the handlers accept, and hostile ones.

Everything is built from code (Pillow, plus pyvips for the few things Pillow cannot write),
so no binary fixtures live in the repository and any test (handler level, the whole
pipeline, the chaos suite) can reuse the same table:

    for name, make, expected in CASES:
        data = make()        # bytes
        # expected is "ready" or an error code from derivd.errors

`DISPLAY_SIZE[name]` is the upright (EXIF-applied) size of every "ready" case, from which the
variant sizes follow through `derivd.handlers.base.target_size`.

The content is smooth (gradients, flat shapes) and asymmetric: smooth so that two resamplers
agree closely, asymmetric so that a missing or wrong EXIF rotation is visible.
"""

from __future__ import annotations

import io
import lzma
import os
import random
import struct
import zlib
from collections.abc import Callable
from functools import cache

import pdfgen
from PIL import Image, ImageCms, ImageDraw

Factory = Callable[[], bytes]

# Odd sizes on purpose: rounding of the long-edge fit differs between resamplers if anyone
# lets the library pick the size, and these sizes make that visible.
W, H = 637, 401


# --- content -------------------------------------------------------------------------------


def scene(width: int = W, height: int = H) -> Image.Image:
    """An RGB image: red falls left to right, green grows top to bottom, plus flat shapes."""
    red = Image.linear_gradient("L").rotate(-90).resize((width, height))
    green = Image.linear_gradient("L").resize((width, height))  # 0 at top
    blue = Image.radial_gradient("L").resize((width, height))
    im = Image.merge("RGB", (red, green, blue))
    draw = ImageDraw.Draw(im)
    # A dark block in the top-left quadrant only: any flip or rotation moves it.
    draw.rectangle((width // 10, height // 10, width // 3, height // 3), fill=(20, 20, 140))
    draw.ellipse((width // 2, height // 2, width * 9 // 10, height * 9 // 10), fill=(240, 200, 40))
    return im


def _save(im: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def with_alpha(im: Image.Image) -> Image.Image:
    """RGBA with a horizontal alpha ramp and a fully transparent corner."""
    alpha = Image.linear_gradient("L").rotate(-90).resize(im.size)
    ImageDraw.Draw(alpha).rectangle((0, 0, im.width // 5, im.height // 5), fill=0)
    out = im.convert("RGBA")
    out.putalpha(alpha)
    return out


# --- JPEG ----------------------------------------------------------------------------------


def jpeg(width: int = W, height: int = H, quality: int = 90, progressive: bool = False) -> bytes:
    return _save(scene(width, height), "JPEG", quality=quality, progressive=progressive)


def jpeg_progressive() -> bytes:
    return jpeg(progressive=True)


def jpeg_grey() -> bytes:
    return _save(scene().convert("L"), "JPEG", quality=90)


def jpeg_cmyk() -> bytes:
    """CMYK JPEG without an embedded profile (Pillow's naive RGB -> CMYK)."""
    return _save(scene().convert("CMYK"), "JPEG", quality=90)


@cache
def _cmyk_profile() -> bytes:
    """A real CMYK profile ("Chemical proof", public domain) taken from libvips' built-ins."""
    import pyvips

    image = pyvips.Image.black(2, 2, bands=3).copy(interpretation="srgb").icc_transform("cmyk")
    data: bytes = image.get("icc-profile-data")
    return data


def jpeg_cmyk_icc() -> bytes:
    """CMYK JPEG with an embedded CMYK ICC profile, colour-managed from the sRGB scene."""
    srgb = ImageCms.createProfile("sRGB")
    cmyk = ImageCms.ImageCmsProfile(io.BytesIO(_cmyk_profile()))
    im = ImageCms.profileToProfile(scene(), srgb, cmyk, outputMode="CMYK")
    assert im is not None
    return _save(im, "JPEG", quality=90, icc_profile=_cmyk_profile())


# Pillow's Image.Transpose that *undoes* EXIF orientation n, i.e. what exif_transpose applies.
_APPLY = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# ...and its inverse, to store pixels so that applying orientation n gives back the scene.
_INVERSE = {**_APPLY, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def jpeg_orientation(n: int) -> bytes:
    """A JPEG whose upright rendering (EXIF orientation `n` applied) is `scene()`."""
    stored = scene() if n == 1 else scene().transpose(_INVERSE[n])
    exif = Image.Exif()
    exif[0x0112] = n
    return _save(stored, "JPEG", quality=92, exif=exif.tobytes())


def jpeg_bad_exif() -> bytes:
    """APP1 'Exif' whose TIFF header points past the end: metadata junk, pixels fine."""
    junk = b"Exif\x00\x00II*\x00\xff\xff\xff\x7f" + b"\xa5" * 40
    return _save(scene(), "JPEG", quality=90, exif=junk)


def jpeg_orientation_out_of_range() -> bytes:
    """Orientation 9 does not exist: both backends must treat it as 1 (upright)."""
    exif = Image.Exif()
    exif[0x0112] = 9
    return _save(scene(), "JPEG", quality=90, exif=exif.tobytes())


# --- PNG -----------------------------------------------------------------------------------


def png_rgb() -> bytes:
    return _save(scene(), "PNG")


def png_rgba() -> bytes:
    return _save(with_alpha(scene()), "PNG")


def png_palette_transparent() -> bytes:
    """Mode P with a tRNS entry: index 0 fully transparent."""
    im = scene().quantize(64)
    ImageDraw.Draw(im).rectangle((0, 0, W // 4, H // 4), fill=0)
    return _save(im, "PNG", transparency=0)


def png_grey() -> bytes:
    return _save(scene().convert("L"), "PNG")


def png_grey_alpha() -> bytes:
    return _save(with_alpha(scene()).convert("LA"), "PNG")


def png_grey16() -> bytes:
    """16-bit greyscale (Pillow mode I;16)."""
    grey = scene().convert("L")
    im = grey.point(lambda v: v * 257, "I").convert("I;16")
    return _save(im, "PNG")


def png_rgb16() -> bytes:
    """16-bit RGB: Pillow cannot write it, libvips can."""
    import pyvips

    base = pyvips.Image.new_from_buffer(png_rgb(), "")
    deep = (base.cast("ushort") * 257).cast("ushort").copy(interpretation="rgb16")
    data: bytes = deep.pngsave_buffer(compression=1)
    return data


@cache
def p3_profile() -> bytes:
    """Display P3 (CC0, libvips' built-in): wide gamut, so the sRGB conversion shows."""
    import pyvips

    image = pyvips.Image.black(2, 2, bands=3).copy(interpretation="srgb").icc_transform("p3")
    data: bytes = image.get("icc-profile-data")
    return data


def png_p3() -> bytes:
    """The scene's pixel values tagged as Display P3: correct output is NOT the same values."""
    return _save(scene(), "PNG", icc_profile=p3_profile())


def png_rgba_p3() -> bytes:
    return _save(with_alpha(scene()), "PNG", icc_profile=p3_profile())


# --- GIF, WebP, TIFF, AVIF -----------------------------------------------------------------


def gif_still() -> bytes:
    return _save(scene().quantize(128), "GIF")


FIRST_FRAME_RGB = (200, 30, 30)


def _frames(count: int, size: tuple[int, int]) -> list[Image.Image]:
    """Frame 0 is red; the others are distinct blues (identical frames would be merged)."""
    first = Image.new("RGB", size, FIRST_FRAME_RGB)
    rest = [Image.new("RGB", size, (0, (i * 7) % 256, 200)) for i in range(1, count)]
    return [first, *rest]


def gif_animated() -> bytes:
    frames = _frames(5, (240, 180))
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=80, loop=0)


def webp_lossy() -> bytes:
    return _save(scene(), "WEBP", quality=90)


def webp_alpha() -> bytes:
    return _save(with_alpha(scene()), "WEBP", quality=90)


def webp_animated() -> bytes:
    frames = _frames(4, (240, 180))
    return _save(
        frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=80, quality=90
    )


def tiff_rgb() -> bytes:
    return _save(scene(), "TIFF", compression="tiff_deflate")


def tiff_cmyk() -> bytes:
    return _save(scene().convert("CMYK"), "TIFF", compression="tiff_lzw")


def avif() -> bytes:
    return _save(scene(), "AVIF", quality=90)


# --- hostile: limits -----------------------------------------------------------------------


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(width: int, height: int, depth: int, colour: int, idat: bytes) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def png_pixel_flood() -> bytes:
    """IHDR declares 100000 x 100000 RGB; the IDAT holds one row. A few hundred bytes."""
    return _png(100_000, 100_000, 8, 2, zlib.compress(b"\x00" * 301))


def png_bomb() -> bytes:
    """A *valid* 1-bit 12000 x 12000 PNG (144 MP once decoded) that compresses to ~20 kB."""
    row = b"\x00" + b"\x00" * (12_000 // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(12_000)) + comp.flush()
    return _png(12_000, 12_000, 1, 0, idat)


def _patch_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    at = data.index(b"\xff\xc0")  # baseline SOF0: length(2) precision(1) height(2) width(2)
    return data[: at + 5] + struct.pack(">HH", height, width) + data[at + 9 :]


def jpeg_pixel_flood() -> bytes:
    """A 16 x 16 JPEG whose SOF0 claims 65000 x 65000."""
    return _patch_jpeg_size(jpeg(16, 16), 65_000, 65_000)


def _patch_gif_screen(data: bytes, width: int, height: int) -> bytes:
    return data[:6] + struct.pack("<HH", width, height) + data[10:]


def gif_pixel_flood() -> bytes:
    """A 16 x 16 GIF inside a 65535 x 65535 logical screen."""
    return _patch_gif_screen(gif_still_small(), 65_535, 65_535)


def gif_still_small() -> bytes:
    return _save(Image.new("P", (16, 16), 1), "GIF")


def gif_many_frames(count: int = 150) -> bytes:
    """More frames than the default max_frames (100); each frame is 4 x 4."""
    frames = _frames(count, (4, 4))
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=20)


def gif_frames_times_pixels() -> bytes:
    """30 frames (< max_frames) on a 2000 x 2000 screen: 4 MP each, 120 MP in total."""
    frames = _frames(30, (4, 4))
    small = _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=20)
    return _patch_gif_screen(small, 2000, 2000)


def tiff_huge() -> bytes:
    """A little-endian TIFF declaring 100000 x 100000 8-bit grey with an 8-byte strip."""
    tags = [  # (tag, type SHORT=3 / LONG=4, value)
        (256, 4, 100_000),  # ImageWidth
        (257, 4, 100_000),  # ImageLength
        (258, 3, 8),  # BitsPerSample
        (259, 3, 1),  # Compression: none
        (262, 3, 1),  # Photometric: BlackIsZero
        (273, 4, 0),  # StripOffsets (patched below)
        (277, 3, 1),  # SamplesPerPixel
        (278, 4, 100_000),  # RowsPerStrip
        (279, 4, 8),  # StripByteCounts
    ]
    ifd_at = 8
    strip_at = ifd_at + 2 + 12 * len(tags) + 4
    entries = b"".join(
        struct.pack("<HHII", tag, kind, 1, strip_at if tag == 273 else value)
        if kind == 4
        else struct.pack("<HHIHH", tag, kind, 1, value, 0)
        for tag, kind, value in tags
    )
    return (
        b"II*\x00"
        + struct.pack("<I", ifd_at)
        + struct.pack("<H", len(tags))
        + entries
        + (b"\x00\x00\x00\x00" + b"\x00" * 8)
    )


def raw_tiff(
    width: int,
    height: int,
    strip: bytes,
    *,
    compression: int = 1,
    offsets_type: int = 4,
) -> bytes:
    """A one-strip little-endian 8-bit RGB TIFF built by hand, for what Pillow will not write
    (a codec it cannot encode, a malformed directory). `offsets_type` is StripOffsets' TIFF
    field type: 4 (LONG) is right; 11 (FLOAT) or 16 (LONG8) are the malformed cases."""
    ifd_at, count = 8, 9
    strip_at = ifd_at + 2 + 12 * count + 4
    offset = struct.pack("<f", strip_at) if offsets_type == 11 else struct.pack("<I", strip_at)
    entries = [  # (tag, type, value as the entry's 4 bytes), in tag order
        (256, 3, struct.pack("<HH", width, 0)),  # ImageWidth
        (257, 3, struct.pack("<HH", height, 0)),  # ImageLength
        (258, 3, struct.pack("<HH", 8, 0)),  # BitsPerSample (one value for all three)
        (259, 3, struct.pack("<HH", compression, 0)),  # Compression
        (262, 3, struct.pack("<HH", 2, 0)),  # Photometric: RGB
        (273, offsets_type, offset),  # StripOffsets
        (277, 3, struct.pack("<HH", 3, 0)),  # SamplesPerPixel
        (278, 3, struct.pack("<HH", height, 0)),  # RowsPerStrip
        (279, 4, struct.pack("<I", len(strip))),  # StripByteCounts
    ]
    ifd = b"".join(struct.pack("<HHI", tag, kind, 1) + value for tag, kind, value in entries)
    return b"II*\x00" + struct.pack("<IH", ifd_at, count) + ifd + b"\x00" * 4 + strip


def tiff_lzma() -> bytes:
    """Compression 34925 (LZMA2 in an .xz stream, as libtiff writes it): valid, and Pillow
    decodes it, but the libtiff bundled with libvips has no LZMA codec."""
    strip = lzma.compress(scene(64, 48).tobytes(), format=lzma.FORMAT_XZ, check=lzma.CHECK_NONE)
    return raw_tiff(64, 48, strip, compression=34925)


def tiff_jpeg2000() -> bytes:
    """Compression 34712 (JPEG 2000 in TIFF): neither backend has that codec."""
    return raw_tiff(64, 48, b"\x00" * 64, compression=34712)


def tiff_offsets_float() -> bytes:
    """StripOffsets typed FLOAT: Pillow's loader raises TypeError when it seeks there."""
    return raw_tiff(64, 48, scene(64, 48).tobytes(), offsets_type=11)


def tiff_offsets_long8() -> bytes:
    """StripOffsets typed LONG8 in a classic TIFF: Pillow raises OverflowError on seek."""
    return raw_tiff(64, 48, scene(64, 48).tobytes(), offsets_type=16)


def tiff_cielab() -> bytes:
    """8-bit CIELAB (Photometric 8, D50 as in Photoshop's), no ICC profile: libvips' loader
    refuses it ("bad labq format") unless the handler reads it another way."""
    to_lab = ImageCms.buildTransform(
        ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB"), "RGB", "LAB"
    )
    lab = ImageCms.applyTransform(scene(), to_lab)
    assert lab is not None
    lab.info.pop("icc_profile", None)
    return _save(lab, "TIFF", compression="tiff_lzw")


def _gif(width: int, height: int, blocks: list[bytes]) -> bytes:
    """GIF89a with a 2-colour global palette (black, white) and the given frame blocks."""
    screen = struct.pack("<HHBBB", width, height, 0x80, 0, 0)
    return b"GIF89a" + screen + b"\x00\x00\x00\xff\xff\xff" + b"".join(blocks) + b";"


def _gif_subblocks(data: bytes) -> bytes:
    chunks = [data[i : i + 255] for i in range(0, len(data), 255)]
    return b"".join(bytes([len(c)]) + c for c in chunks) + b"\x00"


def _gif_frame(width: int, height: int, lzw: bytes) -> bytes:
    descriptor = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    return descriptor + b"\x02" + _gif_subblocks(lzw)  # LZW minimum code size 2


def _lzw_white(pixels: int) -> bytes:
    """GIF LZW data (minimum code size 2) for `pixels` pixels of colour 1.

    On a uniform run the n-th code after a clear covers n pixels (code 1, then 6, 7, ...),
    so 144 MP take about 100 kB: the shape of a decompression bomb. Codes widen exactly
    when the decoder's table does; a clear restarts the table before it is full.
    """
    out = bytearray()
    acc = nbits = 0

    def emit(code: int, size: int) -> None:
        nonlocal acc, nbits
        acc |= code << nbits
        nbits += size
        while nbits >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nbits -= 8

    clear, end, left, size = 4, 5, pixels, 3
    while left > 0:
        emit(clear, 3)
        size, next_code, run = 3, 6, 1
        while left > 0 and next_code < 4095:
            n = min(run, left)
            emit(1 if n == 1 else 6 + n - 2, size)
            left -= n
            if run > 1:  # the decoder adds an entry for every code but the first
                next_code += 1
                if next_code == 1 << size and size < 12:
                    size += 1
            run = n + 1
    emit(end, size)
    if nbits:
        out.append(acc & 0xFF)
    return bytes(out)


def gif_bomb() -> bytes:
    """A *valid* 12000 x 12000 single-frame GIF (144 MP decoded) in about 100 kB."""
    return _gif(12_000, 12_000, [_gif_frame(12_000, 12_000, _lzw_white(12_000 * 12_000))])


def gif_10000_frames() -> bytes:
    """10,000 valid 1 x 1 frames (about 230 kB): a frame-count flood."""
    control = b"\x21\xf9\x04\x00\x02\x00\x00\x00"  # graphic control: 20 ms
    frame = control + _gif_frame(1, 1, b"\x44\x01")  # clear, 0, end in 3-bit codes
    return _gif(1, 1, [frame] * 10_000)


def jpeg_exif_ifd_loop() -> bytes:
    """EXIF whose IFD0 links to itself, with an entry whose count and offset point far
    past the end: metadata junk only, so the pixels must still be derived (upright)."""
    entries = struct.pack("<HHII", 0x010F, 2, 0x7FFFFFF0, 0xFFFFFF00)  # Make: huge count
    entries += struct.pack("<HHII", 0x8769, 4, 1, 8)  # Exif sub-IFD: points back to IFD0
    ifd = struct.pack("<H", 2) + entries + struct.pack("<I", 8)  # next IFD: itself
    exif = b"Exif\x00\x00II*\x00" + struct.pack("<I", 8) + ifd
    return _save(scene(), "JPEG", quality=90, exif=exif)


# --- hostile: not an image we accept -------------------------------------------------------


def empty() -> bytes:
    return b""


def random_bytes() -> bytes:
    return os.urandom(4096)


def svg() -> bytes:
    return (
        b'<?xml version="1.0" encoding="UTF-8"?>\n'
        b'<svg xmlns="http://www.w3.org/2000/svg" width="640" height="400">'
        b'<rect width="640" height="400" fill="red"/></svg>\n'
    )


def pdf() -> bytes:
    """A PDF derivd previews nothing of: it needs a password (tests/unit/test_previews.py has
    the PDFs that end ready)."""
    return pdfgen.encrypted(b"secret")


def html_named_jpg() -> bytes:
    """What a misconfigured upload form stores as `photo.jpg`."""
    return b"<!DOCTYPE html>\n<html><head><title>404</title></head><body>Not found</body></html>\n"


def eps() -> bytes:
    """Pillow would hand this to Ghostscript if its EPS plugin were allowed to open it."""
    return b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n"


def bmp() -> bytes:
    return _save(scene(64, 48), "BMP")


def ppm() -> bytes:
    return _save(scene(64, 48), "PPM")


def ico() -> bytes:
    return _save(scene(64, 48), "ICO")


def matrix_text() -> bytes:
    """libvips' matrix format: plain text that its matrix/csv loaders would accept."""
    return b"2 2\n1 2\n3 4\n"


# --- hostile: damaged ----------------------------------------------------------------------


def truncated(make: Factory, keep: float) -> Factory:
    def cut() -> bytes:
        data = make()
        return data[: int(len(data) * keep)]

    cut.__name__ = f"truncated_{make.__name__}"
    return cut


def png_bad_crc() -> bytes:
    """A flipped byte inside IDAT: zlib or the CRC check must notice."""
    data = bytearray(png_rgb())
    at = data.index(b"IDAT") + 200
    data[at] ^= 0xFF
    return bytes(data)


def scan_start(data: bytes) -> int:
    """Where a JPEG's entropy-coded data starts: just past its first SOS segment."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + struct.unpack(">H", data[sos + 2 : sos + 4])[0]


def scan_flipped(data: bytes, count: int = 40) -> bytes:
    """`count` bytes in the middle of a JPEG's scan data flipped (each XOR 0x5a), as a
    bad sector or a broken transfer would: libjpeg only warns about that."""
    out = bytearray(data)
    middle = (scan_start(data) + len(data)) // 2
    for at in range(middle, middle + count):
        out[at] ^= 0x5A
    return bytes(out)


def scan_overwritten(data: bytes, upto: int | None = None) -> bytes:
    """A JPEG's scan data overwritten with (seeded) random bytes up to byte `upto` (by
    default its end marker), as a half-rewritten file: libjpeg warns, then errs past the
    scan, and libvips published the grey it decoded."""
    start, end = scan_start(data), min(len(data) - 2, upto or len(data))
    return data[:start] + random.Random(43).randbytes(end - start) + data[end:]


def jpeg_scan_flipped() -> bytes:
    return scan_flipped(jpeg())


def jpeg_scan_overwritten() -> bytes:
    return scan_overwritten(jpeg())


def jpeg_progressive_scan_flipped() -> bytes:
    return scan_flipped(jpeg_progressive())


def jpeg_cmyk_scan_flipped() -> bytes:
    """CMYK: the fast decode leaves it to each backend's own decoder."""
    return scan_flipped(jpeg_cmyk())


# --- the table -----------------------------------------------------------------------------

READY = "ready"

CASES: list[tuple[str, Factory, str]] = [
    ("jpeg_baseline", jpeg, READY),
    ("jpeg_progressive", jpeg_progressive, READY),
    ("jpeg_grey", jpeg_grey, READY),
    ("jpeg_cmyk", jpeg_cmyk, READY),
    ("jpeg_cmyk_icc", jpeg_cmyk_icc, READY),
    *[(f"jpeg_orientation_{n}", (lambda n=n: jpeg_orientation(n)), READY) for n in range(1, 9)],
    ("jpeg_bad_exif", jpeg_bad_exif, READY),
    ("jpeg_orientation_9", jpeg_orientation_out_of_range, READY),
    ("jpeg_exif_ifd_loop", jpeg_exif_ifd_loop, READY),
    ("png_rgb", png_rgb, READY),
    ("png_rgba", png_rgba, READY),
    ("png_palette_transparent", png_palette_transparent, READY),
    ("png_grey", png_grey, READY),
    ("png_grey_alpha", png_grey_alpha, READY),
    ("png_grey16", png_grey16, READY),
    ("png_rgb16", png_rgb16, READY),
    ("png_p3", png_p3, READY),
    ("png_rgba_p3", png_rgba_p3, READY),
    ("gif_still", gif_still, READY),
    ("gif_animated", gif_animated, READY),
    ("webp_lossy", webp_lossy, READY),
    ("webp_alpha", webp_alpha, READY),
    ("webp_animated", webp_animated, READY),
    ("tiff_rgb", tiff_rgb, READY),
    ("tiff_cmyk", tiff_cmyk, READY),
    ("tiff_cielab", tiff_cielab, READY),
    ("avif", avif, READY),
    # limits, checked from the header
    ("png_pixel_flood", png_pixel_flood, "resource_limit"),
    ("png_bomb", png_bomb, "resource_limit"),
    ("jpeg_pixel_flood", jpeg_pixel_flood, "resource_limit"),
    ("gif_pixel_flood", gif_pixel_flood, "resource_limit"),
    ("gif_many_frames", gif_many_frames, "resource_limit"),
    ("gif_frames_times_pixels", gif_frames_times_pixels, "resource_limit"),
    ("tiff_huge", tiff_huge, "resource_limit"),
    ("gif_bomb", gif_bomb, "resource_limit"),
    ("gif_10000_frames", gif_10000_frames, "resource_limit"),
    # not a format we accept
    ("empty", empty, "unsupported_content"),
    ("random_bytes", random_bytes, "unsupported_content"),
    ("svg", svg, "unsupported_content"),
    ("pdf", pdf, "unsupported_content"),
    ("html_named_jpg", html_named_jpg, "unsupported_content"),
    ("eps", eps, "unsupported_content"),
    ("bmp", bmp, "unsupported_content"),
    ("ppm", ppm, "unsupported_content"),
    ("ico", ico, "unsupported_content"),
    ("matrix_text", matrix_text, "unsupported_content"),
    ("tiff_jpeg2000", tiff_jpeg2000, "unsupported_content"),  # no codec on either backend
    # damaged
    ("jpeg_truncated", truncated(jpeg, 0.5), "corrupt_content"),
    ("jpeg_progressive_truncated", truncated(jpeg_progressive, 0.5), "corrupt_content"),
    # libjpeg's warnings, not errors: its decoder would fill in grey or garbage
    ("jpeg_scan_flipped", jpeg_scan_flipped, "corrupt_content"),
    ("jpeg_scan_overwritten", jpeg_scan_overwritten, "corrupt_content"),
    ("jpeg_progressive_scan_flipped", jpeg_progressive_scan_flipped, "corrupt_content"),
    ("jpeg_cmyk_scan_flipped", jpeg_cmyk_scan_flipped, "corrupt_content"),
    ("png_truncated", truncated(png_rgb, 0.5), "corrupt_content"),
    ("png_bad_crc", png_bad_crc, "corrupt_content"),
    ("webp_truncated", truncated(webp_lossy, 0.6), "corrupt_content"),
    ("gif_truncated", truncated(gif_still, 0.5), "corrupt_content"),
    ("tiff_truncated", truncated(tiff_rgb, 0.5), "corrupt_content"),
    # what escapes a decoder beyond its documented errors is still the content's fault
    ("tiff_offsets_float", tiff_offsets_float, "corrupt_content"),
    ("tiff_offsets_long8", tiff_offsets_long8, "corrupt_content"),
]

DISPLAY_SIZE: dict[str, tuple[int, int]] = {
    name: (240, 180) if "animated" in name else (W, H)
    for name, _, expected in CASES
    if expected == READY
}


def case(name: str) -> bytes:
    """The bytes of one case by name (handy in other test modules)."""
    for case_name, make, _ in CASES:
        if case_name == name:
            return make()
    raise KeyError(name)
