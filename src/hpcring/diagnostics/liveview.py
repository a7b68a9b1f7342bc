"""What ``hpcring top`` shows: a job's ``live.json`` checked, then turned into one frame.

Rank 0's straggler watcher (:mod:`hpcring.diagnostics.straggler_watch`) rewrites
``<job folder>/live.json`` atomically after each window it judges: the window (first sequence
number, W collectives, the last op), the job's size, each rank's figures over the window
(lateness behind the median rank, seconds inside collectives and outside them, collectives a
second) and the verdict in force, if any.

:func:`parse_live` checks such a document (any bytes: a file that is not one gives one
:class:`LiveError` saying what is wrong, never a traceback); :func:`build_frame` makes a
:class:`Frame` of it, one row per rank, or one per node when the ranks do not fit in ``max_rows``
(the terminal's height); :func:`render` and :func:`frame_text` draw a frame with ``rich``. All of
them are pure (no clock, no terminal, no job records): the command (``hpcring.cli.top_cmd``)
reads the file and the job's state and hands them in.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hpcring.config.text import control_character
from hpcring.errors import HpcringError
from hpcring.ranks import rank_ranges

LIVE_FILE = "live.json"
MAX_BYTES = 64 << 20          # 4096 ranks make about 0.6 MiB; anything this large is no live view
RANK_COLUMNS = ("rank", "host", "ops/s", "lateness ms", "compute s", "inside s", "")
NODE_COLUMNS = ("host", "ranks", "min ops/s", "lateness ms min", "median", "max", "latest rank", "")
_FIGURES = ("lateness_ms", "inside_s", "compute_s", "ops_per_s")
STRAGGLER = "<- straggler"
SLOW_LINK = "<- slow link"      # a link verdict names the sender and its peer


class LiveError(HpcringError):
    """A ``live.json`` that is not what rank 0 writes (truncated, another program's, edited)."""


@dataclass
class Frame:
    """One screen of ``hpcring top``: the header line, the verdict line (or None), the table."""
    header: str
    verdict: str | None
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    marked: list[bool] = field(default_factory=list)    # per row: it holds a rank the verdict names
    by_node: bool = False
    more: str | None = None      # the line below the table when not every node fits
    final: bool = False


# -- checking ----------------------------------------------------------------------------------
def read_live(path: Path) -> dict | None:
    """The checked live view in ``path``; None when there is no such file. Raises LiveError for
    a file that is not one, HpcringError for one that cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise LiveError(f"{path} is a folder, not the job's live view", hint=_HINT) from None
    except OSError as exc:
        raise HpcringError(f"cannot read the live view {path}: {exc.strerror or exc}",
                           hint="check the job folder's permissions") from None
    return parse_live(raw, str(path))


_HINT = ("rank 0 rewrites it (atomically) after each straggler window: a file that stays wrong was written "
         "by something else; delete it (it is only a view) or look at the job with `hpcring report JOB`")


def parse_live(raw: bytes | str, where: str = LIVE_FILE) -> dict:
    """The live view in ``raw``, checked field by field (see the module doc); LiveError naming
    ``where`` and the first thing wrong otherwise. Numbers that are not finite become None."""
    def bad(why: str) -> LiveError:
        return LiveError(f"the live view {where} is corrupt: {why}", hint=_HINT)

    if len(raw) > MAX_BYTES:
        raise bad(f"larger than {MAX_BYTES >> 20} MiB")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad(f"not UTF-8 text (byte {exc.start})") from None
    if not raw.strip():
        raise bad("the file is empty")
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise bad(f"not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise bad("not JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise bad(f"a JSON {_kind(doc)}, not an object")
    try:
        return _checked(doc)
    except ValueError as exc:
        raise bad(str(exc)) from None


def _kind(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _get(d: dict, key: str, where: str):
    if key not in d:
        raise ValueError(f"{where}has no `{key}`")
    return d[key]


def _int(d: dict, key: str, where: str = "", lo: int = 0, hi: int | None = None) -> int:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}`{key}` is a {_kind(v)}, not a whole number")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{where}`{key}` is {v}, out of range")
    return v


def _number(d: dict, key: str, where: str = "", required: bool = True) -> float | None:
    """A number (None where null, absent and not required, or not finite)."""
    if key not in d and not required:
        return None
    v = _get(d, key, where)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}`{key}` is a {_kind(v)}, not a number")
    return float(v) if math.isfinite(v) else None


def _text(d: dict, key: str, where: str = "", nullable: bool = False) -> str | None:
    v = _get(d, key, where)
    if v is None and nullable:
        return None
    if not isinstance(v, str):
        raise ValueError(f"{where}`{key}` is a {_kind(v)}, not text")
    if control_character(v) or len(v) > 4096:
        raise ValueError(f"{where}`{key}` holds control characters or is too long")
    return v


def _checked(doc: dict) -> dict:
    size = _int(doc, "size", lo=1)
    written = _number(doc, "written")
    if written is None:
        raise ValueError("`written` is not a finite number")
    out = {"written": written, "first": _int(doc, "first"), "ops": _int(doc, "ops", lo=1), "size": size,
           "last_op": _text(doc, "last_op", nullable=True)}
    ranks = _get(doc, "ranks", "")
    if not isinstance(ranks, list):
        raise ValueError(f"`ranks` is a {_kind(ranks)}, not an array")
    if not ranks:
        raise ValueError("`ranks` is empty")
    if len(ranks) > size:
        raise ValueError(f"`ranks` has {len(ranks)} entries for a job of {size}")
    rows, seen = [], set()
    for i, r in enumerate(ranks):
        where = f"ranks[{i}] "
        if not isinstance(r, dict):
            raise ValueError(f"{where}is a {_kind(r)}, not an object")
        rank = _int(r, "rank", where, 0, size - 1)
        if rank in seen:
            raise ValueError(f"rank {rank} appears twice in `ranks`")
        seen.add(rank)
        host = _text(r, "host", where)
        if not host:
            raise ValueError(f"{where}`host` is empty")
        rows.append({"rank": rank, "host": host, **{k: _number(r, k, where, required=False) for k in _FIGURES}})
    out["ranks"] = sorted(rows, key=lambda row: row["rank"])
    out["verdict"] = _verdict(doc.get("verdict"), size)
    return out


def _verdict(v, size: int) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"`verdict` is a {_kind(v)}, not an object or null")
    where = "verdict "
    kind = _text(v, "kind", where)              # rank, node, link (a later hpcring may add kinds)
    if not kind:
        raise ValueError("verdict `kind` is empty")
    named = _get(v, "ranks", where)
    if not isinstance(named, list) or not named or any(
            isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < size for r in named):
        raise ValueError(f"verdict `ranks` is not a list of ranks below {size}")
    return {"kind": kind, "ranks": sorted(set(named)), "host": _text(v, "host", where),
            "line": _text(v, "line", where)}


# -- frames ------------------------------------------------------------------------------------
def _fmt(v: float | None, digits: int) -> str:
    if v is None:
        return "-"
    text = f"{v:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text     # no "-0.00"


def age_text(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def build_frame(live: dict, *, job: str, now: float, state: str | None = None, name: str | None = None,
                max_rows: int | None = None, final: bool = False) -> Frame:
    """The frame for ``live`` (as :func:`parse_live` returns it) seen at ``now`` (epoch seconds):
    one row per rank, or per node when there are more ranks than ``max_rows`` (None: no limit).
    When even the nodes do not fit, the latest ones (largest lateness) are kept and ``more`` says
    how many were left out. ``final``: the job has ended; this is its last window."""
    first, ops = live["first"], live["ops"]
    head = [f"job {job}" + (f" ({name})" if name else ""), state or "state unknown", f"{live['size']} ranks"]
    if len(live["ranks"]) < live["size"]:
        head[-1] += f" ({len(live['ranks'])} reported)"
    head.append(f"last op {live['last_op'] or '-'}")
    head.append(f"window #{first}-#{first + ops - 1} ({ops} ops) {age_text(now - live['written'])} ago")
    header = ", ".join(head)
    if final:
        header = "FINAL (the job has ended): " + header
    verdict = live["verdict"]
    named = set(verdict["ranks"]) if verdict else set()
    mark = SLOW_LINK if verdict and verdict["kind"] == "link" else STRAGGLER
    frame = Frame(header, verdict["line"] if verdict else None, RANK_COLUMNS, [], final=final)
    if max_rows is None or len(live["ranks"]) <= max_rows:
        for r in live["ranks"]:
            frame.rows.append((str(r["rank"]), r["host"], _fmt(r["ops_per_s"], 1), _fmt(r["lateness_ms"], 2),
                               _fmt(r["compute_s"], 3), _fmt(r["inside_s"], 3),
                               mark if r["rank"] in named else ""))
            frame.marked.append(r["rank"] in named)
        return frame
    frame.by_node, frame.columns = True, NODE_COLUMNS
    nodes = _nodes(live["ranks"], named)
    if len(nodes) > max_rows:
        keep = max(1, max_rows - 1)
        nodes.sort(key=lambda n: -(n["late_max"] if n["late_max"] is not None else -math.inf))
        left = len(nodes) - keep
        frame.more = (f"... {left} more node{'s' if left > 1 else ''} not shown ({len(nodes)} in all; "
                      f"the latest {keep} above; a taller terminal shows more)")
        nodes = nodes[:keep]
    for n in nodes:
        frame.rows.append((n["host"], n["ranks"], _fmt(n["ops_min"], 1), _fmt(n["late_min"], 2),
                           _fmt(n["late_med"], 2), _fmt(n["late_max"], 2),
                           "-" if n["latest"] is None else str(n["latest"]), mark if n["named"] else ""))
        frame.marked.append(n["named"])
    return frame


def _nodes(ranks: list[dict], named: set[int]) -> list[dict]:
    """One aggregate per host, in the order of each host's first rank."""
    by_host: dict[str, list[dict]] = {}
    for r in ranks:
        by_host.setdefault(r["host"], []).append(r)
    out = []
    for host, rs in by_host.items():
        late = [(r["lateness_ms"], r["rank"]) for r in rs if r["lateness_ms"] is not None]
        rates = [r["ops_per_s"] for r in rs if r["ops_per_s"] is not None]
        vals = [v for v, _ in late]
        out.append({"host": host, "ranks": f"{len(rs)} ({rank_ranges(r['rank'] for r in rs)})",
                    "ops_min": min(rates) if rates else None,
                    "late_min": min(vals) if vals else None,
                    "late_med": statistics.median(vals) if vals else None,
                    "late_max": max(vals) if vals else None,
                    "latest": max(late)[1] if late else None,
                    "named": any(r["rank"] in named for r in rs)})
    return out


# -- drawing -----------------------------------------------------------------------------------
def table(frame: Frame, *, plain: bool = False):
    """The frame's rows as a ``rich.table.Table`` (``plain``: no box, no colour, for text)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text
    t = Table(box=None if plain else box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
              header_style="" if plain else "bold")
    text_cols = {"host", ""} | ({"ranks"} if frame.by_node else set())
    for c in frame.columns:
        t.add_column(c, justify="left" if c in text_cols else "right", no_wrap=True)
    for row, mark in zip(frame.rows, frame.marked):
        # every cell a Text: a host name is never read as rich markup
        t.add_row(*(Text(c) for c in row), style="bold red" if mark and not plain else None)
    return t


def render(frame: Frame, *, plain: bool = False):
    """Everything of the frame, as one rich renderable."""
    from rich.console import Group
    from rich.text import Text
    parts = [Text(frame.header, style="" if plain else ("bold yellow" if frame.final else "bold"))]
    if frame.verdict:
        parts.append(Text(frame.verdict, style="" if plain else "bold red"))
    parts.append(table(frame, plain=plain))
    if frame.more:
        parts.append(Text(frame.more))
    return Group(*parts)


def frame_text(frame: Frame) -> str:
    """The frame as plain text (``hpcring top --once``): no colour, no box, no trailing spaces."""
    import io

    from rich.console import Console
    buf = io.StringIO()
    width = max([len(frame.header), len(frame.verdict or ""), len(frame.more or "")]
                + [sum(len(c) + 2 for c in row) for row in frame.rows] + [200]) + 20
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False,
                      emoji=False, markup=False, no_color=True)
    console.print(render(frame, plain=True))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


__all__ = ["LIVE_FILE", "LiveError", "Frame", "read_live", "parse_live", "build_frame", "render", "frame_text",
           "table", "age_text"]
