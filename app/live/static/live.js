// The live run page: runs arrive over the WebSocket (a snapshot, then the runs that changed) and
// are drawn with uPlot, served from this package (no CDN: the page works offline).
"use strict";

const runs = new Map();  // name -> the run as the server sends it (app/live/runs.py RunView.as_dict)
let selected = null;
let charts = { step: null, time: null };

const fmt = (v, digits = 4) => (v === null || v === undefined ? "–" : typeof v === "number" ? +v.toFixed(digits) : v);
const bytes = (b) => (b ? (b >= 1e9 ? (b / 1e9).toFixed(2) + " GB" : (b / 1e6).toFixed(1) + " MB") : "–");

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
}

function drawRuns() {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  const names = [...runs.keys()].sort((a, b) => runs.get(b).changed - runs.get(a).changed);
  for (const name of names) {
    const r = runs.get(name);
    const tr = document.createElement("tr");
    tr.dataset.run = name;
    if (name === selected) tr.className = "selected";
    cell(tr, name);
    const why = r.why && r.status !== "running" ? r.why : "";
    cell(tr, r.status + (why ? ` (${why.length > 40 ? why.slice(0, 39) + "…" : why})` : ""), "status-" + r.status);
    tr.lastChild.title = why;
    cell(tr, r.strategy || "–");
    cell(tr, r.step === null ? "–" : `${r.step}${r.planned ? " / " + r.planned : ""}`);
    cell(tr, `${r.primary} ${fmt(r.metric)}`);
    cell(tr, fmt(r.loss));
    cell(tr, fmt(r.epsilon, 3));
    cell(tr, bytes(r.bytes));
    tr.onclick = () => { selected = name; drawRuns(); drawDetail(true); };
    body.appendChild(tr);
  }
  if (selected === null && names.length) { selected = names[0]; drawRuns(); drawDetail(true); }
}

function chart(target, xLabel, series, data, old) {
  const el = document.getElementById(target);
  const width = Math.min(560, Math.max(320, window.innerWidth / 2 - 60));
  if (old && old.series.length === series.length + 1) { old.setData(data); return old; }
  if (old) old.destroy();
  el.replaceChildren();
  const opts = {
    width, height: 260,
    scales: { x: { time: false } },
    axes: [{ label: xLabel }, { label: series[0].label, scale: "y" }, ...(series[1] ? [{ side: 1, label: series[1].label, scale: "loss", grid: { show: false } }] : [])],
    series: [{ label: xLabel }, ...series],
  };
  return new uPlot(opts, data, el);
}

function drawDetail(rebuild) {
  const r = runs.get(selected);
  const detail = document.getElementById("detail");
  if (!r) { detail.hidden = true; return; }
  detail.hidden = false;
  const skipped = r.lines_skipped ? ` (${r.lines_skipped} over-long lines of its files skipped)` : "";
  document.getElementById("title").textContent = `${r.name}: ${r.status}${skipped}`;
  document.getElementById("nodes-title").textContent = "Nodes" + (r.nodes_left_out
    ? ` (the first ${r.max_nodes} shown; ${r.nodes_left_out} updates of further nodes left out: --max-nodes)` : "");
  const rows = r.rows.filter((x) => x.round !== null && x.round !== undefined);
  const step = rows.map((x) => x.round);
  const metric = rows.map((x) => x[r.primary] ?? null);
  const loss = rows.map((x) => x.loss ?? null);
  const time = rows.map((x) => x.wall_time_s ?? null);
  if (rebuild) { charts.step?.destroy(); charts.time?.destroy(); charts = { step: null, time: null }; }
  document.getElementById("cap-step").textContent = `${r.primary} and loss per ${r.unit}`;
  document.getElementById("cap-time").textContent = `${r.primary} over wall-clock time (s)`;
  charts.step = chart("chart-step", r.unit, [
    { label: r.primary, stroke: "#0b6bcb", width: 2, scale: "y" },
    { label: "loss", stroke: "#d4722c", width: 1.5, scale: "loss" },
  ], [step, metric, loss], charts.step);
  charts.time = chart("chart-time", "seconds", [{ label: r.primary, stroke: "#1c7c3c", width: 2, scale: "y" }], [time, metric], charts.time);
  document.getElementById("chart-step").dataset.points = String(step.length);  // what the browser test reads
  const nodes = document.querySelector("#nodes tbody");
  nodes.replaceChildren();
  for (const [id, n] of Object.entries(r.nodes)) {
    const tr = document.createElement("tr");
    cell(tr, id);
    cell(tr, fmt(n.last_step));
    cell(tr, n.last_seen ? new Date(n.last_seen).toLocaleTimeString() : "–");
    cell(tr, fmt(n.examples, 0));
    cell(tr, n.applied);
    cell(tr, n.excluded);
    cell(tr, n.rejected);
    cell(tr, fmt(n.contribution, 4));
    cell(tr, n.heartbeat || "–");
    nodes.appendChild(tr);
  }
  const alerts = document.getElementById("alerts");
  alerts.replaceChildren();
  for (const a of [...r.alerts].reverse()) {
    const li = document.createElement("li");
    const about = a.node !== undefined ? ` node ${a.node}` : "";
    const what = a.why || (a.value !== undefined ? `${a.metric} ${fmt(a.value)} ≥ ${a.target}` : "") || (a.epsilon !== undefined ? `ε ${fmt(a.epsilon, 3)} of ${a.max_epsilon}` : "");
    li.textContent = `${r.unit} ${a.step ?? "–"}: ${a.alert}${about}${what ? ": " + what : ""}`;
    alerts.appendChild(li);
  }
  if (!r.alerts.length) alerts.innerHTML = "<li>none</li>";
}

// What the status channel's feed refused (app/live/feed.py): counts by reason.
function showRefused(refused) {
  const el = document.getElementById("channel");
  const reasons = Object.entries(refused);
  const total = reasons.reduce((n, [, k]) => n + k, 0);
  el.textContent = total ? `status channel: ${total} messages refused` : "";
  el.title = reasons.map(([why, k]) => `${k}× ${why}`).join("\n");
}

function connect() {
  const link = document.getElementById("link");
  const ws = new WebSocket(`ws://${location.host}/ws`);
  ws.onopen = () => { link.textContent = "live"; };
  ws.onmessage = (event) => {
    const msg = JSON.parse(event.data);
    for (const r of msg.runs) runs.set(r.name, r);
    if (msg.channel) showRefused(msg.channel.refused);
    drawRuns();
    if (msg.runs.some((r) => r.name === selected)) drawDetail(false);
  };
  ws.onclose = () => { link.textContent = "reconnecting…"; setTimeout(connect, 1000); };
}

connect();
