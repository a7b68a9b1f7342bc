"""``hpcring report JOB --html FILE``: the report as one self-contained HTML page.

Everything is inline: CSS in a ``<style>``, the per-rank time split as an SVG drawn here (one
stacked bar per rank, scaled to the longest wall time, a tooltip per part), no script, no font,
image or link to fetch: the file opens offline and can be mailed or attached to a ticket as is.
"""
from __future__ import annotations

from html import escape

from hpcring.jobreport import PARTS, _clock, fmt_s

COLORS = {"startup": "#9aa3ae", "compute": "#2f6fdb", "communication": "#2e9e5b", "waiting": "#f0a020"}
LABEL_W, BAR_W, ROW_H, TOP, RIGHT = 150, 560, 22, 30, 20

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d232b; margin: 24px;
       max-width: 1000px; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 22px 0 6px; }
.sub { color: #5b6570; margin: 0 0 14px; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0; }
dl.facts dt { color: #5b6570; }
dl.facts dd { margin: 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e3e6ea; text-align: right; }
th { background: #f4f6f8; font-weight: 600; }
td.l, th.l { text-align: left; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 5px; vertical-align: -1px; }
.note { color: #8a4b00; }
svg text { font: 12px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; fill: #1d232b; }
svg .axis { stroke: #c5cbd2; stroke-width: 1; }
figure.plot { margin: 8px 0 18px; }
figure.plot figcaption { color: #5b6570; margin-bottom: 4px; }
figure.plot svg { max-width: 100%; height: auto; }
footer { color: #8a939c; font-size: 12px; margin-top: 24px; }
"""


def _svg(ranks: list[dict]) -> str:
    """The stacked bars: one row per rank, scaled to the longest wall time."""
    longest = max((e["wall_s"] or 0.0 for e in ranks), default=0.0) or 1.0
    height = TOP + ROW_H * len(ranks) + 10
    width = LABEL_W + BAR_W + RIGHT
    out = [f'<svg role="img" aria-label="time split per rank" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}">']
    for i in range(5):                     # the time axis: 0, 1/4, ..., the longest wall time
        x = LABEL_W + BAR_W * i / 4
        out.append(f'<line class="axis" x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{height - 8}"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP - 10}" text-anchor="middle">{escape(fmt_s(longest * i / 4))}</text>')
    for row, e in enumerate(ranks):
        y = TOP + row * ROW_H
        host = f" ({e['host']})" if e.get("host") else ""
        out.append(f'<g class="rank" data-rank="{e["rank"]}">')
        out.append(f'<text x="{LABEL_W - 8}" y="{y + ROW_H / 2 + 4:.1f}" text-anchor="end">'
                   f'rank {e["rank"]}{escape(host)}</text>')
        x = float(LABEL_W)
        if e["compute_s"] is None:
            out.append(f'<text x="{x + 4}" y="{y + ROW_H / 2 + 4:.1f}" fill="#8a4b00">no time split: '
                       f'{escape("; ".join(e["notes"]) or "no records")}</text>')
        else:
            for p in PARTS:
                w = BAR_W * e[f"{p}_s"] / longest
                if w <= 0:
                    continue
                share = 100 * e[f"{p}_s"] / e["wall_s"] if e["wall_s"] else 0.0
                out.append(f'<rect class="{p}" x="{x:.2f}" y="{y + 3}" width="{w:.2f}" height="{ROW_H - 6}" '
                           f'fill="{COLORS[p]}"><title>rank {e["rank"]} {p}: {escape(fmt_s(e[f"{p}_s"]))} '
                           f'({share:.0f}%)</title></rect>')
                x += w
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _row(cells: list[str], left=(0, 1)) -> str:
    """A table row; the columns in ``left`` are text (left-aligned), the others numbers."""
    return "<tr>" + "".join(f'<td class="l">{c}</td>' if i in left else f"<td>{c}</td>"
                            for i, c in enumerate(cells)) + "</tr>"


def _checkpoints(cp: dict | None) -> str:
    if not cp:
        return "none noted (hpcring.checkpoint_saved)"
    step = f" after step {cp['last_step']}" if cp.get("last_step") is not None else ""
    return f"{cp['count']} noted, the last{step} at {_clock(cp['last_at'])}"


def render(report: dict, figures: list[tuple[str, str, list[str]]] | None = None, figures_note: str = "") -> str:
    """The whole page (a str of HTML). ``figures``: (title, SVG markup, what it lacks) of the
    pictures drawn beside the page's own (``hpcring.jobreport_plots.inline``); None with
    ``figures_note`` saying why there are none."""
    j = report["job"]
    final = report["attempts"][-1]
    title = f"hpcring report: job {j['id']}"
    state = report["state"] or ("running" if report["running"] else "state unknown")
    sub = ", ".join(x for x in (j.get("name"), j.get("scheduler"), f"{j['ranks']} ranks", state) if x)
    facts = [("wall time", f"{fmt_s(report['wall_s'])} ({_clock(report['started'])} to {_clock(report['ended'])})"),
             ("rank-hours", f"{report['rank_hours'] or 0:.4g}"),
             ("time to first step", fmt_s(report["time_to_first_step_s"])),
             ("effective ratio", "-" if report["effective_ratio"] is None else
              f"{100 * report['effective_ratio']:.0f}% (productive {fmt_s(report['productive_rank_s'])} of "
              f"{fmt_s(report['allocated_rank_s'])} allocated rank time)"),
             ("lost to hangs", fmt_s(report["lost"]["hangs_s"])),
             ("lost to restarts", fmt_s(report["lost"]["restarts_s"])),
             ("lost, unfinished", fmt_s(report["lost"]["unfinished_s"])),
             ("checkpoints", _checkpoints(report["checkpoints"])),
             ("requeues", str(report["requeues"])),
             ("job folder", j["folder"])]
    h = ['<!DOCTYPE html>', '<html lang="en">', '<head>', '<meta charset="utf-8">',
         f"<title>{escape(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
         f"<h1>{escape(title)}</h1>", f'<p class="sub">{escape(sub)}</p>', '<dl class="facts">']
    h += [f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in facts]
    h.append("</dl>")
    if report["running"]:
        h.append('<p class="note">Running: numbers so far (a rank writes its time summary at exit, or on '
                 'SIGRTMIN+7).</p>')
    h.append("<h2>Where each rank's time went</h2>")
    h.append('<p class="legend">' + "".join(f'<span><i style="background:{COLORS[p]}"></i>{p}</span>'
                                            for p in PARTS) + "</p>")
    h.append(_svg(final["ranks"]))
    h.append('<table class="ranks"><thead><tr><th class="l">rank</th><th class="l">host</th><th>wall</th>'
             + "".join(f"<th>{p}</th>" for p in PARTS) + "<th>collectives</th><th>exit</th></tr></thead><tbody>")
    for e in final["ranks"]:
        cells = [f"rank {e['rank']}", escape(str(e.get("host") or "?")), escape(fmt_s(e["wall_s"]))]
        for p in PARTS:
            v = e[f"{p}_s"]
            share = f" ({100 * v / e['wall_s']:.0f}%)" if v is not None and e["wall_s"] else ""
            cells.append(escape(fmt_s(v) + share))
        cells += [escape(str(e["collectives"] if e["collectives"] is not None else "-")),
                  escape(str(e["exit_code"] if e["exit_code"] is not None else "-"))]
        h.append(_row(cells))
    h.append("</tbody></table>")
    if len(report["attempts"]) > 1 or final["hang"]:
        h.append("<h2>Attempts</h2>")
        h.append('<table class="attempts"><thead><tr><th class="l">attempt</th><th class="l">job</th>'
                 '<th class="l">state</th><th>wall</th><th>gap before</th><th>lost</th><th class="l">hang</th>'
                 "</tr></thead><tbody>")
        for a in report["attempts"]:
            hang = f"{fmt_s(a['hang']['lost_s'])}: {a['hang']['headline']}" if a["hang"] else ""
            h.append(_row([str(a["attempt"]), escape(str(a["job"])), escape(str(a["state"] or "?")),
                           escape(fmt_s(a["wall_s"])), escape(fmt_s(a["gap_s"])), escape(fmt_s(a["lost_s"])),
                           escape(hang)], left=(0, 1, 2, 6)))
        h.append("</tbody></table>")
    if figures:
        h.append("<h2>Over the run</h2>")
        for title, svg, lacks in figures:
            h.append(f'<figure class="plot"><figcaption>{escape(title)}</figcaption>{svg}')
            h += [f'<p class="note">missing: {escape(m)}</p>' for m in lacks]
            h.append("</figure>")
    elif figures_note:
        h.append(f'<p class="note">{escape(figures_note)}</p>')
    named = report.get("stragglers") or []
    h.append("<h2>Stragglers</h2>")
    if named:
        h.append('<ul class="stragglers">' + "".join(
            f'<li class="straggler">{escape(_clock(e["at"]))} {escape(e["line"])}</li>' for e in named) + "</ul>")
    else:
        h.append('<p class="note">None named.</p>')
    notes = report["problems"] + [f"rank {e['rank']}: {n}" for e in final["ranks"] for n in e["notes"]]
    if notes:
        h.append("<h2>Notes</h2><ul>" + "".join(f'<li class="note">{escape(n)}</li>' for n in notes) + "</ul>")
    h.append(f"<footer>hpcring report, {escape(report['schema'])}, generated {escape(_clock(report['generated']))}"
             "</footer>")
    h += ["</body>", "</html>"]
    return "\n".join(h) + "\n"
