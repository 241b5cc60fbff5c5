"""Videos encoded in the test (PyAV's wheels carry x264, x265, libvpx and SVT-AV1), and
hostile ones made from them by editing their boxes.

`clip` draws a scene whose orientation and colours a test can check (a red block in the
top-left corner over a gradient), after `black_s` seconds of black, with a display
matrix (`rotate` counter-clockwise degrees, `mirror`), in any codec and container.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from functools import cache

import av
import numpy as np

# (encoder, container format) by the codec a test names.
ENCODERS = {
    "h264": ("libx264", "mp4"),
    "hevc": ("libx265", "mov"),
    "vp9": ("libvpx-vp9", "webm"),
    "av1": ("libsvtav1", "mp4"),
    "mpeg4": ("mpeg4", "mp4"),  # MPEG-4 Part 2: decodable, but not a codec derivd previews
}
RED_CORNER = (255, 0, 0)


def scene(width: int, height: int, index: int = 0) -> np.ndarray:
    """A gradient with a red block in the top-left quarter; `index` shifts the blue."""
    rows, cols = np.mgrid[0:height, 0:width]
    picture = np.stack([cols * 255 // width, rows * 255 // height,
                        np.full_like(cols, (64 + index * 8) % 256)], -1)  # fmt: skip
    picture = picture.astype(np.uint8)
    picture[: height // 4, : width // 4] = RED_CORNER
    return picture


@cache
def clip(codec: str = "h264", size: tuple[int, int] = (320, 240), seconds: float = 3.0,
         fps: int = 10, black_s: float = 1.0, rotate: int = 0, mirror: bool = False,
         audio: bool = False, gop: int = 5) -> bytes:  # fmt: skip
    """An encoded clip (see the module's docstring); `gop`: keyframe interval, x264's."""
    encoder, container = ENCODERS[codec]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(encoder, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if encoder == "libx264":
            stream.options = {"g": str(gop), "preset": "ultrafast"}
        if encoder == "libx265":
            stream.options = {"x265-params": "log-level=error"}
        if rotate or mirror:
            stream.set_display_rotation(rotate, hflip=mirror)
        sound = out.add_stream("aac", rate=48000) if audio else None
        for index in range(int(fps * seconds)):
            dark = index / fps < black_s
            picture = np.zeros((size[1], size[0], 3), np.uint8) if dark else scene(*size, index)
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            _add_silence(out, sound, seconds)
    return buffer.getvalue()


def _add_silence(out: av.container.OutputContainer, sound: av.audio.stream.AudioStream,
                 seconds: float) -> None:  # fmt: skip
    samples = np.zeros((1, 1024), np.float32)
    for index in range(int(seconds * 48000 / 1024)):
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 48000, index * 1024
        for packet in sound.encode(frame):
            out.mux(packet)
    for packet in sound.encode():
        out.mux(packet)


def audio_only(seconds: float = 1.0) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        _add_silence(out, out.add_stream("aac", rate=48000), seconds)
    return buffer.getvalue()


def hdr_clip(transfer: str) -> bytes:
    """A 10-bit HEVC clip tagged BT.2020 and PQ (`pq`) or HLG (`hlg`): a grey ramp from
    black to the signal's top, and a red block (BT.2020 red at SDR white)."""
    buffer = io.BytesIO()
    width, height = 256, 128
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("libx265", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p10le"
        trc = {"pq": 16, "hlg": 18}[transfer]
        stream.options = {"x265-params": f"log-level=error:colorprim=bt2020:"
                          f"transfer={'smpte2084' if transfer == 'pq' else 'arib-std-b67'}:"
                          "colormatrix=bt2020nc"}  # fmt: skip
        ramp = np.tile(np.linspace(0, 65535, width).astype(np.uint16), (height, 1))
        picture = np.stack([ramp, ramp, ramp], -1)
        red_signal = 0.58 if transfer == "pq" else 0.75  # ~203 nits / HLG reference white
        picture[: height // 2, : width // 4] = (int(red_signal * 65535), 0, 0)
        for _ in range(5):
            frame = av.VideoFrame.from_ndarray(picture, format="rgb48le")
            frame.colorspace, frame.color_range = 9, 1
            frame = frame.reformat(format="yuv420p10le", src_colorspace=9, dst_colorspace=9,
                                   dst_color_range=1)  # fmt: skip
            frame.color_trc, frame.color_primaries = trc, 9
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


# -- hostile: edits of a clip's boxes ------------------------------------------------------


def _find(data: bytes, kind: bytes, start: int = 0) -> int:
    """Where the payload of the first box `kind` at or after `start` begins."""
    at = data.index(kind, start)
    return at + 4


def without_moov() -> bytes:
    """A recording cut off before its `moov` (the muxer writes it last): no index."""
    data = clip()
    return data[: data.index(b"moov") - 4]


def claiming_frame(width: int = 65535, height: int = 65535) -> bytes:
    """The clip with its `tkhd` and `avc1` entry claiming a `width` x `height` frame
    (16 bits a side is all the boxes hold)."""
    data = bytearray(clip())
    tkhd = _find(data, b"tkhd")
    at = tkhd + 4 + 20 + 52
    data[at : at + 8] = struct.pack(">II", width << 16, height << 16)
    entry = _find(data, b"avc1", data.index(b"stsd"))  # not the `avc1` brand in `ftyp`
    data[entry + 24 : entry + 28] = struct.pack(">HH", width, height)
    return bytes(data)


def lasting(seconds: int) -> bytes:
    """The clip with `mvhd` and `tkhd` claiming `seconds` of duration."""
    data = bytearray(clip())
    mvhd = _find(data, b"mvhd")
    (timescale,) = struct.unpack(">I", data[mvhd + 12 : mvhd + 16])
    data[mvhd + 16 : mvhd + 20] = struct.pack(">I", timescale * seconds)
    return bytes(data)


def claiming_samples(count: int = 50_000_000) -> bytes:
    """The clip with its `stsz` claiming `count` samples of one constant size, so no
    table has to back the claim: 14 KB that ffmpeg's demuxer indexes in ~600 MiB."""
    data = bytearray(clip())
    at = _find(data, b"stsz") + 4  # past version and flags
    data[at : at + 8] = struct.pack(">II", 100, count)
    return bytes(data)


def encrypted() -> bytes:
    """The clip with its sample entry renamed `encv`, as CENC stores a protected track."""
    data = bytearray(clip())
    entry = data.index(b"avc1", data.index(b"stsd"))
    data[entry : entry + 4] = b"encv"
    return bytes(data)


def garbled_samples() -> bytes:
    """The clip with every byte of its `mdat` payload replaced: an index and no frame."""
    data = bytearray(clip())
    at = data.index(b"mdat") + 4
    (size,) = struct.unpack(">I", data[at - 8 : at - 4])
    data[at : at - 8 + size] = bytes([0x5A]) * (size - 8)
    return bytes(data)


def _ebml(ident: bytes, payload: bytes) -> bytes:
    """One EBML element, its size written in 8 bytes (fits anything here)."""
    return ident + b"\x01" + len(payload).to_bytes(7, "big") + payload


def _ebml_header(data: bytes, at: int, id_length: int) -> tuple[int, int]:
    """(payload start, payload size) of the element whose ID starts at `at`."""
    first = data[at + id_length]
    length = 9 - first.bit_length()
    size = int.from_bytes(data[at + id_length : at + id_length + length], "big")
    return at + id_length + length, size & ((1 << (7 * length)) - 1)


def encrypted_webm() -> bytes:
    """The VP9 WebM with WebM encryption declared on its track (ContentEncodings with a
    ContentEncryption, AES, as a packager writes it); its segment's size made unknown so
    the longer track entry needs no other offset rewritten."""
    data = clip("vp9")
    tracks_at = data.index(b"\x16\x54\xae\x6b")
    while data[_ebml_header(data, tracks_at, 4)[0]] != 0xAE:  # the SeekHead names it first
        tracks_at = data.index(b"\x16\x54\xae\x6b", tracks_at + 1)
    body, size = _ebml_header(data, tracks_at, 4)
    tracks = data[body : body + size]
    entry_body, entry_size = _ebml_header(tracks, 0, 1)  # the first TrackEntry (0xAE)
    encryption = _ebml(b"\x6d\x80", _ebml(b"\x62\x40", _ebml(b"\x50\x33", b"\x01") + _ebml(
        b"\x50\x35", _ebml(b"\x47\xe1", b"\x05") + _ebml(b"\x47\xe2", bytes(16)))))  # fmt: skip
    entry = _ebml(b"\xae", tracks[entry_body : entry_body + entry_size] + encryption)
    new_tracks = _ebml(b"\x16\x54\xae\x6b", entry + tracks[entry_body + entry_size :])
    segment_at = data.index(b"\x18\x53\x80\x67")
    segment_body, _ = _ebml_header(data, segment_at, 4)
    unknown = b"\x01\xff\xff\xff\xff\xff\xff\xff"
    return (data[: segment_at + 4] + unknown + data[segment_body:tracks_at] + new_tracks
            + data[body + size :])  # fmt: skip


# Hostile inputs and the code each must end in (the handler tests and the supervisor's).
HOSTILE_VIDEOS: dict[str, tuple[Callable[[], bytes], str]] = {
    "audio_only": (audio_only, "unsupported_content"),
    "encrypted": (encrypted, "unsupported_content"),
    "encrypted_webm": (encrypted_webm, "unsupported_content"),
    "codec_not_previewed": (lambda: clip("mpeg4"), "unsupported_content"),
    "without_moov": (without_moov, "corrupt_content"),
    "garbled_samples": (garbled_samples, "corrupt_content"),
    "claims_65535_square_frames": (claiming_frame, "resource_limit"),
    "lasts_ten_hours": (lambda: lasting(10 * 3600), "resource_limit"),
    "claims_50_million_samples": (claiming_samples, "resource_limit"),
}
