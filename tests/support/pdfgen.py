"""PDFs written by hand for the preview tests: small, exact, and hostile where asked.

`document` lays out numbered objects, a cross-reference table and a trailer; the rest
build on it: pages with coloured rectangles (`pages`), a rotated page, a transparent
page (nothing painted: the render's white shows), a zip bomb in an object stream,
encrypted files (`encrypted`: the
standard security handler, revision 2, RC4 40-bit, as ISO 32000-1 section 7.6.3 says),
a page tree that loops, a page count that lies, and a PDF hidden behind a JPEG.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from functools import cache

# Red bar across the top quarter, a blue block lower right: a picture whose orientation
# and colours a test can check.
CONTENT = b"1 0 0 rg 0 600 612 192 re f 0 0 1 rg 306 0 306 300 re f"
_PAD = bytes.fromhex("28bf4e5e4e758a4164004e56fffa01082e2e00b6d0683e802f0ca9fe6453697a")
FILE_ID = bytes(range(16))


def document(objects: list[bytes], trailer: bytes = b"", prefix: bytes = b"") -> bytes:
    """Objects 1..n (object 1 the catalog), an xref table and a trailer."""
    out = bytearray(prefix + b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % at for at in offsets)
    ident = FILE_ID.hex().encode()
    out += b"trailer\n<< /Size %d /Root 1 0 R /ID [<%s> <%s>] %s>>\n" % (
        len(objects) + 1, ident, ident, trailer)  # fmt: skip
    out += b"startxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)


def stream(data: bytes) -> bytes:
    return b"<< /Length %d >>\nstream\n%s\nendstream" % (len(data), data)


def pages(count: int = 1, size: tuple[float, float] = (612, 792), rotate: int = 0,
          content: bytes = CONTENT, claimed: int | None = None) -> bytes:  # fmt: skip
    """`count` pages of `size` points (each with `content`), /Rotate `rotate`; the page
    tree's /Count says `claimed` when given."""
    kids = b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(count))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, claimed or count)]  # fmt: skip
    box = b"%s %s" % (str(size[0]).encode(), str(size[1]).encode())  # never 1e+09: not PDF
    for i in range(count):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %s] /Rotate %d "
                       b"/Contents %d 0 R >>" % (box, rotate, 4 + 2 * i))  # fmt: skip
        objects.append(stream(content))
    return document(objects)


def looping_tree() -> bytes:
    """Two /Pages nodes, each the other's only kid: no page at the end of it."""
    return document([b"<< /Type /Catalog /Pages 2 0 R >>",
                     b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                     b"<< /Type /Pages /Kids [2 0 R] /Count 1 >>"])  # fmt: skip


@cache
def object_stream_bomb(inflated: int = 1 << 30) -> bytes:
    """A page and an object stream (Flate) of `inflated` spaces: ~1 MB that PDFium would
    inflate to 1 GiB when it looks for an object in it."""
    deflater, block = zlib.compressobj(9), b" " * (1 << 24)
    packed = b"".join(deflater.compress(block) for _ in range(inflated >> 24)) + deflater.flush()
    bomb = b"<< /Type /ObjStm /N 1 /First 4 /Length %d /Filter /FlateDecode >>\nstream\n" % (
        len(packed))  # fmt: skip
    return document([b"<< /Type /Catalog /Pages 2 0 R >>",
                     b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                     b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>",
                     bomb + packed + b"\nendstream"])  # fmt: skip


def _rc4(key: bytes, data: bytes) -> bytes:
    state = list(range(256))
    j = 0
    for i in range(256):
        j = (j + state[i] + key[i % len(key)]) % 256
        state[i], state[j] = state[j], state[i]
    out, i, j = bytearray(), 0, 0
    for byte in data:
        i = (i + 1) % 256
        j = (j + state[i]) % 256
        state[i], state[j] = state[j], state[i]
        out.append(byte ^ state[(state[i] + state[j]) % 256])
    return bytes(out)


def _padded(password: bytes) -> bytes:
    return (password + _PAD)[:32]


def encrypted(user_password: bytes, owner_password: bytes = b"owner") -> bytes:
    """One page (CONTENT), encrypted: it opens without a password exactly when
    `user_password` is empty (what most "protected" PDFs are: printing restricted)."""
    permissions = -4
    owner = _rc4(hashlib.md5(_padded(owner_password)).digest()[:5], _padded(user_password))
    key = hashlib.md5(_padded(user_password) + owner + permissions.to_bytes(4, "little",
                      signed=True) + FILE_ID).digest()[:5]  # fmt: skip
    user = _rc4(key, _PAD)
    object_key = hashlib.md5(key + (4).to_bytes(3, "little") + bytes(2)).digest()[:10]
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
               stream(_rc4(object_key, CONTENT)),
               b"<< /Filter /Standard /V 1 /R 2 /O <%s> /U <%s> /P %d >>" % (
                   owner.hex().encode(), user.hex().encode(), permissions)]  # fmt: skip
    return document(objects, trailer=b"/Encrypt 5 0 R ")


def behind_jpeg(jpeg: bytes) -> bytes:
    """A polyglot: a whole JPEG, then a PDF (readers find `%PDF-` in the first KiB, and
    its xref offsets count from there)."""
    return jpeg + pages()


# Hostile inputs and the code each must end in (the handler tests and the supervisor's).
HOSTILE_PDFS: dict[str, tuple[Callable[[], bytes], str]] = {
    "claims_a_million_pages": (lambda: pages(claimed=10**6), "resource_limit"),
    "page_of_2_31_points": (lambda: pages(size=(2**31, 2**31)), "resource_limit"),
    "page_of_zero_points": (lambda: pages(size=(0.001, 0.001)), "resource_limit"),
    "page_tree_loops": (looping_tree, "corrupt_content"),
    "truncated": (lambda: pages()[:300], "corrupt_content"),
    "not_a_pdf_after_its_magic": (lambda: b"%PDF-1.7\n" + bytes(2000), "corrupt_content"),
    "zip_bomb_in_an_object_stream": (object_stream_bomb, "resource_limit"),
}
