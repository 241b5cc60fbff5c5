"""What re-derivations in a table of their own (issue 27) cost the default path: server
CPU per job at defaults (commit + next claim in one statement, one client, prepared, no
backfill, no tenants), this build vs `--baseline` (a git ref: its migrations and
functions.sql), interleaved runs on one private cluster, median of `--repeat`. The
measurement is bench/traffic.py's (cpu_per_job); this script runs only it.

    .venv/bin/python bench/rederive_cost.py [--jobs 3000] [--repeat 5] [--baseline main]
"""

from __future__ import annotations

import argparse

from common import cluster, machine, median_run, save_results, table
from traffic import cpu_per_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", default="main")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"this build": [], "baseline": []}
    with cluster() as pg:
        for n in range(args.repeat):
            order = list(runs) if n % 2 == 0 else list(reversed(runs))
            for label in order:
                runs[label].append(cpu_per_job(pg, label, args.baseline, args.jobs))
        lines = machine(pg.dsn())
    medians = {k: median_run(v, key=lambda r: r[0]) for k, v in runs.items()}
    base = medians["baseline"][0][0]
    print("## re-derivations apart: the default path (bench/rederive_cost.py)")
    print("\n".join(lines))
    print(f"{args.jobs:,} jobs per run, {args.repeat} interleaved runs, baseline {args.baseline}")
    print(
        table(
            ["build", "server CPU ms/job (median)", "stdev", "vs baseline", "runs"],
            [
                [
                    k,
                    m[0][0],
                    m[1],
                    f"{(m[0][0] / base - 1) * 100:+.1f} %",
                    " ".join(f"{r[0]:.3f}" for r in runs[k]),
                ]
                for k, m in medians.items()
            ],
        )
    )
    save_results(
        "rederive_cost",
        {
            "machine": lines,
            "baseline": args.baseline,
            "jobs": args.jobs,
            "runs": {k: [r[0] for r in v] for k, v in runs.items()},
        },
    )


if __name__ == "__main__":
    main()
