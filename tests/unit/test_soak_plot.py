"""benchmarks/soak_plot.py: the soak's RSS samples as an SVG chart, one line per process."""
from __future__ import annotations

import xml.dom.minidom

from tests.integration.bench_scripts import load_script


def test_one_line_per_process_with_a_point_per_sample():
    plot = load_script("soak_plot")
    rows = [{"seconds": str(60 * i), "api_rss_mb": str(400 + i), "engine_rss_mb": str(700 - i),
             "grammar_compile_rss_mb": "0" if i == 0 else "300", "requests": str(10 * i)} for i in range(5)]
    doc = xml.dom.minidom.parseString(plot.svg(rows, "soak"))
    lines = doc.getElementsByTagName("polyline")
    assert len(lines) == 3
    points = [[tuple(map(float, p.split(","))) for p in line.getAttribute("points").split()] for line in lines]
    assert all(len(p) == 5 for p in points)
    api, engine, _ = points
    assert api[-1][1] < api[0][1] and engine[-1][1] > engine[0][1]  # SVG y grows downwards
    assert api[0][0] == engine[0][0] < api[-1][0]
