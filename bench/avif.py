"""AVIF vs WebP at the pinned encoder settings, both backends: time, bytes and fidelity.

    .venv/bin/python bench/avif.py [--repeat 3]            # the comparison at the defaults
    .venv/bin/python bench/avif.py --calibrate              # the sweep behind AVIF_QUALITY

Comparison: for each output size (1600 and 320 long edge, and a 1200x630 cover) and
backend, the handler derives one variant from a photo-like 12 MP JPEG (a generated scene
with heavy grain) and from the corpus photograph Landscape_0.jpg in WebP and then in
AVIF at `[derive] quality` 80 and effort 4 (WebP effort 4; AVIF effort 2 = aom cpu-used 7,
and the AVIF quality that `AVIF_QUALITY` in derivd/handlers/outputs.py maps 80 to). Times
are whole derivations (median of N after a warm-up); decode and resize are the same for
both formats, so the difference is the encode. libvips runs with concurrency 1, Pillow's
AVIF encoder with one thread, as in a worker. Fidelity is SSIM on luma (tests/support/fidelity.py)
against the same variant written as PNG by the same handler: the pixels the encoder was
given.

Calibration (`--calibrate`): on photo-like images (the two untagged photographs of
tests/corpus/exif-orientation, and generated scenes with heavy, light and no grain) and
the 1600 and 320 sizes, each backend encodes WebP at several qualities and AVIF at
several libavif qualities (the encoder's own number, bypassing the mapping); for each
WebP quality the AVIF quality of equal SSIM is read off the AVIF curve by linear
interpolation, per image, and the median over images and sizes is printed per backend
and for both together: the table pinned as `AVIF_QUALITY`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

os.environ.setdefault("VIPS_CONCURRENCY", "1")

from fidelity import ssim  # noqa: E402  # tests/support/fidelity.py: the one SSIM

SIZES = (("1600", (1600, 1600), "inside"), ("320", (320, 320), "inside"),
         ("1200x630", (1200, 630), "cover"))  # fmt: skip
QUALITY, EFFORT = 80, 4
WEBP_SWEEP = (50, 60, 70, 80, 90)
AVIF_SWEEP = (20, 30, 40, 50, 60, 70, 80, 90)
FLAT = 0.02  # SSIM spread over WEBP_SWEEP below which an input says nothing (--calibrate)
CORPUS = ROOT / "tests" / "corpus" / "exif-orientation"


def photo(grain: int = 32, size: tuple[int, int] = (4240, 2832)) -> bytes:
    """A generated scene blended with grain (0: none), as a q90 JPEG."""
    import imagegen
    from PIL import Image

    scene = imagegen.scene(*size)
    if grain:
        noise = Image.effect_noise(scene.size, grain).convert("RGB")
        scene = Image.blend(scene, noise, 0.25)
    buf = io.BytesIO()
    scene.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def calibration_inputs() -> dict[str, bytes]:
    return {
        "corpus-landscape": (CORPUS / "Landscape_0.jpg").read_bytes(),
        "corpus-portrait": (CORPUS / "Portrait_0.jpg").read_bytes(),
        "scene-grain32": photo(32),
        "scene-grain8": photo(8),
        "scene-smooth": photo(0),
    }


# --- fidelity --------------------------------------------------------------------------------


# --- derivations -----------------------------------------------------------------------------


def _spec(box: tuple[int, int], fit: str, fmt: str, quality: int = QUALITY) -> Any:
    from derivd.handlers.base import DeriveSpec, VariantSpec

    return DeriveSpec(variants=(VariantSpec("v", box=box, fit=fit, formats=(fmt,)),),
                      quality=quality, effort=EFFORT, concurrency=1)  # fmt: skip


def derive(backend: str, data: bytes, spec: Any) -> bytes:
    from derivd.handlers.registry import create_handler

    (out,) = create_handler(backend, spec).derive(data, spec)
    return bytes(out.data)


def timed(backend: str, data: bytes, spec: Any, repeat: int) -> tuple[float, bytes]:
    from derivd.handlers.registry import create_handler

    handler = create_handler(backend, spec)
    out = handler.derive(data, spec)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = handler.derive(data, spec)
        times.append(time.perf_counter() - start)
    return statistics.median(times), bytes(out[0].data)


COMPARE_INPUTS = ("12 MP grainy scene (JPEG q90)", "corpus Landscape_0.jpg (1800x1200 photo)")


def compare(repeat: int) -> list[dict[str, Any]]:
    from derivd.handlers.outputs import avif_quality

    inputs = dict(zip(COMPARE_INPUTS, (photo(), (CORPUS / "Landscape_0.jpg").read_bytes()),
                      strict=True))  # fmt: skip
    rows = []
    for name, data in inputs.items():
        print(name)
        print(f"  {'backend':7} {'size':9} {'webp ms':>8} {'avif ms':>8} {'avif/webp':>9} "
              f"{'webp B':>8} {'avif B':>8} {'bytes':>6} {'webp ssim':>9} "
              f"{'avif ssim':>9}")  # fmt: skip
        for backend in ("vips", "pillow"):
            for label, box, fit in SIZES:
                rows.append(_compare_one(name, data, backend, label, box, fit, repeat))
    print(f"quality {QUALITY}: webp q{QUALITY}, avif q{avif_quality(QUALITY)} (AVIF_QUALITY)")
    return rows


def _compare_one(name: str, data: bytes, backend: str, label: str, box: tuple[int, int],
                 fit: str, repeat: int) -> dict[str, Any]:  # fmt: skip
    reference = derive(backend, data, _spec(box, fit, "png"))
    webp_s, webp = timed(backend, data, _spec(box, fit, "webp"), repeat)
    avif_s, avif = timed(backend, data, _spec(box, fit, "avif"), repeat)
    row = {"input": name, "backend": backend, "size": label, "fit": fit,
           "webp_ms": webp_s * 1000, "avif_ms": avif_s * 1000,
           "webp_bytes": len(webp), "avif_bytes": len(avif),
           "webp_ssim": ssim(reference, webp), "avif_ssim": ssim(reference, avif)}  # fmt: skip
    print(f"  {backend:7} {label:9} {webp_s * 1000:8.0f} {avif_s * 1000:8.0f} "
          f"{avif_s / webp_s:9.2f} {len(webp):8d} {len(avif):8d} "
          f"{len(avif) / len(webp):6.2f} {row['webp_ssim']:9.4f} {row['avif_ssim']:9.4f}",
          flush=True)  # fmt: skip
    return row


# --- calibration -----------------------------------------------------------------------------


def _avif_at(backend: str, data: bytes, spec: Any, quality: int) -> bytes:
    """AVIF at libavif's own quality number, bypassing AVIF_QUALITY."""
    import derivd.handlers.outputs as outputs

    saved = outputs.AVIF_QUALITY
    outputs.AVIF_QUALITY = ((1, 1), (100, 100))
    try:
        return derive(backend, data, replace(spec, quality=quality))
    finally:
        outputs.AVIF_QUALITY = saved


def _interpolate(target: float, curve: list[tuple[float, float]]) -> float:
    """The x where the (x, ssim) curve, sorted by x, reaches `target` (clamped)."""
    for (x0, y0), (x1, y1) in pairwise(curve):
        if y0 <= target <= y1 and y1 > y0:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return curve[0][0] if target < curve[0][1] else curve[-1][0]


def calibrate() -> dict[str, Any]:
    inputs = calibration_inputs()
    matched: dict[str, dict[int, list[float]]] = {}
    points = []
    for backend in ("vips", "pillow"):
        for name, data in inputs.items():
            for label, box, fit in SIZES[:2]:
                spec = _spec(box, fit, "webp")
                reference = derive(backend, data, _spec(box, fit, "png"))
                webp = {q: derive(backend, data, replace(spec, quality=q)) for q in WEBP_SWEEP}
                avif_spec = _spec(box, fit, "avif")
                avif = {q: _avif_at(backend, data, avif_spec, q) for q in AVIF_SWEEP}
                curve = [(float(q), ssim(reference, b)) for q, b in avif.items()]
                webp_ssim = {q: ssim(reference, b) for q, b in webp.items()}
                # A flat curve (SSIM moving < FLAT across the whole sweep: smooth scenes,
                # grain both encoders drop at every quality) matches any quality.
                informative = max(webp_ssim.values()) - min(webp_ssim.values()) >= FLAT
                for q, b in webp.items():
                    s = webp_ssim[q]
                    at = _interpolate(s, curve)
                    if informative:
                        matched.setdefault(backend, {}).setdefault(q, []).append(at)
                    points.append({"backend": backend, "input": name, "size": label,
                                   "webp_q": q, "webp_bytes": len(b), "webp_ssim": s,
                                   "avif_q_same_ssim": at, "used": informative})  # fmt: skip
                print(f"{backend:7} {name:17} {label:5} {'used' if informative else 'flat'} "
                      + " ".join(f"w{q}:{webp_ssim[q]:.3f}/{len(b)}" for q, b in webp.items())
                      + " | " + " ".join(f"a{q:.0f}:{s:.3f}/{len(avif[int(q)])}"
                                         for q, s in curve), flush=True)  # fmt: skip
    table: dict[str, dict[int, float]] = {}
    for backend, by_q in matched.items():
        table[backend] = {q: statistics.median(v) for q, v in by_q.items()}
    both = {q: statistics.median(matched["vips"][q] + matched["pillow"][q]) for q in WEBP_SWEEP}
    table["both"] = both
    print("webp quality -> avif quality of the same luma SSIM (median over inputs and sizes)")
    for who, row in table.items():
        print(f"  {who:7} " + "  ".join(f"{q}->{v:.1f}" for q, v in row.items()))
    return {"points": points, "table": {k: {str(q): v for q, v in r.items()}
                                        for k, r in table.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out_dir = ROOT / "bench" / "out"
    if args.calibrate:
        result: dict[str, Any] = {"bench": "avif-calibration", "effort": EFFORT,
                                  **calibrate()}  # fmt: skip
        out = args.out or out_dir / "avif-calibration.json"
    else:
        from derivd.handlers.outputs import avif_quality

        result = {"bench": "avif", "quality": QUALITY, "avif_quality": avif_quality(QUALITY),
                  "effort": EFFORT, "inputs": list(COMPARE_INPUTS),
                  "rows": compare(args.repeat)}  # fmt: skip
        out = args.out or out_dir / "avif.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
