#!/usr/bin/env python3
"""Renders kvrelay-dashboard.json from a live Prometheus into a PNG "screenshot".

Grafana is not needed: every panel's queries run against Prometheus's HTTP API
(query_range) exactly as the dashboard writes them, with Grafana's variables
substituted ($__rate_interval = max(step + scrape interval, 4 x scrape
interval), $instance = .* for "All"), and matplotlib draws them on the
dashboard's grid in Grafana's dark theme, with the panels' titles and units.

    .venv/bin/python deploy/grafana/render_png.py --prometheus http://127.0.0.1:9090 \\
        --last 15m --scrape-interval 15s --out dashboard.png

Needs matplotlib (the project venv has it: scripts/install_python.sh).
tests/deploy/test_live_prometheus.py uses it to draw docs/dashboard.png from a
real relay and a real Prometheus.
"""
import argparse
import datetime
import json
import math
import os
import re
import sys
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
DASHBOARD = os.path.join(HERE, "kvrelay-dashboard.json")
# The PNG text chunk listing the panels and those that show data.
PANELS_KEY = "kvrelay-panels"

# Grafana's dark theme and its "classic" palette.
BG = "#111217"
PANEL = "#181b1f"
BORDER = "#2a2d33"
TEXT = "#ccccdc"
MUTED = "#8e8e9a"
GRID = "#26292f"
PALETTE = ["#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9",
           "#705DA0", "#37872D", "#FADE2A", "#447EBC", "#C15C17"]
NAMED = {"green": "#73BF69", "red": "#F2495C", "orange": "#FF9830", "yellow": "#FADE2A", "blue": "#5794F2"}

GRID_ROW_PX = 30  # Grafana: one gridPos unit of height is 30 px (+ margins)


def parse_duration(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text.strip())
    if not m:
        raise ValueError(f"bad duration {text!r}")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def prom_duration(seconds):
    ms = int(round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def substitute(expr, rate_interval, instance=".*"):
    return (expr.replace("${__rate_interval}", rate_interval).replace("$__rate_interval", rate_interval)
                .replace("${instance}", instance).replace("$instance", instance))


def query_range(prom, expr, start, end, step, timeout=30):
    q = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{q}", timeout=timeout) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"query_range {expr}: {body}")
    out = []
    for s in body["data"]["result"]:
        ts = [float(t) for t, _ in s["values"]]
        vs = [float(v) for _, v in s["values"]]  # "NaN" and "+Inf" parse as floats
        out.append((s["metric"], ts, vs))
    return out


def legend(fmt, labels):
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__") + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


# ---------------------------------------------------------------- units

def _scaled(v, steps, base, suffixes, decimals=None):
    if v is None or math.isnan(v):
        return "-"
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    a, i = abs(v), 0
    while a >= base and i < len(suffixes) - 1:
        a /= base
        i += 1
    d = decimals if decimals is not None else (0 if a >= 100 or a == int(a) else 1 if a >= 10 else 2)
    return f"{'-' if v < 0 else ''}{a:.{d}f} {suffixes[i]}".rstrip()


def fmt_value(v, unit, decimals=None):
    """A value as Grafana shows it in `unit`."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "No data"
    if unit in ("bytes",):
        return _scaled(v, None, 1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"], decimals)
    if unit in ("decbytes",):
        return _scaled(v, None, 1000, ["B", "kB", "MB", "GB", "TB"], decimals)
    if unit in ("binBps",):
        return _scaled(v, None, 1024, ["B/s", "KiB/s", "MiB/s", "GiB/s", "TiB/s"], decimals)
    if unit in ("Bps", "decBps"):
        return _scaled(v, None, 1000, ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"], decimals)
    if unit == "s":
        if v == 0:
            return "0 s"
        a = abs(v)
        if a < 1e-3:
            return f"{v * 1e6:.{0 if decimals is None else decimals}f} µs"
        if a < 1:
            return f"{v * 1e3:.{1 if a < 0.01 and decimals is None else 0 if decimals is None else decimals}f} ms"
        if a < 60:
            return f"{v:.{2 if decimals is None else decimals}f} s"
        return f"{v / 60:.1f} min"
    if unit in ("reqps",):
        return _scaled(v, None, 1000, ["req/s", "K req/s", "M req/s"], 2 if decimals is None and abs(v) < 10 else decimals)
    if unit in ("ops",):
        return _scaled(v, None, 1000, ["ops/s", "K ops/s", "M ops/s"], decimals)
    if unit == "percentunit":
        pct = v * 100
        a = abs(pct)
        d = decimals if decimals is not None else (0 if a == int(a) or a >= 100 else 1 if a >= 10 else 2)
        return f"{pct:.{d}f}%"
    if unit.startswith("suffix:"):
        d = 2 if decimals is None else decimals
        if abs(v) >= 100:
            d = 0 if decimals is None else decimals
        return f"{v:.{d}f}{unit[len('suffix:'):]}"
    if unit in ("short", "none", ""):
        if decimals is not None:
            return f"{v:.{decimals}f}"
        return _scaled(v, None, 1000, ["", "K", "Mil", "Bil"], None)
    return f"{v:g} {unit}"


def axis_ticks(vmax, unit):
    """Tick positions that are round in the unit's own scale (1024-based for binary bytes)."""
    import numpy as np
    if not vmax or vmax <= 0 or math.isnan(vmax):
        return None
    base = 1024 if unit in ("bytes", "binBps") else None
    if base:
        scale = 1.0
        while vmax / scale >= base:
            scale *= base
        raw = vmax / scale / 4
    else:
        scale, raw = 1.0, vmax / 4
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    return np.arange(0, vmax / scale + step * 1.001, step) * scale


# ---------------------------------------------------------------- drawing

def color_of(name):
    return NAMED.get(name, name)


CALC_NAMES = {"mean": "Mean", "max": "Max", "min": "Min", "lastNotNull": "Last *", "last": "Last"}


def calcs(vs, panel):
    """The legend's calculations (options.legend.calcs) of one series, formatted in the panel's unit."""
    unit = panel["fieldConfig"]["defaults"].get("unit", "")
    finite = [v for v in vs if not math.isnan(v) and not math.isinf(v)]
    out = []
    for c in (panel.get("options", {}).get("legend", {}).get("calcs") or ["lastNotNull"]):
        if not finite:
            v = float("nan")
        elif c == "mean":
            v = sum(finite) / len(finite)
        elif c == "max":
            v = max(finite)
        elif c == "min":
            v = min(finite)
        else:
            v = finite[-1]
        out.append((CALC_NAMES.get(c, c), fmt_value(v, unit)))
    return out


def draw_timeseries(ax, panel, series, start, end):
    import matplotlib.dates as mdates
    import numpy as np
    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "")
    custom = defaults.get("custom", {})
    stacked = (custom.get("stacking") or {}).get("mode") == "normal"
    overrides = panel["fieldConfig"].get("overrides", [])
    ax.set_facecolor(PANEL)
    handles, vmax = [], 0.0
    stack_base = None
    for i, (name, ts, vs) in enumerate(series):
        color, dashed, width, fill = PALETTE[i % len(PALETTE)], False, custom.get("lineWidth", 1), custom.get("fillOpacity", 10)
        for o in overrides:
            m = o.get("matcher", {})
            if m.get("id") == "byRegexp" and re.fullmatch(m.get("options", ""), name) or \
               m.get("id") == "byName" and m.get("options") == name:
                for prop in o.get("properties", []):
                    if prop["id"] == "color":
                        color = color_of(prop["value"].get("fixedColor", color))
                    elif prop["id"] == "custom.lineStyle":
                        dashed = prop["value"].get("fill") == "dash"
                    elif prop["id"] == "custom.lineWidth":
                        width = prop["value"]
                    elif prop["id"] == "custom.fillOpacity":
                        fill = prop["value"]
        x = [datetime.datetime.fromtimestamp(t) for t in ts]
        y = np.array(vs, dtype=float)
        y[~np.isfinite(y)] = np.nan
        if stacked and not dashed:
            base = np.zeros_like(y) if stack_base is None else stack_base
            top = np.where(np.isnan(y), base, base + np.nan_to_num(y))
            ax.fill_between(x, base, top, color=color, alpha=max(fill, 10) / 100, linewidth=0)
            line, = ax.plot(x, top, color=color, linewidth=width)
            stack_base = top
            finite = top[np.isfinite(top)]
        else:
            line, = ax.plot(x, y, color=color, linewidth=width * (1.6 if dashed else 1.2),
                            linestyle=(0, (6, 4)) if dashed else "-")
            if fill and not dashed:
                ax.fill_between(x, 0, np.nan_to_num(y), where=np.isfinite(y), color=color, alpha=fill / 100, linewidth=0)
            finite = y[np.isfinite(y)]
            # Points with no finite neighbour would not show as a line: draw them as dots.
            ok = np.isfinite(y)
            lonely = ok & ~np.r_[False, ok[:-1]] & ~np.r_[ok[1:], False]
            if lonely.any():
                ax.plot([x[i] for i in np.flatnonzero(lonely)], y[lonely], linestyle="none", marker="o",
                        markersize=2.5 + width, color=color)
        if finite.size:
            vmax = max(vmax, float(finite.max()))
        handles.append((line, name, calcs(vs, panel)))
    # Thresholds drawn as lines (custom.thresholdsStyle), and a soft maximum the axis reaches at least.
    if (custom.get("thresholdsStyle") or {}).get("mode") in ("line", "dashed", "line+area", "dashed+area"):
        for step in (defaults.get("thresholds") or {}).get("steps") or []:
            if step.get("value") is not None:
                ax.axhline(step["value"], color=color_of(step.get("color", "red")), linewidth=1.0,
                           linestyle=(0, (6, 4)) if custom["thresholdsStyle"]["mode"].startswith("dashed") else "-")
                vmax = max(vmax, float(step["value"]))
    if isinstance(custom.get("axisSoftMax"), (int, float)):
        vmax = max(vmax, float(custom["axisSoftMax"]) / 1.08)
    ax.set_xlim(datetime.datetime.fromtimestamp(start), datetime.datetime.fromtimestamp(end))
    lo = defaults.get("min", custom.get("axisSoftMin"))
    ticks = axis_ticks(vmax * 1.08 if vmax > 0 else 1, unit)
    if ticks is not None:
        ax.set_yticks(ticks)
        ax.set_ylim(0 if lo is not None else None, max(ticks[-1], vmax * 1.05))
    ax.yaxis.set_major_formatter(lambda v, _pos: fmt_value(v, unit, decimals=None))
    # Time ticks at a round interval, at most 6 of them, as Grafana spaces them.
    span = max(end - start, 1.0)
    tick = next((t for t in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
                 if span / t <= 6), 86400 * math.ceil(span / 86400 / 6))
    first = math.ceil(start / tick) * tick
    ax.set_xticks([datetime.datetime.fromtimestamp(t) for t in range(int(first), int(end) + 1, int(tick))])
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if tick < 60 else "%H:%M"))
    ax.tick_params(colors=MUTED, labelsize=7, length=0, pad=3)
    ax.grid(True, color=GRID, linewidth=0.6)
    for s in ax.spines.values():
        s.set_visible(False)
    if not series:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color=MUTED, fontsize=11)
    return handles


def draw_stat(fig, rect, panel, series):
    import numpy as np
    defaults = panel["fieldConfig"]["defaults"]
    unit, decimals = defaults.get("unit", ""), defaults.get("decimals")
    steps = (defaults.get("thresholds") or {}).get("steps") or [{"color": "green", "value": None}]
    value = float("nan")
    ts, vs = [], []
    if series:
        _, ts, vs = series[0]
        value = next((v for v in reversed(vs) if not math.isnan(v)), float("nan"))
    color = color_of(steps[0]["color"])
    for s in steps[1:]:
        if not math.isnan(value) and value >= s["value"]:
            color = color_of(s["color"])
    x0, y0, w, h = rect
    spark = fig.add_axes([x0, y0, w, h * 0.45])
    spark.set_axis_off()
    if len(ts) > 1:
        y = np.array(vs, dtype=float)
        y[~np.isfinite(y)] = np.nan
        spark.fill_between(ts, 0, np.nan_to_num(y), color=color, alpha=0.18, linewidth=0)
        spark.plot(ts, y, color=color, linewidth=1)
        finite = y[np.isfinite(y)]
        spark.set_ylim(0, (finite.max() * 1.15) if finite.size and finite.max() > 0 else 1)
        spark.set_xlim(ts[0], ts[-1])
    fig.text(x0 + w / 2, y0 + h * 0.52, fmt_value(value, unit, decimals), ha="center", va="center",
             color=color, fontsize=22, fontweight="bold")


def render(prom, out, start, end, step=None, scrape_interval=15.0, instance=".*", dashboard=DASHBOARD,
           subtitle=None, width_px=1800, dpi=100):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    with open(dashboard) as f:
        dash = json.load(f)
    if step is None:
        step = max(1.0, round((end - start) / 300.0, 3))
    rate_interval = prom_duration(max(step + scrape_interval, 4 * scrape_interval))
    panels = [p for p in dash["panels"] if p.get("type") != "row"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    header_px, margin = 70, 8
    height_px = header_px + rows * (GRID_ROW_PX + 6) + margin
    W, H = width_px, height_px
    fig = plt.figure(figsize=(W / dpi, H / dpi), dpi=dpi, facecolor=BG)
    plt.rcParams.update({"font.family": "DejaVu Sans", "text.color": TEXT})

    def frac(x_px, y_px, w_px, h_px):  # top-left pixel box -> figure fraction rect
        return [x_px / W, 1 - (y_px + h_px) / H, w_px / W, h_px / H]

    t0 = datetime.datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M:%S")
    t1 = datetime.datetime.fromtimestamp(end).strftime("%H:%M:%S")
    fig.text(margin / W, 1 - 22 / H, f"▦  Dashboards / kvrelay / {dash['title']}", color=TEXT, fontsize=14,
             fontweight="bold", va="center")
    fig.text(1 - margin / W, 1 - 22 / H, f"{t0} to {t1}   ⟳ {dash.get('refresh', '')}", color=MUTED,
             fontsize=10, ha="right", va="center")
    chips = ["Data source  Prometheus", f"Relay  {'All' if instance == '.*' else instance}"]
    x = margin
    for c in chips:
        wpx = 9 + 7.2 * len(c)
        fig.patches.append(FancyBboxPatch((x / W, 1 - 58 / H), wpx / W, 22 / H, boxstyle="round,pad=0,rounding_size=0.002",
                                          transform=fig.transFigure, facecolor=PANEL, edgecolor=BORDER, linewidth=1,
                                          zorder=-10))
        fig.text((x + 8) / W, 1 - 47 / H, c, color=TEXT, fontsize=9, va="center")
        x += wpx + 8
    if subtitle:
        fig.text(1 - margin / W, 1 - 47 / H, subtitle, color=MUTED, fontsize=9, ha="right", va="center")

    grid = [start + k * step for k in range(int((end - start) / step + 1e-9) + 1)]
    col_px = (W - margin) / 24
    drawn, moving = [], []  # panels with a value, and with a value other than 0
    for p in panels:
        g = p["gridPos"]
        px, py = margin + g["x"] * col_px, header_px + g["y"] * (GRID_ROW_PX + 6)
        pw, ph = g["w"] * col_px - margin, g["h"] * (GRID_ROW_PX + 6) - margin
        fig.patches.append(FancyBboxPatch((px / W, 1 - (py + ph) / H), pw / W, ph / H,
                                          boxstyle="round,pad=0,rounding_size=0.003", transform=fig.transFigure,
                                          facecolor=PANEL, edgecolor=BORDER, linewidth=1, zorder=-10))
        fig.text((px + 10) / W, 1 - (py + 16) / H, p["title"], color=TEXT, fontsize=10.5, fontweight="bold", va="center")
        series = []
        drawn_before = len(drawn)
        for t in p["targets"]:
            expr = substitute(t["expr"], rate_interval, instance)
            for labels, ts, vs in query_range(prom, expr, start, end, step):
                # On the query's step grid, NaN where a series has no point (gaps, stacking).
                at = {round((x - start) / step): v for x, v in zip(ts, vs)}
                series.append((legend(t.get("legendFormat"), labels), grid, [at.get(k, float("nan")) for k in range(len(grid))]))
                values = [v for v in vs if math.isfinite(v)]
                if values and len(drawn) == drawn_before:
                    drawn.append(p["title"])
                if any(v != 0 for v in values) and p["title"] not in moving:
                    moving.append(p["title"])
        if p["type"] == "stat":
            draw_stat(fig, frac(px + 6, py + 30, pw - 12, ph - 36), p, series)
            continue
        # A table legend as Grafana draws it: name, then the panel's calcs in columns.
        n = max(1, len(series))
        rows_shown = min(n, 6)
        legend_px = 15 * (rows_shown + 1) + 4
        ax = fig.add_axes(frac(px + 64, py + 30, pw - 78, ph - 30 - 22 - legend_px))
        handles = draw_timeseries(ax, p, series, start, end)
        lx, ly = px + 12, py + ph - legend_px
        col_w = 92 if pw > 500 else 78
        cols = handles[0][2] if handles else []
        for j, (cname, _) in enumerate(cols):
            fig.text((px + pw - 12 - (len(cols) - 1 - j) * col_w) / W, 1 - (ly + 5) / H, cname, color=MUTED,
                     fontsize=7.5, ha="right", va="center")
        for i, (line, label, values) in enumerate(handles[:rows_shown]):
            cy = ly + (i + 1) * 15 + 5
            fig.lines.append(matplotlib.lines.Line2D([lx / W, (lx + 14) / W], [1 - cy / H] * 2,
                                                     transform=fig.transFigure, color=line.get_color(),
                                                     linewidth=2.5, linestyle=line.get_linestyle()))
            fig.text((lx + 20) / W, 1 - cy / H, label, color=TEXT, fontsize=8, va="center")
            for j, (_, v) in enumerate(values):
                fig.text((px + pw - 12 - (len(values) - 1 - j) * col_w) / W, 1 - cy / H, v, color=TEXT,
                         fontsize=8, ha="right", va="center")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    # Which panels show data, for tests/deploy/test_dashboard.py to hold the
    # picture against the dashboard.
    shown = {"panels": [p["title"] for p in panels], "drawn": drawn, "moving": moving}
    fig.savefig(out, dpi=dpi, facecolor=BG, metadata={PANELS_KEY: json.dumps(shown)})
    plt.close(fig)
    return {"rate_interval": rate_interval, "step": step, "panels": len(panels), "drawn": len(drawn),
            "moving": len(moving), "size": (W, H)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--out", required=True)
    ap.add_argument("--last", default="1h", help="time range ending now (e.g. 15m), unless --start/--end")
    ap.add_argument("--start", type=float, help="unix seconds")
    ap.add_argument("--end", type=float, help="unix seconds")
    ap.add_argument("--step", type=float, help="seconds (default: range / 300)")
    ap.add_argument("--scrape-interval", default="15s", help="Prometheus' scrape interval, for $__rate_interval")
    ap.add_argument("--instance", default=".*", help="value of $instance (default .*: All)")
    ap.add_argument("--dashboard", default=DASHBOARD)
    args = ap.parse_args()
    end = args.end or time.time()
    start = args.start or end - parse_duration(args.last)
    info = render(args.prometheus.rstrip("/"), args.out, start, end, args.step, parse_duration(args.scrape_interval),
                  args.instance, args.dashboard)
    print(f"wrote {args.out}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
