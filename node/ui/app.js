// The status page: polls /ui/status.json (node/status_page.py) every 2 s and draws it.
// Charts: uPlot (vendored, node/ui/vendor/). The JSON's "series" already holds the last minutes
// (node/status_history.py), so the charts are full as soon as the page opens.
"use strict";

const POLL_MS = 2000;
const query = window.location.search; // ?token=... is passed on to the JSON polls
const state = { polls: 0, last: null, charts: {} };
window.sbpStatus = state;

function el(id) { return document.getElementById(id); }

function text(v) { return v === null || v === undefined ? "–" : String(v); }

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function fmtDuration(s) {
  s = Math.floor(s);
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
  return (d ? d + "d " : "") + (d || h ? h + "h " : "") + m + "m " + (s % 60) + "s";
}

function facts(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v] of pairs) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = text(v);
    dl.append(dt, dd);
  }
}

function rows(tbody, data) {
  tbody.replaceChildren();
  for (const cells of data) {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = text(c);
      tr.append(td);
    }
    tbody.append(tr);
  }
}

// One uPlot per chart; rebuilt when its set of series changes (a new operation shows up).
function drawChart(id, title, seriesDefs, xs, columns) {
  const box = el(id);
  const key = seriesDefs.map(s => s.label).join("|");
  let entry = state.charts[id];
  const data = [xs].concat(columns);
  if (!entry || entry.key !== key) {
    if (entry) entry.plot.destroy();
    const width = Math.max(300, box.clientWidth || 800);
    const axes = [{}, { scale: seriesDefs[0].scale, label: seriesDefs[0].scale }];
    const scales = { x: { time: true } };
    const second = seriesDefs.find(s => s.scale !== seriesDefs[0].scale);
    if (second) axes.push({ scale: second.scale, side: 1, label: second.scale, grid: { show: false } });
    const opts = {
      title, width, height: 240, scales, axes,
      series: [{}].concat(seriesDefs.map(s => ({
        label: s.label, scale: s.scale, stroke: s.color, width: 1.5, spanGaps: false,
        value: (u, v) => v === null || v === undefined ? "–" : v.toFixed(s.digits || 0),
      }))),
    };
    entry = state.charts[id] = { key, plot: new uPlot(opts, data, box) };
  } else {
    entry.plot.setData(data);
  }
  box.dataset.points = String(xs.length);
}

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

function render(s) {
  const n = s.node;
  el("node-id").textContent = "#" + n.node_id;
  document.title = "sbpnode #" + n.node_id;
  const listeners = Object.entries(n.listeners).map(([k, v]) => k + " " + text(v)).join(", ");
  facts(el("node-facts"), [
    ["id", n.node_id], ["version", n.version], ["uptime", fmtDuration(n.uptime_s)], ["fsync", n.fsync],
    ["listeners", listeners], ["data dir", n.data_dir], ["pid", n.pid],
  ]);

  const c = s.cluster;
  el("cluster-mode").textContent = c.mode;
  el("cluster-leader").textContent = text(c.leader);
  el("cluster-failovers").textContent = text(c.failovers);
  rows(el("members").tBodies[0], c.members.map(m => {
    const per = c.per_node[String(m.node_id)] || { leads: 0, replicas: 0 };
    return [m.node_id + (m.node_id === c.leader ? " (leader)" : ""), m.sbp, m.http, m.alive ? "yes" : "no", per.leads, per.replicas];
  }));

  rows(el("busiest").tBodies[0], s.streams.busiest.map(b => [b.stream_id, b.records_s, b.next_offset]));
  rows(el("peer-table").tBodies[0], s.peers.map(p => [p.peer, p.connected ? "yes" : "no", p.lag, p.rate_items_s, p.last_error]));

  const st = s.store;
  facts(el("store-facts"), [
    ["streams", s.streams.count], ["WAL", fmtBytes(st.wal_bytes) + " in " + text(st.wal_segments) + " segments"],
    ["chunks", text(st.chunks) + " in " + text(st.chunk_packs) + " packs"], ["kv keys", st.kv_keys],
    ["write queue", fmtBytes(st.queued_bytes)], ["failed", st.failed || "no"],
  ]);

  const ser = s.series;
  const mb = v => v === null ? null : v / 1e6;
  drawChart("chart-throughput", "append / fetch",
    [
      { label: "append records/s", scale: "per s", color: COLORS[0] },
      { label: "fetches/s", scale: "per s", color: COLORS[1] },
      { label: "append MB/s", scale: "MB/s", color: COLORS[2], digits: 2 },
      { label: "fetch MB/s", scale: "MB/s", color: COLORS[3], digits: 2 },
    ],
    ser.t, [ser.append_records_s, ser.fetches_s, ser.append_bytes_s.map(mb), ser.fetch_bytes_s.map(mb)]);

  const defs = [], cols = [];
  let k = 0;
  for (const op of Object.keys(ser.latency_ms).sort()) {
    for (const q of ["p50", "p99"]) {
      defs.push({ label: op + " " + q, scale: "ms", color: COLORS[k++ % COLORS.length], digits: 3 });
      cols.push(ser.latency_ms[op][q]);
    }
  }
  if (defs.length) drawChart("chart-latency", "latency", defs, ser.t, cols);
}

async function poll() {
  try {
    const r = await fetch("/ui/status.json" + query, { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    state.last = s;
    state.polls++;
    render(s);
    el("state").textContent = "live";
    el("state").className = "state ok";
  } catch (e) {
    el("state").textContent = "unreachable: " + e.message;
    el("state").className = "state bad";
  }
  setTimeout(poll, POLL_MS);
}

el("metrics-link").href = "/metrics" + query;
el("json-link").href = "/ui/status.json" + query;
poll();
