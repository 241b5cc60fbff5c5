"""libjpeg-turbo's verdict on a JPEG's data, one rule for both backends.

libjpeg treats damaged scan data as a *warning*: it fills what it cannot decode with grey,
or with whatever a desynchronised Huffman decoder produces, and carries on. 40 flipped
bytes in the middle of a photo's scan are "Corrupt JPEG data: 25 extraneous bytes before
marker 0xd9" and 40 % of its pixels garbled; libvips (at `fail_on=error`) and Pillow
(which has no hook for warnings at all) both publish that. So a JPEG is judged by
libjpeg-turbo, strictly (simplejpeg's `strict`: any warning is an error), before either
backend publishes it: by the fast decode itself (`jpegscale`), or, for a JPEG that decode
does not take (CMYK on `vips`, over its memory bound, `shrink_on_load = off`, several
frames: the first), by `check_jpeg`, the same strict decode at 1/8 scale, in grey (CMYK
as it is stored), whose pixels are dropped. The Huffman or arithmetic decoding of every
coefficient is the same at any scale, so it meets the same damage; only the inverse DCT
and the colour conversion shrink, and the check costs about half a whole decode (a 24 MP
photo: ~60 CPU ms, against ~110; bench/jpegcheck.py).

What it says is `damage` or not (`is_damage`): the warnings about the scan data and the
errors that mean a broken structure are `corrupt_content`. Everything else stays the
backend's to decide, as before: the warnings valid-but-unusual files draw (an unknown JFIF
revision or Adobe transform, sequential SOS parameters off by a little, an inconsistent
progression, a bad ICC marker: the backends ignore a broken profile anyway), and what this
build of libjpeg-turbo cannot decode but a backend might (12-bit, lossless, an unsupported
colour conversion). libjpeg-turbo decodes on past a warning but reports only the first (or
an error that follows it): damage in the scan of a file whose header draws one of those
warnings is hidden behind it, and the backend's own decoder (`fail_on=error` in libvips)
is then all that judges the file.

Extraneous bytes are damage even where the pixels happen to be whole (16 zero bytes
before the end marker): it is the very warning a desynchronised scan gives, and nothing
tells the two apart. sharp does the same by default (`failOn: 'warning'`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from derivd.handlers.base import CorruptContent
from derivd.handlers.lazy_numpy import numpy
from derivd.handlers.sniff import accepted_format


@cache
def simplejpeg() -> Any:  # simplejpeg carries no py.typed
    """simplejpeg, loaded with the first JPEG, not at the worker's boot; numpy (which it
    imports) through `lazy_numpy`, which tunes it first."""
    numpy()
    import simplejpeg as module

    return module


# libjpeg-turbo's messages (jerror.h) that mean the data is broken, by their start.
_DAMAGE = (
    "Corrupt JPEG data",  # bad Huffman/arithmetic code, premature end of segment, extraneous
    "Premature end of JPEG file",  # bytes, a marker where a restart marker belongs
    "Premature end of input file",
    "Invalid JPEG file structure",  # two SOI or SOF markers, SOS before SOF, no SOS
    "Unsupported marker type",  # 0xff and a byte no JPEG marker is: in a scan, damage
    "Bogus marker length",
    "Bogus Huffman table definition",
    "Bogus DQT index",
    "Bogus DHT index",
    "Bogus DAC",
    "Huffman table 0x",  # ... was not defined
    "Arithmetic table 0x",
    "Quantization table 0x",
    "Missing Huffman code table entry",
    "Huffman code size table overflow",
    "Invalid component ID",
    "Invalid progressive parameters",
    "Didn't expect more than one scan",
    "JPEG datastream contains no image",
)
# ... except this one: a broken ICC marker, which both backends ignore (the pixels are whole).
_NOT_DAMAGE = ("Corrupt JPEG data: bad ICC marker",)


def is_damage(message: str) -> bool:
    """Whether libjpeg-turbo's `message` (a warning or an error) says the JPEG's data is
    broken, rather than unusual or beyond this decoder."""
    words = message.strip()
    return words.startswith(_DAMAGE) and not words.startswith(_NOT_DAMAGE)


def raise_if_damage(message: str) -> None:
    """CorruptContent for a `message` that is damage (`is_damage`); else nothing."""
    if is_damage(message):
        raise CorruptContent(f"libjpeg-turbo: {message.strip()[:200]}")


# What the check decodes each colour space of a JPEG to: grey, the least output; CMYK and
# YCCK to CMYK, as libjpeg-turbo turns them into nothing else.
_CHECK_AS = {"CMYK": "CMYK", "YCCK": "CMYK"}


def check_jpeg(original: bytes) -> None:
    """For a JPEG by its magic that a backend's own decoder is about to decode:
    CorruptContent when libjpeg-turbo, decoding it strictly at 1/8 scale, meets damage
    (`is_damage`); nothing for a clean file, for what is not damage, or for another
    format. The caller has checked the declared size against the limits: the decode
    holds 1/64 of it."""
    if accepted_format(original) != "jpeg":
        return
    turbo = simplejpeg()
    try:
        _, _, colourspace, _ = turbo.decode_jpeg_header(original)
        # The smallest size asked for: libjpeg-turbo's smallest scale, 1/8.
        turbo.decode_jpeg(original, colorspace=_CHECK_AS.get(colourspace, "GRAY"),
                          min_width=1, min_height=1, strict=True)  # fmt: skip
    except ValueError as e:
        raise_if_damage(str(e))
