"""``hpcring report JOB --plots DIR``: the report as three pictures, each a PNG and an SVG.

* ``split``: each rank's wall time as one stacked horizontal bar of startup, compute,
  communication and waiting (seconds; the HTML page's colors), ranks named by a straggler
  verdict marked;
* ``rate``: the collective rate over the run (collectives a second of the median rank, one point
  at most every 5 s: each attempt's ``diag/windows.jsonl``, written by the straggler watcher), x in
  seconds since the job's start, each attempt's start and end and each straggler verdict marked;
* ``bandwidth``: algorithm bandwidth against the message size, for the last collectives of each
  rank (the ``tail`` of its time summary, :mod:`hpcring.diagnostics.rank_summary`, with each
  message's bytes): a point per rank and collective, bytes over the rank's time inside (its
  waiting for late ranks included), the median of those per size, and the median per size of
  bytes over the time from the last rank's arrival to the last end (the communication alone).

matplotlib is optional (the ``plots`` extra: ``pip install 'hpcring[plots]'``); nothing here
touches pyplot or the process's backend: each picture is a bare :class:`matplotlib.figure.Figure`.
A picture whose data is missing is still drawn, its title saying what is missing.
Each function takes the report dict (:func:`hpcring.jobreport.build`) and the output folder,
and returns a :class:`Drawn`.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hpcring.errors import HpcringError, UsageError
from hpcring.jobreport import PARTS
from hpcring.jobreport_html import COLORS
from hpcring.config.text import check_text, shown
from hpcring.diagnostics import rank_summary

NAMES = ("split", "rate", "bandwidth")
TITLES = {"split": "Where each rank's time went", "rate": "Collectives a second over the run",
          "bandwidth": "Bandwidth against the message size (each rank's last collectives)"}
FORMATS = ("png", "svg")
EXTRA = "plots"                  # pyproject.toml's optional dependency that brings matplotlib
INSTALL = f"pip install 'hpcring[{EXTRA}]'"
MAX_LABELS = 128                 # above this many ranks, the split labels every k-th (and the marked) ones
VERDICT, CLEARED = "#d62728", "#2ca02c"


@dataclass
class Drawn:
    """One picture: its files (a PNG and an SVG) and what it lacks (also in its title)."""
    name: str
    files: list[Path] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


# ---- checks made before anything is read --------------------------------------------------------

def require_matplotlib(flag: str = "--plots") -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib, which is not installed",
                         hint=f"{INSTALL} (or pip install matplotlib), or drop {flag}") from None


def check_folder(path: str, flag: str = "--plots") -> None:
    """``path`` is a folder that exists or can be made (its nearest existing parent is a writable
    folder); nothing is created here."""
    hint = f"give {flag} a folder (it is made when missing) in a writable place"
    try:
        check_text(path)
        target = Path(path)
        if target.exists() and not target.is_dir():
            raise UsageError(f"{flag} {shown(path)} is a file, not a folder", hint=hint)
        probe = target
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        if not probe.is_dir():
            raise UsageError(f"{flag} {shown(path)} cannot be made: {shown(str(probe))} is a file", hint=hint)
        if not os.access(probe, os.W_OK | os.X_OK):
            what = "is not writable" if probe == target else f"cannot be made: {shown(str(probe))} is not writable"
            raise UsageError(f"{flag} {shown(path)} {what}", hint=hint)
    except (ValueError, OSError) as exc:       # control characters, a name too long, a link loop
        raise UsageError(f"{flag} {shown(path)}: {exc}", hint=hint) from None


# ---- what the pictures read -----------------------------------------------------------------------

def read_windows(folder: Path) -> tuple[list[dict] | None, list[str]]:
    """(the lines of ``<folder>/diag/windows.jsonl`` with a time and a rate, oldest first, or None
    when there is no such file; a problem for each line or file that cannot be read)."""
    path = Path(folder) / "diag" / "windows.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, []
    except (OSError, UnicodeDecodeError) as exc:
        return None, [f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})"]
    out, problems = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            at, rate = float(e["at"]), e.get("ops_per_s")
            rate = None if rate is None else float(rate)
            if not math.isfinite(at) or (rate is not None and not math.isfinite(rate)):
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            problems.append(f"{path}:{n}: not a window line (left out)")
            continue
        out.append({"at": at, "ops_per_s": rate})
    return sorted(out, key=lambda e: e["at"]), problems


def tail_points(summaries: dict[int, dict]) -> tuple[dict[int, list[tuple[int, float]]], bool]:
    """({rank: [(bytes, seconds inside)]} over every communicator's tail, whether any tail had
    sizes at all): collectives of no bytes, of a dtype not known, or of no time are left out."""
    points: dict[int, list[tuple[int, float]]] = {}
    sized = False
    for r, sm in sorted(summaries.items()):
        for c in sm.get("comms", []):
            tail = c.get("tail") or {}
            sizes = tail.get("bytes")
            if sizes is None:                  # an older hpcring's summary
                continue
            sized = True
            for b, a, e in zip(sizes, tail.get("started", []), tail.get("ended", [])):
                if b and e > a:
                    points.setdefault(r, []).append((int(b), float(e - a)))
    return points, sized


def after_last_arrival(summaries: dict[int, dict]) -> list[tuple[int, float]]:
    """[(bytes, seconds)] per collective that every rank of its communicator holds in its tail:
    from the last rank's arrival to the last rank's end (the communication alone, the report's
    split's; on the ranks' own clocks). Communicators of one rank, or without sizes, give none."""
    by_comm: dict[str, dict[int, dict]] = {}
    for r, sm in summaries.items():
        for c in sm.get("comms", []):
            by_comm.setdefault(c["name"], {})[r] = c
    out = []
    for members in by_comm.values():
        if len(members) < 2 or any(c["tail"].get("bytes") is None for c in members.values()):
            continue
        t0 = min(c["totals"]["base"] for c in members.values())
        seen: dict[int, list] = {}
        for c in members.values():
            shift = c["totals"]["base"] - t0
            t = c["tail"]
            for q, b, a, e in zip(t["seq"], t["bytes"], t["started"], t["ended"]):
                seen.setdefault(q, []).append((b, a + shift, e + shift))
        for q, rows in seen.items():
            b = rows[0][0]
            if len(rows) == len(members) and b:
                took = max(e for _, _, e in rows) - max(a for _, a, _ in rows)
                if took > 0:
                    out.append((int(b), took))
    return out


def _folders(report: dict) -> list[tuple[object, Path]]:
    return [(a.get("attempt", i), Path(str(a.get("folder") or ""))) for i, a in enumerate(report["attempts"])]


def marked(report: dict) -> dict[int, str]:
    """{rank: "straggler" or "slow link"} for the ranks any straggler verdict named."""
    out: dict[int, str] = {}
    for e in report.get("stragglers") or []:
        v = e.get("verdict")
        if not isinstance(v, dict):
            continue
        what = "slow link" if v.get("kind") == "link" else "straggler"
        for r in v.get("ranks") or []:
            if isinstance(r, int) and out.get(r) != "straggler":
                out[r] = what
    return out


def label(e: dict) -> str:
    return f"rank {e['rank']} ({e['host']})" if e.get("host") else f"rank {e['rank']}"


# ---- drawing ---------------------------------------------------------------------------------------

def _figure(width: float, height: float):
    require_matplotlib()
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height))


def _title(ax, head: str, missing: list[str]) -> None:
    import textwrap
    lines = [textwrap.fill(head, 100)] + [textwrap.fill(m, 110) for m in missing]
    ax.set_title("\n".join(lines), fontsize=10, loc="left")


def _save(fig, out: Path, name: str, formats=FORMATS) -> list[Path]:
    """``out/name.png`` and ``out/name.svg`` (the SVG keeps its text as text: searchable, small)."""
    import matplotlib
    files = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "hpcring"}):
            for fmt in formats:
                path = out / f"{name}.{fmt}"
                fig.savefig(path, format=fmt, dpi=110, metadata={"Date": None} if fmt == "svg" else None)
                files.append(path)
    except OSError as exc:
        raise HpcringError(f"cannot write the {name} picture into {out}: {exc.strerror or exc}",
                           hint="pass --plots a folder in a writable place") from None
    return files


def split(report: dict, out: Path) -> Drawn:
    """``split.{png,svg}``: each rank's startup / compute / communication / waiting (s), stacked."""
    drawn = Drawn("split")
    ranks = report["ranks"]
    marks = marked(report)
    n = max(1, len(ranks))
    fig = _figure(9.0, min(1.6 + 0.3 * n, 60.0))
    ax = fig.add_subplot()
    ys = list(range(len(ranks)))
    for p in PARTS:
        left = [sum((e[f"{q}_s"] or 0.0) for q in PARTS[:PARTS.index(p)]) for e in ranks]
        ax.barh(ys, [e[f"{p}_s"] or 0.0 for e in ranks], left=left, color=COLORS[p], label=p, height=0.7)
    longest = max((e["wall_s"] or 0.0 for e in ranks), default=0.0)
    for y, e in zip(ys, ranks):
        if e["compute_s"] is None:
            ax.text(longest * 0.01, y, "no time split: " + ("; ".join(e["notes"]) or "no records")[:120],
                    va="center", fontsize=8, color="#8a4b00")
        elif e["rank"] in marks:
            ax.text((e["wall_s"] or 0.0) + longest * 0.01, y, marks[e["rank"]], va="center", fontsize=8,
                    color=VERDICT, fontweight="bold")
    step = 1 if len(ranks) <= MAX_LABELS else math.ceil(len(ranks) / MAX_LABELS)
    shown = [i for i, e in enumerate(ranks) if i % step == 0 or e["rank"] in marks]
    ax.set_yticks(shown, [label(ranks[i]) for i in shown], fontsize=8 if len(ranks) <= 32 else 6)
    for i, t in zip(shown, ax.get_yticklabels()):
        if ranks[i]["rank"] in marks:
            t.set_color(VERDICT)
            t.set_fontweight("bold")
    ax.set_ylim(len(ranks) - 0.5, -0.5)              # rank 0 on top
    ax.set_xlim(0, longest * 1.12 if longest > 0 else 1.0)
    ax.set_xlabel("seconds (each rank's process start to its end)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08 - 0.6 / fig.get_figheight()), ncol=len(PARTS),
              frameon=False, fontsize=9)
    if not any(e["compute_s"] is not None for e in ranks):
        drawn.missing.append("no rank has a time split (no time summaries in diag/: "
                             "written at each rank's exit, HPCRING_WATCHDOG not 0)")
    attempt = report["attempts"][-1].get("attempt", 0) if report["attempts"] else 0
    again = f", attempt {attempt}" if len(report["attempts"]) > 1 else ""
    _title(ax, f"job {report['job']['id']}: where each rank's time went{again}", drawn.missing)
    fig.tight_layout()
    drawn.files = _save(fig, out, "split")
    return drawn


def rate(report: dict, out: Path, folders: list[Path] | None = None, formats=FORMATS) -> Drawn:
    """``rate.{png,svg}``: the median rank's collectives a second over the run, from each attempt's
    ``diag/windows.jsonl`` (``folders``: the attempts' folders, default the report's)."""
    drawn = Drawn("rate")
    pairs = _folders(report) if folders is None else [(i, Path(f)) for i, f in enumerate(folders)]
    series, found = [], 0
    for attempt, folder in pairs:
        lines, problems = read_windows(folder)
        drawn.missing += problems
        if lines is not None:
            found += 1
            series.append((attempt, lines))
    starts = [a["started"] for a in report["attempts"] if a.get("started") is not None]
    ats = [e["at"] for _, lines in series for e in lines]
    t0 = report.get("started") or min(starts + ats, default=0.0)
    fig = _figure(9.0, 4.2)
    ax = fig.add_subplot()
    palette = ["#2f6fdb", "#7b3fb8", "#1b8a8a", "#b5651d", "#555555"]
    plotted, top = 0, 0.0
    for k, (attempt, lines) in enumerate(series):
        pts = [(e["at"] - t0, e["ops_per_s"]) for e in lines if e["ops_per_s"] is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3, linewidth=1.2,
                    color=palette[k % len(palette)],
                    label=f"attempt {attempt}" if len(report["attempts"]) > 1 else "median rank")
            plotted += len(pts)
            top = max([top, *(y for _, y in pts)])
    multi = len(report["attempts"]) > 1
    said = set()
    for a in report["attempts"]:
        for key, style in (("started", "-"), ("ended", "--")):
            t = a.get(key)
            if t is None or (key == "ended" and a.get("running")):
                continue
            what = ("attempt " if multi else "job ") + ("start" if key == "started" else "end")
            ax.axvline(t - t0, color="#9aa3ae", linestyle=style, linewidth=1, label=None if what in said else what)
            said.add(what)
        if multi and a.get("started") is not None:
            ax.text(a["started"] - t0, 1.0, f" attempt {a.get('attempt')}", transform=ax.get_xaxis_transform(),
                    va="top", fontsize=8, color="#5b6570")
    for e in report.get("stragglers") or []:
        named = e.get("verdict") is not None
        kind = "straggler named" if named else "straggler cleared"
        ax.axvline(e["at"] - t0, color=VERDICT if named else CLEARED, linestyle=":", linewidth=1.4,
                   label=None if kind in said else kind)
        said.add(kind)
    if not series:
        drawn.missing.insert(0, "no diag/windows.jsonl in the job's folder" + ("s" if len(pairs) > 1 else "")
                             + ": the straggler watcher writes it (rank 0, jobs of 2 ranks or more, a line "
                               "at most every 5 s)")
    elif not plotted:
        drawn.missing.insert(0, "diag/windows.jsonl holds no rate")
    elif found < len(pairs):
        drawn.missing.append(f"{len(pairs) - found} of {len(pairs)} attempts have no diag/windows.jsonl")
    ax.set_xlabel("seconds since the job's start")
    ax.set_ylabel("collectives / s (median rank)")
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower right")
    _title(ax, f"job {report['job']['id']}: collective rate over the run", drawn.missing)
    fig.tight_layout()
    drawn.files = _save(fig, out, "rate", formats)
    return drawn


def bandwidth(report: dict, out: Path, folders: list[Path] | None = None, formats=FORMATS) -> Drawn:
    """``bandwidth.{png,svg}``: bytes per collective over its time inside (GB/s) against the message
    size, for the collectives in each rank's time summary tail (every attempt's ``diag/``)."""
    drawn = Drawn("bandwidth")
    pairs = _folders(report) if folders is None else [(i, Path(f)) for i, f in enumerate(folders)]
    points: dict[int, list[tuple[int, float]]] = {}
    joined: list[tuple[int, float]] = []
    hosts: dict[int, str] = {e["rank"]: e.get("host") for a in report["attempts"] for e in a.get("ranks", [])}
    any_summary, any_sized = False, False
    for _, folder in pairs:
        summaries, problems = rank_summary.read_dir(folder / "diag")
        drawn.missing += problems
        any_summary = any_summary or bool(summaries)
        pts, sized = tail_points(summaries)
        any_sized = any_sized or sized
        for r, p in pts.items():
            points.setdefault(r, []).extend(p)
        joined += after_last_arrival(summaries)
        for r, sm in summaries.items():
            hosts[r] = hosts.get(r) or sm.get("host")
    fig = _figure(9.0, 4.8)
    ax = fig.add_subplot()
    if points:
        cmap = ["#2f6fdb", "#2e9e5b", "#f0a020", "#7b3fb8", "#d62728", "#1b8a8a", "#b5651d", "#e377c2",
                "#555555", "#9aa3ae"]
        many = len(points) > len(cmap)
        for k, (r, pts) in enumerate(sorted(points.items())):
            lab = label({"rank": r, "host": hosts.get(r)})
            ax.scatter([b for b, _ in pts], [b / s / 1e9 for b, s in pts], s=10, alpha=0.55,
                       color="#2f6fdb" if many else cmap[k], label=None if many and k else
                       ("ranks" if many else lab), edgecolors="none")
        for what, pts, style in (("time inside, median", [x for p in points.values() for x in p], "--"),
                                 ("after the last rank arrived, median", joined, "-")):
            by_size: dict[int, list[float]] = {}
            for b, s in pts:
                by_size.setdefault(b, []).append(b / s / 1e9)
            sizes = sorted(by_size)
            if sizes:
                ax.plot(sizes, [sorted(by_size[b])[len(by_size[b]) // 2] for b in sizes], color="#1d232b",
                        linestyle=style, linewidth=1.2, marker="o" if style == "-" else None, markersize=3,
                        label=what)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend(fontsize=8, loc="best")
    elif not any_summary:
        drawn.missing.insert(0, "no time summaries in diag/ (written at each rank's exit, HPCRING_WATCHDOG not 0)")
    elif not any_sized:
        drawn.missing.insert(0, "the time summaries hold no message sizes (written by an older hpcring)")
    else:
        drawn.missing.insert(0, "no collective in the summaries' tails moved bytes of a known type")
    ax.set_xlabel("message (bytes: count x dtype size)")
    ax.set_ylabel("algorithm bandwidth (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    _title(ax, f"job {report['job']['id']}: algorithm bandwidth, bytes per collective / its time (the last "
           f"{rank_summary.TAIL} of each rank; a rank's time inside counts its waiting for late ranks)",
           drawn.missing)
    fig.tight_layout()
    drawn.files = _save(fig, out, "bandwidth", formats)
    return drawn


def write_all(report: dict, out: Path | str) -> list[Drawn]:
    """The three pictures into ``out`` (made when missing)."""
    out = Path(out)
    return [split(report, out), rate(report, out), bandwidth(report, out)]


# ---- the pictures inside the HTML page ----------------------------------------------------------

_PROLOG = re.compile(r"\A.*?(?=<svg[\s>])", re.S)
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)
_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')
_ID = re.compile(r'\bid="([^"]+)"')


def for_html(svg: str, prefix: str) -> str:
    """A matplotlib SVG as markup inside an HTML page: no XML prolog, no metadata (it names web
    addresses the page must not hold), no namespace declarations (HTML knows SVG's), and every id
    (clip paths, markers) prefixed, so two pictures' ids cannot meet."""
    svg = _METADATA.sub("", _PROLOG.sub("", svg, count=1))
    svg = _XMLNS.sub("", svg)
    for old in sorted(set(_ID.findall(svg)), key=len, reverse=True):
        new = f"{prefix}-{old}"
        svg = svg.replace(f'id="{old}"', f'id="{new}"').replace(f"#{old})", f"#{new})").replace(
            f'href="#{old}"', f'href="#{new}"')
    return svg.strip()


def inline(report: dict) -> list[tuple[Drawn, str]]:
    """The rate and bandwidth pictures (the page draws the split itself) as (what was drawn, SVG
    markup for :func:`for_html`'s page), drawn in a folder of their own that is then removed."""
    require_matplotlib("--html")
    out = []
    with tempfile.TemporaryDirectory(prefix="hpcring-report-") as tmp:
        for draw in (rate, bandwidth):
            d = draw(report, Path(tmp), formats=("svg",))
            out.append((d, for_html((Path(tmp) / f"{d.name}.svg").read_text(), f"fig-{d.name}")))
    return out
