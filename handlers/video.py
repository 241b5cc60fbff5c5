"""Video previews through ffmpeg's libraries (PyAV, whose wheels carry them).

Per job: the container is recognised by its first bytes (ISO-BMFF: MP4, MOV; EBML:
Matroska, WebM) and opened with that demuxer alone, so no other one ever probes the
bytes (HLS and concat would follow URLs). An MP4/MOV's `moov` box is read first
(`movie_boxes`): encrypted tracks, declared frame size, duration and tracks are refused
before any demuxer runs; a Matroska/WebM track declaring encryption too (`matroska`).
Then, from the demuxer's header: streams, the video stream's codec (`DECODERS`, where
this build has a decoder), its frame size and duration.

The frame: a seek to `[derive] frame_offset` of the duration lands on the keyframe at or
before it; keyframes alone are decoded from there (`skip_frame`), and one that is almost
uniform (a black or white fade: `UNIFORM_SPREAD`) is passed over for the next, at most
`MAX_KEYFRAMES` of them; when all are, every frame from the same seek, at most
`MAX_FRAMES` (a long GOP: one black keyframe, then the picture); the most varied frame
seen is kept if all are uniform, and a frame the decoder flags as concealed never is.
Then, once, on the frame scaled to the base the largest variant needs: the
BT.601/709/2020 matrix and range to RGB, HDR (PQ, HLG) tone mapped (`tonemap`), and
the display matrix applied whole (a quarter turn and a mirror: `oriented`).
"""

from __future__ import annotations

import contextlib
import io
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from derivd.handlers import matroska
from derivd.handlers.base import (
    CorruptContent,
    DeriveSpec,
    ResourceLimit,
    UnsupportedContent,
    check_declared_size,
)
from derivd.handlers.geometry import base_size
from derivd.handlers.lazy_numpy import numpy
from derivd.handlers.matroska import EBML_MAGIC
from derivd.handlers.movie_boxes import declared_movie
from derivd.handlers.preview_picture import Preview
from derivd.handlers.tonemap import to_sdr

# Codecs previewed (ffmpeg's canonical names): what phones, cameras and browsers record.
DECODERS = frozenset({"h264", "hevc", "vp8", "vp9", "av1"})
MAX_KEYFRAMES = 8  # keyframes decoded at most, looking for one that is not uniform
MAX_FRAMES = 90  # then frames of any kind (3 s at 30 fps), when all keyframes were uniform
UNIFORM_SPREAD = 6.0  # luma standard deviation (0-255) below which a frame is "uniform"
# ffmpeg indexes every sample of a track up front (24 bytes an entry): 10 M samples is
# 240 MiB of index, and 3 hours at 240 fps is 2.6 M (AAC audio: 47 frames a second).
MAX_TRACK_SAMPLES = 10_000_000
_SPREAD_SIZE = (64, 36)  # what the spread is measured on
_TRANSFERS = {16: "pq", 18: "hlg"}  # AVCOL_TRC_SMPTE2084, AVCOL_TRC_ARIB_STD_B67
# AVColorSpace values swscale takes, by the frame's tag (smpte170m is BT.601's matrix).
_MATRICES = {1: 1, 5: 5, 6: 5, 9: 9, 10: 9, 7: 7, 4: 4}
_BT709, _BT601 = 1, 5
_FULL_RANGE = 2  # AVCOL_RANGE_JPEG
# The bytes come from memory; nothing else is ever opened: no protocol for a reference a
# file makes (a MOV's data references, `dref`, stay off as well).
_DEMUXER_OPTIONS = {"protocol_whitelist": "none", "enable_drefs": "0"}


@cache
def libav() -> Any:
    """PyAV, imported with the first video a worker gets; ffmpeg's own log lines (about
    the user's damaged bytes) stay quiet: the outcome says what happened."""
    try:
        import av
    except ImportError:  # a build without it cannot decode videos: the format's outcome
        raise UnsupportedContent("video previews need PyAV (av), not installed") from None
    av.logging.set_level(av.logging.PANIC)
    return av


def container_format(original: bytes) -> str:
    """`mp4`, `mov`, `webm` or `mkv`, by the first bytes (see `previews.kind_of`)."""
    if original.startswith(EBML_MAGIC):
        return "webm" if b"webm" in original[:64] else "mkv"
    if original[4:8] == b"ftyp" and original[8:12] != b"qt  ":
        return "mp4"
    return "mov"


def check_movie(original: bytes, spec: DeriveSpec) -> None:
    """An MP4/MOV's refusals and limits from its `moov` box, before any demuxer."""
    movie = declared_movie(original)
    if movie.encrypted:
        raise UnsupportedContent("encrypted video (CENC): no key, no preview")
    check_streams(movie.tracks, spec)
    if movie.samples > MAX_TRACK_SAMPLES:
        raise ResourceLimit(f"{movie.samples} samples in a track > {MAX_TRACK_SAMPLES}")
    check_declared_size(*movie.frame, 1, spec)
    if movie.duration_s is not None:
        check_duration(movie.duration_s, spec)


def check_streams(count: int, spec: DeriveSpec) -> None:
    if count > spec.previews.max_streams:
        raise ResourceLimit(f"{count} streams > max_streams {spec.previews.max_streams}")


def check_duration(seconds: float, spec: DeriveSpec) -> None:
    if seconds > spec.previews.max_duration_s:
        raise ResourceLimit(f"{seconds:.0f} s > max_duration {spec.previews.max_duration_s:g} s")


def still(original: bytes, spec: DeriveSpec) -> Preview:
    """The representative frame of a video, checked and decoded (see the docstring)."""
    fmt = container_format(original)
    if fmt in ("mp4", "mov"):
        check_movie(original, spec)
    elif matroska.encrypted(original):
        raise UnsupportedContent("encrypted video (WebM encryption): no key, no preview")
    with contextlib.ExitStack() as opened:

        def video_stream() -> Any:
            """The video stream of the container opened anew: a decoder takes
            `skip_frame` when it opens (libdav1d), so each scan gets its own."""
            container = opened.enter_context(_open(original, fmt))
            stream = _video_stream(container)
            if stream.codec_context is not None:
                stream.codec_context.thread_count = spec.concurrency
                # The decoder's own bound too: a stream may change its frame size midway.
                stream.codec_context.options = {"max_pixels": str(spec.max_pixels)}
            return stream

        stream = video_stream()
        codec, duration = checked_stream(stream, spec)
        frame = pick_frame(stream, video_stream, duration * spec.previews.frame_offset)
        media, frames = _facts(stream, codec, duration, frame)
        return _picture(frame, stream.codec_context, fmt, frames, media, spec)


def checked_stream(stream: Any, spec: DeriveSpec) -> tuple[str, float]:
    """The video stream's codec and duration, once the demuxer's header passed every
    limit and the codec is one previewed."""
    check_streams(len(stream.container.streams), spec)
    context = stream.codec_context
    codec = context.codec.canonical_name if context is not None else None
    if codec not in DECODERS:
        raise UnsupportedContent(f"video codec {codec or 'unknown'!r} not previewed")
    check_declared_size(context.width, context.height, 1, spec)
    duration = _duration(stream.container, stream)
    check_duration(duration, spec)
    if context.width < 1 or context.height < 1:
        raise CorruptContent("video stream without a frame size")
    return str(codec), duration


def _facts(stream: Any, codec: str, duration: float, frame: Any) -> tuple[dict[str, Any], int]:
    """What the analysis adds for a video (`Analysis.media`), and its frame count."""
    rate = stream.average_rate or stream.guessed_rate
    media = {
        "duration": round(duration, 3),
        "frame_rate": round(float(rate), 3) if rate else None,
        "codec": codec,
        "audio": bool(stream.container.streams.audio),
        "frame_time": round(float(frame.time or 0.0), 3),
    }
    frames = stream.frames or (round(duration * float(rate)) if rate else 0)
    return media, max(1, frames)


def _open(original: bytes, fmt: str) -> Any:
    """The container, opened by its own demuxer only (see the docstring)."""
    av = libav()
    try:
        return av.open(io.BytesIO(original), format="matroska" if fmt in ("webm", "mkv") else "mov",
                       options=_DEMUXER_OPTIONS)  # fmt: skip
    except av.error.FFmpegError as error:
        raise CorruptContent(f"unreadable {fmt}: {error}"[:200]) from None


def _video_stream(container: Any) -> Any:
    """The first video stream that is not a cover picture; audio alone is not previewed."""
    videos = [s for s in container.streams.video if not _is_cover(s)]
    if videos:
        return videos[0]
    if container.streams.audio:
        raise UnsupportedContent("audio only: no picture to preview")
    raise CorruptContent("no video stream")


def _is_cover(stream: Any) -> bool:
    disposition = getattr(stream, "disposition", 0)
    return bool(int(disposition) & 0x400)  # AV_DISPOSITION_ATTACHED_PIC


def _duration(container: Any, stream: Any) -> float:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return float(container.duration or 0) / 1_000_000  # AV_TIME_BASE


def pick_frame(stream: Any, reopened: Callable[[], Any], offset_s: float) -> Any:
    """The frame to preview: near `offset_s`, the first that is not uniform among
    MAX_KEYFRAMES keyframes of `stream`, else among MAX_FRAMES frames of any kind from
    the same seek in a `reopened` stream (a long GOP holds one black keyframe and then
    the picture), else the most varied one seen. From the start when the seek finds
    nothing; CorruptContent when no frame decodes at all."""
    for start in (offset_s, 0.0) if offset_s > 0 else (0.0,):
        stream.codec_context.skip_frame = "NONKEY"
        found = _scan(stream, start, MAX_KEYFRAMES)
        if found is not None and found[1] < UNIFORM_SPREAD:
            found = max(found, _scan(reopened(), start, MAX_FRAMES) or found,
                        key=lambda pair: pair[1])  # fmt: skip
        if found is not None:
            return found[0]
        stream = reopened()
    raise CorruptContent("no decodable frame")


def _scan(stream: Any, start_s: float, limit: int) -> tuple[Any, float] | None:
    """The first frame that is not uniform among `limit` decoded from the seek to
    `start_s`, else the most varied one, with its spread; None when none decoded."""
    av, container = libav(), stream.container
    try:
        base = stream.start_time or 0
        container.seek(base + int(start_s / stream.time_base), stream=stream, backward=True)
    except (av.error.FFmpegError, ZeroDivisionError, TypeError):
        if start_s > 0:
            return None  # no index to seek by: the caller starts from the beginning
    best: tuple[Any, float] | None = None
    try:
        for decoded, frame in enumerate(container.decode(stream), 1):
            if not frame.is_corrupt:
                spread = _spread(frame)
                if best is None or spread > best[1]:
                    best = (frame, spread)
                if spread >= UNIFORM_SPREAD:
                    break
            if decoded >= limit:
                break
    except av.error.FFmpegError:
        pass  # damage past the frames decoded: keep what decoded cleanly
    return best


def _spread(frame: Any) -> float:
    small = frame.reformat(*_SPREAD_SIZE, format="gray").to_ndarray()
    return float(small.std())


def _picture(frame: Any, context: Any, fmt: str, frames: int, media: dict[str, Any],
             spec: DeriveSpec) -> Preview:  # fmt: skip
    np = numpy()
    turn = display_turn(frame)
    shown = _displayed(frame, context, turn)
    base = base_size(*shown, spec.variants)
    stored_way = (base[1], base[0]) if turn.transpose else base
    transfer = _TRANSFERS.get(int(frame.color_trc or 0))
    matrix = _MATRICES.get(int(frame.colorspace or 0), _BT709 if frame.height >= 720 else _BT601)
    scaled = frame.reformat(
        *stored_way, format="rgb48le" if transfer else "rgb24", src_colorspace=matrix,
        dst_colorspace=matrix, src_color_range=int(frame.color_range or 1),
        dst_color_range=_FULL_RANGE, interpolation="AREA",
    )  # fmt: skip
    pixels = scaled.to_ndarray()
    if transfer:
        pixels = to_sdr(pixels, transfer)
    upright = np.ascontiguousarray(oriented(pixels, turn))
    size = (int(upright.shape[1]), int(upright.shape[0]))
    return Preview(upright.tobytes(), size, shown, shown, fmt, frames, media)


@dataclass(frozen=True)
class Turn:
    """How the display matrix turns stored pixels upright: transpose first, then flip
    each axis (as displayed)."""

    transpose: bool = False
    flip_x: bool = False
    flip_y: bool = False


def turn_of(matrix: tuple[int, ...]) -> Turn:
    """The display matrix (ffmpeg's layout: 9 int32, a b u / c d v / x y w, 16.16 fixed
    for a-d) as a Turn. A source point (x, y) is shown at (a x + c y, b x + d y): with a
    zero `a` the axes swap (a transpose), and a negative factor flips the axis it lands
    on. Angles between the quarter turns snap to the nearest one."""
    a, b, _, c, d = matrix[:5]
    if abs(a) >= abs(b):  # x stays horizontal
        return Turn(False, a < 0, d < 0)
    return Turn(True, c < 0, b < 0)


def display_turn(frame: Any) -> Turn:
    """The frame's display matrix side data as a Turn (none: upright as stored)."""
    for data in frame.side_data:
        if data.type.name == "DISPLAYMATRIX":
            raw = bytes(data)
            if len(raw) >= 36:
                return turn_of(struct.unpack("<9i", raw[:36]))
    return Turn()


def oriented(pixels: Any, turn: Turn) -> Any:
    """`pixels` (rows x columns x bands) turned as displayed (views, no copy)."""
    np = numpy()
    if turn.transpose:
        pixels = pixels.transpose(1, 0, 2)
    if turn.flip_x:
        pixels = pixels[:, ::-1]
    if turn.flip_y:
        pixels = pixels[::-1]
    return np.asarray(pixels)


def _displayed(frame: Any, context: Any, turn: Turn) -> tuple[int, int]:
    """The frame's size as shown: its sample aspect ratio applied, then the turn."""
    width, height = frame.width, frame.height
    ratio = context.sample_aspect_ratio
    if ratio and ratio > 0 and ratio != 1:
        width = max(1, round(width * float(ratio)))
    return (height, width) if turn.transpose else (width, height)
