"""The Pillow backend's variants: shape each one from the decoded base, then encode it.

`pillow.py` decodes the original once (the frames it needs, upright, 8-bit sRGB, JPEG
shrunk on load); everything here works on those decoded frames. Geometry comes from
`derivd.handlers.geometry`, encoder settings and the smart-crop measure from
`derivd.handlers.outputs`, so the dimensions match the `vips` backend exactly.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from derivd.handlers.base import DerivedVariant, DeriveSpec, VariantSpec
from derivd.handlers.geometry import cover_window, output_size
from derivd.handlers.outputs import (
    JPEG_BACKGROUND,
    PNG_COMPRESSION,
    avif_quality,
    avif_speed,
    best_window,
    check_avif_size,
    quality_of,
)

# Above 1.0 Pillow first reduces by an integer factor (box filter, cheap) to within this
# multiple of the target, then resamples with Lanczos; Pillow's docs call 3.0 or more
# indistinguishable from fair resampling in most cases, and it keeps big reductions fast.
REDUCING_GAP = 3.0


@dataclass(frozen=True)
class Decoded:
    """The original, decoded once: upright sRGB frames (one unless an animated variant
    asked for all), their durations in ms, the loop count, and the original's upright
    size (variant sizes come from it, not from a shrunk-on-load base)."""

    frames: list[Image.Image]
    durations: list[int]
    loop: int
    upright: tuple[int, int]


def derive_variants(decoded: Decoded, spec: DeriveSpec) -> list[DerivedVariant]:
    out: list[DerivedVariant] = []
    for variant in spec.variants:
        animate = variant.animated and len(decoded.frames) > 1
        frames = decoded.frames if animate else decoded.frames[:1]
        shaped = shape(frames, decoded.upright, variant)
        width, height = shaped[0].size
        for fmt in variant.formats:
            data = encode(shaped, decoded.durations, decoded.loop, fmt, variant, spec)
            out.append(DerivedVariant.of(variant.name, data, width, height, fmt))
    return out


def shape(
    frames: list[Image.Image], upright: tuple[int, int], variant: VariantSpec
) -> list[Image.Image]:
    """Every frame resized (inside) or cut and resized (cover) to the variant's size; a
    cover window is placed once, on the first frame, so an animation does not jitter."""
    size = output_size(*upright, variant)
    base = frames[0]
    if variant.fit != "cover":
        return [_resize(frame, size, None) for frame in frames]
    window = cover_window(upright, base.size, variant)
    left, top = best_window(base, window, variant.gravity)
    box = (left, top, left + window.width, top + window.height)
    return [_resize(frame, size, box) for frame in frames]


def _resize(
    frame: Image.Image, size: tuple[int, int], box: tuple[int, int, int, int] | None
) -> Image.Image:
    if box is None and frame.size == size:
        return frame
    if box is not None and (box[2] - box[0], box[3] - box[1]) == size:
        return frame.crop(box)
    return frame.resize(size, Image.Resampling.LANCZOS, box=box, reducing_gap=REDUCING_GAP)


def encode(
    frames: list[Image.Image],
    durations: list[int],
    loop: int,
    fmt: str,
    variant: VariantSpec,
    spec: DeriveSpec,
) -> bytes:
    buf = io.BytesIO()
    first, rest = frames[0], frames[1:]
    # No exif/icc_profile/xmp arguments: Pillow's writers take metadata only from them,
    # so the output carries none (tests check the WebP RIFF chunks).
    animation = (
        {"save_all": True, "append_images": rest, "duration": durations[: len(frames)],
         "loop": loop}
        if rest
        else {}
    )  # fmt: skip
    quality = quality_of(variant, spec)
    if fmt == "webp":
        first.save(buf, "WEBP", quality=quality, method=spec.effort, lossless=variant.lossless,
                   **animation)  # fmt: skip
    elif fmt == "avif":
        check_avif_size(len(frames), *first.size)
        first.save(buf, "AVIF", quality=avif_quality(quality), speed=avif_speed(spec),
                   subsampling="4:2:0", max_threads=spec.concurrency, **animation)  # fmt: skip
    elif fmt == "jpeg":
        return save_jpeg(_flatten(first), quality)
    elif fmt == "png":
        first.save(buf, "PNG", compress_level=PNG_COMPRESSION)
    else:  # pragma: no cover - formats are validated with the config
        raise ValueError(f"unknown format {fmt!r}")
    return buf.getvalue()


def save_jpeg(image: Image.Image, quality: int) -> bytes:
    """The JPEG writer of both backends: libjpeg-turbo (Pillow's), 4:2:0, optimised Huffman
    tables, no metadata. An L image stays greyscale."""
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality, subsampling=2, optimize=True)
    return buf.getvalue()


def _flatten(image: Image.Image) -> Image.Image:
    """JPEG has no alpha: composite onto white, as the vips backend does."""
    if image.mode != "RGBA":
        return image.convert("RGB")
    flat = Image.new("RGB", image.size, JPEG_BACKGROUND)
    flat.paste(image, mask=image.getchannel("A"))
    return flat
