"""Both backends on the image corpus in tests/corpus (PngSuite, EXIF orientation samples).

The corpus is part of the repository (see tests/corpus/README.md for sources and
licences), so these tests never skip: a missing file is a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.corpus import CORPUS
from fixtures.pixels import MISTAKE_MAD, SPEC, decode, mad

from derivd.handlers.base import Handler, Permanent

pytestmark = pytest.mark.corpus


PNGSUITE = sorted((CORPUS / "pngsuite").glob("*.png"))
ORIENTATION = sorted((CORPUS / "exif-orientation").glob("*_[1-8].jpg"))

# Photos, not smooth generated content: a sideways file is a re-encode of transposed pixels
# (another JPEG block grid), so it differs more from _0 than the generated cases do.
# Measured 2.2-4.6 over both kinds, both variants, both backends; a wrong rotation is > 10.
PHOTO_ORIENTATION_MAD = 6.0


def test_the_corpus_is_complete_and_licensed() -> None:
    """Parametrized tests over an empty glob would pass by running nothing."""
    assert len(PNGSUITE) == 175
    assert len([p for p in PNGSUITE if p.name.startswith("x")]) == 14
    assert len(ORIENTATION) == 16
    uprights = {p.with_name(p.name.rsplit("_", 1)[0] + "_0.jpg") for p in ORIENTATION}
    assert len(uprights) == 2 and all(p.is_file() for p in uprights)
    for folder in ("pngsuite", "exif-orientation"):
        assert (CORPUS / folder / "LICENSE").stat().st_size > 100


@pytest.mark.parametrize("path", [p for p in PNGSUITE if not p.name.startswith("x")],
                         ids=lambda p: p.name)  # fmt: skip
def test_pngsuite_valid_files_derive(handler: Handler, path: Path) -> None:
    out = handler.derive(path.read_bytes(), SPEC)
    assert [v.name for v in out] == [v.name for v in SPEC.variants]
    assert all(v.data[:4] == b"RIFF" for v in out)


@pytest.mark.parametrize("path", [p for p in PNGSUITE if p.name.startswith("x")],
                         ids=lambda p: p.name)  # fmt: skip
def test_pngsuite_broken_files_are_rejected(handler: Handler, path: Path) -> None:
    with pytest.raises(Permanent) as caught:
        handler.derive(path.read_bytes(), SPEC)
    assert caught.value.code in ("corrupt_content", "unsupported_content")


@pytest.mark.parametrize("path", ORIENTATION, ids=lambda p: p.name)
def test_exif_orientation_matches_the_upright_original(handler: Handler, path: Path) -> None:
    """Landscape_n / Portrait_n with orientation n must derive like the untagged _0 file,
    within PHOTO_ORIENTATION_MAD (metric: `mad`, see test_handlers)."""
    upright = path.with_name(path.name.rsplit("_", 1)[0] + "_0.jpg")
    expected = handler.derive(upright.read_bytes(), SPEC)
    got = handler.derive(path.read_bytes(), SPEC)
    for a, b in zip(expected, got, strict=True):
        assert (a.width, a.height) == (b.width, b.height)
        assert mad(a.data, b.data) <= PHOTO_ORIENTATION_MAD
    # ...and orientation matters: the rotated-by-180 output is far off.
    turned = decode(got[1].data).rotate(180)
    assert mad(expected[1].data, turned) > MISTAKE_MAD
