"""bench/plots.py: a chart per benchmark output present, a skip per absent one, and a
charts section of RESULTS.md that is replaced, not repeated, on every run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("matplotlib", reason="matplotlib (setup.cfg's bench extra) absent")

PLOTS = Path(__file__).resolve().parent.parent / "bench" / "plots.py"


def _plots() -> ModuleType:
    spec = importlib.util.spec_from_file_location("derivd_bench_plots", PLOTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_charts_for_what_is_present_and_one_section(tmp_path: Path) -> None:
    plots = _plots()
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
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\ntext\n")

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
    plots.embed(results, made)
    plots.embed(results, made)  # a second run replaces its section
    text = results.read_text()
    assert text.startswith("# Results\n\ntext\n")
    assert text.count("## Charts") == 1
    assert "](chart-throughput.png)" in text and "](chart-latency.png)" in text
    assert "chart-derive.png" not in text
