"""Open a page in headless Chromium and read back what it drew.

A copy of the page gets two small scripts: one first in ``<head>`` that keeps every uncaught
error and ``console.error`` call, and one at the end that, once the page has loaded, writes
into the DOM what each plotly figure holds: its SVG layers, its drawn traces and the data
behind them. ``--dump-dom`` prints the DOM after ``--virtual-time-budget`` has run the page's
scripts, and the test reads that element back.
"""

from __future__ import annotations

import html
import json
import subprocess
from pathlib import Path
from typing import Any

from tests.helpers import require_tool

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")

CATCH = """<script>window.__errors=[];
window.addEventListener('error',e=>window.__errors.push(String(e.message)));
const __ce=console.error;console.error=(...a)=>{window.__errors.push(a.map(String).join(' '));
__ce(...a)};</script>"""

READ = """<script>window.addEventListener('load',()=>setTimeout(()=>{
const out={errors:window.__errors,figures:{}};
for(const div of document.querySelectorAll('.plotly-graph-div')){
 out.figures[div.id]={svg:div.querySelectorAll('svg.main-svg').length,
  drawn:div.querySelectorAll('g.trace, g.hm').length,
  heatmaps:div.querySelectorAll('g.hm image').length,
  ticks:[...div.querySelectorAll('g.colorbar g.tick text, g.colorbar .cbaxis text')].map(t=>{
   const r=t.getBoundingClientRect();return [r.top,r.bottom];}),
  width:div.getBoundingClientRect().width,
  data:(div.data||[]).map(t=>({name:t.name,type:t.type,x:t.x,y:t.y,z:t.z,text:t.text})),
  shapes:((div.layout||{}).shapes||[]).map(s=>({x0:s.x0,x1:s.x1})),
  notes:((div.layout||{}).annotations||[]).map(a=>({x:a.x,text:a.text}))};}
out.overflow=document.documentElement.scrollWidth-window.innerWidth;out.inner=window.innerWidth;
const pre=document.createElement('pre');pre.id='browser-check';
pre.textContent=JSON.stringify(out);document.body.appendChild(pre);},100));</script>"""


def open_page(page: Path, tmp: Path, width: int = 1400) -> dict[str, Any]:
    """What the page drew in Chromium, its window ``width`` px wide: ``errors`` (console),
    ``figures`` by div id (with each colour bar's tick labels, top and bottom, the figure's
    width, its layout's shapes and annotations), ``inner`` (the window's inner width:
    headless Chromium opens no window narrower than 500 px), ``overflow`` (how far the page
    is wider than it) and ``meta``, the page's own account of its figures and time bins."""
    chromium = require_tool("chromium")
    text = page.read_text(encoding="utf-8")
    assert text.count("<head>") == 1 and text.count("</body>") == 1
    probe = tmp / f"probe-{page.name}"
    probe.write_text(text.replace("<head>", "<head>" + CATCH, 1)
                     .replace("</body>", READ + "</body>", 1), encoding="utf-8")
    result = subprocess.run(
        [chromium, *FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", f"--window-size={width},2000",
         "--virtual-time-budget=20000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    dom = result.stdout
    start = dom.find('<pre id="browser-check">')
    assert start >= 0, f"the page never finished loading:\n{result.stderr[-3000:]}"
    body = dom[start + len('<pre id="browser-check">'):dom.index("</pre>", start)]
    found = dict(json.loads(html.unescape(body)))
    meta = text.split('<script type="application/json" id="gpumon-report">', 1)[1]
    found["meta"] = json.loads(meta.split("</script>", 1)[0])
    return found

