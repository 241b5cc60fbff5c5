"""`pillow`: the Pillow backend, same contract as `vips` (see handlers/base.py).

Per job: open with only the accepted plugins (so Pillow never hands EPS to Ghostscript or
guesses at TGA), check the limits from the header, decode once (the first frame, or every
frame when a variant is animated; a still JPEG by libjpeg-turbo at the M/8 scale of
`[derive] shrink_on_load` (`jpegscale`, `geometry.jpeg_eighths`), or, where that decoder
declines it, by Pillow shrunk on load by `draft` (`geometry.jpeg_shrink`), then resampled
with Lanczos; Pillow has no scaled WebP decode, so WebP is decoded whole), orient, convert to 8-bit
sRGB, then shape and encode each variant from that one decoded image (`pillow_variants`),
with metadata stripped.

Malformed EXIF is treated as orientation 1, as libvips does: the pixels are fine, only the
metadata is junk, and the derivative is stripped of it anyway.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import PIL
from PIL import (
    Image,
    ImageChops,
    ImageCms,
    ImageFile,
    TiffImagePlugin,
    UnidentifiedImageError,
    features,
)

from derivd.handlers import heif, previews
from derivd.handlers.analysis import Small, analyse, whole_blocks
from derivd.handlers.base import (
    Analysis,
    CorruptContent,
    Derivation,
    DeriveSpec,
    MissingEncoder,
    ResourceLimit,
    UnsupportedContent,
    check_declared_size,
    check_input_size,
    decoding,
    encoding,
)
from derivd.handlers.geometry import base_size, jpeg_eighths, jpeg_shrink
from derivd.handlers.jpegcheck import check_jpeg
from derivd.handlers.jpegscale import decode_scaled
from derivd.handlers.pillow_variants import REDUCING_GAP, Decoded, derive_variants
from derivd.handlers.sniff import (
    TIFF_COMPRESSION,
    accepted_format,
    input_format,
    png_chunks_intact,
    tiff_tags,
)

# Pillow plugin ids. MPO (a JPEG with a multi-picture index) comes in through the JPEG
# plugin, which returns an MpoImageFile: it is not an id of its own.
ALLOWED_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "TIFF", "AVIF")

_ORIENTATION_TAG = 0x0112
_SIDEWAYS = frozenset({5, 6, 7, 8})
# What turns a stored image upright, per EXIF orientation (as ImageOps.exif_transpose).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}

_SRGB = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))


# Pillow's feature name for each output format's encoder (PNG is built in).
_ENCODER_FEATURES = {"webp": "webp", "avif": "avif", "jpeg": "jpg"}


def missing_encoders(formats: set[str]) -> list[str]:
    """The formats among `formats` this Pillow cannot write."""
    return sorted(
        fmt for fmt in formats
        if fmt in _ENCODER_FEATURES and not features.check(_ENCODER_FEATURES[fmt])
    )  # fmt: skip


def check_encoders(spec: DeriveSpec) -> None:
    """MissingEncoder, one line, when the configured variants need what Pillow lacks."""
    missing = missing_encoders({fmt for v in spec.variants for fmt in v.formats})
    if missing:
        raise MissingEncoder(
            f"backend pillow: Pillow {PIL.__version__} cannot write {', '.join(missing)} "
            "(setup.cfg's Pillow floor has every encoder derivd uses)"
        )


def configure(spec: DeriveSpec) -> None:
    """Process-wide Pillow settings for a worker (it handles one image at a time)."""
    # Pillow's own bomb check, a backstop behind ours: it warns above this and raises at
    # twice it; we turn the warning into an error in `_strict_open`.
    Image.MAX_IMAGE_PIXELS = spec.max_pixels
    # Never hand out a half-decoded image: truncated data must raise.
    ImageFile.LOAD_TRUNCATED_IMAGES = False


@contextmanager
def _classify_errors() -> Iterator[None]:
    """Turn what Pillow raises into outcome exceptions; messages go to the log only."""
    with warnings.catch_warnings():
        # Pillow warns about junk metadata ("Corrupt EXIF data") on stderr; we either
        # tolerate it (orientation 1) or reject the file, so the warning is noise.
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            yield
        except UnidentifiedImageError:
            raise  # an OSError too, but it means "not ours": the caller classifies it
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ResourceLimit(f"decompression bomb: {e}") from None
        # Anything else escapes to `decoding` around `derive`: corrupt content.


def open_image(original: bytes) -> ImageFile.ImageFile:
    if not original:
        raise UnsupportedContent("empty input")
    try:
        with _classify_errors():
            im = Image.open(io.BytesIO(original), formats=ALLOWED_FORMATS)
    except CorruptContent:
        raise
    except UnidentifiedImageError:
        # Pillow says the same for a text file and for a TIFF whose IFD was cut off.
        compression = tiff_tags(original).get(TIFF_COMPRESSION, (1, 0))[0]
        if compression not in TiffImagePlugin.COMPRESSION_INFO:  # e.g. JPEG 2000 in TIFF
            raise UnsupportedContent(f"TIFF compression {compression} has no decoder") from None
        if accepted_format(original):
            raise CorruptContent("accepted format by its magic, but unreadable") from None
        raise UnsupportedContent("not a recognised image format") from None
    if not isinstance(im, ImageFile.ImageFile):  # pragma: no cover - Image.open contract
        raise UnsupportedContent("not a file image")
    return im


def count_frames(im: ImageFile.ImageFile, cap: int) -> int:
    """Frames in `im`, stopping at `cap + 1`.

    `n_frames` walks a whole GIF (millions of 1-pixel frames fit in max_input_bytes), so
    for GIF we step frame headers ourselves, without decoding, and stop past the cap.
    Other formats know their frame count from an index.
    """
    if im.format != "GIF":
        return int(getattr(im, "n_frames", 1))
    # What GifImageFile.n_frames itself calls: with update_image=False it reads a frame's
    # header and skips its data blocks.
    step = getattr(im, "_seek")  # noqa: B009 - private, hence no type
    count = 1
    try:
        while count <= cap:
            step(count, False)
            count += 1
    except EOFError:
        pass
    finally:
        im.seek(0)
    return count


def orientation(im: Image.Image) -> int:
    """EXIF orientation 1-8; junk or out-of-range EXIF counts as 1 (upright)."""
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # malformed EXIF: any parser error means "no usable orientation"
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def to_srgb(im: Image.Image) -> Image.Image:
    """8-bit RGB or RGBA in sRGB, from any accepted mode; alpha kept."""
    icc = im.info.get("icc_profile")
    im = _eight_bit(im)
    alpha = im.getchannel("A") if im.mode in ("RGBA", "LA") else None
    colour = im.convert(im.mode[:-1]) if alpha is not None else im
    if icc:
        colour = _colour_managed(colour, icc)
    if colour.mode != "RGB":  # L, CMYK without a profile (naive), YCbCr
        colour = colour.convert("RGB")
    if alpha is not None:
        colour.putalpha(alpha)
    return colour


def _eight_bit(im: Image.Image) -> Image.Image:
    """One of L, LA, RGB, RGBA, CMYK, YCbCr: palettes expanded, 16-bit scaled down, RGBX
    without its padding."""
    if im.mode in ("P", "PA"):
        has_alpha = im.mode == "PA" or "transparency" in im.info
        return im.convert("RGBA" if has_alpha else "RGB")
    if im.mode.startswith("I"):
        # Scale 16 bits to 8; convert("L") would clip everything above 255 to white.
        return im.convert("I").point(lambda v: v * (1 / 257)).convert("L")
    if im.mode == "RGBX":  # libjpeg-turbo's pixels as Pillow stores RGB (`_turbo_base`)
        return im.convert("RGB")
    if im.mode in ("1", "La", "RGBa"):
        return im.convert({"1": "L", "La": "LA", "RGBa": "RGBA"}[im.mode])
    return im


def _colour_managed(im: Image.Image, icc: bytes) -> Image.Image:
    """Convert through the embedded profile to sRGB.

    A broken profile, or one that does not fit the pixels (an RGB profile on a grey image),
    is ignored, as libvips ignores it: the pixels are still worth publishing.
    """
    try:
        source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        out = ImageCms.profileToProfile(
            im, source, _SRGB, renderingIntent=ImageCms.Intent.RELATIVE_COLORIMETRIC,
            outputMode="RGB",
        )  # fmt: skip
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
        return im
    return out if out is not None else im


def decode(im: ImageFile.ImageFile, original: bytes, spec: DeriveSpec) -> Decoded:
    """Upright 8-bit sRGB frames: the first only, unless an animated variant wants all.

    Variant sizes come from the original's size, not from the drafted one, so they match
    the libvips backend exactly.
    """
    stored = im.size
    turn = orientation(im)
    upright = (stored[1], stored[0]) if turn in _SIDEWAYS else stored
    base = base_size(*upright, spec.variants)
    stored_way = (base[1], base[0]) if turn in _SIDEWAYS else base
    jpeg = im.format in ("JPEG", "MPO")
    animated = any(v.animated for v in spec.variants)
    count = int(getattr(im, "n_frames", 1)) if animated else 1
    if jpeg and count == 1:
        scaled = _turbo_base(im, original, upright, base, stored_way, spec.shrink_on_load)
        if scaled is not None:
            frame = scaled.transpose(_TRANSPOSE[turn]) if turn in _TRANSPOSE else scaled
            return Decoded([frame], [100], 0, upright)
    if jpeg:
        check_jpeg(original)  # Pillow has no word for what libjpeg only warns about
        # The whole file in one read: libjpeg's arithmetic decoder cannot suspend, and
        # Pillow's 64 KiB reads made every arithmetic-coded JPEG past them "broken".
        im.decodermaxblock = max(im.decodermaxblock, len(original))
    shrink = jpeg_shrink(upright, base, spec.shrink_on_load) if jpeg else 1
    if shrink > 1:
        # DCT-domain downscale by `shrink` (the rule both backends share), which draft
        # picks for a requested size of the stored size over `shrink`.
        im.draft(im.mode, (stored[0] // shrink, stored[1] // shrink))
    frames, durations = [], []
    for index in range(count):
        if index:
            im.seek(index)
        im.load()
        # Resized as stored, turned upright once small: turning the decoded original
        # first would copy it whole (a 12 MP portrait photo: 9 MiB more at peak).
        frame = _to_base(im, stored_way, _whole_pixels(im, stored, shrink))
        if turn in _TRANSPOSE:
            frame = frame.transpose(_TRANSPOSE[turn])
        # to_srgb may hand back the file image itself, whose pixels the next seek replaces.
        frames.append(frame.copy() if frame is im and count > 1 else frame)
        durations.append(int(im.info.get("duration", 100) or 100))
    return Decoded(frames, durations, int(im.info.get("loop", 0) or 0), upright)


def _turbo_base(im: ImageFile.ImageFile, original: bytes, upright: tuple[int, int],
                base: tuple[int, int], stored_way: tuple[int, int], mode: str
                ) -> Image.Image | None:  # fmt: skip
    """A still JPEG decoded by libjpeg-turbo at M/8 (`jpegscale`, the scale
    `geometry.jpeg_eighths` gives) and brought to the base as stored (not yet upright) by
    `_to_base`: its ICC profile from the file's header; or None, for Pillow's own decoder
    (a JPEG the fast one does not take, and `off`, the reference)."""
    if mode == "off":
        return None
    scaled = decode_scaled(original, im.size, jpeg_eighths(upright, base, mode), "RGBX",
                           cmyk=True)  # fmt: skip
    if scaled is None:
        return None
    # Read in place (L, RGBX and CMYK are how Pillow stores grey, RGB and CMYK): no copy of
    # the pixels.
    pixels = Image.frombuffer(scaled.mode, (scaled.width, scaled.height), scaled.pixels, "raw",
                              scaled.mode, 0, 1)  # fmt: skip
    icc = im.info.get("icc_profile")
    if icc:
        pixels.info["icc_profile"] = icc
    # The exact part of the decoded pixels the stored image spans (`Scaled.extent`). CMYK
    # as the file stores it; Pillow's own decoder reads it inverted (Adobe's convention,
    # which JpegImagePlugin assumes for every CMYK JPEG), and so it is turned, after the
    # resize (`_to_base`), so the same file gives the same image.
    return _to_base(pixels, stored_way, (0, 0, *scaled.extent), inverted=scaled.mode == "CMYK")


def _whole_pixels(
    im: Image.Image, stored: tuple[int, int], shrink: int
) -> tuple[int, int, int, int] | None:
    """The box of whole pixels of a JPEG decoded at 1/shrink, or None when all are whole.

    When the stored size is not a multiple of `shrink`, the last row and column hold a
    partial pixel: Pillow rounds the scaled size up, libvips (and so sharp) down.
    Resampling it as a whole one shifts the result by a fraction of a pixel (SSIM 0.92
    against sharp's output on its fixture, 0.99 without it)."""
    whole = (stored[0] // shrink, stored[1] // shrink)
    return None if shrink == 1 or im.size == whole else (0, 0, *whole)


# Modes Pillow resamples with Lanczos as they are; palettes and 16-bit go to sRGB first.
_RESIZABLE = frozenset({"L", "LA", "RGB", "RGBA", "RGBX", "CMYK"})


def _to_base(image: Image.Image, base: tuple[int, int],
             box: tuple[float, float, float, float] | None = None, inverted: bool = False
             ) -> Image.Image:  # fmt: skip
    """Down to the base size once, as libvips' thumbnail does, and to 8-bit sRGB: every
    variant then resamples a base-sized image instead of the (drafted) original, and the
    colour transform runs on the base's pixels, not the original's (also as libvips).
    `box`: the part of `image` to resample (`_whole_pixels`), read in place, not copied.
    `inverted`: every value is to be turned (255 - v) before the colour transform; done
    after the resize, which commutes with it (but for the rounding of a half), on the
    base's pixels: a copy of the whole decode turned cost 30 ms on a 12 MP CMYK photo."""
    icc = image.info.get("icc_profile")
    if (image.size != base or box) and image.mode in _RESIZABLE:
        image = image.resize(base, Image.Resampling.LANCZOS, box=box, reducing_gap=REDUCING_GAP)
    if inverted:
        image = ImageChops.invert(image)
    if icc:
        image.info["icc_profile"] = icc
    image = to_srgb(image)
    if image.size != base:
        image = image.resize(base, Image.Resampling.LANCZOS, reducing_gap=REDUCING_GAP)
    return image


def small_copy(frame: Image.Image) -> Small:
    """The analysis' intermediate: the first frame, RGBA, at most SMALL_EDGE px: box-shrunk
    by `whole_blocks`, as the vips backend does."""
    blocks = whole_blocks(*frame.size)
    small = frame
    if (blocks.across, blocks.down) != (1, 1):
        # Alpha is premultiplied around the averaging, as a resize does by itself.
        premultiplied = {"RGBA": "RGBa", "LA": "La"}.get(frame.mode)
        source = frame.convert(premultiplied) if premultiplied else frame
        small = source.reduce((blocks.across, blocks.down), (0, 0, blocks.width, blocks.height))
        if premultiplied:
            small = small.convert(frame.mode)
    return Small(small.width, small.height, small.convert("RGBA").tobytes())


def analysis_of(decoded: Decoded, fmt: str, frames: int) -> Analysis:
    first = decoded.frames[0]
    return analyse(
        small_copy(first), width=decoded.upright[0], height=decoded.upright[1], fmt=fmt,
        frames=frames, has_alpha=_transparent(first),
    )  # fmt: skip


def _transparent(frame: Image.Image) -> bool:
    """Whether any pixel of the frame is less than opaque (an opaque alpha channel, or
    libvips' always-present GIF alpha, does not count: both backends agree on pixels)."""
    if frame.mode not in ("RGBA", "LA"):
        return False
    low, _ = frame.getchannel("A").getextrema()
    return bool(low < 255)  # type: ignore[operator]  # one band: ints, not tuples


def decode_heif(original: bytes, spec: DeriveSpec) -> tuple[Decoded, int]:
    """HEIC/HEIF through pi-heif (handlers/heif.py): the primary image, upright."""
    header = heif.read_header(original, spec)
    upright = (header.width, header.height)
    frame = _to_base(heif.to_pillow(heif.decode(header)), base_size(*upright, spec.variants))
    return Decoded([frame], [100], 0, upright), header.frames


def decode_preview(preview: previews.Preview, spec: DeriveSpec) -> tuple[Decoded, int]:
    """A PDF's page or a video's frame (`previews`): 8-bit sRGB pixels, to the base."""
    image = Image.frombuffer("RGB", preview.size, preview.pixels, "raw", "RGB", 0, 1)
    frame = _to_base(image, base_size(*preview.upright, spec.variants))
    return Decoded([frame], [100], 0, preview.upright), preview.frames


def decode_original(original: bytes, spec: DeriveSpec) -> tuple[Decoded, int]:
    """Everything that parses the user's bytes: the decoded base and the file's frames."""
    if heif.is_heif(original):
        return decode_heif(original, spec)
    if input_format(original) == "avif":
        # libavif refuses images past its own size limit in words Pillow turns into
        # "cannot identify": check the declared size first, as libvips' header does.
        size = heif.check_avif(original, spec).size
        if size is not None:
            check_declared_size(*size, 1, spec)
    im = open_image(original)
    try:
        if im.format == "PNG" and not png_chunks_intact(original):
            raise CorruptContent("PNG chunk CRC mismatch or chunk past the end")
        with _classify_errors():
            frames = count_frames(im, spec.max_frames)
            check_declared_size(*im.size, frames, spec)
            decoded = decode(im, original, spec)
        # A frame that needed no resize or conversion is the file image itself, which
        # closes below: keep its pixels.
        decoded.frames[:] = [f.copy() if f is im else f for f in decoded.frames]
        return decoded, frames
    finally:
        im.close()


class PillowHandler:
    name = "pillow"

    def __init__(self, spec: DeriveSpec) -> None:
        self.spec = spec
        check_encoders(spec)
        configure(spec)

    def derive(self, original: bytes, spec: DeriveSpec) -> Derivation:
        check_input_size(original, spec)
        with decoding():
            preview = previews.preview_of(original, spec)
            decoded, frames = decode_original(original, spec) if preview is None else (
                decode_preview(preview, spec))  # fmt: skip
        fmt = input_format(original) or "unknown"
        with encoding():
            variants = derive_variants(decoded, spec)
            analysis = analysis_of(decoded, fmt, frames)
            return Derivation(variants, previews.analysed(analysis, preview))
