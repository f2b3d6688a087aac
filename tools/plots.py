#!/usr/bin/env python3
"""Draws the figures of docs/benchmarks.md from the CSV files in docs/data/ into docs/img/*.svg.

    python3 tools/plots.py [--data docs/data] [--out docs/img]

Python 3 standard library only (no matplotlib): each plot is a small hand-written SVG. Lines that
start with '#' in a CSV are comments (they say where the numbers come from) and are skipped.
"""
import argparse
import csv
import math
import os
import re
import sys
from xml.sax.saxutils import escape

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#7f7f7f", "#9467bd", "#ff7f0e"]
W, H = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 72, 24, 48, 64


def read_csv(path):
    with open(path, newline="") as f:
        rows = [line for line in f if line.strip() and not line.lstrip().startswith("#")]
    return list(csv.DictReader(rows))


def nice_ticks(hi, count=5):
    """Round tick values from 0 to at least `hi`."""
    raw = hi / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    ticks, v = [], 0.0
    while v < hi + step * 0.999:
        ticks.append(round(v, 10))
        v += step
    return ticks


def fmt(v):
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.3g}"


class Svg:
    def __init__(self, title, xlabel, ylabel):
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            'font-family="Helvetica, Arial, sans-serif" font-size="12">',
            f'<rect width="{W}" height="{H}" fill="white"/>',
            f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{escape(title)}</text>',
            f'<text x="{LEFT + (W - LEFT - RIGHT) / 2}" y="{H - 14}" text-anchor="middle">{escape(xlabel)}</text>',
            f'<text x="16" y="{TOP + (H - TOP - BOTTOM) / 2}" text-anchor="middle" '
            f'transform="rotate(-90 16 {TOP + (H - TOP - BOTTOM) / 2})">{escape(ylabel)}</text>',
        ]

    def add(self, s):
        self.parts.append(s)

    def y_axis(self, ticks, to_y):
        for t in ticks:
            y = to_y(t)
            self.add(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#e5e5e5"/>')
            self.add(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
        self.add(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="black"/>')
        self.add(f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="black"/>')

    def legend(self, names, x=None, y=None, dashed=(), colors=COLORS):
        x = LEFT + 12 if x is None else x
        y = TOP + 6 if y is None else y
        for i, name in enumerate(names):
            yy = y + 18 * i
            dash = ' stroke-dasharray="6 4"' if name in dashed else ""
            self.add(f'<line x1="{x}" y1="{yy}" x2="{x + 22}" y2="{yy}" stroke="{colors[i % len(colors)]}" '
                     f'stroke-width="3"{dash}/>')
            self.add(f'<text x="{x + 28}" y="{yy + 4}">{escape(name)}</text>')

    def write(self, path):
        self.parts.append("</svg>")
        with open(path, "w") as f:
            f.write("\n".join(self.parts) + "\n")
        print(f"plots: wrote {os.path.relpath(path)}")


def line_chart(path, title, xlabel, ylabel, xs, series, dashed=(), colors=COLORS, legend_at=(W - RIGHT - 250, TOP + 6),
               label_dashed=False, labels=True):
    """series: list of (name, [y per x]); x values are categories spaced evenly. Dashed series (references)
    are labelled at their last point only."""
    svg = Svg(title, xlabel, ylabel)
    hi = max(v for _, ys in series for v in ys if v is not None)
    ticks = nice_ticks(hi)
    top = ticks[-1]
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    to_x = lambda i: LEFT + plot_w * (i + 0.5) / len(xs)
    to_y = lambda v: TOP + plot_h * (1 - v / top)
    svg.y_axis(ticks, to_y)
    for i, x in enumerate(xs):
        svg.add(f'<text x="{to_x(i):.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{escape(str(x))}</text>')
    for k, (name, ys) in enumerate(series):
        color = colors[k % len(colors)]
        pts = [(to_x(i), to_y(v)) for i, v in enumerate(ys) if v is not None]
        dash = ' stroke-dasharray="6 4"' if name in dashed else ""
        svg.add(f'<polyline fill="none" stroke="{color}" stroke-width="2.5"{dash} points="'
                + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        for x, y in pts:
            svg.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"/>')
        labelled = list(zip(pts, [v for v in ys if v is not None]))
        if not labels:
            labelled = []
        elif name in dashed and not label_dashed:
            labelled = labelled[-1:]
        for (x, y), v in labelled:
            svg.add(f'<text x="{x + 6:.1f}" y="{y - 6:.1f}" fill="{color}" font-size="11">{fmt(round(v, 1))}</text>')
    svg.legend([name for name, _ in series], x=legend_at[0], y=legend_at[1], dashed=dashed, colors=colors)
    svg.write(path)


def bar_chart(path, title, xlabel, ylabel, groups, names, values):
    """values[g][k]: bar k of group g."""
    svg = Svg(title, xlabel, ylabel)
    hi = max(v for row in values for v in row)
    ticks = nice_ticks(hi * 1.15)
    top = ticks[-1]
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    to_y = lambda v: TOP + plot_h * (1 - v / top)
    svg.y_axis(ticks, to_y)
    group_w = plot_w / len(groups)
    bar_w = group_w * 0.8 / len(names)
    for g, label in enumerate(groups):
        x0 = LEFT + group_w * g + group_w * 0.1
        for k, v in enumerate(values[g]):
            x, y = x0 + bar_w * k, to_y(v)
            svg.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 2:.1f}" height="{H - BOTTOM - y:.1f}" '
                    f'fill="{COLORS[k % len(COLORS)]}"/>')
            svg.add(f'<text x="{x + (bar_w - 2) / 2:.1f}" y="{y - 4:.1f}" text-anchor="middle" font-size="10">'
                    f"{fmt(v)}</text>")
        svg.add(f'<text x="{LEFT + group_w * (g + 0.5):.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">'
                f"{escape(label)}</text>")
    svg.legend(names, x=W - RIGHT - 150)
    svg.write(path)


def memory_per_rank(data, out):
    rows = read_csv(os.path.join(data, "memory_per_rank.csv"))
    xs = [int(r["world_size"]) for r in rows]
    mib = lambda key: [int(r[key]) / 2**20 for r in rows]
    line_chart(os.path.join(out, "memory_per_rank.svg"),
               "Memory per rank vs world size (GPT 17.0M, FullShard, AdamW)", "ranks (world size)", "MiB per rank",
               xs, [("fsdpx: model state (params+grads+Adam)", mib("fsdpx_model_state_bytes")),
                    ("unsharded: model state", mib("unsharded_model_state_bytes")),
                    ("fsdpx: peak RSS (measured)", [float(r["fsdpx_peak_rss_mib"]) for r in rows]),
                    ("unsharded: peak RSS (measured)", [float(r["unsharded_peak_rss_mib"]) for r in rows])],
               dashed=("unsharded: model state", "unsharded: peak RSS (measured)"),
               colors=[COLORS[0], COLORS[0], COLORS[2], COLORS[2]], legend_at=(W - RIGHT - 275, TOP + 40))


def gpt_step_time(data, out):
    rows = read_csv(os.path.join(data, "gpt_step_time.csv"))
    groups = [f"batch {r['global_batch']}, run {r['run']}" for r in rows]
    names = ["fsdpx", "PyTorch FSDP2", "PyTorch DDP", "unsharded LibTorch"]
    keys = ["fsdpx_ms", "fsdp2_ms", "ddp_ms", "unsharded_ms"]
    bar_chart(os.path.join(out, "gpt_step_time.svg"), "GPT step time, 2 CPU ranks (lower is better)",
              "global batch (run)", "ms per step", groups, names, [[float(r[k]) for k in keys] for r in rows])
    bar_chart(os.path.join(out, "gpt_peak_rss.svg"), "Peak RSS per rank, 2 CPU ranks (lower is better)",
              "global batch (run)", "MiB per rank", groups, ["fsdpx", "PyTorch FSDP2"],
              [[float(r["fsdpx_rss_mib"]), float(r["fsdp2_rss_mib"])] for r in rows])


def collectives(data, out):
    rows = read_csv(os.path.join(data, "collectives_busbw.csv"))
    xs = [r["size_mib"] for r in rows]
    col = lambda key: [float(r[key]) for r in rows]
    line_chart(os.path.join(out, "collectives_busbw.svg"), "MPI backend bus bandwidth, 2 ranks (higher is better)",
               "message size (MiB)", "busbw (GB/s)", xs,
               [("all_gather fsdpx", col("all_gather_fsdpx")), ("all_gather raw MPI", col("all_gather_raw")),
                ("reduce_scatter fsdpx", col("reduce_scatter_fsdpx")),
                ("reduce_scatter raw MPI", col("reduce_scatter_raw"))],
               dashed=("all_gather raw MPI", "reduce_scatter raw MPI"),
               colors=[COLORS[0], COLORS[0], COLORS[1], COLORS[1]], labels=False)


def soak_chart(path, title, x_label, x_max, warmup, series):
    """Resident memory of each process against a numeric x (steps or seconds: samples are not evenly
    spaced), with a dashed line where warm-up ends."""
    svg = Svg(title, x_label, "VmRSS (MiB)")
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    xticks = nice_ticks(x_max)
    yticks = nice_ticks(1.3 * max(v for _, pts in series for _, v in pts))  # room above the lines for the legend
    to_x = lambda v: LEFT + plot_w * v / xticks[-1]
    to_y = lambda v: TOP + plot_h * (1 - v / yticks[-1])
    svg.y_axis(yticks, to_y)
    for t in xticks:
        svg.add(f'<text x="{to_x(t):.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{fmt(t)}</text>')
    wx = to_x(warmup)
    svg.add(f'<line x1="{wx:.1f}" y1="{TOP}" x2="{wx:.1f}" y2="{H - BOTTOM}" stroke="#7f7f7f" stroke-dasharray="4 4"/>')
    svg.add(f'<text x="{wx + 4:.1f}" y="{H - BOTTOM - 6}" fill="#7f7f7f">end of warm-up</text>')
    for k, (_, pts) in enumerate(series):
        svg.add(f'<polyline fill="none" stroke="{COLORS[k % len(COLORS)]}" stroke-width="2" points="'
                + " ".join(f"{to_x(x):.1f},{to_y(y):.1f}" for x, y in pts) + '"/>')
    svg.legend([name for name, _ in series], x=W - RIGHT - 150)
    svg.write(path)


def comments_of(path):
    with open(path) as f:
        return "".join(line for line in f if line.startswith("#"))


def rl_soak(data, out):
    """RSS of each rl_hf process against the step."""
    path = os.path.join(data, "rl_soak.csv")
    rows, comments = read_csv(path), comments_of(path)
    steps = int(re.search(r"--steps (\d+)", comments).group(1))  # the last sample may come before the last step
    warmup = int(re.search(r"Warm-up: (\d+) steps", comments).group(1))
    names = {"rank0_mib": "rank 0 (trainer)", "rank1_mib": "rank 1 (trainer)", "rank2_mib": "rank 2 (rollout)"}
    series = [(name, [(int(r["step"]), float(r[key])) for r in rows if r[key]]) for key, name in names.items()]
    soak_chart(os.path.join(out, "rl_soak.svg"), f"Resident memory per process over {steps:,} RL steps (rl_hf)",
               "step", steps, warmup, series)


def sync_soak(data, out):
    """RSS of the synchronizer's server, publisher and readers against time, over a burst of versions."""
    path = os.path.join(data, "sync_soak.csv")
    rows, comments = read_csv(path), comments_of(path)
    versions = int(re.search(r"--versions (\d+)", comments).group(1))
    warm_version = int(re.search(r"Warm-up: (\d+) versions", comments).group(1))
    warmup = next(float(r["seconds"]) for r in rows if int(r["versions"]) >= warm_version)
    keys = [k for k in rows[0] if k.endswith("_mib")]
    series = [(k[:-4].replace("_", " "), [(float(r["seconds"]), float(r[k])) for r in rows if r[k]]) for k in keys]
    soak_chart(os.path.join(out, "sync_soak.svg"), f"Synchronizer service over a burst of {versions:,} versions",
               "seconds", float(rows[-1]["seconds"]), warmup, series)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.path.join(root, "docs", "data"))
    p.add_argument("--out", default=os.path.join(root, "docs", "img"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for plot in (memory_per_rank, gpt_step_time, collectives, rl_soak, sync_soak):
        plot(args.data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
