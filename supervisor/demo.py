"""`derivd demo`: sample images of several formats and sizes, processed end to end."""

from __future__ import annotations

import dataclasses
import io
import logging
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
from PIL import Image, ImageDraw

from derivd import client
from derivd.config import Config, DatabaseSettings, StorageSettings
from derivd.embedded.runtime import database
from derivd.ops.enqueue import upload_and_queue
from derivd.ops.gallery import Sample, write_gallery
from derivd.processes.daemon import run_daemon
from derivd.queue.db import QueueDB
from derivd.storage.configured import open_storage
from derivd.storage.fs import FsStorage


def _gradient(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = random.Random(seed)
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = rng.randrange(width), rng.randrange(height)
        r = rng.randrange(max(2, min(width, height) // 10), max(3, min(width, height) // 3))
        colour = tuple(rng.randrange(256) for _ in range(3))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    return image.convert(mode) if mode != "RGB" else image


def _encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


# (file name pattern, width, height, format, mode, save options)
_GOOD: list[tuple[str, int, int, str, str, dict[str, Any]]] = [
    ("photo-{i}.jpg", 4000, 3000, "JPEG", "RGB", {"quality": 88}),
    ("progressive-{i}.jpg", 2400, 1600, "JPEG", "RGB", {"progressive": True}),
    ("alpha-{i}.png", 1200, 900, "PNG", "RGBA", {}),
    ("palette-{i}.png", 800, 600, "PNG", "P", {}),
    ("grey-{i}.tif", 1600, 1200, "TIFF", "L", {"compression": "tiff_deflate"}),
    ("wide-{i}.webp", 3840, 2160, "WEBP", "RGB", {"quality": 90}),
    ("small-{i}.gif", 300, 200, "GIF", "P", {}),
    ("tiny-{i}.png", 120, 80, "PNG", "RGB", {}),
]


def generate_samples(folder: Path, count: int) -> list[Path]:
    """`count` good images cycling through the formats above, plus two bad ones."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for i in range(count):
        pattern, width, height, fmt, mode, options = _GOOD[i % len(_GOOD)]
        path = folder / pattern.format(i=i)
        if not path.exists():
            path.write_bytes(_encode(_gradient(width, height, i, mode), fmt, **options))
        paths.append(path)
    truncated = folder / "bad-truncated.jpg"
    photo = _encode(_gradient(640, 480, 99), "JPEG")
    truncated.write_bytes(photo[: len(photo) // 2])
    not_an_image = folder / "bad-not-an-image.jpg"
    not_an_image.write_bytes(b"<html><body>this is not a JPEG</body></html>\n")
    return [*paths, truncated, not_an_image]


FINAL = ("ready", "rejected")


class Progress(threading.Thread):
    """Prints `done/total` of the demo's own rows while they drain (read twice a second;
    with `--into` the database holds other rows, which are none of its business): one
    line rewritten in place on a terminal, a new line per change in a log or a pipe."""

    def __init__(self, dsn: str, ids: list[int], *, live: bool | None = None) -> None:
        super().__init__(daemon=True)
        self.dsn, self.ids, self.total = dsn, ids, len(ids)
        self.live = sys.stderr.isatty() if live is None else live
        self.finished = threading.Event()

    def run(self) -> None:
        shown = -1
        with QueueDB.open(self.dsn, role="derivd-demo-progress") as queue:
            last_round = False
            while not last_round:
                last_round = self.finished.wait(0.5)  # one more read after the drain
                done = sum(s in FINAL for s in queue.statuses(self.ids).values())
                if done != shown:
                    self.show(f"processed {done}/{self.total}")
                    shown = done
        if self.live:
            click.echo("", err=True)

    def show(self, text: str) -> None:
        if self.live:
            click.echo(f"\r{text}", err=True, nl=False)
        else:
            click.echo(text, err=True)


def quiet_job_logs() -> None:
    """The demo shows a progress line instead of one log line per job (unless debugging);
    forked workers inherit the level."""
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("derivd").setLevel(logging.WARNING)


def demo_config(config: Config, *, into: str | None) -> Config:
    """What the demo runs on: the embedded database and an fs store under state_dir,
    whatever the config names (its samples include bad ones: never a production
    database by accident); with `into`, that database and the configured store."""
    if into:
        return config.replace("database", dsn=into, listen_dsn="")
    return dataclasses.replace(config, database=DatabaseSettings(), storage=StorageSettings())


def run_demo(config: Config, *, count: int) -> int:
    samples = generate_samples(config.state_dir / "samples", count)
    storage = open_storage(config)
    storage.check()
    with database(config) as dsn:
        with QueueDB.open(dsn, role="derivd-demo") as queue:
            ids = upload_and_queue(samples, storage, queue)
        click.echo(f"queued {len(ids)} sample images from {samples[0].parent}", err=True)
        progress = Progress(dsn, ids)
        progress.start()
        quiet_job_logs()
        started = time.monotonic()
        code = run_daemon(config, burst=True, dsn=dsn)
        elapsed = time.monotonic() - started
        progress.finished.set()
        progress.join()
        with QueueDB.open(dsn, role="derivd-demo") as queue:
            rows = [queue.file_row(i) for i in ids]
            variants = [queue.file_variants(i) for i in ids]
            # What an app gets at `ready`, through the app's own call.
            originals = [client.result(queue.conn, i).original for i in ids]
    statuses = [row["status"] if row else "missing" for row in rows]
    ready = statuses.count("ready")
    rejected = [
        (path.name, row["error_code"])
        for path, row in zip(samples, rows, strict=True)
        if row and row["status"] == "rejected"
    ]
    click.echo(
        f"ready: {ready}  rejected: {len(rejected)}  other: {len(statuses) - ready - len(rejected)}"
    )
    for name, error_code in rejected:
        click.echo(f"  rejected {name}: {error_code}")
    click.echo(
        f"throughput: {len(ids) / elapsed:.1f} images/s "
        f"({elapsed:.1f}s, backend {config.derive.backend})"
    )
    click.echo(
        f"derived files: {config.fs_root / 'derived'}"
        if config.storage.backend == "fs"
        else f"derived files: s3://{config.storage.bucket}/{config.storage.prefix}derived/"
    )
    example = next((row for row in rows if row and row["derived_key"]), None)
    if example is not None and isinstance(storage, FsStorage):
        # The fs store keeps versions as <key>.versions/<version id>.webp: show one for real.
        path = storage.path_of(example["derived_key"], example["derived_version"])
        click.echo(f"  e.g. {path}")
    gallery = write_gallery(
        config.state_dir / "demo",
        [
            Sample(path, row["status"], row["error_code"], found, analysis)
            if row
            else Sample(path, "missing", None, ())
            for path, row, found, analysis in zip(samples, rows, variants, originals, strict=True)
        ],
        storage,
    )
    click.echo(f"gallery: {gallery}")  # the last line: the page to open
    unfinished = len(statuses) - ready - len(rejected)
    return code if unfinished == 0 else 1
