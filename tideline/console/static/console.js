// The Tideline console's page: polls the JSON endpoints (tideline/console/app.py) and renders every panel.
// Plain browser JavaScript, no library: tables are built with DOM calls (text only, never HTML from data),
// charts are SVG polylines drawn here.
"use strict";

const PANELS = ["topics", "capture", "groups", "projections", "schemas", "warnings", "series"];
const SVG = "http://www.w3.org/2000/svg";
let intervalMs = 1000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function td(value, cls) { return el("td", cls ? { class: cls } : {}, value === null || value === undefined ? "–" : value); }

function fmtInt(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let size = Number(n), unit = 0;
  while (size >= 1024 && unit < units.length - 1) { size /= 1024; unit++; }
  return unit === 0 ? `${size} B` : `${size.toFixed(1)} ${units[unit]}`;
}

function setValue(id, raw, text) {
  const node = document.getElementById(id);
  node.dataset.value = raw === null || raw === undefined ? "" : String(raw);
  node.textContent = text;
}

function setRows(tableId, rows, emptyText) {
  const columns = document.querySelectorAll(`#${tableId} thead th`).length;
  const none = el("tr", { class: "none" }, el("td", { colspan: columns, class: "muted" }, emptyText || "none"));
  document.querySelector(`#${tableId} tbody`).replaceChildren(...(rows.length ? rows : [none]));
}

function showError(panel, data) {
  const node = document.getElementById(`${panel}-error`);
  if (!node) return;
  node.hidden = !data.error;
  node.textContent = data.error || "";
}

function renderTopics(data) {
  showError("topics", data);
  if (data.error) return;
  setValue("topic-count", data.count, fmtInt(data.count));
  const partitions = data.topics.reduce((n, t) => n + t.partitions, 0);
  document.getElementById("partition-count").textContent = `${fmtInt(partitions)} partitions`;
  const rows = [];
  for (const topic of data.topics) {
    const policy = topic.config ? topic.config.cleanup_policy : "";
    for (const p of topic.partition_info) {
      rows.push(el("tr", { "data-topic": topic.topic, "data-partition": p.partition,
                          class: topic.topic.startsWith("_") ? "internal" : null },
        td(p.partition === 0 ? topic.topic : ""), td(p.partition, "num"), td(fmtInt(p.log_start_offset), "num"),
        el("td", { class: "num end", "data-value": p.log_end_offset }, fmtInt(p.log_end_offset)),
        td(fmtInt(p.last_stable_offset), "num stable"), td(p.size_bytes === undefined ? "–" : fmtBytes(p.size_bytes), "num size"),
        td(p.segments ?? "–", "num size"), td(p.partition === 0 ? policy : "")));
    }
  }
  const all = data.topics.flatMap((t) => t.partition_info);
  const table = document.getElementById("topics-table");
  table.classList.toggle("no-stable", !all.some((p) => p.last_stable_offset !== undefined));
  table.classList.toggle("no-size", !all.some((p) => p.size_bytes !== undefined));
  setRows("topics-table", rows, "no topics yet");
}

function renderCapture(data) {
  showError("capture", data);
  const details = document.getElementById("capture-details");
  if (data.error) {
    for (const id of ["capture-lag-bytes", "slot-confirmed-lsn", "slot-retained-wal"]) setValue(id, null, "–");
    details.replaceChildren();
    return;
  }
  const slot = data.slot;
  const lag = data.lag_bytes ?? null;
  setValue("capture-lag-bytes", lag, lag === null ? "–" : fmtBytes(lag));
  setValue("slot-confirmed-lsn", slot ? slot.confirmed_flush_lsn : null, slot ? slot.confirmed_flush_lsn || "–" : "missing");
  setValue("slot-retained-wal", slot ? slot.retained_wal_bytes : null, slot ? fmtBytes(slot.retained_wal_bytes) : "–");
  document.getElementById("slot-state").textContent =
    slot ? `${slot.slot} · ${slot.plugin} · ${slot.active ? "active" : "inactive"}` : "no slot";
  document.getElementById("slot-wal-status").textContent = slot ? `wal_status ${slot.wal_status}` : "";
  const position = data.stored_position;
  const pairs = [
    ["slot", slot ? `${slot.slot} (${slot.plugin})` : "missing"],
    ["server WAL", slot ? slot.current_wal_lsn : "–"],
    ["restart LSN", slot ? slot.restart_lsn : "–"],
    ["stored up to", position ? `commit ${position.commit_lsn_text} event ${position.event_index}` : "nothing stored"],
    ["snapshot", position ? (position.snapshot_done ? "done" : "under way") : "–"],
    ["keyless tables", data.keyless_tables.join(", ") || "none"],
    ["publications", data.publications.map((p) => p.name).join(", ") || "–"],
  ];
  details.replaceChildren(...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { class: "mono" }, v)]),
    ...coreDetails(data));
}

// The core the connector runs (capture status: core, core_reason, core_tables): one entry, then one per table on
// the Python path while the native core runs the others.
function coreDetails(data) {
  const core = data.core ?? null;
  const text = core === null ? `not reported (${data.core_reason})`
    : `${core}${data.core_requested ? ` (--core ${data.core_requested})` : ""}${data.core_reason ? `: ${data.core_reason}` : ""}`;
  const out = [el("dt", {}, "core"),
    el("dd", { id: "capture-core", class: core === "python" && !data.core_chosen ? "mono bad" : "mono", "data-value": core ?? "" }, text)];
  if (core !== null && !data.core_reason) {
    for (const [table, t] of Object.entries(data.core_tables || {})) {
      if (t.core !== "python") continue;
      out.push(el("dt", {}, `core of ${table}`),
        el("dd", { class: "mono bad", "data-table": table, "data-value": t.core }, `python: ${t.reason}`));
    }
  }
  return out;
}

function renderGroups(data) {
  showError("groups", data);
  if (data.error) return;
  const rows = [];
  for (const group of data.groups) {
    group.partitions.forEach((p, i) => rows.push(el("tr", { "data-group": group.group },
      td(i === 0 ? group.group : ""), td(i === 0 ? group.members.length : "", "num"), td(`${p.topic}[${p.partition}]`),
      td(fmtInt(p.committed_offset), "num"), td(fmtInt(p.log_end_offset), "num"),
      el("td", { class: "num lag", "data-value": p.lag ?? "" }, fmtInt(p.lag)))));
    if (group.partitions.length === 0) rows.push(el("tr", {}, td(group.group), td(group.members.length, "num"), td("–"), td(""), td(""), td("")));
  }
  setRows("groups-table", rows, "no consumer groups");
}

function renderProjections(data) {
  showError("projections", data);
  if (data.error) return;
  setRows("projections-table", data.projections.map((r) => {
    const health = r.stalled ? "stalled" : (r.lag ? "behind" : "ok");
    const parts = r.partitions.map((p) => `${p.topic}[${p.partition}] @${p.next_offset}`).join(", ");
    return el("tr", { "data-projection": r.projection },
      td(r.projection), td(r.mode || "–"), td(health, `health-${health}`), td(fmtInt(r.events), "num"),
      el("td", { class: "num lag", "data-value": r.lag ?? "" }, fmtInt(r.lag)), td(r.reached_lsn, "mono"), td(parts, "wrap"));
  }), "no projections have run");
}

function renderSchemas(data) {
  showError("schemas", data);
  if (data.error) return;
  setRows("schemas-table", data.subjects.map((s) => el("tr", { "data-subject": s.subject },
    td(s.subject), td(s.versions.join(", ")), td(s.latest_version, "num"), td(s.id, "num"), td(s.compatibility))),
    "no subjects in the registry");
}

function renderWarnings(data) {
  const items = data.warnings.map((w) => el("li", { "data-panel": w.panel }, w.message));
  setValue("warning-count", data.warnings.length, String(data.warnings.length));
  document.getElementById("warnings").replaceChildren(
    ...(items.length ? items : [el("li", { class: "none" }, "no warnings")]));
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// A line chart of points[key] over points.t; null values leave gaps. 600×170 user units, left axis labels.
function drawChart(id, points, key, unit, emptyText) {
  const chart = document.getElementById(id);
  const W = 600, H = 170, left = 46, right = 8, top = 8, bottom = 20;
  const values = points.filter((p) => p[key] !== null && p[key] !== undefined);
  const nodes = [];
  if (values.length === 0) {
    nodes.push(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, emptyText));
    chart.replaceChildren(...nodes);
    return;
  }
  const t0 = points[0].t, t1 = Math.max(points[points.length - 1].t, t0 + 1);
  const max = Math.max(1, ...values.map((p) => p[key])) * 1.1;
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (W - left - right);
  const y = (v) => top + (1 - v / max) * (H - top - bottom);
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    nodes.push(svg("line", { x1: left, x2: W - right, y1: y(v), y2: y(v), class: "grid" }));
    nodes.push(svg("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end", class: "axis" }, compact(v)));
  }
  nodes.push(svg("text", { x: left, y: H - 4, class: "axis" }, new Date(t0).toLocaleTimeString("en-GB")));
  nodes.push(svg("text", { x: W - right, y: H - 4, "text-anchor": "end", class: "axis" },
    `${new Date(t1).toLocaleTimeString("en-GB")} · ${unit}`));
  let run = [];
  const flush = () => {
    if (run.length) nodes.push(svg("polyline", { points: run.join(" "), class: "series" }));
    run = [];
  };
  for (const p of points) {
    if (p[key] === null || p[key] === undefined) { flush(); continue; }
    run.push(`${x(p.t).toFixed(1)},${y(p[key]).toFixed(1)}`);
  }
  flush();
  chart.replaceChildren(...nodes);
}

function compact(v) {
  if (v >= 1e6) return `${(v / 1e6).toFixed(1)}M`;
  if (v >= 1e3) return `${(v / 1e3).toFixed(1)}k`;
  return v >= 10 ? v.toFixed(0) : v.toFixed(1);
}

function renderSeries(data) {
  const points = data.points;
  const last = points.length ? points[points.length - 1] : {};
  setValue("events-per-s", last.events_per_s ?? null, last.events_per_s === null || last.events_per_s === undefined ? "–" : compact(last.events_per_s));
  setValue("latency-ms", last.latency_ms ?? null, last.latency_ms === null || last.latency_ms === undefined ? "–" : fmtInt(last.latency_ms));
  document.getElementById("throughput-source").textContent = `(${data.throughput_source})`;
  document.getElementById("latency-source").textContent = data.latency_source ? `(${data.latency_source})` : "";
  drawChart("chart-throughput", points, "events_per_s", "per second", "waiting for a second sample…");
  drawChart("chart-latency", points, "latency_ms", "ms", data.latency_source ? "no sample yet"
    : "start capture with --metrics-port and the console with --capture-metrics");
}

const RENDER = { topics: renderTopics, capture: renderCapture, groups: renderGroups, projections: renderProjections,
  schemas: renderSchemas, warnings: renderWarnings, series: renderSeries };

async function poll() {
  const dot = document.getElementById("health-dot");
  try {
    const answers = await Promise.all(PANELS.map((p) => fetch(`/api/${p}`, { cache: "no-store" }).then((r) => {
      if (!r.ok) throw new Error(`/api/${p}: HTTP ${r.status}`);
      return r.json();
    })));
    PANELS.forEach((p, i) => RENDER[p](answers[i]));
    const refreshed = Math.max(...answers.map((a) => a.refreshed_ms || 0));
    const updated = document.getElementById("updated-at");
    updated.dataset.value = String(refreshed);
    updated.textContent = refreshed ? new Date(refreshed).toLocaleTimeString("en-GB") : "never";
    dot.className = "dot ok";
  } catch (e) {
    dot.className = "dot bad";
    dot.title = String(e);
  }
  setTimeout(poll, intervalMs);
}

async function start() {
  try {
    const config = await (await fetch("/api/config", { cache: "no-store" })).json();
    intervalMs = Math.max(250, config.interval_s * 1000);
    document.getElementById("watching").textContent =
      `${config.where} · slot ${config.slot} · topic prefix ${config.topic_prefix}`;
  } catch (e) {
    document.getElementById("watching").textContent = `cannot read /api/config: ${e}`;
  }
  poll();
}

start();
