"""`GET /dash/<model>`: one self-contained page (inline CSS, JS and SVG; no external assets, works offline).

The page carries its first data inline, so it renders at once, then refreshes from `/dash/<model>/data`.
It shows the workload as a heatmap over (input, output) tokens in log2 cells, the plan and its cost, a burst
in the newest windows and whether the plan was made for it or left it to the router, an add the plan held
while the fleet running had room, what each deployment
reports, the model's estimate (load: replicas' worth of work the plan sends it) next to what the gateways
observed there (requests completed in the feedback's span, their SLO attainment and P99, of the SLO
latency the deployment keeps worst, and the factor the feedback keeps on its profile), and replicas per
GPU type over time.
"""

from __future__ import annotations

import json
import math
from typing import Any

from extproc.gpu_profiles import GpuProfile
from extproc.optimizer.monitor import ModelState


def dashboard_data(state: ModelState, profiles: dict[str, GpuProfile | None], now: float) -> dict[str, Any]:
    """Everything the page draws, as JSON-ready data."""
    heat: dict[tuple[int, int], float] = {}
    for d in state.demands:  # whole-log2 cells: a readable grid whatever the profiles' grids are
        cell = (round(math.log2(max(d.input_tokens, 1.0))), round(math.log2(max(d.output_tokens, 1.0))))
        heat[cell] = heat.get(cell, 0.0) + d.rps
    plan = state.plan
    deployments = []
    reported_cost = 0.0
    feedback = state.feedback
    for key, d in state.deployments.items():
        p = profiles.get(key)
        reported = state.reported(key)
        seen = feedback.outcomes.get(key)
        if p is not None:
            reported_cost += p.cost * reported
        deployments.append({
            "key": key, "namespace": d.namespace, "name": d.name, "reported": reported,
            "planned": None if plan is None else plan.replicas.get(key, 0),
            "load": None if plan is None else round(plan.load.get(key, 0.0), 4),
            "override": state.overrides.get(key), "min_replicas": d.min_replicas,
            "cost": None if p is None else p.cost, "profiled": p is not None,
            "observed": None if seen is None or not seen.requests else {
                "completed": seen.completed, "rejected": seen.rejected,
                "attainment": round(seen.attainment, 5),
                "metric": seen.metric, "p99_s": round(seen.p99_s, 5)},
            "factor": round(feedback.factor(key), 4),
        })
    return {
        "model": state.model, "now": now, "updated": state.updated, "has_load": state.has_load,
        "error": state.error,
        "rps": sum(d.rps for d in state.demands),
        "heatmap": [{"in_log2": i, "out_log2": o, "rps": r} for (i, o), r in sorted(heat.items())],
        "plan": None if plan is None else {
            "replicas": plan.replicas, "cost": plan.cost, "solve_seconds": plan.solve_seconds,
            "rps": plan.rps,
            "optimal": plan.optimal,
        },
        "reported_cost": reported_cost,
        "held": state.held,  # the plan's own counts while the fleet running is kept (planning._held)
        "burst": None if state.burst is None else {
            "rps": round(state.burst.rps, 4), "level": round(state.burst.level, 4),
            "planned": state.burst.planned},
        "deployments": deployments,
        "history": [{"t": t, "replicas": r} for t, r in state.history],
    }


def render_page(data: dict[str, Any], refresh_ms: int = 2000) -> str:
    """The page with its first data inline ("</" escaped so no value can close the script element)."""
    inline = json.dumps(data).replace("</", "<\\/")
    return (_PAGE.replace("__MODEL__", _html_escape(data["model"]))
            .replace("__DATA__", inline).replace("__REFRESH__", str(int(refresh_ms))))


def _html_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>GPU optimizer · __MODEL__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:20px;color:#1d2330;background:#f6f7fb}
 h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:0 0 8px;color:#3a4256}
 .sub{color:#667;margin-bottom:14px} .err{color:#b3261e;font-weight:600}
 .grid{display:grid;grid-template-columns:minmax(340px,1fr) minmax(340px,1fr);gap:16px}
 .card{background:#fff;border:1px solid #dde1ea;border-radius:8px;padding:14px}
 .wide{grid-column:1/-1} table{border-collapse:collapse;width:100%}
 th,td{padding:5px 8px;border-bottom:1px solid #eceff5;text-align:right} th:first-child,td:first-child{text-align:left}
 th{font-weight:600;color:#556;font-size:12px} .big{font-size:26px;font-weight:700}
 .kpis{display:flex;gap:28px;margin-bottom:10px} .kpi span{display:block;color:#667;font-size:12px}
 .tag{display:inline-block;padding:0 6px;border-radius:4px;background:#fff3cd;font-size:11px;margin-left:4px}
 svg text{font:11px system-ui,sans-serif;fill:#445}
</style></head>
<body data-refreshes="0">
<h1>GPU optimizer: <span id="model">__MODEL__</span></h1>
<div class="sub" id="status">loading…</div>
<div class="grid">
 <div class="card">
  <h2>Plan</h2>
  <div class="kpis">
   <div class="kpi"><span>cost of reported replicas</span><b class="big" id="cost">–</b></div>
   <div class="kpi"><span>plan cost</span><b class="big" id="plan-cost">–</b></div>
   <div class="kpi"><span>requests / s</span><b class="big" id="rps">–</b></div>
  </div>
  <table id="plan"><thead><tr><th>deployment</th><th>replicas</th><th>plan</th><th>load</th><th>min</th>
   <th>cost/replica</th><th>seen</th><th>SLO %</th><th>P99 ms</th><th>factor</th></tr></thead>
   <tbody></tbody></table>
  <div class="sub" id="solve"></div>
  <div class="sub" id="burst"></div>
  <div class="sub" id="held"></div>
 </div>
 <div class="card"><h2>Workload (requests/s per cell)</h2><svg id="heatmap" width="100%" height="300"></svg></div>
 <div class="card wide"><h2>Replicas per GPU type over time</h2><svg id="history" width="100%" height="240"></svg></div>
</div>
<script type="application/json" id="initial">__DATA__</script>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#3367d6","#e8710a","#1e8e3e","#a142f4","#d93025","#12b5cb","#f9ab00","#5f6368"];
const REFRESH = Number(new URLSearchParams(location.search).get("refresh")) || __REFRESH__;
function el(tag, attrs, text){ const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; }
function fmt(x, d){ return x === null || x === undefined ? "–" : Number(x).toFixed(d); }
function clear(node){ while (node.firstChild) node.removeChild(node.firstChild); }
function tokens(k){ const t = Math.pow(2, k); return t >= 1024 ? (t / 1024) + "K" : String(t); }

function renderPlan(d){
  document.getElementById("cost").textContent = fmt(d.reported_cost, 2);
  document.getElementById("plan-cost").textContent = d.plan ? fmt(d.plan.cost, 2) : "–";
  document.getElementById("rps").textContent = fmt(d.rps, 2);
  const body = document.querySelector("#plan tbody"); clear(body);
  d.deployments.forEach((x, i) => {
    const tr = document.createElement("tr"); tr.dataset.deployment = x.key;
    const o = x.observed;
    const cells = [x.key, x.reported, x.planned === null ? "–" : x.planned, fmt(x.load, 2), x.min_replicas,
                   x.cost === null ? "no profile" : fmt(x.cost, 2),
                   o ? o.completed + (o.rejected ? " (+" + o.rejected + " refused)" : "") : "–",
                   o ? fmt(o.attainment * 100, 1) : "–", o ? fmt(o.p99_s * 1000, 1) + " " + o.metric.toUpperCase() : "–", fmt(x.factor, 2)];
    cells.forEach((c, j) => { const td = document.createElement("td"); td.textContent = c;
      if (j === 0) td.style.color = COLORS[i % COLORS.length];
      if (j === 1) { td.className = "replicas"; if (x.override !== null) { const s = document.createElement("span");
        s.className = "tag"; s.textContent = "override"; td.appendChild(s); } }
      tr.appendChild(td); });
    body.appendChild(tr);
  });
  const s = document.getElementById("solve");
  s.textContent = d.plan ? "solved in " + fmt(d.plan.solve_seconds * 1000, 1) + " ms" +
    (d.plan.optimal ? " (optimal)" : " (time limit: best found)") : "no plan yet";
  if (!d.has_load) s.textContent += " · no load: reporting min_replicas";
}

function renderHeatmap(d){
  const svg = document.getElementById("heatmap"); clear(svg);
  const cells = d.heatmap;
  if (!cells.length){ svg.appendChild(el("text", {x: 20, y: 30}, "no requests in the window")); return; }
  const ins = cells.map(c => c.in_log2), outs = cells.map(c => c.out_log2);
  const x0 = Math.min(...ins), x1 = Math.max(...ins), y0 = Math.min(...outs), y1 = Math.max(...outs);
  const W = svg.clientWidth || 480, H = 300, L = 56, B = 40, T = 8, R = 8;
  const cw = (W - L - R) / (x1 - x0 + 1), ch = (H - T - B) / (y1 - y0 + 1);
  const top = Math.max(...cells.map(c => c.rps));
  for (const c of cells){
    const x = L + (c.in_log2 - x0) * cw, y = T + (y1 - c.out_log2) * ch, a = 0.12 + 0.88 * c.rps / top;
    const r = el("rect", {x: x + 1, y: y + 1, width: Math.max(cw - 2, 1), height: Math.max(ch - 2, 1),
      fill: "rgba(51,103,214," + a.toFixed(3) + ")", rx: 3, "class": "cell"});
    r.appendChild(el("title", {}, tokens(c.in_log2) + " in × " + tokens(c.out_log2) + " out: " +
                     fmt(c.rps, 3) + " req/s")); svg.appendChild(r);
    if (cw > 34 && ch > 16) svg.appendChild(el("text", {x: x + cw / 2, y: y + ch / 2 + 4, "text-anchor": "middle",
      style: a > 0.55 ? "fill:#fff" : ""}, fmt(c.rps, c.rps < 10 ? 2 : 0)));
  }
  for (let k = x0; k <= x1; k++) svg.appendChild(el("text", {x: L + (k - x0 + 0.5) * cw, y: H - B + 16,
    "text-anchor": "middle"}, tokens(k)));
  for (let k = y0; k <= y1; k++) svg.appendChild(el("text", {x: L - 6, y: T + (y1 - k + 0.5) * ch + 4,
    "text-anchor": "end"}, tokens(k)));
  svg.appendChild(el("text", {x: L + (W - L - R) / 2, y: H - 6, "text-anchor": "middle"}, "input tokens"));
  svg.appendChild(el("text", {x: 12, y: T + (H - T - B) / 2, transform: "rotate(-90 12 " + (T + (H - T - B) / 2) + ")",
    "text-anchor": "middle"}, "output tokens"));
}

function renderHistory(d){
  const svg = document.getElementById("history"); clear(svg);
  const h = d.history, keys = d.deployments.map(x => x.key);
  if (!h.length){ svg.appendChild(el("text", {x: 20, y: 30}, "no re-plans yet")); return; }
  const W = svg.clientWidth || 900, H = 240, L = 40, R = 180, T = 10, B = 28;
  const t0 = h[0].t, t1 = Math.max(h[h.length - 1].t, t0 + 1);
  const ymax = Math.max(1, ...h.flatMap(p => keys.map(k => p.replicas[k] || 0)));
  const X = t => L + (t - t0) / (t1 - t0) * (W - L - R), Y = v => T + (1 - v / ymax) * (H - T - B);
  svg.appendChild(el("line", {x1: L, y1: Y(0), x2: W - R, y2: Y(0), stroke: "#99a"}));
  for (let v = 0; v <= ymax; v += Math.max(1, Math.ceil(ymax / 5))) svg.appendChild(el("text", {x: L - 6,
    y: Y(v) + 4, "text-anchor": "end"}, String(v)));
  svg.appendChild(el("text", {x: L, y: H - 6}, new Date(t0 * 1000).toLocaleTimeString()));
  svg.appendChild(el("text", {x: W - R, y: H - 6, "text-anchor": "end"}, new Date(t1 * 1000).toLocaleTimeString()));
  keys.forEach((k, i) => {
    let path = "";
    h.forEach((p, j) => { const v = p.replicas[k] || 0;
      path += (j ? " H" + X(p.t).toFixed(1) + " V" : "M" + X(p.t).toFixed(1) + " ") + Y(v).toFixed(1); });
    path += " H" + X(t1).toFixed(1);
    svg.appendChild(el("path", {d: path, fill: "none", stroke: COLORS[i % COLORS.length], "stroke-width": 2,
      "class": "series", "data-deployment": k}));
    const last = h[h.length - 1].replicas[k] || 0;
    svg.appendChild(el("text", {x: W - R + 10, y: T + 14 + 16 * i, style: "fill:" + COLORS[i % COLORS.length]},
      k + ": " + last));
  });
}

function renderBurst(d){
  const b = d.burst, node = document.getElementById("burst");
  node.textContent = !b ? "" : "burst: " + fmt(b.rps, 2) + " req/s in the newest windows, against " + fmt(b.level, 2) +
    " on average · " + (b.planned ? "planned for (the fleet strains: requests refused or the TPOT SLO missed)" :
    "left to the router (the fleet serves it with nothing refused and the TPOT SLO kept)");
  node.dataset.planned = b ? String(b.planned) : "";
}

function renderHeld(d){
  const h = d.held, node = document.getElementById("held");
  node.textContent = !h ? "" : "held: the plan asks for " + Object.keys(h).sort().map(k => k + " " + h[k]).join(", ") +
    "; the fleet running is kept (it kept the TPOT SLO with room, refused nothing and carries the load)";
}

function render(d){
  renderPlan(d); renderHeatmap(d); renderHistory(d); renderBurst(d); renderHeld(d);
  const st = document.getElementById("status"); clear(st);
  st.appendChild(document.createTextNode(d.updated ? "re-planned " + new Date(d.updated * 1000).toLocaleTimeString() :
    "waiting for the first re-plan"));
  if (d.error){ const e = document.createElement("span"); e.className = "err"; e.id = "error";
    e.textContent = " · " + d.error; st.appendChild(e); }
}

async function refresh(){
  try {
    const r = await fetch(location.pathname.replace(/\\/$/, "") + "/data", {cache: "no-store"});
    if (r.ok){ render(await r.json()); document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes) + 1); }
  } catch (e) { /* the service restarts or is unreachable: keep the last picture */ }
  setTimeout(refresh, REFRESH);
}
render(JSON.parse(document.getElementById("initial").textContent));
setTimeout(refresh, Math.min(REFRESH, 500));
</script>
</body></html>
"""  # noqa: E501 (the page's inline JS reads better unwrapped)
