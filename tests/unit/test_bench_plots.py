"""bench/plots.py: a chart per benchmark output present, a skip per absent or malformed one;
bench/results.py: RESULTS.md made from the outputs alone, each with its command, machine
and chart, and the page in the tree is what the outputs in the tree give."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("matplotlib", reason="matplotlib (setup.cfg's bench extra) absent")

BENCH = Path(__file__).resolve().parents[2] / "bench"
PLOTS = BENCH / "plots.py"
RESULTS_PY = BENCH / "results.py"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_charts_for_what_is_present_and_one_section(tmp_path: Path) -> None:
    plots = _load(PLOTS, "derivd_bench_plots")
    out = tmp_path / "out"
    out.mkdir()
    run = {"system": "derivd", "processes": 2, "concurrency": "1 job/process", "jobs": 100,
           "drain_s": 0.5, "wall_s": 0.7}  # fmt: skip
    (out / "throughput.json").write_text(json.dumps({"runs": [run]}))
    series = {"listen": "yes", "enqueue": "one row per commit", "ms": [1.0, 2.0, 5.0]}
    (out / "latency.json").write_text(json.dumps({"series": [series]}))
    (out / "derive.json").write_text(json.dumps({"rows": [{"input": "x"}]}))  # malformed
    sides = [
        {
            "set": "sharp",
            "side": side,
            "images": 240,
            "images_per_s": rate,
            "cpu_ms_per_image": cpu,
            "load_1min": 2.0,
        }
        for side, rate, cpu in (("sharp:per-core", 39.4, 45), ("derivd:vips", 41.0, 40))
    ]
    (out / "sharp.json").write_text(json.dumps({"runs": sides}))
    sizes = [["10,000", "scan", 15.2, 25.3, 15], ["10,000", "GIN band index", 4.9, 16.7, 15]]
    (out / "similar.json").write_text(json.dumps({"similar": sizes}))
    roles = ["worker main thread", "PostgreSQL", "idle or elsewhere"]
    bursts = [{"side": side, "images": 240, "images_per_s": 66.0, "boot_s": 0.25,
               "cpu_s": {"worker main thread": 4.0, "PostgreSQL": 0.3, "idle or elsewhere": 0.5}}
              for side in ("this tree", "#HEAD~1")]  # fmt: skip
    (out / "anatomy.json").write_text(json.dumps({"roles": roles, "runs": bursts}))
    made = plots.draw(out, tmp_path)
    assert [png for png, _ in made] == [
        "chart-throughput.png",
        "chart-latency.png",
        "chart-sharp.png",
        "chart-similar.png",
        "chart-anatomy.png",
    ]
    for png, _ in made:
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "chart-derive.png").exists()


def test_results_come_from_the_outputs_with_command_machine_and_chart(tmp_path: Path) -> None:
    results = _load(RESULTS_PY, "derivd_bench_results")
    out, charts = tmp_path / "out", tmp_path / "charts"
    out.mkdir()
    charts.mkdir()
    record = {"bench": "latency", "command": "python bench/latency.py", "when": "2026-12-07",
              "machine": ["cpus: 2", "python 3.11"],
              "figures": "| p50 ms |\n|---|\n| 1.2 |"}  # fmt: skip
    (out / "latency.json").write_text(json.dumps(record))
    rows = [{"input": "a.jpg", "ratio": 0.5, "detail": {"x": 1}}, {"input": "b|c", "ratio": 512.4}]
    (out / "derive.json").write_text(json.dumps({"bench": "derive", "rows": rows}))
    (charts / "chart-latency.png").write_bytes(b"\x89PNG")
    page = results.render(out, charts)
    latency = page.split("## Pickup latency\n", 1)[1].split("\n## ", 1)[0]
    assert "- command: `python bench/latency.py`" in latency
    assert "- machine: cpus: 2; python 3.11" in latency and "| 1.2 |" in latency
    assert "](charts/chart-latency.png)" in latency
    image_handlers = page.split("## Image handlers\n", 1)[1].split("\n## ", 1)[0]
    assert "- command: `not recorded`" in image_handlers and "chart-" not in image_handlers
    assert "| input | ratio |" in image_handlers and "| a.jpg | 0.5 |" in image_handlers
    assert "| b\\|c | 512 |" in image_handlers  # a bar stays in its cell
    assert page.count("## Pickup latency") == 1 and "`throughput`" in page  # not run yet


def test_the_results_page_is_current() -> None:
    results = _load(RESULTS_PY, "derivd_bench_results")
    assert (BENCH / "RESULTS.md").read_text(encoding="utf-8") == results.render(), (
        "run `python bench/results.py`"
    )


def test_every_output_in_the_tree_is_a_catalogued_benchmark() -> None:
    results = _load(RESULTS_PY, "derivd_bench_results")
    names = {entry.name for entry in results.CATALOGUE}
    assert {path.stem for path in (BENCH / "out").glob("*.json")} <= names
