// The sessioncache admin dashboard: polls /admin/api/* every 2 s, no build step, no framework.
// Everything from the server goes into the page through textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const TIER_COLORS = { gpu: "#7b3fe4", cpu: "#2f6fde", disk: "#d98a00", redis: "#c4314b" };
const PALETTE = ["#2f6fde", "#d98a00", "#7b3fe4", "#c4314b", "#1f8a4c", "#667085"];
const state = {
  csrf: null, view: null, timer: null, samples: [], charts: {},
  sessions: { q: "", sort: "last_seen", order: "desc", offset: 0, limit: 25, total: 0 },
};
const $ = (sel, root = document) => root.querySelector(sel);

// -- formatting ------------------------------------------------------------------------
function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
}
function fmtTime(t) {
  if (t == null) return "–";
  const d = new Date(t * 1000);
  const p = (x) => String(x).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}
const FORMATS = {
  pct: (v) => (v == null ? "–" : (100 * v).toFixed(1) + " %"),
  rate: (v) => (v == null ? "–" : v.toFixed(v < 10 ? 2 : 0)),
  seconds: (v) => (v == null ? "–" : v.toFixed(v < 10 ? 3 : 1)),
  ms: (v) => (v == null ? "–" : (1000 * v).toFixed(2) + " ms"),
  gbps: (v) => (v == null ? "–" : v >= 1e9 ? (v / 1e9).toFixed(2) + " GB/s" : (v / 1e6).toFixed(2) + " MB/s"),
  bytes: fmtBytes,
  time: fmtTime,
  int: (v) => (v == null ? "–" : String(v)),
};
function pick(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? null : o[k]), obj);
}
function el(tag, text, attrs = {}) {
  const e = document.createElement(tag);
  if (text != null) e.textContent = text;
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
function cell(row, text, value) {
  const td = el("td", text);
  if (value != null) td.dataset.value = String(value);
  row.appendChild(td);
  return td;
}

// -- requests --------------------------------------------------------------------------
async function api(path, opts = {}) {
  const headers = { Accept: "application/json", ...(opts.headers || {}) };
  if (opts.body !== undefined) headers["Content-Type"] = "application/json";
  if (opts.method && opts.method !== "GET" && state.csrf) headers["X-CSRF-Token"] = state.csrf;
  const res = await fetch(path, {
    method: opts.method || "GET", headers, credentials: "same-origin",
    body: opts.body !== undefined ? JSON.stringify(opts.body) : undefined,
  });
  if (res.status === 401) { showLogin(); throw new Error("login required"); }
  const body = res.status === 204 ? null : await res.json().catch(() => null);
  if (!res.ok) throw new Error((body && body.detail) || res.statusText);
  return body;
}
function banner(msg) {
  const b = $("#banner");
  b.textContent = msg || "";
  b.hidden = !msg;
}

// -- login -----------------------------------------------------------------------------
function showLogin() {
  stopPolling();
  state.csrf = null;
  for (const v of document.querySelectorAll(".view")) v.hidden = true;
  $("#nav").hidden = true;
  $("#logout").hidden = true;
  $("#login").hidden = false;
  $("#token").focus();
}
async function boot() {
  const res = await fetch("/admin/api/session", { credentials: "same-origin" });
  if (res.status === 401) return showLogin();
  const body = await res.json().catch(() => ({}));
  if (!res.ok) { banner(body.detail || res.statusText); return; }
  state.csrf = body.csrf;
  $("#login").hidden = true;
  $("#nav").hidden = false;
  $("#logout").hidden = body.via !== "cookie";
  route();
}
$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const res = await fetch("/admin/api/login", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token: $("#token").value }),
  });
  $("#token").value = "";
  if (!res.ok) {
    const body = await res.json().catch(() => ({}));
    $("#login-error").textContent = body.detail || "login failed";
    return;
  }
  $("#login-error").textContent = "";
  boot();
});
$("#logout").addEventListener("click", async () => {
  await api("/admin/api/logout", { method: "POST" }).catch(() => {});
  showLogin();
});

// -- routing and polling ---------------------------------------------------------------
function route() {
  const hash = location.hash.replace(/^#/, "") || "overview";
  const [view, ...rest] = hash.split("/");
  const name = view === "session" ? "session" : ["overview", "sessions", "namespaces"].includes(view) ? view : "overview";
  state.view = name;
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== "view-" + name;
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", a.dataset.view === (name === "session" ? "sessions" : name));
  }
  state.detail = name === "session" ? rest.join("/") : null; // "<tenant>/<id>", each encoded
  if (name === "overview" && !state.samples.length) loadHistory();
  startPolling();
}
window.addEventListener("hashchange", () => { if (state.csrf !== null || !$("#nav").hidden) route(); });
function startPolling() {
  stopPolling();
  refresh();
  state.timer = setInterval(refresh, POLL_MS);
}
function stopPolling() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
}
async function refresh() {
  const live = $("#live");
  try {
    if (state.view === "overview") await refreshOverview();
    else if (state.view === "sessions") await refreshSessions();
    else if (state.view === "session") await refreshDetail();
    else if (state.view === "namespaces") await refreshNamespaces();
    live.className = "live on";
    banner("");
  } catch (err) {
    live.className = "live err";
    if (err.message !== "login required") banner(err.message);
  }
}

// -- overview --------------------------------------------------------------------------
async function loadHistory() {
  const h = await api("/admin/api/history").catch(() => null);
  if (h) { mergeSamples(h.samples); drawCharts(); }
}
async function refreshOverview() {
  const last = state.samples.length ? state.samples[state.samples.length - 1].at : null;
  const [o, h] = await Promise.all([
    api("/admin/api/overview"),
    api("/admin/api/history" + (last != null ? "?since=" + last : "")),
  ]);
  for (const node of document.querySelectorAll("#view-overview [data-k]")) {
    const v = pick(o, node.dataset.k);
    node.textContent = (FORMATS[node.dataset.fmt || "int"])(v);
    node.dataset.value = v == null ? "" : String(v);
  }
  renderTiers(o.tiers);
  renderStored(o.stored || []);
  renderFleet(o.fleet, o.problems);
  renderMissReasons(o.miss_reasons);
  if (mergeSamples(h.samples)) drawCharts();
}
function mergeSamples(samples) {
  // the first history load and the first poll may both bring the same samples
  const last = state.samples.length ? state.samples[state.samples.length - 1].at : -Infinity;
  const fresh = samples.filter((x) => x.at > last);
  if (fresh.length) state.samples = state.samples.concat(fresh).slice(-1000);
  return fresh.length > 0;
}
function renderStored(rows) {
  const body = $("#stored tbody");
  body.replaceChildren();
  for (const r of rows) {
    const tr = el("tr", null, { "data-tier": r.tier, "data-namespace": r.namespace });
    cell(tr, r.tier);
    cell(tr, r.namespace);
    cell(tr, r.tenant);
    cell(tr, r.model);
    cell(tr, r.codec);
    cell(tr, fmtBytes(r.raw_bytes), r.raw_bytes);
    cell(tr, fmtBytes(r.stored_bytes), r.stored_bytes);
    cell(tr, r.ratio.toFixed(2) + "x", r.ratio).classList.add("ratio");
    body.appendChild(tr);
  }
}

function renderTiers(tiers) {
  const body = $("#tiers tbody");
  body.replaceChildren();
  for (const t of tiers) {
    const tr = el("tr", null, { "data-tier": t.name });
    cell(tr, t.name);
    const bar = el("div", null, { class: "bar" });
    const used = el("div", null, { class: "used" });
    used.style.width = (t.capacity_bytes ? (100 * t.used_bytes) / t.capacity_bytes : 0) + "%";
    const pinned = el("div", null, { class: "pinned" });
    pinned.style.width = (t.capacity_bytes ? (100 * t.pinned_bytes) / t.capacity_bytes : 0) + "%";
    bar.append(used, pinned);
    const barCell = cell(tr, null);
    barCell.appendChild(bar);
    cell(tr, `${fmtBytes(t.used_bytes)} / ${fmtBytes(t.capacity_bytes)}`, t.used_bytes).classList.add("used-bytes");
    cell(tr, fmtBytes(t.pinned_bytes), t.pinned_bytes).classList.add("pinned-bytes");
    cell(tr, String(t.blocks), t.blocks).classList.add("blocks");
    const s = cell(tr, t.up ? "up" : "down");
    s.className = t.up ? "ok" : "error";
    body.appendChild(tr);
  }
}
function renderFleet(fleet, problems) {
  const box = $("#fleet");
  box.replaceChildren();
  if (!fleet) {
    box.appendChild(el("p", "single node (no fleet index: SESSIONCACHE_REDIS_URL unset)", { class: "sub" }));
  } else {
    const wrap = el("div", null, { class: "scroll" });
    const table = el("table");
    const head = el("tr");
    for (const h of ["node", "url", "heartbeat lapses in", "health"]) head.appendChild(el("th", h));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (const n of fleet.nodes) {
      const tr = el("tr");
      cell(tr, n.node_id + (n.self ? " (this node)" : ""));
      cell(tr, n.url || "–");
      cell(tr, n.heartbeat_lapses_in_s + " s");
      const h = cell(tr, n.healthy ? "healthy" : "lapsed");
      h.className = n.healthy ? "ok" : "error";
      body.appendChild(tr);
    }
    wrap.appendChild(table);
    box.appendChild(wrap);
  }
  const list = $("#problems");
  list.replaceChildren();
  for (const p of problems) list.appendChild(el("li", p, { class: "error" }));
  if (!problems.length) list.appendChild(el("li", "ready: no readiness problems", { class: "ok" }));
}
function renderMissReasons(reasons) {
  // filled once the node attributes misses by reason (the overview's "miss_reasons")
  const box = $("#miss-reasons");
  box.hidden = !reasons;
  if (!reasons) return;
  const body = $("#miss-reasons-rows");
  body.replaceChildren();
  for (const [reason, tokens] of Object.entries(reasons)) {
    const tr = el("tr");
    cell(tr, reason);
    cell(tr, String(tokens), tokens);
    body.appendChild(tr);
  }
}

function seriesFromSamples() {
  const s = state.samples;
  const t = [], hit = [], lookups = [], stores = [], load = [], evict = [], demote = [], expire = [];
  const tierNames = s.length ? s[s.length - 1].tiers.map((x) => x.name) : [];
  const tiers = tierNames.map(() => []);
  for (let i = 1; i < s.length; i++) {
    const a = s[i - 1], b = s[i];
    const dt = b.at - a.at;
    if (dt <= 0) continue;
    t.push(b.at);
    const h = b.hit_tokens - a.hit_tokens;
    const asked = h + b.miss_tokens - a.miss_tokens;
    hit.push(asked > 0 ? (100 * h) / asked : null);
    lookups.push((b.lookups - a.lookups) / dt);
    stores.push((b.puts - a.puts) / dt);
    load.push((b.loaded_bytes - a.loaded_bytes) / dt);
    evict.push((60 * (b.evictions - a.evictions)) / dt);
    demote.push((60 * (b.demotions - a.demotions)) / dt);
    expire.push((60 * (b.expirations - a.expirations)) / dt);
    tierNames.forEach((name, k) => {
      const x = b.tiers.find((y) => y.name === name);
      tiers[k].push(x ? x.used_bytes : null);
    });
  }
  return { t, hit, lookups, stores, load, evict, demote, expire, tierNames, tiers };
}
function chart(id, series, data, yFmt) {
  const box = document.getElementById(id);
  const width = Math.max(240, box.clientWidth || 400);
  const old = state.charts[id];
  if (old && old.series.length === series.length + 1 && old.width === width) {
    old.setData(data);
    return;
  }
  if (old) old.destroy();
  const opts = {
    width, height: 180, legend: { show: true },
    scales: { x: { time: true } },
    axes: [{}, { values: (u, vals) => vals.map(yFmt), size: 80 }],
    series: [{}, ...series.map((s, i) => ({ label: s, stroke: s in TIER_COLORS ? TIER_COLORS[s] : PALETTE[i % PALETTE.length], width: 2, spanGaps: true }))],
  };
  const u = new uPlot(opts, data, box);
  u.width = width;
  state.charts[id] = u;
}
function drawCharts() {
  if (typeof uPlot === "undefined" || state.view !== "overview") return;
  const d = seriesFromSamples();
  chart("chart-hit", ["hit rate %"], [d.t, d.hit], (v) => v.toFixed(0) + "%");
  chart("chart-ops", ["lookups/s", "stores/s"], [d.t, d.lookups, d.stores], (v) => v.toFixed(1));
  chart("chart-load", ["loaded/s"], [d.t, d.load], (v) => fmtBytes(v) + "/s");
  chart("chart-tiers", d.tierNames, [d.t, ...d.tiers], fmtBytes);
  chart("chart-churn", ["evictions", "demotions", "expirations"], [d.t, d.evict, d.demote, d.expire], (v) => v.toFixed(0));
}
window.addEventListener("resize", () => { for (const k of Object.keys(state.charts)) { state.charts[k].destroy(); delete state.charts[k]; } drawCharts(); });

// -- sessions --------------------------------------------------------------------------
async function refreshSessions() {
  const q = state.sessions;
  const params = new URLSearchParams({ q: q.q, sort: q.sort, order: q.order, offset: q.offset, limit: q.limit });
  const page = await api("/admin/api/sessions?" + params);
  q.total = page.total;
  const body = $("#sessions tbody");
  body.replaceChildren();
  for (const s of page.sessions) {
    const tr = el("tr", null, { "data-session": s.id, "data-tenant": s.tenant });
    cell(tr, s.tenant);
    const idCell = cell(tr, null);
    idCell.appendChild(el("a", s.id, { href: "#session/" + sessionPath(s) }));
    cell(tr, s.kind);
    cell(tr, fmtTime(s.created), s.created);
    cell(tr, fmtTime(s.last_seen), s.last_seen);
    cell(tr, fmtTime(s.expires_at), s.expires_at).classList.add("expires");
    cell(tr, fmtBytes(s.pinned_bytes), s.pinned_bytes);
    cell(tr, String(s.blocks), s.blocks);
    cell(tr, String(s.hit_tokens), s.hit_tokens);
    const actions = cell(tr, null);
    for (const [label, action, cls] of [["Extend", "extend", ""], ["Close", "close", ""], ["Purge", "purge", "danger"]]) {
      const b = el("button", label, { type: "button", "data-action": action });
      if (cls) b.className = cls;
      b.addEventListener("click", () => act(action, s));
      actions.appendChild(b);
    }
    body.appendChild(tr);
  }
  $("#session-count").textContent = `${page.total} sessions`;
  const pages = Math.max(1, Math.ceil(page.total / q.limit));
  $("#page").textContent = `page ${Math.floor(q.offset / q.limit) + 1} of ${pages}`;
  $("#prev").disabled = q.offset === 0;
  $("#next").disabled = q.offset + q.limit >= page.total;
  for (const th of document.querySelectorAll("#sessions th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === q.sort);
    th.classList.toggle("asc", th.dataset.sort === q.sort && q.order === "asc");
  }
}
// A session is named by its tenant and its id (ids are scoped by tenant).
function sessionPath(s) { return encodeURIComponent(s.tenant) + "/" + encodeURIComponent(s.id); }
async function act(action, s) {
  const id = `${s.tenant}/${s.id}`;
  if (action === "purge" && !confirm(`Purge session ${id}: close it and drop its blocks from every tier?`)) return;
  try {
    await api(`/admin/api/sessions/${sessionPath(s)}/${action}`, { method: "POST", body: {} });
  } catch (err) {
    banner(`${action} ${id}: ${err.message}`);
    return;
  }
  if (state.view === "session" && action !== "extend") location.hash = "#sessions";
  else refresh();
}
let searchTimer = null;
$("#session-search").addEventListener("input", (ev) => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(() => {
    state.sessions.q = ev.target.value.trim();
    state.sessions.offset = 0;
    refresh();
  }, 200);
});
for (const th of document.querySelectorAll("#sessions th[data-sort]")) {
  th.addEventListener("click", () => {
    const q = state.sessions;
    if (q.sort === th.dataset.sort) q.order = q.order === "desc" ? "asc" : "desc";
    else { q.sort = th.dataset.sort; q.order = "desc"; }
    q.offset = 0;
    refresh();
  });
}
$("#prev").addEventListener("click", () => { state.sessions.offset = Math.max(0, state.sessions.offset - state.sessions.limit); refresh(); });
$("#next").addEventListener("click", () => { state.sessions.offset += state.sessions.limit; refresh(); });

// -- one session's chain ---------------------------------------------------------------
async function refreshDetail() {
  const d = await api("/admin/api/sessions/" + state.detail);
  $("#detail-id").textContent = d.id;
  const dl = $("#detail-fields");
  dl.replaceChildren();
  const fields = [
    ["tenant", d.tenant], ["kind", d.kind], ["TTL", d.ttl_s + " s"], ["created", fmtTime(d.created)],
    ["last active", fmtTime(d.last_seen)], ["expires", fmtTime(d.expires_at)],
    ["blocks", String(d.blocks) + (d.chain_truncated ? " (strip cut)" : "")], ["bytes", fmtBytes(d.bytes)],
    ["pinned", d.pinned ? "yes" : "no"], ["hit tokens", String(d.hit_tokens)],
  ];
  for (const [k, v] of fields) { dl.appendChild(el("dt", k)); dl.appendChild(el("dd", v)); }
  const legend = $("#legend");
  legend.replaceChildren();
  for (const name of d.tiers) {
    const item = el("span", name);
    const sw = el("i");
    sw.style.background = TIER_COLORS[name] || "#667085";
    item.prepend(sw);
    legend.appendChild(item);
  }
  legend.appendChild(el("span", "outlined: pinned"));
  const strip = $("#strip");
  strip.replaceChildren();
  d.chain.forEach((b, i) => {
    const top = b.tiers[0];
    const box = el("span", null, {
      title: `#${i} ${b.id.slice(0, 16)}… ${b.tiers.join("+") || "not held"} · ${fmtBytes(b.nbytes)} · ${b.hit_count} hits`,
      "data-tier": top || "",
    });
    box.style.background = TIER_COLORS[top] || "#c9ced8";
    if (b.pinned) box.classList.add("pinned");
    strip.appendChild(box);
  });
}

// -- namespaces and tenants ------------------------------------------------------------
async function refreshNamespaces() {
  const d = await api("/admin/api/namespaces");
  const ns = $("#namespaces tbody");
  ns.replaceChildren();
  for (const r of d.namespaces) {
    const tr = el("tr");
    cell(tr, r.tenant);
    cell(tr, r.model || "–");
    cell(tr, r.block_tokens == null ? "–" : String(r.block_tokens));
    cell(tr, r.root.slice(0, 16) + "…", r.root);
    cell(tr, String(r.blocks), r.blocks);
    cell(tr, fmtBytes(r.bytes), r.bytes);
    cell(tr, FORMATS.pct(r.hit_rate), r.hit_rate);
    ns.appendChild(tr);
  }
  const tb = $("#tenants tbody");
  tb.replaceChildren();
  for (const r of d.tenants) {
    const tr = el("tr", null, { "data-tenant": r.tenant });
    cell(tr, r.tenant);
    cell(tr, String(r.namespaces), r.namespaces);
    cell(tr, String(r.blocks), r.blocks);
    cell(tr, fmtBytes(r.bytes), r.bytes);
    cell(tr, FORMATS.pct(r.hit_rate), r.hit_rate);
    const bounds = Object.entries(r.bounds || {}).map(([name, b]) =>
      name === "pin_share"
        ? `${name} ${FORMATS.pct(b.held)} of ${FORMATS.pct(b.limit)}`
        : `${name} ${b.held}/${b.limit}`);
    cell(tr, bounds.join(" · ") || "–");
    tb.appendChild(tr);
  }
}

boot();
