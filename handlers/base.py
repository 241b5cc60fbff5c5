"""The handler contract shared by every backend.

A handler is created once per worker process, after fork, and then called once per
job with the original's bytes. It returns one `DerivedVariant` per configured variant and
format (`VariantSpec.formats`), in the configured order (the first is the primary), or
raises an outcome from `derivd.errors`:
`UnsupportedContent`, `CorruptContent`, `ResourceLimit` (permanent) or `Transient`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

from derivd.errors import (  # re-exported for third-party handlers
    CorruptContent,
    Outcome,
    Permanent,
    ResourceLimit,
    Transient,
    UnsupportedContent,
)
from derivd.handlers.preview_spec import PreviewSpec

__all__ = [
    "FORMATS",
    "Analysis",
    "CorruptContent",
    "Derivation",
    "DeriveSpec",
    "DerivedVariant",
    "Handler",
    "MissingEncoder",
    "Permanent",
    "PreviewSpec",
    "ResourceLimit",
    "Transient",
    "UnsupportedContent",
    "VariantSpec",
]


# Output formats: name -> (file extension, Content-Type).
FORMATS: dict[str, tuple[str, str]] = {
    "webp": ("webp", "image/webp"),
    "avif": ("avif", "image/avif"),
    "jpeg": ("jpg", "image/jpeg"),
    "png": ("png", "image/png"),
}
ANIMATED_FORMATS = frozenset({"webp", "avif"})
# The most pixels one AVIF may hold (all frames of an animation together). aom needs about
# 25 MiB per megapixel at the pinned effort (measured on noise, its worst case): 4096 x 4096
# stays near 450 MiB, within the default [supervisor] max_worker_rss_mb of 1024.
AVIF_MAX_PIXELS = 4096 * 4096
# The most coded images one HEIF primary image may be assembled from (a grid's tiles). Each
# tile is a decoder run of its own: a grid of thousands of tiny tiles costs far more CPU
# than its pixel count says. Phones use 512 x 512 tiles: a 48 MP photo has 192.
HEIF_MAX_TILES = 1024


@dataclass(frozen=True)
class VariantSpec:
    """One named output (`name` is a key segment, e.g. `thumb`), in one or more formats.

    `VariantSpec("thumb", 320)` is the shorthand `thumb:320`: long edge 320, fit inside,
    WebP. A box (`box=(w, h)`) replaces the long edge; `fit="cover"` fills the box exactly
    and crops the rest at `gravity`. `quality=None` means `DeriveSpec.quality`.
    """

    name: str
    long_edge: int = 0
    box: tuple[int, int] | None = None
    fit: str = "inside"
    gravity: str = "centre"
    formats: tuple[str, ...] = ("webp",)
    quality: int | None = None
    lossless: bool = False
    upscale: bool = False
    animated: bool = False

    @property
    def bounds(self) -> tuple[int, int]:
        """The box the output must fit (inside) or fill (cover)."""
        return self.box or (self.long_edge, self.long_edge)


@dataclass(frozen=True)
class DeriveSpec:
    """Everything a handler needs from `[derive]`, already validated."""

    variants: tuple[VariantSpec, ...]
    quality: int = 80
    effort: int = 4
    max_input_bytes: int = 50 * 1024 * 1024
    max_pixels: int = 100_000_000
    max_frames: int = 100
    concurrency: int = 1
    shrink_on_load: str = "fast"  # fast | safe | off (see derivd.handlers.geometry)
    previews: PreviewSpec = field(default_factory=PreviewSpec)  # documents, videos: `previews`


@dataclass(frozen=True)
class DerivedVariant:
    name: str
    data: bytes
    width: int
    height: int
    sha256: str
    content_type: str = "image/webp"
    format: str = "webp"  # a key of FORMATS

    @classmethod
    def of(
        cls, name: str, data: bytes, width: int, height: int, fmt: str = "webp"
    ) -> DerivedVariant:
        digest = hashlib.sha256(data).hexdigest()
        return cls(name, data, width, height, digest, FORMATS[fmt][1], fmt)

    @property
    def extension(self) -> str:
        return FORMATS[self.format][0] if self.format in FORMATS else self.format


@dataclass(frozen=True)
class Analysis:
    """What the one decode learned about the original (DESIGN.md "Analysis")."""

    width: int  # as displayed, after orientation
    height: int
    format: str  # the input format: jpeg, png, gif, webp, tiff, avif, heic
    frames: int
    has_alpha: bool
    colour: str  # "#rrggbb", sRGB
    placeholder: str  # ThumbHash, base64
    dhash: int  # 64-bit difference hash as a signed bigint
    # What a preview's original adds (derivd.handlers.previews): a PDF's pages and page
    # size, a video's duration, frame rate, codec and audio; None for an image.
    media: dict[str, Any] | None = None


class Derivation(Sequence[DerivedVariant]):
    """A handler's result: the variants in configured order (the first is the primary),
    and the analysis of the original (None from a handler that analyses nothing).

    It is a sequence of its variants, so code that only needs the variants reads it as one.
    """

    __slots__ = ("original", "variants")

    def __init__(
        self, variants: Iterable[DerivedVariant], original: Analysis | None = None
    ) -> None:
        self.variants: tuple[DerivedVariant, ...] = tuple(variants)
        self.original = original

    @classmethod
    def of(cls, result: Sequence[DerivedVariant]) -> Derivation:
        """Accept a third-party handler's plain list of variants as well."""
        return result if isinstance(result, Derivation) else cls(result)

    @overload
    def __getitem__(self, index: int) -> DerivedVariant: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[DerivedVariant]: ...
    def __getitem__(self, index: int | slice) -> DerivedVariant | Sequence[DerivedVariant]:
        return self.variants[index]

    def __len__(self) -> int:
        return len(self.variants)

    def __repr__(self) -> str:
        return f"Derivation({list(self.variants)!r}, original={self.original!r})"


class Handler(Protocol):
    """What the worker calls. `name` is the registry name (`vips`, `pillow`, ...).

    `derive` returns a `Derivation`; a plain sequence of variants (no analysis) is accepted
    from third-party handlers.
    """

    name: str

    def derive(self, original: bytes, spec: DeriveSpec) -> Sequence[DerivedVariant]: ...


def target_size(width: int, height: int, long_edge: int) -> tuple[int, int]:
    """Fit (width, height) into a box of `long_edge`, never upscaling; both sides >= 1."""
    scale = min(1.0, long_edge / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def check_input_size(original: bytes, spec: DeriveSpec) -> None:
    """`max_input_mb`, before anything parses the bytes."""
    if len(original) > spec.max_input_bytes:
        raise ResourceLimit(f"{len(original)} bytes > max_input_bytes {spec.max_input_bytes}")


def check_declared_size(
    width: int, height: int, frames: int, spec: DeriveSpec, decoded_frames: int | None = None
) -> None:
    """`max_frames` and `max_pixels` (width x height x the frames decoded) from the header
    alone. `decoded_frames` defaults to `frames`; a HEIF burst decodes only its primary."""
    if frames > spec.max_frames:
        raise ResourceLimit(f"{frames} frames > max_frames {spec.max_frames}")
    frames = frames if decoded_frames is None else decoded_frames
    pixels = width * height * frames
    if pixels > spec.max_pixels:
        raise ResourceLimit(
            f"{width}x{height}x{frames} = {pixels} px > max_pixels {spec.max_pixels}"
        )


class MissingEncoder(RuntimeError):
    """The backend cannot write a format the configured variants need: raised when the
    handler is created, so a worker refuses to start (one line) instead of failing jobs."""


@contextmanager
def decoding() -> Iterator[None]:
    """Classify whatever escapes a decoder while it parses the original's bytes.

    Decoders raise far more than their documented errors on hostile input (Pillow: TypeError,
    OverflowError, struct.error, IndexError, ...; libvips: pyvips.Error). Wrap only the
    steps that parse the original (header, decode to the base): any of those is
    `corrupt_content`, final on the first attempt; MemoryError is `resource_limit`.
    Outcomes a handler raised on purpose pass through.
    """
    try:
        yield
    except Outcome:
        raise
    except MemoryError:
        raise ResourceLimit("out of memory while decoding") from None
    except Exception as e:  # every escape is the content's: see the docstring
        raise CorruptContent(f"decode failed: {type(e).__name__}: {e}"[:300]) from None


@contextmanager
def encoding() -> Iterator[None]:
    """Classify whatever escapes shaping and encoding the decoded pixels.

    The user's bytes were read already: a fault here is the backend's or an encoder's,
    never the content's. `processing_failed`, final: the same pixels through the same
    encoder fail the same way, so a retry would only spend the attempts.
    """
    try:
        yield
    except Outcome:
        raise
    except MemoryError:
        raise ResourceLimit("out of memory while encoding") from None
    except Exception as e:  # see the docstring
        raise Permanent("processing_failed", f"encode failed: {type(e).__name__}: {e}"[:300]
                        ) from None  # fmt: skip
