"""Printing, JSON and plots for scenario results."""

from __future__ import annotations

import json
import os

from .harness import OK, Metric, ScenarioResult


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_metric(m: Metric) -> str:
    if m.value is None:
        return "-"
    if m.unit == "x":
        return f"{m.value:.3f}x"
    if m.unit == "us":
        return f"{m.value:.1f} us"
    return f"{m.value:.4g} {m.unit}"


def _verdict(m: Metric) -> str:
    return {True: "met", False: "MISSED", None: ""}[m.met]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_scenario(res: ScenarioResult) -> str:
    out = [f"== {res.name}: {res.title}",
           f"   reference: {res.reference}",
           f"   tolerance: {res.tolerance}"]
    for case, rows in res.cases.items():
        bare = next((r.stats.median_s for r in rows if r.system == "bare" and r.stats), None)
        table = []
        for r in rows:
            s = r.stats
            cells = [r.system, r.status if r.status != OK else "",
                     fmt_time(s.median_s) if s else "-", fmt_time(s.min_s) if s else "-",
                     fmt_time(s.max_s) if s else "-", str(s.n) if s else "-",
                     f"{s.median_s / bare:.2f}x" if s and bare else "-"]
            if "bytes" in r.extra:
                cells.append(f"{r.extra['bytes']} B ({r.extra['bytes_ratio']:.3f}x rows)")
            else:
                cells.append("")
            cells.append(r.note)
            table.append(cells)
        out.append(f"\n   [{case}]")
        out.append(_indent(_table(["system", "status", "median", "min", "max", "n",
                                   "/bare", "size", "note"], table)))
    if res.metrics:
        out.append("\n   derived")
        out.append(_indent(_table(
            ["metric", "value", "target", "", "note"],
            [[m.name, fmt_metric(m), m.target_text, _verdict(m), m.note] for m in res.metrics])))
    for n in res.notes:
        out.append(f"   note: {n}")
    for f in res.failures:
        out.append("   !! FAILED " + f.splitlines()[0])
    return "\n".join(out)


def _indent(text: str, pad: str = "   ") -> str:
    return "\n".join(pad + line for line in text.splitlines())


def to_json(res: ScenarioResult, machine: dict) -> dict:
    return {
        "scenario": res.name,
        "title": res.title,
        "reference": res.reference,
        "tolerance": res.tolerance,
        "machine": machine,
        "cases": {case: [r.to_json() for r in rows] for case, rows in res.cases.items()},
        "metrics": [m.to_json() for m in res.metrics],
        "notes": res.notes,
        "failures": res.failures,
        "ok": not res.failures,
    }


def write_json(res: ScenarioResult, machine: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{res.name}.json")
    with open(path, "w") as f:
        json.dump(to_json(res, machine), f, indent=2)
    return path


def plot(res: ScenarioResult, out_dir: str) -> str | None:
    """A bar per ratio metric, its target as a red tick; missing values are
    drawn as an empty slot labelled with why."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [m for m in res.metrics if m.unit == "x"]
    if not ratios:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(ratios) + 1.5))
    ys = range(len(ratios))
    values = [m.value if m.value is not None else 0.0 for m in ratios]
    colors = ["tab:gray" if m.met is None else ("tab:green" if m.met else "tab:red")
              for m in ratios]
    ax.barh(list(ys), values, color=colors)
    for y, m in zip(ys, ratios):
        if m.target is not None:
            ax.plot([m.target, m.target], [y - 0.4, y + 0.4], color="red", lw=2)
        label = fmt_metric(m) if m.value is not None else "n/a: " + (m.note or "")[:60]
        ax.text(max(m.value or 0.0, 0.0), y, " " + label, va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([m.name for m in ratios], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=1.0)
    ax.axvline(1.0, color="black", lw=0.5)
    ax.set_xlabel("ratio (red tick: target, value must be at or left of it)")
    ax.set_title(f"{res.name}: {res.title}", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{res.name}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_summary(results: list[ScenarioResult]) -> str:
    rows = []
    for res in results:
        for m in res.metrics:
            if m.target is not None:
                rows.append([res.name, m.name, fmt_metric(m), m.target_text,
                             _verdict(m) or "n/a", m.note])
    if not rows:
        return ""
    return "== targets (DESIGN.md)\n" + _indent(
        _table(["scenario", "metric", "value", "target", "", "note"], rows))
