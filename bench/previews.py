"""Previews of videos and PDFs: derivd against the CLI pipeline an Active Storage
deployment runs, side by side in one run.

    .venv/bin/python bench/previews.py [--copies 12] [--rounds 2] [--out bench/out/previews.json]

Inputs, made here: H.264 clips at 1080p and 4K and an HEVC clip at 1080p (PyAV's x264
and x265, 2 s at 30 fps, a keyframe a second, grain over a moving gradient so the
encoders have texture), and a 50-page PDF (text in Helvetica and vector shapes on every
page). Each is previewed into derivd's default variants (`preview:1600, thumb:320`,
WebP quality 80, effort 4) `--copies` times a round by both sides (odd rounds run
derivd first, so neither side always gets the quieter minutes of a shared machine):

- derivd: `derivd run --burst`, one worker (`[derive] concurrency = 1`, vips backend),
  the copies queued on an embedded PostgreSQL (fsync on), the fs store (objects
  fsynced), fenced commits: the whole daemon. Images/s: copies over first claim to last
  finish (database clock); CPU a preview: the run's user + system CPU (supervisor and
  worker, boot included; PostgreSQL's not) over the copies; latency: each row's claim
  to its `ready`, p50 and p95.
- cli: one preview after the other, each a shell running what Rails' previewers run
  (ActiveStorage::Previewer::VideoPreviewer: `ffmpeg` with its `select` filter for the
  first keyframe or scene change, one JPEG; PopplerPDFPreviewer: `pdftoppm -singlefile
  -cropbox -r 72 -png`), then `vipsthumbnail` once per variant (the variant processor).
  Images/s: copies over the sum of the runs' wall time; CPU: getrusage of the shell and
  everything it waited for; latency: one run's wall time. ffmpeg runs with its own
  default threads (one per core), as Rails leaves it.
  `pdf_50_pages_at_size` is the same with `pdftoppm -scale-to 1600`: poppler drawing
  the page at the size the 1600 px variant needs, as derivd does (at 72 dpi the preview
  variant is 612 x 792, blurred up nowhere but smaller than asked).

Needs ffmpeg, pdftoppm and vipsthumbnail on the PATH (Debian: ffmpeg poppler-utils
libvips-tools); derivd needs none of them. Prints a table, writes the JSON that
bench/plots.py draws (chart-previews.png).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import av
import numpy as np
import psycopg
from common import (
    OUT,
    burst_drain,
    cluster,
    fresh_db,
    machine,
    measured,
    percentile,
    save_results,
    store_and_queue,
    table,
)

VARIANTS = (("preview", 1600), ("thumb", 320))
QUALITY, EFFORT = 80, 4
TOOLS = ("ffmpeg", "pdftoppm", "vipsthumbnail")
# Rails 7's VideoPreviewer: the first frame, else the first keyframe or scene change.
RAILS_SELECT = r"select=eq(n\,0)+eq(key\,1)+gt(scene\,0.015),loop=loop=-1:size=2,trim=start_frame=1"


def clip(path: Path, encoder: str, size: tuple[int, int], seconds: float = 2.0,
         fps: int = 30) -> Path:  # fmt: skip
    """A clip with texture: grain over a gradient that moves a little every frame."""
    rng = np.random.default_rng(7)
    width, height = size
    rows, cols = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as out:
        stream = out.add_stream(encoder, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": str(fps)}
        if encoder == "libx265":
            stream.options = {"preset": "ultrafast", "x265-params": f"keyint={fps}:log-level=error"}
        grain = rng.integers(0, 24, (height, width, 1), dtype=np.uint8)
        for index in range(int(seconds * fps)):
            base = np.stack([(cols + index * 8) * 255 // width, rows * 255 // height,
                             np.full_like(cols, 128)], -1).astype(np.uint8)  # fmt: skip
            picture = base + grain
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def document(path: Path, pages: int = 50) -> Path:
    """A PDF of `pages` pages, each with lines of Helvetica text and coloured shapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    import pdfgen

    text = b" ".join(
        b"BT /F1 11 Tf 56 %d Td (Invoice line %d: derivd previews PDFs with PDFium.) Tj ET"
        % (740 - 14 * line, line) for line in range(48))  # fmt: skip
    shapes = b"0.2 0.4 0.8 rg 56 40 500 20 re f 0.9 0.3 0.1 RG 4 w 300 400 m 500 600 l S"
    kids = b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]  # fmt: skip
    for i in range(pages):
        page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources "
        objects.append(page + b"<< /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (5 + 2 * i))
        objects.append(pdfgen.stream(shapes + b" " + text))
    path.write_bytes(pdfgen.document(objects))
    return path


def make_inputs(folder: Path) -> dict[str, Path]:
    inputs = {
        "h264_1080p": clip(folder / "h264_1080p.mp4", "libx264", (1920, 1080)),
        "h264_4k": clip(folder / "h264_4k.mp4", "libx264", (3840, 2160)),
        "pdf_50_pages": document(folder / "fifty.pdf"),
    }
    if "libx265" in av.codecs_available:
        inputs["hevc_1080p"] = clip(folder / "hevc_1080p.mp4", "libx265", (1920, 1080))
    return inputs


def cli_command(case: str, source: Path, work: Path) -> list[str]:
    """The shell a Rails deployment runs for one preview and its variants."""
    if case.startswith("pdf"):
        size = "-scale-to 1600" if case.endswith("at_size") else "-r 72"
        first = f"pdftoppm -singlefile -cropbox {size} -png {source} {work}/page"
        image = f"{work}/page.png"
    else:
        first = (f"ffmpeg -loglevel error -i {source} -y -vf '{RAILS_SELECT}' -frames:v 1 "
                 f"-f image2 {work}/frame.jpg")  # fmt: skip
        image = f"{work}/frame.jpg"
    thumbs = [f"vipsthumbnail {image} -s {edge} -o {work}/{name}.webp[Q={QUALITY},"
              f"effort={EFFORT},strip]" for name, edge in VARIANTS]  # fmt: skip
    return ["sh", "-c", " && ".join([first, *thumbs])]


def run_cli(case: str, source: Path, copies: int, work: Path) -> dict[str, float]:
    runs = [measured(cli_command(case, source, work), work / "cli.log") for _ in range(copies)]
    walls = [r.wall_s for r in runs]
    cpu_s = sum(r.cpu_s for r in runs)
    return summary(copies, sum(walls), cpu_s, walls)


def summary(copies: int, wall_s: float, cpu_s: float, latencies: list[float]) -> dict[str, float]:
    """images/s, CPU ms a preview, p50 and p95 latency (ms)."""
    return {
        "images_per_s": copies / wall_s,
        "cpu_ms": 1000 * cpu_s / copies,
        "p50_ms": 1000 * percentile(latencies, 50),
        "p95_ms": 1000 * percentile(latencies, 95),
    }


def run_derivd(pg: Any, case: str, source: Path, copies: int, work: Path, tag: str
               ) -> dict[str, float]:  # fmt: skip
    dsn = fresh_db(pg, f"previews_{tag}")
    store = work / f"objects-{tag}"
    store_and_queue(dsn, store, [(f"originals/{i}-{source.name}", source) for i in range(copies)])
    ini = work / "derivd.ini"
    ini.write_text(
        f"[database]\ndsn = {dsn}\n[storage]\nbackend = fs\nroot = {store}\n"
        f"[supervisor]\nworkers = 1\nstate_dir = {work / 'state'}\n"
        f"[derive]\nbackend = vips\nquality = {QUALITY}\neffort = {EFFORT}\nconcurrency = 1\n"
        f"variants = {', '.join(f'{n}:{e}' for n, e in VARIANTS)}\n",
        encoding="utf-8",
    )
    burst = burst_drain(ini, work / "derivd.log", dsn)
    if burst.ready != copies:
        raise SystemExit(f"derivd left {copies - burst.ready} previews of {case} unfinished; "
                         f"see {work / 'derivd.log'}")  # fmt: skip
    with psycopg.connect(dsn) as conn:
        served = [float(r[0]) for r in conn.execute(
            "SELECT extract(epoch FROM finished_at - claimed_at) FROM archive_files")]  # fmt: skip
    return summary(copies, burst.drain_s, burst.cpu_s, served)


def one_round(pg: Any, inputs: dict[str, Path], copies: int, work: Path, index: int
              ) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    cases = [*inputs, "pdf_50_pages_at_size"]
    for case in cases:
        source = inputs["pdf_50_pages" if case.startswith("pdf") else case]
        order = ("cli", "derivd") if index % 2 == 0 else ("derivd", "cli")
        sides: dict[str, dict[str, float]] = {}
        for side in order:
            print(f"round {index + 1}: {case}: {side} ...", file=sys.stderr, flush=True)
            if side == "cli":
                sides[side] = run_cli(case, source, copies, work)
            elif case.endswith("at_size"):
                sides[side] = rows[[r["case"] for r in rows].index("pdf_50_pages")]["derivd"]
            else:
                sides[side] = run_derivd(pg, case, source, copies, work, f"{case}_{index}")
        rows.append({"case": case, "round": index + 1, "copies": copies, **sides,
                     "speedup": sides["derivd"]["images_per_s"] / sides["cli"]["images_per_s"],
                     "cpu_ratio": sides["cli"]["cpu_ms"] / sides["derivd"]["cpu_ms"]})  # fmt: skip
    return rows


def median_rows(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case's round with the median wall-clock ratio, and the medians of both ratios."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rounds):
        mine = sorted((r for r in rounds if r["case"] == case), key=lambda r: r["speedup"])
        speedups = [r["speedup"] for r in mine]
        cpu_ratios = [r["cpu_ratio"] for r in mine]
        out.append({**mine[len(mine) // 2], "speedup_median": statistics.median(speedups),
                    "cpu_ratio_median": statistics.median(cpu_ratios)})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=12, help="previews of each input a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT / "previews.json")
    args = parser.parse_args()
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"bench/previews.py needs {', '.join(missing)} for the CLI side "
                         "(apt-get install ffmpeg poppler-utils libvips-tools)")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="derivd-previews-"))
    try:
        inputs = make_inputs(work)
        with cluster() as pg:
            lines = machine(fresh_db(pg, "previews_machine", derivd_schema=False))
            rounds = [row for index in range(args.rounds)
                      for row in one_round(pg, inputs, args.copies, work, index)]  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = median_rows(rounds)
    figures = figures_text(results, rounds, args.copies)
    print("\n".join(lines))
    print(figures)
    path = save_results(args.out.stem, {"machine": lines, "results": results, "rounds": rounds,
                                        "copies": args.copies, "figures": figures})  # fmt: skip
    print(f"wrote {path}", file=sys.stderr)


def figures_text(results: list[dict[str, Any]], rounds: list[dict[str, Any]], copies: int) -> str:
    """The table and what it says, as RESULTS.md shows them (bench/results.py)."""
    headers = ["case", "side", "images/s", "CPU ms/preview", "p50 ms", "p95 ms",
               "derivd/cli images/s", "cli/derivd CPU"]  # fmt: skip
    body = []
    for r in results:
        for side in ("derivd", "cli"):
            s = r[side]
            ratio = (f"{r['speedup_median']:.2f}x", f"{r['cpu_ratio_median']:.2f}x") if (
                side == "derivd") else ("", "")  # fmt: skip
            body.append([r["case"], side, s["images_per_s"], s["cpu_ms"], s["p50_ms"],
                         s["p95_ms"], *ratio])  # fmt: skip
    speedups = [r["speedup"] for r in rounds]
    cpu = [r["cpu_ratio"] for r in rounds]
    return "\n\n".join([
        f"Each input previewed into `preview:1600, thumb:320` (WebP q{QUALITY}, effort "
        f"{EFFORT}) {copies} times a round by both sides, {len(rounds) // len(results)} "
        "rounds, order alternating. derivd: `derivd run --burst`, one worker, vips, "
        "`concurrency = 1`, the whole daemon (its boot in its CPU). cli: Rails' "
        "previewers' commands (`ffmpeg` with VideoPreviewer's `select` filter, its default "
        "threads; `pdftoppm -r 72`, or `-scale-to 1600` for `pdf_50_pages_at_size`), then "
        "`vipsthumbnail` per variant. Latency: derivd, a row's claim to its `ready`; cli, "
        "one run. The median round by images/s; the ratios are medians over the rounds.",
        table(headers, body),
        f"Over every round: derivd/cli images/s {min(speedups):.2f}-{max(speedups):.2f}x, "
        f"cli/derivd CPU per preview {min(cpu):.2f}-{max(cpu):.2f}x.",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
