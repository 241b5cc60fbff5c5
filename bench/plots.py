"""`python bench/plots.py`: PNG charts in bench/charts/ from the benchmarks' machine-readable
outputs (bench/out/*.json); bench/results.py puts each under its benchmark's figures.

    throughput.json  (bench/throughput.py)   -> chart-throughput.png: derivd vs peers
    latency.json     (bench/latency.py)      -> chart-latency.png: pickup latency CDF
    derive.json      (bench/derive.py)       -> chart-derive.png: ours vs plain per input
    e2e.json         (bench/e2e.py)          -> chart-e2e.png: derivd vs a naive pool
    fleet.json       (bench/fleet.py)        -> chart-fleet.png: the fleet's figures
    sharp.json       (bench/sharp.py)        -> chart-sharp.png: derivd whole vs sharp
    similar.json     (bench/similar.py)      -> chart-similar.png: client.similar vs rows
    traffic.json     (bench/traffic.py)      -> chart-traffic.png: priorities, tenants
    store_latency.json (bench/store_latency.py) -> chart-store_latency.png: far vs near store
    webhooks.json    (bench/webhooks.py)     -> chart-webhooks.png: outbox cost, delivery
    server_instructions.json (bench/server_instructions.py) -> chart-server_instructions.png
    anatomy.json     (bench/anatomy.py)      -> chart-anatomy.png: a burst's CPU by role
    previews.json    (bench/previews.py)     -> chart-previews.png: derivd vs Rails' CLIs

A chart whose input is absent is skipped (and said so); the others are still drawn.
matplotlib comes with the `bench` extra (`pip install -e '.[bench]'`), never with
derivd itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

BENCH = Path(__file__).resolve().parent
OUT = BENCH / "out"
CHART_DIR = BENCH / "charts"
COLOURS = {"derivd": "#4a7bd0", "pgqueuer": "#d9822b", "procrastinate": "#7a9a3a"}

Data = dict[str, Any]


def throughput(data: Data) -> tuple[Figure, str]:
    """Jobs/s per configuration, one group per process count."""
    runs = data["runs"]
    counts = sorted({r["processes"] for r in runs})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.2 * len(counts), 3.6), sharey=True,
                             squeeze=False)  # fmt: skip
    for ax, n in zip(axes[0], counts, strict=True):
        these = [r for r in runs if r["processes"] == n]
        labels = [f"{r['system']}\n{r['concurrency']}" for r in these]
        rates = [r["jobs"] / r["drain_s"] if r["drain_s"] else 0.0 for r in these]
        ax.bar(range(len(these)), rates, color=[COLOURS.get(r["system"], "#888") for r in these])
        ax.set_xticks(range(len(these)), labels, fontsize=7, rotation=30, ha="right")
        ax.set_title(f"{n} processes")
        ax.grid(axis="y", alpha=0.3)
        for i, rate in enumerate(rates):
            ax.text(i, rate, f"{rate:,.0f}", ha="center", va="bottom", fontsize=7)
    axes[0][0].set_ylabel("no-op jobs/s (drain)")
    fig.suptitle("Queue throughput: derivd vs pgqueuer and procrastinate")
    return fig, "Queue throughput, derivd vs peers (bench/throughput.py)"


def latency(data: Data) -> tuple[Figure, str]:
    """The distribution of pickup latency (enqueue commit to claim), as a CDF."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for series in data["series"]:
        values = sorted(series["ms"])
        if not values:
            continue
        share = [(i + 1) / len(values) for i in range(len(values))]
        label = f"listen = {series['listen']}, {series['enqueue']}"
        ax.step(values, share, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("pickup latency, ms (log)")
    ax.set_ylabel("share of rows")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    first = sorted(data["series"][0]["ms"])
    p50, p99 = first[len(first) // 2], first[min(len(first) - 1, int(len(first) * 0.99))]
    ax.set_title(f"Pickup latency: claimed_at - created_at (listen = yes, one row: "
                 f"p50 {p50:.1f} ms, p99 {p99:.1f} ms)", fontsize=10)  # fmt: skip
    return fig, "Pickup latency distribution (bench/latency.py)"


def derive(data: Data) -> tuple[Figure, str]:
    """Per input: our handler's time beside a plain call of the same library."""
    rows = data["rows"]
    # CPU time where the benchmark reports it (wall time on a shared machine is noise).
    measure = "cpu_ms" if "ours_cpu_ms" in rows[0] else "ms"
    backends = sorted({r["backend"] for r in rows})
    fig, axes = plt.subplots(len(backends), 1, figsize=(8, 2.6 * len(backends)), squeeze=False)
    for ax, backend in zip(axes[:, 0], backends, strict=True):
        these = [r for r in rows if r["backend"] == backend]
        xs = range(len(these))
        ax.bar([x - 0.2 for x in xs], [r[f"ours_{measure}"] for r in these], 0.4, label="derivd")
        ax.bar([x + 0.2 for x in xs], [r[f"plain_{measure}"] for r in these], 0.4, label="plain")
        ax.set_xticks(list(xs), [r["input"] for r in these], fontsize=7, rotation=20, ha="right")
        ax.set_ylabel("CPU ms (median)" if measure == "cpu_ms" else "ms (median)")
        ax.set_title(backend, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Derive time per input: derivd's handler vs a plain library call")
    return fig, "Derive time, ours vs plain, per input (bench/derive.py)"


def e2e(data: Data) -> tuple[Figure, str]:
    rows = data["results"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["derivd_images_per_s"] for r in rows], 0.4, label="derivd")
    ax.bar([x + 0.2 for x in xs], [r["naive_images_per_s"] for r in rows], 0.4,
           label="naive pool")  # fmt: skip
    ax.set_xticks(list(xs), [r["backend"] for r in rows])
    ax.set_ylabel("images/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("End to end: derivd vs a naive process pool")
    return fig, "End to end, derivd vs a naive pool (bench/e2e.py)"


def previews(data: Data) -> tuple[Figure, str]:
    """Per input: images/s and CPU ms a preview, derivd beside the CLI pipeline."""
    rows = data["results"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    xs = range(len(rows))
    measures = (("images_per_s", "images/s"), ("cpu_ms", "CPU ms per preview"))
    for ax, (measure, label) in zip(axes, measures, strict=True):
        ax.bar([x - 0.2 for x in xs], [r["derivd"][measure] for r in rows], 0.4, label="derivd")
        ax.bar([x + 0.2 for x in xs], [r["cli"][measure] for r in rows], 0.4,
               label="ffmpeg / pdftoppm + vipsthumbnail")  # fmt: skip
        ax.set_xticks(list(xs), [r["case"] for r in rows], fontsize=7, rotation=20, ha="right")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Previews: derivd vs the CLI pipeline of Active Storage")
    return fig, "Previews of videos and PDFs, derivd vs the CLI pipeline (bench/previews.py)"


def fleet(data: Data) -> tuple[Figure, str]:
    """Whatever numeric figures bench/fleet.py reports per run, one panel each."""
    rows = next(data[k] for k in ("results", "runs", "rows") if isinstance(data.get(k), list))
    skip = ("jobs", "processes", "batch")
    numeric = [k for k in rows[0] if k not in skip and not isinstance(rows[0][k], bool)
               and all(isinstance(r.get(k), int | float) for r in rows)]  # fmt: skip
    labels = [str(r.get("label") or " ".join(str(r[k]) for k in r if k not in numeric))
              for r in rows]  # fmt: skip
    cols = min(3, len(numeric))
    grid = (len(numeric) + cols - 1) // cols
    fig, axes = plt.subplots(grid, cols, figsize=(3.8 * cols, 3.2 * grid), squeeze=False)
    for ax in axes.flat[len(numeric) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, numeric, strict=False):
        ax.bar(range(len(rows)), [r[key] for r in rows], color="#4a7bd0")
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=35, ha="right")
        ax.set_title(key.replace("_", " "), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Fleet: the database's cost per job")
    return fig, "Fleet figures (bench/fleet.py)"


def sharp(data: Data) -> tuple[Figure, str]:
    """Per set of images: images/s and CPU per image of each side (sharp's two ways to use
    the cores, derivd's backends, their plain-library floors and a `--baseline` or
    `--build`, in grey):
    the median over the rounds, whiskers from the lowest to the highest round, the rounds'
    median load under each bar."""
    runs = data["runs"]
    sets = list(dict.fromkeys(r["set"] for r in runs))
    fig, axes = plt.subplots(2, len(sets), figsize=(4.6 * len(sets), 6.2), squeeze=False)
    for col, name in enumerate(sets):
        sides = list(dict.fromkeys(r["side"] for r in runs if r["set"] == name))
        by_side = {side: [r for r in runs if r["set"] == name and r["side"] == side]
                   for side in sides}  # fmt: skip
        rounds = max(len(these) for these in by_side.values())
        labels = [f"{side}\nload {statistics.median(r['load_1min'] for r in these):.1f}"
                  for side, these in by_side.items()]  # fmt: skip
        colours = ["#d9822b" if side.startswith("sharp") else "#999999"
                   if side.startswith("floor") or "@" in side or "#" in side else "#4a7bd0"
                   for side in sides]  # fmt: skip
        for row, (key, unit) in enumerate((("images_per_s", "images/s"),
                                           ("cpu_ms_per_image", "CPU ms per image"))):  # fmt: skip
            ax = axes[row][col]
            values = [[r[key] for r in these] for these in by_side.values()]
            middle = [statistics.median(v) for v in values]
            spread = [[m - min(v) for m, v in zip(middle, values, strict=True)],
                      [max(v) - m for m, v in zip(middle, values, strict=True)]]  # fmt: skip
            ax.bar(range(len(sides)), middle, color=colours, yerr=spread, capsize=3)
            ax.set_xticks(range(len(sides)), labels, fontsize=6, rotation=30, ha="right")
            ax.set_ylabel(unit)
            ax.grid(axis="y", alpha=0.3)
            for i, value in enumerate(middle):
                ax.text(i, value, f"{value:.1f}", ha="left", va="bottom", fontsize=7)
        axes[0][col].set_title(f"{name} set ({runs[0]['images']} images, {rounds} rounds)",
                               fontsize=9)  # fmt: skip
    fig.suptitle(
        "derivd whole (run --burst, boot included) vs sharp, 720x588 cover JPEG q80", fontsize=9
    )
    return fig, "derivd vs sharp on sharp's task and phone photos (bench/sharp.py)"


def similar(data: Data) -> tuple[Figure, str]:
    """Median ms of client.similar per table size, scan vs the optional band index."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for path in dict.fromkeys(r[1] for r in data["similar"]):
        rows = [r for r in data["similar"] if r[1] == path]
        ax.plot([int(r[0].replace(",", "")) for r in rows], [r[2] for r in rows], "o-",
                label=path)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ready rows")
    ax.set_ylabel("median ms per call")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("client.similar(max_distance=6): scan vs GIN band index")
    return fig, "Near-duplicate search, scan vs band index (bench/similar.py)"


def traffic(data: Data) -> tuple[Figure, str]:
    """bench/traffic.py's four figures, each with and without the feature, side by side."""
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    panels = [
        ("live upload wait, s (log)", ["p50_s", "p99_s"],
         [("backfill at -10" if r["priority"] < 0 else "no priorities", r)
          for r in data["live"]]),
        ("small tenant's wait, s (log)", ["p50_s", "max_s"],
         [("shared" if r["shared"] else "one FIFO", r) for r in data["tenant"]]),
        ("claim at 1M queued / 10k tenants, ms", ["p50_ms", "p99_ms"],
         [(f"cap {r['cap']}" if isinstance(r["cap"], int) else str(r["cap"]), r)
          for r in data["scale"]]),
        ("server CPU per job, ms", ["server_ms"],
         [(k, v) for k, v in data["cpu"].items()]),
    ]  # fmt: skip
    for ax, (title, keys, rows) in zip(axes, panels, strict=True):
        width = 0.8 / len(keys)
        for n, key in enumerate(keys):
            values = [r[key] for _, r in rows]
            ax.bar([i + n * width for i in range(len(rows))], values, width, label=key)
            for i, v in enumerate(values):
                ax.text(i + n * width, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(rows))],
                      [label for label, _ in rows], fontsize=8)  # fmt: skip
        if title.endswith("(log)"):
            ax.set_yscale("log")
        if "claim" in title:
            ax.axhline(2.0, color="#c44", linestyle="--", linewidth=1, label="target 2 ms")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Traffic: priorities, tenants, the claim at scale (load {data['load'][0]})")
    return fig, "Priorities, tenants and the claim at scale (bench/traffic.py)"


def store_latency(data: Data) -> tuple[Figure, str]:
    """images/s per store, grouped by workers and pipeline, each bar with its ratio to
    the file store's; a tick on each S3 bar where the rig's CPU bounds it (moto's and the
    proxy's CPU on the same cores). Other builds of the run (--refs) are not drawn."""
    rows = data["results"]
    this = rows[0].get("build") if rows else None
    rows = [r for r in rows if r.get("build") == this]
    stores = list(dict.fromkeys(r["store"] for r in rows))
    groups = list(dict.fromkeys((r["workers"], r["pipeline"]) for r in rows))
    fs = {(r["workers"], r["pipeline"]): r["images_per_s"] for r in rows if r["store"] == "fs"}
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(stores)
    bound_label = "the rig's CPU bound"
    for n, store in enumerate(stores):
        by_group = {(r["workers"], r["pipeline"]): r for r in rows if r["store"] == store}
        xs = [g + (n - (len(stores) - 1) / 2) * width for g in range(len(groups))]
        ys = [by_group[g]["images_per_s"] if g in by_group else 0.0 for g in groups]
        ax.bar(xs, ys, width, label=store)
        for x, g in zip(xs, groups, strict=True):
            ratio = by_group.get(g, {}).get("vs_fs")
            if ratio is not None and store != "fs":
                ax.text(x, by_group[g]["images_per_s"], f"{ratio:.2f}x", ha="center",
                        va="bottom", fontsize=7)  # fmt: skip
            bound = by_group.get(g, {}).get("rig_bound")
            if bound is not None and g in fs:
                ax.hlines(fs[g] * bound, x - width / 2, x + width / 2, colors="black",
                          linewidth=1, label=bound_label)  # fmt: skip
                bound_label = "_nolegend_"
    ax.set_xticks(range(len(groups)), [f"{w} workers\npipeline {p}" for w, p in groups])
    ax.set_ylabel("images/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    delay = data.get("delay_ms_each_way", 20)
    title = f"Store latency: {data.get('images', '?')} phone JPEGs, S3 +{2 * delay:g} ms"
    ax.set_title(data.get("note") or title, fontsize=9 if data.get("note") else None)
    return fig, "A far store against a near one, by pipeline depth (bench/store_latency.py)"


def webhooks(data: Data) -> tuple[Figure, str]:
    """The commit's server CPU per build, commit-to-delivery latency, and the
    deliveries of a backlog per second."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    cpu = data["commit_cpu_ms"]
    names = list(cpu)
    axes[0].bar(range(len(names)), [cpu[n]["median"] for n in names], color="#4a7bd0")
    for i, n in enumerate(names):
        axes[0].text(i, cpu[n]["median"], f"{cpu[n]['median']:.3f}", ha="center",
                     va="bottom", fontsize=7)  # fmt: skip
    axes[0].set_xticks(range(len(names)), names, fontsize=8)
    axes[0].set_title("server CPU per job, commit + claim, ms", fontsize=9)
    lat = data["latency"]
    axes[1].bar([0, 1], [lat["p50_ms"], lat["p99_ms"]], color="#d9822b")
    axes[1].axhline(50, color="#c44", linestyle="--", linewidth=1, label="p50 target 50 ms")
    axes[1].set_xticks([0, 1], ["p50", "p99"])
    axes[1].set_title("commit to delivery, ms", fontsize=9)
    axes[1].legend(fontsize=7)
    rates = data["throughput"]
    axes[2].bar(range(len(rates)), [r["deliveries_per_s"] for r in rates.values()],
                color="#7a9a3a")  # fmt: skip
    axes[2].set_xticks(range(len(rates)), [f"concurrency {c}" for c in rates], fontsize=8)
    axes[2].set_title("a backlog's deliveries/s", fontsize=9)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Webhooks (load {data['load'][0]})")
    return fig, "Webhooks: the commit's cost, delivery latency and rate (bench/webhooks.py)"


def server_instructions(data: Data) -> tuple[Figure, str]:
    """The server's instructions per noop job (commit + next claim) per build."""
    kir = data["kir"]
    names = list(kir)
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.bar(range(len(names)), [kir[n] for n in names], color="#4a7bd0")
    for i, n in enumerate(names):
        ax.text(i, kir[n], f"{kir[n]:,.0f}k ({100 * (kir[n] / kir[names[0]] - 1):+.1f} %)",
                ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("thousand instructions per job")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"commit + next claim, callgrind, {data['clients']} client(s)", fontsize=9)
    return fig, "Server instructions per noop job, by build (bench/server_instructions.py)"


def anatomy(data: Data) -> tuple[Figure, str]:
    """One stacked bar per side: CPU ms per image by role (the median over the rounds),
    images/s and the boot in the side's label."""
    runs, roles = data["runs"], data["roles"]
    sides = list(dict.fromkeys(r["side"] for r in runs))
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.5 * len(sides)))
    colours = plt.get_cmap("tab10").colors
    for row, side in enumerate(sides):
        mine = [r for r in runs if r["side"] == side]
        left = 0.0
        for n, role in enumerate(roles):
            value = statistics.median(r["cpu_s"][role] / r["images"] * 1000 for r in mine)
            ax.barh(row, value, left=left, color=colours[n % len(colours)],
                    label=role if row == 0 else None)  # fmt: skip
            if value >= 1.0:
                ax.text(left + value / 2, row, f"{value:.1f}", ha="center", va="center",
                        fontsize=7)  # fmt: skip
            left += value
    labels = []
    for side in sides:
        rate = statistics.median(r["images_per_s"] for r in runs if r["side"] == side)
        boot = statistics.median(r["boot_s"] for r in runs if r["side"] == side)
        labels.append(f"{side}\n{rate:.1f} images/s, boot {1000 * boot:.0f} ms")
    ax.set_yticks(range(len(sides)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("CPU ms per image (the cores' whole time: idle included)")
    ax.set_xlim(0, ax.get_xlim()[1] * 1.45)  # room on the right for the legend
    ax.legend(fontsize=6, loc="center right")
    ax.set_title(f"derivd run --burst, sharp's task, {data.get('backend', '?')}: where the "
                 "cores' time goes", fontsize=9)  # fmt: skip
    return fig, "A burst's CPU by role, per image (bench/anatomy.py)"


CHARTS: dict[str, Callable[[Data], tuple[Figure, str]]] = {
    "throughput": throughput,
    "latency": latency,
    "derive": derive,
    "e2e": e2e,
    "fleet": fleet,
    "sharp": sharp,
    "similar": similar,
    "traffic": traffic,
    "store_latency": store_latency,
    "webhooks": webhooks,
    "server_instructions": server_instructions,
    "anatomy": anatomy,
    "previews": previews,
}


def draw(out: Path = OUT, into: Path = CHART_DIR) -> list[tuple[str, str]]:
    """Every chart whose input exists: [(png file name, caption)]."""
    made = []
    for name, plot in CHARTS.items():
        source = out / f"{name}.json"
        if not source.exists():
            print(f"plots: {name}: skipped ({source.relative_to(out.parent)} absent)",
                  file=sys.stderr)  # fmt: skip
            continue
        try:
            fig, caption = plot(json.loads(source.read_text()))
        except (KeyError, IndexError, StopIteration, TypeError, ValueError) as error:
            print(f"plots: {name}: skipped ({source.name} not as expected: {error!r})",
                  file=sys.stderr)  # fmt: skip
            continue
        png = into / f"chart-{name}.png"
        fig.tight_layout()
        fig.savefig(png, dpi=110, metadata={"Software": None})
        plt.close(fig)
        made.append((png.name, caption))
        print(f"plots: wrote {png.relative_to(into.parent)}", file=sys.stderr)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON results are")
    parser.add_argument("--charts", type=Path, default=CHART_DIR, help="where the PNGs go")
    args = parser.parse_args()
    args.charts.mkdir(parents=True, exist_ok=True)
    draw(args.out, args.charts)


if __name__ == "__main__":
    main()
