"""The fingerprint of a variant's spec: what made its bytes, as a short digest.

Every stored variant (one row per variant and format) records it (migration 0014), so
`derivd backfill` can tell which files were made with another spec than the configured
one. It covers every setting that changes the bytes: the variant's size or box, fit,
gravity, the row's format, its effective quality, lossless, upscale, animated, plus the
backend, the WebP effort and the shrink-on-load rule (`fast` decodes at a smaller
scale). Not the variant's name (that is the key it is compared under) nor the limits
(they decide whether a file is derived, not how).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

from derivd.handlers.base import DeriveSpec, VariantSpec
from derivd.handlers.outputs import quality_of

# Bumped when the meaning of a field changes (every stored fingerprint then differs).
VERSION = 1


def fingerprint(variant: VariantSpec, fmt: str, spec: DeriveSpec, backend: str) -> str:
    """16 hex digits for `variant` stored as `fmt` by `backend` under `spec`."""
    fields = {
        "v": VERSION,
        "size": list(variant.box) if variant.box else variant.long_edge,
        "fit": variant.fit,
        "gravity": variant.gravity if variant.fit == "cover" else None,
        "format": fmt,
        "quality": None if fmt == "png" or variant.lossless else quality_of(variant, spec),
        "lossless": variant.lossless,
        "upscale": variant.upscale,
        "animated": variant.animated,
        "effort": spec.effort if fmt == "webp" else None,
        "backend": backend,
        "shrink_on_load": spec.shrink_on_load,
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def slot(name: str, fmt: str) -> str:
    """How one stored variant row is named in a set: `thumb.webp`."""
    return f"{name}.{fmt}"


def configured_set(spec: DeriveSpec, backend: str) -> dict[str, str]:
    """slot -> fingerprint of every variant and format the configuration asks for."""
    return {
        slot(v.name, fmt): fingerprint(v, fmt, spec, backend)
        for v in spec.variants
        for fmt in v.formats
    }


def target_digest(configured: Mapping[str, str]) -> str:
    """One digest of a whole configured set: a backfill resumes only toward the same."""
    text = json.dumps(sorted(configured.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def set_problem(
    produced: Iterable[str], configured: Mapping[str, str], *, rederive: bool
) -> str | None:
    """Why a derived set of slots (`name.format`, one per stored variant) may not be
    committed, or None. It must be exactly the configured set; a first derivation may
    also be empty (a backend that derives nothing by design: noop, an analysis-only
    plugin), a re-derivation never (it exists to swap the configured set in)."""
    slots = list(produced)
    if not slots:
        return "derived no variant" if rederive else None
    twice = sorted({s for s in slots if slots.count(s) > 1})
    if twice:
        return f"twice: {', '.join(twice)}"
    missing = [s for s in configured if s not in slots]
    if missing:
        return f"missing {', '.join(missing)}"
    extra = [s for s in slots if s not in configured]
    if extra:
        return f"not configured: {', '.join(extra)}"
    return None
