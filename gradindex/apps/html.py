"""Pieces of HTML shared by the audit report and the server's page: styles, token heatmaps, sortable tables.

Everything is inline (no CDN, no network): a page made from these opens from a file.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em auto;max-width:1200px;color:#222;
padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd}h3{font-size:1.05em}
table{border-collapse:collapse;width:100%;margin:.5em 0}
th,td{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f5f5f5;position:sticky;top:0;white-space:nowrap}
table.sortable th{cursor:pointer;user-select:none}table.sortable th:after{content:" \\2195";color:#aaa}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.heat{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.heat span{border-radius:2px}
.muted{color:#777}.query{background:#f7f7fb;padding:.4em .6em;border-left:3px solid #88a}
details>summary{cursor:pointer;color:#446}
img.plot{max-width:100%;border:1px solid #eee}
.legend span{padding:0 .4em;border-radius:2px}
"""

SORT_JS = """
function gxSortable(root){(root||document).querySelectorAll('table.sortable').forEach(function(t){
t.querySelectorAll('th').forEach(function(th,i){th.addEventListener('click',function(){
var b=t.tBodies[0],rows=Array.prototype.slice.call(b.rows),asc=th.dataset.dir!=='asc';
rows.sort(function(x,y){var a=x.cells[i].dataset.v!==undefined?x.cells[i].dataset.v:x.cells[i].textContent,
c=y.cells[i].dataset.v!==undefined?y.cells[i].dataset.v:y.cells[i].textContent,na=parseFloat(a),nc=parseFloat(c),
r=(isNaN(na)||isNaN(nc))?String(a).localeCompare(String(c)):na-nc;return asc?r:-r;});
th.dataset.dir=asc?'asc':'desc';rows.forEach(function(r){b.appendChild(r);});});});});}
"""

# the same colouring in JavaScript, for pages that render results they fetch
HEAT_JS = """
function gxHeat(tokens,scores){var m=0;scores.forEach(function(s){m=Math.max(m,Math.abs(s));});
var d=document.createElement('div');d.className='heat';tokens.forEach(function(t,i){
var s=document.createElement('span'),a=m>0?Math.abs(scores[i])/m:0;
s.style.background=scores[i]>=0?'rgba(0,160,60,'+(0.85*a).toFixed(3)+')':'rgba(220,40,40,'+(0.85*a).toFixed(3)+')';
s.title=scores[i].toExponential(3);s.textContent=t;d.appendChild(s);});return d;}
"""

# the same format as :func:`number`, for pages that render the scores they fetch
NUMBER_JS = """
function gxNum(x){var a=Math.abs(x);if(!isFinite(x)||a===0){return String(x);}
if(a>=1e-3&&a<1e7){return x.toFixed(Math.max(0,3-Math.floor(Math.log10(a))));}
return x.toExponential(3).replace(/e([+-])(\\d)$/,'e$10$2');}
"""


def number(x: float) -> str:
    """A score for a table or a page: 4 significant digits, without an exponent from 0.001 to 10 million
    (``:.4g`` wrote 37880 as ``3.788e+04`` beside ``2084``), else as ``1.234e+08``; :data:`NUMBER_JS` alike."""
    a = abs(x)
    if not math.isfinite(x) or a == 0:
        return f"{x:g}"
    if 1e-3 <= a < 1e7:
        return f"{x:.{max(0, 3 - math.floor(math.log10(a)))}f}"
    return f"{x:.3e}"


LEGEND = ('<p class="legend">Token heatmaps: <span style="background:rgba(0,160,60,.6)">raises the score</span> '
          '<span style="background:rgba(220,40,40,.6)">lowers it</span>; shade ∝ |term| / largest |term| of the '
          'sequence; hover a token for its term.</p>')


def heatmap(tokens: Sequence[str], scores: Sequence[float]) -> str:
    """Tokens as spans shaded by their score (green up, red down), scaled to the sequence's largest |score|."""
    m = max((abs(s) for s in scores), default=0.0)
    out = []
    for t, s in zip(tokens, scores, strict=True):
        a = abs(s) / m if m > 0 else 0.0
        rgb = "0,160,60" if s >= 0 else "220,40,40"
        out.append(f'<span style="background:rgba({rgb},{0.85 * a:.3f})" title="{s:.3e}">{html.escape(t)}</span>')
    return f'<div class="heat">{"".join(out)}</div>'


def table(headers: Sequence[str], rows: Sequence[Sequence], sortable: bool = True) -> str:
    """A table; a cell is text (escaped), a number (right-aligned, sortable by value) or ``("html", raw)``."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for r in rows:
        cells = []
        for c in r:
            if isinstance(c, tuple) and len(c) == 2 and c[0] == "html":
                cells.append(f"<td>{c[1]}</td>")
            elif isinstance(c, bool) or c is None:
                cells.append(f"<td>{'' if c is None else html.escape(str(c))}</td>")
            elif isinstance(c, int):
                cells.append(f'<td class="num" data-v="{c}">{c}</td>')
            elif isinstance(c, float):
                cells.append(f'<td class="num" data-v="{c!r}">{number(c)}</td>')
            else:
                cells.append(f"<td>{html.escape(str(c))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    cls = ' class="sortable"' if sortable else ""
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def page(title: str, body: str, script: str = "") -> str:
    """A complete page: inline styles and scripts only."""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}</style></head>'
            f"<body>{body}<script>{SORT_JS}{HEAT_JS}{NUMBER_JS}{script}</script></body></html>")
