"""The soak test's RSS samples (`make soak` writes soak_rss.csv) as an SVG line chart, one line per process.

    python benchmarks/soak_plot.py soak_rss.csv docs/soak_rss.svg --title "30-minute soak"

No plotting library: the SVG is written by hand (the venv has none and needs none).
"""
from __future__ import annotations

import argparse
import csv

SERIES = (("api_rss_mb", "API server", "#1f77b4"), ("engine_rss_mb", "engine core", "#d62728"),
          ("grammar_compile_rss_mb", "grammar compile process", "#2ca02c"))
W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 360, 60, 20, 40, 50


def svg(rows: list[dict[str, str]], title: str) -> str:
    xs = [float(r["seconds"]) / 60 for r in rows]
    ys = {key: [float(r[key]) for r in rows] for key, _, _ in SERIES}
    x_max = max(xs) or 1.0
    y_max = max(max(v) for v in ys.values()) * 1.1 or 1.0
    px = lambda x: LEFT + (W - LEFT - RIGHT) * x / x_max  # noqa: E731
    py = lambda y: H - BOTTOM - (H - TOP - BOTTOM) * y / y_max  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    step = 100 if y_max > 300 else 50
    for y in range(0, int(y_max) + 1, step):
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y}</text>')
    for m in range(0, int(x_max) + 1, 5 if x_max > 10 else 1):
        out.append(f'<text x="{px(m):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{m}</text>')
    out.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">minutes</text>'
               f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">RSS (MB)</text>')
    for i, (key, label, color) in enumerate(SERIES):
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys[key]))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        out.append(f'<rect x="{LEFT + 10 + 200 * i}" y="{TOP - 4}" width="12" height="3" fill="{color}"/>'
                   f'<text x="{LEFT + 26 + 200 * i}" y="{TOP}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("svg")
    p.add_argument("--title", default="RSS during the soak test")
    args = p.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(args.svg, "w") as f:
        f.write(svg(rows, args.title))


if __name__ == "__main__":
    main()
