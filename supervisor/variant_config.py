"""`[derive] variants` and the `[variant:NAME]` sections: from settings to `VariantSpec`s.

The keys of a `[variant:NAME]` section are declared in `derivd.config` (VariantSettings),
like every other setting; this module parses the values that need more than a type (sizes,
format lists), checks the combinations no encoder can honour, and builds the specs in the
listed order (the first one is the primary variant). Problems come back as
(section, key, message), and `derivd.config` adds the file name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

from derivd.handlers.base import ANIMATED_FORMATS, AVIF_MAX_PIXELS, FORMATS, VariantSpec


class VariantValues(Protocol):
    """What this module reads of a `[variant:NAME]` section (`derivd.config.VariantSettings`
    declares the keys; naming them here keeps this module below the config that uses it)."""

    @property
    def size(self) -> str: ...
    @property
    def fit(self) -> str: ...
    @property
    def gravity(self) -> str: ...
    @property
    def format(self) -> str: ...
    @property
    def quality(self) -> int: ...
    @property
    def lossless(self) -> bool: ...
    @property
    def upscale(self) -> bool: ...
    @property
    def animated(self) -> bool: ...


SECTION_PREFIX = "variant:"
MAX_SIDE = 16383  # WebP's limit per side, the smallest of the four formats
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_SHORTHAND = re.compile(r"^([a-z0-9][a-z0-9_-]{0,31}):([0-9]{1,5})$")
_BOX = re.compile(r"^([0-9]{1,5})\s*[xX]\s*([0-9]{1,5})$")

VariantProblem = tuple[str, str | None, str]  # section, key (None: the section), message


def is_variant_section(section: str) -> bool:
    return section.startswith(SECTION_PREFIX)


def parse_size(text: str) -> int | tuple[int, int]:
    """`EDGE` -> EDGE; `WxH` -> (W, H). ValueError when it is neither, or out of range."""
    text = text.strip()
    box = _BOX.match(text)
    sides = [int(box.group(1)), int(box.group(2))] if box else None
    if sides is None:
        if not text.isdigit() or len(text) > 5:
            raise ValueError(f"{text!r} is not EDGE or WxH (e.g. 1600 or 320x320)")
        sides = [int(text)]
    if not all(1 <= side <= MAX_SIDE for side in sides):
        raise ValueError(f"{text!r}: each side must be between 1 and {MAX_SIDE} px")
    return (sides[0], sides[1]) if box else sides[0]


def parse_formats(text: str) -> tuple[str, ...]:
    """`avif, webp` -> ("avif", "webp"); at least one, each known, none twice."""
    formats = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    if not formats:
        raise ValueError(f"name one or more of: {', '.join(FORMATS)}")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown format {unknown[0]!r}; known: {', '.join(FORMATS)}")
    if len(set(formats)) != len(formats):
        raise ValueError("a format is listed twice")
    return formats


def check_size(value: str) -> str | None:
    if not value:
        return None  # required, but reported once per section by `build_variants`
    try:
        parse_size(value)
    except ValueError as error:
        return str(error)
    return None


def check_formats(value: str) -> str | None:
    try:
        parse_formats(value)
    except ValueError as error:
        return str(error)
    return None


def check_listed(value: str) -> str | None:
    """The `[derive] variants` list itself: names or `name:EDGE`, none twice."""
    names: list[str] = []
    for item in _items(value):
        shorthand = _SHORTHAND.match(item)
        name = shorthand.group(1) if shorthand else item
        if shorthand and int(shorthand.group(2)) < 1:
            return f"{item!r}: the long edge must be at least 1 px"
        if not shorthand and not _NAME.match(item):
            return f"{item!r} is not name:EDGE (e.g. thumb:320) or a [variant:NAME] name"
        if name in names:
            return f"variant {name!r} is listed twice"
        names.append(name)
    return None


def _items(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_variants(
    listed: str, sections: Mapping[str, VariantValues]
) -> tuple[tuple[VariantSpec, ...], list[VariantProblem]]:
    """The specs for `[derive] variants = listed`, given the `[variant:NAME]` sections
    (keyed by NAME), and every problem found."""
    problems: list[VariantProblem] = []
    specs: list[VariantSpec] = []
    for item in _items(listed):
        shorthand = _SHORTHAND.match(item)
        if shorthand:
            name = shorthand.group(1)
            if name in sections:
                clash = f"{item!r}: [{SECTION_PREFIX}{name}] exists too; list it as {name!r}"
                problems.append(("derive", "variants", clash))
            specs.append(VariantSpec(name, int(shorthand.group(2))))
        elif item in sections:
            spec = _from_section(item, sections[item], problems)
            if spec is not None:
                specs.append(spec)
        else:
            problems.append(("derive", "variants", f"{item!r} has no [{SECTION_PREFIX}{item}] "
                             "section (or write it as name:EDGE)"))  # fmt: skip
    names = {spec.name for spec in specs}
    for name in sections:
        section = SECTION_PREFIX + name
        if not _NAME.match(name):
            problems.append((section, None, "NAME must be lower-case letters, digits, - or _"))
        elif name not in names and not any(p[0] == section for p in problems):
            # The key to change is the list, not anything inside the section.
            unlisted = (
                f"does not list {name!r}, yet [{section}] exists: list it or remove the section"
            )
            problems.append(("derive", "variants", unlisted))
    return tuple(specs), problems


def _from_section(
    name: str, values: VariantValues, problems: list[VariantProblem]
) -> VariantSpec | None:
    section = SECTION_PREFIX + name
    found: list[VariantProblem] = []

    def problem(key: str, message: str) -> None:
        found.append((section, key, message))

    if not values.size:
        problem("size", "required: EDGE (long edge) or WxH (a box)")
        size: int | tuple[int, int] = 1
    else:
        size = parse_size(values.size)  # the declared check already passed
    formats = parse_formats(values.format)
    if values.fit == "cover" and not isinstance(size, tuple):
        problem("fit", "cover fills a box: give size as WxH (e.g. 320x320)")
    if values.gravity != "centre" and values.fit != "cover":
        problem("gravity", "only fit = cover crops, so only it takes a gravity")
    if values.lossless and formats != ("webp",):
        problem("lossless", f"lossless is for webp only, not {_others(formats, {'webp'})}")
    if values.animated and not set(formats) <= ANIMATED_FORMATS:
        problem("animated", f"{_others(formats, ANIMATED_FORMATS)} cannot hold an animation; "
                "use webp or avif")  # fmt: skip
    if "avif" in formats and _area(size) > AVIF_MAX_PIXELS:
        problem("size", f"avif holds at most {AVIF_MAX_PIXELS:,} px (4096x4096); an EDGE "
                "bounds EDGE x EDGE")  # fmt: skip
    if values.quality and formats == ("png",):
        problem("quality", "png is lossless: quality does not apply")
    problems.extend(found)
    if found:
        return None
    return VariantSpec(
        name,
        long_edge=size if isinstance(size, int) else 0,
        box=size if isinstance(size, tuple) else None,
        fit=values.fit,
        gravity=values.gravity,
        formats=formats,
        quality=values.quality or None,
        lossless=values.lossless,
        upscale=values.upscale,
        animated=values.animated,
    )


def _area(size: int | tuple[int, int]) -> int:
    return size[0] * size[1] if isinstance(size, tuple) else size * size


def _others(formats: tuple[str, ...], allowed: frozenset[str] | set[str]) -> str:
    return ", ".join(f for f in formats if f not in allowed)
