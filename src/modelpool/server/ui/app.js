// modelpool's status page: polls /stats, draws the workers, the queue, recent kills and
// retries with their cause, and the last minutes as small plots. Plain DOM and canvas.
"use strict";

const POLL_MS = 2000;
const HISTORY = 150; // samples kept: 5 minutes at one per 2 s
const KEY_ITEM = "modelpool-api-key";
const history = [];

function takeKeyFromFragment() {
  // #key=... is never sent to the server (no access log sees it); it is kept for this
  // tab only and removed from the address bar.
  const match = /(?:^|&)key=([^&]*)/.exec(location.hash.slice(1));
  if (match) {
    sessionStorage.setItem(KEY_ITEM, decodeURIComponent(match[1]));
    window.history.replaceState(null, "", location.pathname);
  }
}

async function fetchStats() {
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const response = await fetch("/stats", { headers, cache: "no-store" });
  if (response.status === 401) {
    throw Object.assign(new Error("the API key is missing or wrong"), { unauthorized: true });
  }
  if (!response.ok) throw new Error("/stats answered " + response.status);
  return response.json();
}

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function cell(row, value, className) {
  const td = document.createElement("td");
  td.textContent = value === null || value === undefined ? "-" : String(value);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function when(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString();
}

const READY = ["idle", "busy", "spare"];
const COUNTERS = ["completed", "failed", "kills", "retries", "queue_full"];

function added(into, from) {
  for (const [key, value] of Object.entries(from || {})) {
    if (typeof value === "number") into[key] = (into[key] || 0) + value;
  }
  return into;
}

function highest(values) {
  const known = values.filter((v) => v !== null && v !== undefined && isFinite(v));
  return known.length ? Math.max(...known) : null;
}

function poolView(stats) {
  // A daemon with [models] tables has each loaded model's pool under models.NAME.pool:
  // the page shows them together, each worker and event with its model's name, counters
  // and queues summed, the worst latency, and a row per model (renderModels).
  if (!stats.models) return stats;
  const pools = Object.entries(stats.models).filter(([, m]) => m.pool).map(([n, m]) => [n, m.pool]);
  const sum = (field) => pools.reduce((total, [, p]) => total + (p[field] || 0), 0);
  const counters = Object.fromEntries(COUNTERS.map((name) => [name, 0]));
  const byPriority = {};
  const throughput = {};
  for (const [, p] of pools) {
    added(counters, p.counters);
    added(byPriority, p.queue_by_priority);
    added(throughput, p.throughput);
  }
  const shares = Object.values(stats.fair_share_by_model || {});
  const states = Object.values(stats.models).map((m) => m.state);
  return {
    state: states.includes("failed") ? "degraded" : "ready",
    workers: pools.flatMap(([name, p]) => p.workers.map((w) => ({ ...w, model: name }))),
    recent_events: pools
      .flatMap(([name, p]) => p.recent_events.map((e) => ({ ...e, model: name })))
      .sort((a, b) => a.at - b.at),
    counters,
    queue_by_priority: byPriority,
    throughput,
    latency_s: {
      p50: highest(pools.map(([, p]) => p.latency_s.p50)),
      p99: highest(pools.map(([, p]) => p.latency_s.p99)),
    },
    queue_depth: sum("queue_depth"),
    running: sum("running"),
    capacity: sum("capacity"),
    fair_share: { waiting: shares.reduce((total, share) => total + share.waiting, 0) },
    models: stats.models,
    fair_share_by_model: stats.fair_share_by_model || {},
  };
}

function renderModels(stats) {
  const section = document.getElementById("models-section");
  section.hidden = !stats.models;
  if (!stats.models) return;
  const body = document.getElementById("models");
  body.replaceChildren();
  for (const [name, model] of Object.entries(stats.models)) {
    const pool = model.pool;
    const share = stats.fair_share_by_model[name];
    const row = document.createElement("tr");
    cell(row, name);
    cell(row, model.state, "state-" + model.state);
    cell(row, model.rss_bytes === null ? null : (model.rss_bytes / 1e6).toFixed(0));
    cell(row, pool ? pool.workers.filter((w) => READY.includes(w.state)).length + " / " +
      pool.workers.length : "0");
    cell(row, (pool ? pool.queue_depth : 0) + (share ? share.waiting : 0));
    cell(row, pool ? pool.running : 0);
    cell(row, model.reason);
    body.appendChild(row);
  }
}

function renderWorkers(stats) {
  const body = document.getElementById("workers");
  body.replaceChildren();
  for (const w of stats.workers) {
    const row = document.createElement("tr");
    cell(row, w.model ? w.model + " / " + w.id : w.id);
    cell(row, w.pid);
    cell(row, w.state, "state-" + w.state);
    cell(row, w.role);
    cell(row, w.device);
    cell(row, w.requests);
    cell(row, w.running.length);
    cell(row, w.uptime_s.toFixed(1));
    cell(row, w.rss_mb === null ? null : w.rss_mb.toFixed(0));
    body.appendChild(row);
  }
}

function replacement(stats, event) {
  // A killed worker is replaced once a new process, ready, holds its pool slot.
  if (stats.workers.some((w) => w.pid === event.pid)) return null;
  return stats.workers.find((w) => w.model === event.model && w.pool_slot === event.pool_slot &&
    w.pid !== null && w.state !== "starting") || null;
}

function renderEvents(stats) {
  const body = document.getElementById("events");
  body.replaceChildren();
  const events = stats.recent_events.filter((e) => e.kind !== "exit").slice().reverse();
  for (const event of events) {
    const row = document.createElement("tr");
    cell(row, when(event.at));
    cell(row, event.kind === "release" ? "release check" : event.kind);
    cell(row, (event.model ? event.model + ": " : "") + "worker " + event.worker_id +
      " (pid " + event.pid + ")");
    let cause = event.reason || "-";
    if (event.kind === "retry") cause = event.reason + ": " + event.detail;
    if (event.kind === "kill") cause = event.reason + " (" + event.detail + ")";
    cell(row, cause);
    const outcome = cell(row, "");
    if (event.kind === "kill") {
      const next = replacement(stats, event);
      if (next) {
        row.className = "replaced";
        const tag = document.createElement("span");
        tag.className = "tag";
        tag.textContent = "replaced by pid " + next.pid;
        outcome.appendChild(tag);
      } else {
        outcome.textContent = "replacement starting";
      }
    } else if (event.kind === "release") {
      outcome.textContent = (event.ok ? "memory released" : "memory still held") +
        " in " + (event.seconds * 1000).toFixed(0) + " ms (" + event.detail + ")";
    } else if (event.kind === "retry") {
      outcome.textContent = "request " + event.request_id + " queued again";
    }
    body.appendChild(row);
  }
  if (!events.length) {
    const row = document.createElement("tr");
    cell(row, "none yet").colSpan = 5;
    body.appendChild(row);
  }
}

function plot(id, series, colors) {
  const canvas = document.getElementById(id);
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 18;
  ctx.clearRect(0, 0, w, h);
  const values = series.flat().filter((v) => v !== null && isFinite(v));
  const highest = Math.max(0, ...values);
  const top = highest > 0 ? highest * 1.1 : 1; // nothing yet: a 0..1 scale
  ctx.fillStyle = "#667085";
  ctx.font = "10px system-ui";
  ctx.fillText(top.toPrecision(3), 2, 10);
  ctx.fillText("0", 2, h - 4);
  ctx.strokeStyle = "#e4e7ec";
  ctx.strokeRect(pad, 2, w - pad - 2, h - 6);
  series.forEach((points, index) => {
    ctx.strokeStyle = colors[index];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let started = false;
    points.forEach((v, i) => {
      if (v === null || !isFinite(v)) return;
      const x = pad + ((w - pad - 4) * i) / Math.max(1, HISTORY - 1);
      const y = h - 4 - ((h - 8) * v) / top;
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    });
    ctx.stroke();
  });
}

function renderPlots(stats) {
  const now = Date.now() / 1000;
  const last = history[history.length - 1];
  const tokens = stats.throughput.completion_tokens || 0;
  const rate = last ? Math.max(0, (tokens - last.tokens) / Math.max(1e-3, now - last.at)) : null;
  history.push({
    at: now, tokens, rate,
    p50: stats.latency_s.p50, p99: stats.latency_s.p99,
    queued: stats.queue_depth + ((stats.fair_share && stats.fair_share.waiting) || 0),
    running: stats.running,
  });
  while (history.length > HISTORY) history.shift();
  plot("plot-tokens", [history.map((s) => s.rate)], ["#1d4ed8"]);
  plot("plot-latency", [history.map((s) => s.p50), history.map((s) => s.p99)], ["#15803d", "#b42318"]);
  plot("plot-queue", [history.map((s) => s.queued), history.map((s) => s.running)], ["#b45309", "#1d4ed8"]);
}

function render(raw) {
  const stats = poolView(raw);
  const state = document.getElementById("state");
  state.textContent = stats.state;
  state.className = "badge " + stats.state;
  text("updated", "updated " + new Date().toLocaleTimeString());
  const c = stats.counters;
  text("running", stats.running);
  text("queued", stats.queue_depth + ((stats.fair_share && stats.fair_share.waiting) || 0));
  text("capacity", stats.capacity);
  text("completed", c.completed);
  text("failed", c.failed);
  text("kills", c.kills);
  text("retries", c.retries);
  text("queue_full", c.queue_full);
  const levels = Object.entries(stats.queue_by_priority);
  text("queue-by-priority", levels.length
    ? levels.map(([p, n]) => "priority " + p + ": " + n).join(", ") : "empty");
  renderModels(stats);
  renderWorkers(stats);
  renderEvents(stats);
  renderPlots(stats);
}

async function poll() {
  try {
    const stats = await fetchStats();
    document.getElementById("login").hidden = true;
    document.getElementById("main").hidden = false;
    render(stats);
  } catch (error) {
    if (error.unauthorized) {
      document.getElementById("login").hidden = false;
      text("login-error", sessionStorage.getItem(KEY_ITEM) ? error.message : "");
    } else {
      const state = document.getElementById("state");
      state.textContent = "unreachable";
      state.className = "badge unreachable";
    }
  }
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, document.getElementById("key").value);
  poll();
});
takeKeyFromFragment();
poll();
setInterval(poll, POLL_MS);
