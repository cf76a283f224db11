// The controller dashboard. Plain ES2020, no framework, no build step.
//
// Safety rule: every string that came from a worker or an API answer reaches the page through
// text nodes (el()/textContent) or attribute values, never through innerHTML. An instance id
// like <img src=x onerror=alert(1)> must show as those characters.
"use strict";

const POLL_MS = Number(document.body.dataset.pollMs) || 2000;
const FETCH_TIMEOUT_MS = 4000;
const SVG_NS = "http://www.w3.org/2000/svg";

// null when the controller protects its reads (protect_reads): the first poll, with the token, fills it.
let state = JSON.parse(document.getElementById("initial-state").textContent);
let lastOkAt = Date.now();
let openInstance = null; // the instance whose workers are shown

// -- small helpers ---------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

const num = (n) => Number(n || 0).toLocaleString("en-US");

function rate(n) {
  if (!n) return "0";
  return n >= 100 ? num(Math.round(n)) : n >= 1 ? n.toFixed(1) : n.toFixed(2);
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  n = Number(n || 0);
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n >= 100 || i === 0 ? Math.round(n) : n.toFixed(1)} ${units[i]}`;
}

function duration(s) {
  s = Math.max(0, Math.floor(s));
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${s % 60}s`;
  return `${s}s`;
}

const clock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB");
const pct = (r) => (r === null || r === undefined ? "—" : `${(100 * r).toFixed(1)}%`);

function keysText(keys) {
  const parts = Object.entries(keys || {}).map(([loc, n]) => `${loc.replace(/^Local|Backend$/g, "")} ${num(n)}`);
  return parts.length ? parts.join(" · ") : "none";
}

function parseTokens(text) {
  text = text.trim();
  if (!text) return null;
  let values;
  if (text.startsWith("[") || text.startsWith("{")) {
    let parsed;
    try { parsed = JSON.parse(text); } catch (e) { throw new Error(`not valid JSON: ${e.message}`); }
    values = Array.isArray(parsed) ? parsed : parsed.tokens;
    if (!Array.isArray(values)) throw new Error("expected a JSON list of token ids (or {\"tokens\": [...]})");
  } else {
    values = text.split(/[\s,]+/);
  }
  return values.map((v, i) => {
    const n = Number(v);
    if (!Number.isInteger(n) || n < 0) throw new Error(`token ${i} is ${JSON.stringify(v)}, not a non-negative integer`);
    return n;
  });
}

// -- the API token ------------------------------------------------------------------------------
//
// A controller started with an API token answers 401 to actions (and, with protect_reads, to reads)
// that come without it. The page then asks for the token once, in a dialog, keeps it in this tab's
// sessionStorage (gone when the tab closes, never shared with other tabs or sent anywhere else) and
// sends it as "Authorization: Bearer ..." with every request from then on.

const TOKEN_KEY = "lmcache-p2p.api-token";
let memoryToken = null; // where sessionStorage is unavailable (some privacy modes), this tab's memory
let tokenAsk = null; // the open dialog's promise: requests that meet a 401 together share one question
let tokenDeclined = false; // the user cancelled: polls stop asking (actions, which the user starts, still ask)

function storedToken() {
  try { return sessionStorage.getItem(TOKEN_KEY); } catch (e) { return memoryToken; }
}

function storeToken(token) {
  memoryToken = token;
  try {
    if (token === null) sessionStorage.removeItem(TOKEN_KEY); else sessionStorage.setItem(TOKEN_KEY, token);
  } catch (e) { /* memoryToken holds it */ }
}

// Resolves with the token entered, or null when the user cancelled.
function askForToken(why) {
  if (tokenAsk) return tokenAsk;
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  document.getElementById("token-why").textContent = why;
  input.value = "";
  tokenAsk = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const token = dialog.returnValue === "ok" ? input.value.trim() : "";
      input.value = ""; // the token lives in sessionStorage only, not in the page
      tokenAsk = null;
      tokenDeclined = !token;
      if (token) storeToken(token);
      resolve(token || null);
    }, { once: true });
    dialog.returnValue = "cancel"; // Escape closes it as a cancel
    dialog.showModal();
    input.focus();
  });
  return tokenAsk;
}

document.getElementById("token-cancel").addEventListener("click", () => {
  document.getElementById("token-dialog").close("cancel");
});

async function send(path, body, token) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), body === undefined ? FETCH_TIMEOUT_MS : 60000);
  const headers = body === undefined ? {} : { "Content-Type": "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    const response = await fetch(path, {
      method: body === undefined ? "GET" : "POST", signal: controller.signal, headers,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let data = null;
    try { data = await response.json(); } catch (e) { /* not JSON: reported by the caller */ }
    return { response, data };
  } finally {
    clearTimeout(timer);
  }
}

// GET (no body) or POST a JSON body; the answer's JSON, or an Error carrying the answer's message
// and status. A 401 asks for the token (unless ask is false) and sends the request again with it.
async function api(path, body, { ask = true } = {}) {
  for (;;) {
    const token = storedToken();
    const { response, data } = await send(path, body, token);
    if (response.status === 401) {
      if (storedToken() !== token) continue; // a token was entered meanwhile: try that one
      if (token) storeToken(null); // refused: never send it again
      const why = token
        ? "The controller refused the API token this tab had. Enter its API token:"
        : body === undefined || path === "/lookup"
          ? "This controller shows its data only to holders of its API token. Enter it:"
          : "Actions on this controller need its API token. Enter it:";
      if (ask && (await askForToken(why)) !== null) continue;
    }
    if (!response.ok) {
      const message = data && data.error ? data.error : `HTTP ${response.status}`;
      throw Object.assign(new Error(message), { status: response.status });
    }
    return data;
  }
}

// -- overview --------------------------------------------------------------------------------

function card(label, value, sub, id) {
  return el("div", { class: "card", "data-card": id },
    el("div", { class: "label" }, label), el("div", { class: "value" }, value), el("div", { class: "sub" }, sub || ""));
}

function renderOverview() {
  const o = state.overview, c = state.controller, ws = o.workers_by_status;
  document.getElementById("epoch").textContent = c.epoch;
  document.getElementById("uptime").textContent = duration(c.uptime_s);
  const totals = o.traffic_totals || {};
  document.getElementById("cards").replaceChildren(
    card("Instances", num(o.instances), `${num(o.workers)} workers: ${ws.live} live, ${ws.late} late, ${ws.dead} dead`, "instances"),
    card("Keys", num(o.total_keys), `distinct chunks · copies held: ${keysText(o.keys_by_location)}`, "keys"),
    card("Lookups/s", rate(o.lookups_per_s), `engine prefix lookups · peer lookups ${rate(o.peer_lookups_per_s)}/s`, "lookups"),
    card("Hit ratio", pct(o.hit_ratio), `local + peer, last ${c.rate_window_s}s`, "hit-ratio"),
    card("P2P throughput", `${bytes(o.p2p_bytes_per_s)}/s`, `${rate(o.p2p_transfers_per_s)} transfers/s · ${bytes(totals.pulled_bytes)} total`, "p2p"),
    // Peer pulls the ranks left undone because recomputing was estimated faster (p2p_pull_policy
    // auto); which peers, and the estimates, are in each worker's POST /status.
    card("Pulls skipped", num(totals.pulls_skipped), `slower than recomputing · ${num(totals.skipped_tokens)} tokens recomputed · ${rate(o.pulls_skipped_per_s)}/s`, "pulls-skipped"),
    card("Commands in flight", num(o.commands_in_flight), "pending move/copy/clear/pin", "in-flight"),
    card("Bad frames", num(o.bad_frames), "undecodable messages dropped", "bad-frames"),
    card("Uptime", duration(c.uptime_s), `since ${clock(c.started_at)}`, "uptime"),
  );
  document.getElementById("thresholds").textContent =
    `live: heartbeat within ${state.thresholds.live_within_s}s · late: ${state.thresholds.live_within_s}–` +
    `${state.thresholds.reaped_after_s}s · dead: silent over ${state.thresholds.reaped_after_s}s (reaped) · ` +
    `workers heartbeat every ${c.heartbeat_interval_s}s`;
}

// Two series on one time axis: hit ratio on the left scale (0-100%), P2P bytes/s on the right
// scale (0 to the window's peak).
function renderChart() {
  const chart = document.getElementById("chart");
  const W = 900, H = 180, L = 48, R = 72, T = 12, B = 24;
  const points = state.series || [];
  const nodes = [];
  for (let i = 0; i <= 4; i++) {
    const y = T + (H - T - B) * i / 4;
    nodes.push(svg("line", { x1: L, x2: W - R, y1: y, y2: y, class: "gridline" }));
    nodes.push(svg("text", { x: L - 6, y: y + 4, "text-anchor": "end", class: "axis hit" }, `${100 - 25 * i}%`));
  }
  const peak = Math.max(1, ...points.map((p) => p.p2p_bytes_per_s));
  nodes.push(svg("text", { x: W - R + 6, y: T + 4, class: "axis p2p" }, `${bytes(peak)}/s`));
  nodes.push(svg("text", { x: W - R + 6, y: H - B + 4, class: "axis p2p" }, "0"));
  if (points.length > 1) {
    const t0 = points[0].t, t1 = points[points.length - 1].t, span = Math.max(1, t1 - t0);
    const x = (t) => L + (W - L - R) * (t - t0) / span;
    const y = (f) => T + (H - T - B) * (1 - f);
    const hit = points.filter((p) => p.hit_ratio !== null).map((p) => [x(p.t), y(p.hit_ratio)]);
    const p2p = points.map((p) => [x(p.t), y(p.p2p_bytes_per_s / peak)]);
    for (const [line, cls] of [[p2p, "p2p"], [hit, "hit"]]) {
      if (!line.length) continue;
      nodes.push(svg("polyline", { points: line.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`).join(" "),
        class: `line ${cls}` }));
      const [lx, ly] = line[line.length - 1]; // the latest value, visible even as a single point
      nodes.push(svg("circle", { cx: lx.toFixed(1), cy: ly.toFixed(1), r: 3, class: `dot ${cls}` }));
    }
    nodes.push(svg("text", { x: L, y: H - 6, class: "axis" }, `−${duration(span)}`));
    nodes.push(svg("text", { x: W - R, y: H - 6, "text-anchor": "end", class: "axis" }, "now"));
  } else {
    nodes.push(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "axis" }, "collecting samples…"));
  }
  chart.replaceChildren(...nodes);
  const c = state.controller;
  document.getElementById("chart-caption").replaceChildren(
    el("span", { class: "swatch hit" }), " hit ratio (left)  ",
    el("span", { class: "swatch p2p" }), " P2P bytes/s (right)  ",
    `· sampled every ${c.sample_every_s}s, averaged over ${c.rate_window_s}s; workers report with each heartbeat`);
}

// -- instances -------------------------------------------------------------------------------

function badge(status) {
  return el("span", { class: `badge ${status}` }, status);
}

function ports(workers) {
  return workers.map((w) => `${w.worker_port} · ${w.p2p_init_port || "–"}/${w.p2p_lookup_port || "–"}`).join(", ");
}

// The channel a worker runs; where it is not the configured one (NIXL missing on its host), the
// fallback is flagged, and the worker's error, which names the fix, is the tooltip.
function channelCell(w) {
  const running = w.effective_channel || w.transfer_channel;
  if (!running) return "none";
  if (!w.channel_error) return running;
  return el("span", { class: "channel-fallback", title: w.channel_error },
    `${running} (${w.transfer_channel} unavailable)`);
}

function workerTable(inst) {
  return el("table", { class: "grid inner" },
    el("thead", {}, el("tr", {}, ["Rank", "Status", "Host", "Worker port", "P2P init/lookup", "Channel",
      "Fingerprint", "Keys", "Last heartbeat", "Registered"].map((h) => el("th", {}, h)))),
    el("tbody", {}, inst.workers.map((w) => el("tr", { "data-worker": w.worker_id },
      el("td", {}, w.worker_id), el("td", {}, badge(w.status)), el("td", {}, w.host), el("td", {}, w.worker_port),
      el("td", {}, `${w.p2p_init_port || "–"}/${w.p2p_lookup_port || "–"}`), el("td", {}, channelCell(w)),
      el("td", {}, el("code", {}, w.fingerprint)), el("td", {}, keysText(w.keys)),
      el("td", {}, `${w.last_heartbeat_ago_s.toFixed(1)} s ago`), el("td", {}, clock(w.registered_at))))));
}

// Instances serving the same model whose KV this one can never use (the controller compares
// layouts on arrival): one line each, naming the fields that differ.
function cannotShare(inst) {
  const others = Object.entries(inst.cannot_share_with || {});
  if (!others.length) return "";
  return el("div", { class: "cannot-share" }, ...others.map(([other, why]) =>
    el("div", {}, `cannot share KV with ${other}: ${why.join("; ")}`)));
}

function renderInstances() {
  const rows = [];
  for (const inst of state.instances) {
    const open = inst.instance_id === openInstance;
    rows.push(el("tr", {
      class: `instance${open ? " open" : ""}`, "data-instance": inst.instance_id, tabindex: 0,
      "aria-expanded": open ? "true" : "false",
      onclick: () => { openInstance = open ? null : inst.instance_id; renderInstances(); },
      onkeydown: (e) => { if (e.key === "Enter") { openInstance = open ? null : inst.instance_id; renderInstances(); } },
    },
    el("td", { class: "id" }, el("span", { class: "caret" }, open ? "▾ " : "▸ "), inst.instance_id),
    el("td", {}, badge(inst.status)),
    el("td", {}, inst.hosts.join(", ")),
    el("td", {}, ports(inst.workers)),
    el("td", {}, `${inst.model} · ${inst.dtype} · TP ${inst.tp_size} · ${inst.chunk_size}`, cannotShare(inst)),
    el("td", {}, keysText(inst.keys)),
    el("td", {}, `${inst.last_heartbeat_ago_s.toFixed(1)} s ago`)));
    if (open) rows.push(el("tr", { class: "detail" }, el("td", { colspan: 7 }, workerTable(inst))));
  }
  for (const gone of state.departed || []) {
    rows.push(el("tr", { class: "departed", "data-departed": gone.instance_id },
      el("td", { class: "id" }, `${gone.instance_id} (rank ${gone.worker_id})`), el("td", {}, badge("dead")),
      el("td", {}, gone.host), el("td", { colspan: 3 }, gone.reason), el("td", {}, `left at ${clock(gone.at)}`)));
  }
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: 7, class: "muted" },
      "No worker has registered yet. Engines register when they start with enable_controller: true.")));
  }
  document.querySelector("#instances tbody").replaceChildren(...rows);
}

// -- pickers: instance and location selects, filled from the registry -------------------------

function fillPickers() {
  const ids = state.instances.map((i) => i.instance_id);
  for (const select of document.querySelectorAll("select[data-instances]")) {
    setOptions(select, ids);
  }
  // A move's destination defaults to another instance than its source, until the user picks.
  const move = document.getElementById("move-form").elements;
  if (!move.dst.dataset.touched && move.dst.value === move.src.value) {
    const other = ids.find((id) => id !== move.src.value);
    if (other !== undefined) move.dst.value = other;
  }
  for (const select of document.querySelectorAll("select[data-locations-of]")) {
    const owner = select.form.elements[select.dataset.locationsOf];
    const inst = state.instances.find((i) => i.instance_id === owner.value);
    setOptions(select, inst ? inst.locations : []);
  }
}

function setOptions(select, values) {
  const current = select.value;
  const same = select.options.length === values.length && values.every((v, i) => select.options[i].value === v);
  if (same) return; // leave the user's choice and focus alone
  select.replaceChildren(...values.map((v) => el("option", { value: v }, v)));
  if (values.includes(current)) select.value = current;
}

// -- events ----------------------------------------------------------------------------------

function renderEvents() {
  const rows = (state.events || []).map((e) => el("tr", { "data-event": e.event_id, class: e.status },
    el("td", {}, clock(e.created_at)), el("td", {}, el("code", {}, e.event_id)), el("td", {}, e.kind),
    el("td", {}, e.instance_id), el("td", {}, e.detail), el("td", {}, badge(e.status)),
    el("td", { class: "num" }, num(e.num_tokens)),
    el("td", { class: "num" }, e.duration_ms === null ? "…" : `${e.duration_ms.toFixed(1)} ms`),
    el("td", { class: "error" }, e.error || "")));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "No commands yet.")));
  document.querySelector("#events tbody").replaceChildren(...rows);
}

// -- refresh loop ----------------------------------------------------------------------------

function render() {
  renderOverview();
  renderChart();
  renderInstances();
  fillPickers();
  renderEvents();
}

function showBanner(error) {
  const banner = document.getElementById("banner");
  const ago = Math.round((Date.now() - lastOkAt) / 1000);
  if (error.status === 401) {
    // Reads are protected and the user cancelled the token dialog: polls no longer ask, this does.
    banner.replaceChildren("The controller shows its data only with its API token.",
      el("button", { type: "button", id: "banner-token", onclick: () => { tokenDeclined = false; refresh(); } },
        "Enter token"));
  } else {
    banner.textContent = `Controller unreachable (${error.message}). Showing data from ${ago} s ago; ` +
      `retrying every ${POLL_MS / 1000} s.`;
  }
  banner.hidden = false;
  document.getElementById("main").classList.add("stale");
}

async function refresh() {
  try {
    state = await api("/controller/dashboard", undefined, { ask: !tokenDeclined });
    lastOkAt = Date.now();
    document.getElementById("banner").hidden = true;
    document.getElementById("main").classList.remove("stale");
    render();
    document.getElementById("refreshed").textContent = `updated ${new Date().toLocaleTimeString("en-GB")}`;
  } catch (error) {
    showBanner(error.name === "AbortError" ? new Error("no answer in 4 s") : error);
  }
}

async function pollForever() {
  await refresh();
  setTimeout(pollForever, POLL_MS);
}

// -- lookup tool -----------------------------------------------------------------------------

function showLookup(tokens, answer) {
  const holders = answer.holders || [];
  const best = Object.entries(answer.layout_info || {}).sort((a, b) => b[1][1] - a[1][1]);
  const summary = best.length
    ? `${best[0][0]} holds ${num(best[0][1][1])} of ${num(tokens.length)} tokens (${best[0][1][0]})`
    : `no instance holds a prefix of these ${num(tokens.length)} tokens`;
  const table = holders.length ? el("table", { class: "grid inner" },
    el("thead", {}, el("tr", {}, ["Instance", "Rank", "Location", "Matched tokens", "Of the prompt"].map((h) => el("th", {}, h)))),
    el("tbody", {}, holders.map((h) => el("tr", { "data-holder": h.instance_id },
      el("td", {}, h.instance_id), el("td", {}, h.worker_id), el("td", {}, h.location),
      el("td", { class: "num" }, num(h.matched_tokens)),
      el("td", { class: "num" }, pct(h.matched_tokens / tokens.length)))))) : null;
  document.getElementById("lookup-result").replaceChildren(el("p", { class: "summary" }, summary), table);
}

function showError(target, error) {
  document.getElementById(target).replaceChildren(el("p", { class: "error" }, error.message));
}

document.getElementById("lookup-file").addEventListener("change", async (event) => {
  const file = event.target.files[0];
  if (file) document.getElementById("lookup-tokens").value = await file.text();
});

document.getElementById("lookup-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  try {
    const tokens = parseTokens(document.getElementById("lookup-tokens").value);
    if (!tokens) throw new Error("paste token ids or choose a JSON file first");
    showLookup(tokens, await api("/lookup", { tokens }));
  } catch (error) {
    showError("lookup-result", error);
  }
});

// POST /explain: chunk runs with their status (own, peer, layout_mismatch, partial_tp,
// other_model, not_held), for the instance picked.
function showExplain(tokens, instance, answer) {
  const summary = `${instance} can reuse ${num(answer.usable_tokens)} of ${num(tokens.length)} tokens`;
  const table = el("table", { class: "grid inner explain" },
    el("thead", {}, el("tr", {}, ["Tokens", "Chunks", "Status", "Why", "Held by"].map((h) => el("th", {}, h)))),
    el("tbody", {}, (answer.runs || []).map((r) => el("tr", { "data-status": r.status },
      el("td", { class: "num" }, `${num(r.start_token)}-${num(r.end_token)}`),
      el("td", { class: "num" }, num(r.chunks)),
      el("td", {}, r.status), el("td", {}, r.detail || ""),
      el("td", {}, (r.holders || []).map((h) => `${h.instance_id} (${h.locations.join(", ")})`).join("; "))))));
  const never = Object.entries(answer.cannot_share_with || {}).map(([other, fields]) =>
    el("p", { class: "muted" }, `can never share with ${other}: ${[].concat(fields).join(", ")}`));
  document.getElementById("lookup-result").replaceChildren(el("p", { class: "summary" }, summary), table, ...never);
}

document.getElementById("explain-button").addEventListener("click", async () => {
  try {
    const tokens = parseTokens(document.getElementById("lookup-tokens").value);
    if (!tokens) throw new Error("paste token ids or choose a JSON file first");
    const instance = document.getElementById("explain-instance").value;
    if (!instance) throw new Error("no instance to explain for: none is registered");
    showExplain(tokens, instance, await api("/explain", { tokens, instance_id: instance }));
  } catch (error) {
    showError("lookup-result", error);
  }
});

// -- actions ---------------------------------------------------------------------------------

for (const tab of document.querySelectorAll("[role=tab]")) {
  tab.addEventListener("click", () => {
    for (const other of document.querySelectorAll("[role=tab]")) other.setAttribute("aria-selected", String(other === tab));
    for (const form of document.querySelectorAll("form.tab")) form.hidden = form.dataset.tab !== tab.dataset.tab;
  });
}

for (const select of document.querySelectorAll("select[data-instances]")) {
  select.addEventListener("change", () => { select.dataset.touched = "1"; fillPickers(); });
}

function confirmAction(text) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "cancel";
    dialog.showModal();
  });
}

async function submitAction(path, body, question) {
  if (question && !(await confirmAction(question))) {
    document.getElementById("action-result").replaceChildren(el("p", { class: "muted" }, "Cancelled; nothing was sent."));
    return;
  }
  try {
    const answer = await api(path, body);
    document.getElementById("action-result").replaceChildren(el("p", { class: "ok" },
      `${path.slice(1)} accepted: event `, el("code", {}, answer.event_id),
      answer.num_tokens !== undefined ? ` (${num(answer.num_tokens)} tokens)` : "", ". Its progress shows in Events."));
  } catch (error) {
    showError("action-result", error);
  }
  refresh();
}

function actionHandler(formId, build) {
  document.getElementById(formId).addEventListener("submit", async (event) => {
    event.preventDefault();
    const f = event.target.elements;
    let action;
    try {
      action = build(f);
    } catch (error) {
      showError("action-result", error);
      return;
    }
    await submitAction(...action);
  });
}

function requireInstance(select, what) {
  if (!select.value) throw new Error(`pick ${what}: no instance is registered`);
  return select.value;
}

actionHandler("move-form", (f) => {
  const src = requireInstance(f.src, "a source"), dst = requireInstance(f.dst, "a destination");
  const tokens = parseTokens(f.tokens.value);
  const copy = f.copy.checked;
  const body = { old_position: [src, f.src_loc.value], new_position: [dst, f.dst_loc.value], copy };
  if (tokens) body.tokens = tokens;
  const what = tokens ? `the chunks of these ${num(tokens.length)} tokens` : "every chunk";
  const question = copy ? null :
    `Move ${what} ${src} holds at ${f.src_loc.value} to ${dst} at ${f.dst_loc.value}? They are deleted from ${src}.`;
  return [copy ? "/copy" : "/move", body, question];
});

actionHandler("clear-form", (f) => {
  const instance = requireInstance(f.instance, "an instance");
  return ["/clear", { instance_id: instance, location: f.location.value },
    `Clear every chunk ${instance} holds at ${f.location.value}? This cannot be undone.`];
});

actionHandler("pin-form", (f) => {
  const instance = requireInstance(f.instance, "an instance");
  const tokens = parseTokens(f.tokens.value);
  if (!tokens) throw new Error("pin needs the token ids of the prefix to pin");
  return ["/pin", { instance_id: instance, location: f.location.value, tokens, unpin: f.unpin.checked }, null];
});

if (state) {
  render();
  setTimeout(pollForever, POLL_MS);
} else {
  pollForever(); // no data in the page (protect_reads): fetch it now, asking for the token
}
