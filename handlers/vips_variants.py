"""The libvips backend's variants: one decode to a base image, every variant from it.

`load_base` runs libvips' `thumbnail` once, to the size the most demanding variant needs
(`geometry.base_size`): shrink-on-load (`open_shrunk`), EXIF autorotation, colour
management to sRGB and 16-to-8-bit all happen there. The handler renders the base to
memory once (`copy_memory`) before any variant: libvips pipelines are demand-driven, and
without that every variant (and the analysis) would decode the original again, and a
decoder fault would surface inside an encoder.

Each variant is then shaped from the base (`thumbnail_image` to resize, `crop` or
`smartcrop` for cover) and encoded with the parameters pinned in `derivd.handlers.outputs`.
libvips writes AVIF through libheif, which stores the pages of an animation as separate
still images; an animated AVIF is therefore encoded by Pillow (a dependency of derivd
anyway) from the frames libvips shaped, and JPEG by Pillow's libjpeg-turbo (`_jpeg`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyvips

from derivd.handlers.base import CorruptContent, DerivedVariant, DeriveSpec, VariantSpec
from derivd.handlers.geometry import cover_window, jpeg_shrink, output_size, webp_scale
from derivd.handlers.outputs import (
    JPEG_BACKGROUND,
    PNG_COMPRESSION,
    avif_effort,
    avif_quality,
    best_window,
    check_avif_size,
    quality_of,
)

if TYPE_CHECKING:  # Pillow only for an animated AVIF or a smart-crop measure (imported there)
    from PIL import Image

    from derivd.handlers.jpegscale import Scaled

_PIL_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}


def load_base(
    original: bytes,
    size: tuple[int, int],
    icc: bool,
    all_frames: bool,
    shrunk: Any | None = None,
) -> tuple[Any, int]:
    """The decoded base (every frame stacked vertically when `all_frames`) and its page
    height. `size="force"` with the box computed by `geometry` pins the output to the
    same dimensions the Pillow backend produces; libvips' own fit may round the short
    edge the other way. The base never exceeds the upright original.

    `shrunk` is the original already opened at a reduced scale (`open_shrunk`): then
    `thumbnail_image` does the rest of thumbnail's work (resize, colour, orientation),
    without the shrink-on-load choice of its own that `thumbnail_source` would make."""
    # Without a profile libvips still converts any colourspace to sRGB; with one (or for
    # CMYK, through its built-in CMYK profile) it goes through LittleCMS.
    colour = {"output_profile": "srgb", "intent": "relative"} if icc else {}
    if shrunk is not None:
        image = shrunk.thumbnail_image(size[0], height=size[1], size="force", **colour)
        return checked_base(image, size)
    options = "fail_on=error" + (",n=-1" if all_frames else "")
    image = read_in_place(
        "thumbnail_source",
        original,
        size[0],
        height=size[1],
        size="force",
        # The loader must get fail_on through option_string: thumbnail's own `fail_on`
        # argument does not reach it (libvips 8.18), and truncated JPEG/PNG
        # would then come out half grey. tests/test_handlers.py holds both cases.
        option_string=options,
        fail_on="error",
        **colour,
    )
    return checked_base(image, size)


def open_shrunk(
    original: bytes, loader: str, upright: tuple[int, int], size: tuple[int, int], mode: str
) -> Any | None:
    """A single-frame JPEG or WebP opened (lazily) at the cheapest scale whose pixels still
    cover `size`, per `[derive] shrink_on_load` (`geometry.jpeg_shrink`/`webp_scale`);
    None for other loaders, which `thumbnail_source` opens itself.

    libvips' thumbnail leaves a JPEG a factor of 2 for its resize (sharp's `safe`): the
    2725 x 2225 fixture of sharp's benchmark is then decoded at full size for a 720 x 588
    cover, where a DCT shrink of 2 and a lanczos3 resize take 40 % less CPU."""
    if loader == "jpegload_buffer":
        shrink = jpeg_shrink(upright, size, mode)
        return read_in_place("jpegload_source", original, shrink=shrink, access="sequential",
                             fail_on="error")  # fmt: skip
    if loader == "webpload_buffer":
        scale = webp_scale(upright, size, mode)
        return read_in_place("webpload_source", original, scale=scale, access="sequential",
                             fail_on="error")  # fmt: skip
    return None


def from_scaled(scaled: Scaled, size: tuple[int, int], orientation: int, icc: bytes | None
                ) -> Any:  # fmt: skip
    """libjpeg-turbo's pixels (`jpegscale`) resized to `size` (the base, as stored: not
    yet turned upright) with lanczos3, as thumbnail's own resize, but at the scale of the
    part of them the stored image spans (`Scaled.extent`); sRGB or grey. With an ICC
    profile it carries that and the file's EXIF orientation for `thumbnail_image` to
    apply, as it does to jpegload's image; without one it is turned upright here and is
    the base itself. The image reads the array in place and holds it."""
    bands = 1 if scaled.mode == "L" else 3
    image = pyvips.Image.new_from_memory(scaled.pixels, scaled.width, scaled.height, bands,
                                         "uchar")  # fmt: skip
    if (scaled.width, scaled.height) != size:
        extent = scaled.extent
        # libvips' reduce centres its output on the input it is given: given the decoded
        # image whole (its last, partial pixel counted whole), the result is shifted by
        # half that pixel's missing part (sharp's fixture at 3/8: 0.31 of a pixel down,
        # SSIM 0.982 against the full decode). Cut to the nearest whole pixel, the
        # shift is at most a quarter of a pixel (0.992); the output is `size` either way
        # (the extent moves by at most half a pixel, the scale is above 1).
        whole = (min(scaled.width, round(extent[0])), min(scaled.height, round(extent[1])))
        if whole != (scaled.width, scaled.height):
            image = image.crop(0, 0, *whole)
        image = image.resize(size[0] / extent[0], vscale=size[1] / extent[1], kernel="lanczos3")
        image = image.crop(0, 0, *size)
    image = image.copy(interpretation="b-w" if bands == 1 else "srgb")
    if orientation != 1:
        image.set_type(pyvips.GValue.gint_type, "orientation", orientation)
    if icc is not None:
        image.set_type(pyvips.GValue.blob_type, "icc-profile-data", icc)
        return image
    # Without a profile nothing is left for thumbnail_image but the orientation, which it
    # applies only after rendering its input to memory (libvips' thumbnail stays
    # sequential): a sideways photo's base rendered twice, ~1 ms more. These pixels are
    # in memory already, so autorot reads the resize out of order at no cost: the same
    # pixels, rendered once (tests/test_jpegscale.py: the orientation pairs).
    return image.autorot() if orientation != 1 else image


def read_in_place(loader: str, data: bytes, *args: Any, **options: Any) -> Any:
    """Run a `*_source` loader (or `thumbnail_source`) over `data` without copying it.

    A `*_buffer` loader first copies the whole original into a blob of its own (a 19 MB
    PNG: 19 MB more at peak and ~1 ms); a memory source is a pointer and a length. The
    image holds the source, as `Image.new_from_source` does, and pyvips hands an input
    image's references on to every image computed from it: `data` stays alive as long
    as any image that may still read it, whoever holds the bytes."""
    source = pyvips.Source.new_from_memory(data)
    image = pyvips.Operation.call(loader, source, *args, **options)
    image._references.append(source)
    return image


def source_loader(nickname: str) -> str:
    """The loader that reads a source, for the `*_buffer` nickname libvips' sniffing
    reports (jpegload_buffer -> jpegload_source)."""
    return nickname.removesuffix("_buffer") + "_source"


def checked_base(image: Any, size: tuple[int, int]) -> tuple[Any, int]:
    """The base as 8-bit, with its page height; its size is what `size` asked for."""
    page_height = _page_height(image)
    if image.width != size[0] or page_height != size[1]:  # cannot happen with "force"
        raise CorruptContent(f"thumbnail gave {image.width}x{page_height}")
    if image.format != "uchar":
        image = image.cast("uchar")
    return image, page_height


def _page_height(image: Any) -> int:
    if image.get_typeof("page-height") == 0:
        return int(image.height)
    page_height = int(image.get("page-height"))
    return page_height if 0 < page_height <= image.height else int(image.height)


def derive_variants(
    base: Any, page_height: int, upright: tuple[int, int], spec: DeriveSpec
) -> list[DerivedVariant]:
    # The base is in memory already (the handler renders it before any encoder runs):
    # every variant reads these pixels, none decodes the original again.
    count = max(1, base.height // page_height)
    frames = [base.crop(0, i * page_height, base.width, page_height) for i in range(count)]
    out: list[DerivedVariant] = []
    for variant in spec.variants:
        animate = variant.animated and count > 1
        shaped = shape(frames if animate else frames[:1], upright, variant)
        image = _join(shaped, base) if animate else shaped[0]
        if len(variant.formats) > 1:
            image = image.copy_memory()
        width, height = shaped[0].width, shaped[0].height
        for fmt in variant.formats:
            data = encode(image, shaped, fmt, variant, spec)
            out.append(DerivedVariant.of(variant.name, data, width, height, fmt))
    return out


def shape(frames: list[Any], upright: tuple[int, int], variant: VariantSpec) -> list[Any]:
    """Each frame resized (inside) or cut and resized (cover) to the variant's size."""
    width, height = output_size(*upright, variant)
    first = frames[0]
    if variant.fit != "cover":
        return [_resize(frame, width, height) for frame in frames]
    window = cover_window(upright, (first.width, first.height), variant)
    if variant.gravity != "centre" and len(frames) == 1:
        cut = first.smartcrop(window.width, window.height, interesting=variant.gravity)
        return [_resize(cut, width, height)]
    # Centre, or an animation: one window for every frame, placed on the first (by its
    # pixels for a smart crop; centre needs none, so nothing is copied out of libvips).
    if variant.gravity == "centre":
        left, top = window.centred()
    else:
        left, top = best_window(to_pillow(first), window, variant.gravity)
    return [
        _resize(frame.crop(left, top, window.width, window.height), width, height)
        for frame in frames
    ]


def _resize(image: Any, width: int, height: int) -> Any:
    if image.width == width and image.height == height:
        return image
    # thumbnail_image premultiplies alpha around the resize, as thumbnail_source does.
    return image.thumbnail_image(width, height=height, size="force", no_rotate=True)


def _join(frames: list[Any], base: Any) -> Any:
    joined = pyvips.Image.arrayjoin(frames, across=1).copy()
    joined.set_type(pyvips.GValue.gint_type, "page-height", frames[0].height)
    for name in ("delay", "loop"):
        if base.get_typeof(name):
            joined.set_type(base.get_typeof(name), name, base.get(name))
    return joined


def encode(image: Any, frames: list[Any], fmt: str, variant: VariantSpec, spec: DeriveSpec
           ) -> bytes:  # fmt: skip
    quality = quality_of(variant, spec)
    data: bytes
    if fmt == "webp":
        data = image.webpsave_buffer(
            Q=quality, effort=spec.effort, lossless=variant.lossless, keep="none"
        )
    elif fmt == "avif" and len(frames) > 1:
        durations, loop = _timing(image, len(frames))
        from derivd.handlers.pillow_variants import encode as pillow_encode

        pil = [to_pillow(frame) for frame in frames]
        data = pillow_encode(pil, durations, loop, "avif", variant, spec)
    elif fmt == "avif":
        check_avif_size(1, image.width, image.height)
        data = image.heifsave_buffer(Q=avif_quality(quality), compression="av1",
                                     effort=avif_effort(spec), bitdepth=8, subsample_mode="on",
                                     keep="none")  # fmt: skip
    elif fmt == "jpeg":
        flat = image.flatten(background=list(JPEG_BACKGROUND)) if image.hasalpha() else image
        data = _jpeg(flat, quality)
    elif fmt == "png":
        data = image.pngsave_buffer(compression=PNG_COMPRESSION, keep="none")
    else:  # pragma: no cover - formats are validated with the config
        raise ValueError(f"unknown format {fmt!r}")
    return data


def _jpeg(image: Any, quality: int) -> bytes:
    # pyvips-binary's libvips writes JPEG with mozjpeg, which takes ~1.5x libjpeg-turbo's
    # CPU for the same settings and about the same bytes (bench/steps.py: crop_encode_ms);
    # libjpeg-turbo decodes the originals already (jpegscale, simplejpeg's build), and
    # Pillow's build writes them: simplejpeg has no optimised Huffman tables.
    from derivd.handlers.pillow_variants import save_jpeg

    return save_jpeg(to_pillow(image), quality)


def _timing(image: Any, count: int) -> tuple[list[int], int]:
    delays = list(image.get("delay")) if image.get_typeof("delay") else []
    delays = (delays + [100] * count)[:count]
    loop = int(image.get("loop")) if image.get_typeof("loop") else 0
    return [d if d > 0 else 100 for d in delays], loop


def to_pillow(image: Any) -> Image.Image:
    """An 8-bit libvips image as a Pillow image (for the smart-crop measure, AVIF frames,
    the JPEG writer)."""
    from PIL import Image

    mode = _PIL_MODES[image.bands]
    return Image.frombytes(mode, (image.width, image.height), image.write_to_memory())
