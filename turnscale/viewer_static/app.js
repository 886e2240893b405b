// turnscale view: a dependency-free single page over the viewer's JSON API.
// State lives in the URL hash (#/?filters, #/episode/<id>?turn=<k>, #/compare/<a>/<b>, #/eval),
// so every view is a link.  All data is inserted with textContent (never as HTML).
"use strict";

const $ = (sel) => document.querySelector(sel);
const FILTER_KEYS = ["env", "task", "split", "category", "checkpoint", "success", "finish_reason", "turn_limit",
  "step_min", "step_max", "version_min", "version_max", "step"];
const PAGE = 50;
const DEFAULT_CURVES = ["rollout/success", "rollout/return", "schedule/turn_limit", "rollout/turn_limit"];
const state = { status: null, metrics: null, episode: null, selected: new Set(), selectedTask: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function showError(msg) {
  const box = $("#error");
  box.textContent = msg;
  box.hidden = !msg;
}

async function api(path) {
  const resp = await fetch(path);
  let body;
  try { body = await resp.json(); } catch (e) { body = { error: `bad response from ${path}` }; }
  if (!resp.ok) throw new Error(body.error || `${resp.status} on ${path}`);
  return body;
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(digits);
  if (typeof v === "boolean") return v ? "yes" : "no";
  return String(v);
}

function parseHash() {
  const h = location.hash.replace(/^#/, "") || "/";
  const [path, qs] = h.split("?");
  return { parts: path.split("/").filter(Boolean), query: new URLSearchParams(qs || "") };
}

function go(hash) {
  if (location.hash === hash || (hash === "#/" && !location.hash)) route();
  else location.hash = hash;
}

// ------------------------------------------------------------------ status, facets, malformed

async function loadStatus() {
  const s = await api("/api/status");
  state.status = s;
  $("#source").textContent = s.root;
  $("#counts").textContent = `${s.episodes} episodes`;
  const bad = s.malformed.trajectories.count + s.malformed.metrics.count;
  const box = $("#malformed");
  box.hidden = bad === 0;
  if (bad) {
    box.textContent = "";
    box.append(`Skipped malformed lines: ${s.malformed.trajectories.count} in trajectories, ${s.malformed.metrics.count} in metrics. `);
    const ex = [...s.malformed.trajectories.examples.map((b) => `trajectories line ${b.line}: ${b.reason}`),
      ...s.malformed.metrics.examples.map((b) => `metrics line ${b.line}: ${b.reason}`)].slice(0, 5);
    box.append(el("span", { class: "hint", text: ex.join("; ") }));
  }
  const sel = { env: "env", split: "split", category: "category", checkpoint: "checkpoint", finish_reason: "finish_reason" };
  for (const [name, facet] of Object.entries(sel)) {
    const select = document.querySelector(`#filters [name=${name}]`);
    const keep = select.value;
    select.replaceChildren(el("option", { value: "", text: "any" }), ...s.facets[facet].map((v) => el("option", { value: v, text: v })));
    select.value = keep;
  }
  $("#nav-eval").hidden = !s.files.eval;
  const idx = $("#indexing");
  idx.hidden = !s.indexing;
  if (s.indexing) {
    const mb = (b) => (b / 1e6).toFixed(0);
    idx.textContent = `Indexing trajectories: ${mb(s.bytes_indexed)} of ${mb(s.bytes_total)} MB (${s.episodes} episodes so far)…`;
    setTimeout(pollIndexing, 1000);
  }
  $("#episodes").classList.toggle("no-ckpt", s.facets.checkpoint.length === 0);
}

async function pollIndexing() {
  try { await loadStatus(); } catch (e) { showError(e.message); return; }
  if (!$("#view-list").hidden) await route();
}

// ------------------------------------------------------------------ curves

async function loadMetrics() {
  try { state.metrics = await api("/api/metrics"); } catch (e) { state.metrics = { series: {} }; }
  const keys = Object.keys(state.metrics.series).sort();
  const select = $("#curve-keys");
  const wanted = DEFAULT_CURVES.filter((k) => keys.includes(k));
  select.replaceChildren(...keys.map((k) => el("option", { value: k, text: k })));
  for (const opt of select.options) opt.selected = wanted.includes(opt.value) || (wanted.length === 0 && opt.index < 2);
  $("#curves").hidden = keys.length === 0;
}

function drawCharts(selStep) {
  const box = $("#charts");
  box.replaceChildren();
  if (!state.metrics) return;
  for (const opt of $("#curve-keys").selectedOptions) box.append(chart(opt.value, state.metrics.series[opt.value], selStep));
}

function chart(key, pts, selStep) {
  const W = 340, H = 180, L = 44, R = 10, T = 22, B = 26;
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  const mk = (tag, attrs, text) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n);
    return n;
  };
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("class", "chart");
  svg.setAttribute("data-testid", `chart-${key}`); svg.setAttribute("data-key", key);
  mk("text", { x: L, y: 14, class: "title" }, key);
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  mk("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" });
  mk("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" });
  mk("text", { x: 2, y: sy(y1) + 4 }, fmt(y1, 2));
  mk("text", { x: 2, y: sy(y0) + 4 }, fmt(y0, 2));
  mk("text", { x: L, y: H - 8 }, `step ${fmt(x0)}`);
  mk("text", { x: W - R - 60, y: H - 8 }, fmt(x1));
  mk("polyline", { points: pts.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), class: "line" });
  const half = pts.length > 1 ? (W - L - R) / (pts.length - 1) / 2 : 10;
  for (const [x, y] of pts) {
    const hit = mk("rect", { x: sx(x) - half, y: T, width: 2 * half, height: H - T - B, class: "hit", "data-step": x });
    const pt = mk("circle", { cx: sx(x), cy: sy(y), r: pts.length > 60 ? 2 : 3.5, class: x === selStep ? "pt sel" : "pt", "data-step": x });
    const tip = document.createElementNS(NS, "title");
    tip.textContent = `step ${x}: ${fmt(y, 4)}`;
    pt.append(tip);
    for (const n of [hit, pt]) n.addEventListener("click", () => go(`#/?step=${encodeURIComponent(x)}`));
  }
  return svg;
}

// ------------------------------------------------------------------ episode list

function filtersFromQuery(q) {
  const f = {};
  for (const k of FILTER_KEYS) if (q.get(k)) f[k] = q.get(k);
  return f;
}

function fillForm(f) {
  const form = $("#filters");
  for (const k of FILTER_KEYS) {
    const input = form.querySelector(`[name=${k}]`);
    if (input) input.value = f[k] || "";
  }
}

function listHash(f, offset) {
  const q = new URLSearchParams(f);
  if (offset) q.set("offset", offset);
  const s = q.toString();
  return s ? `#/?${s}` : "#/";
}

async function showList(q) {
  const f = filtersFromQuery(q);
  const offset = Math.max(0, parseInt(q.get("offset") || "0", 10) || 0);
  fillForm(f);
  drawCharts(f.step !== undefined ? Number(f.step) : null);
  $("#list-title").textContent = f.step !== undefined ? `Episodes of step ${f.step}` : "Episodes";
  const params = new URLSearchParams({ ...f, offset, limit: PAGE });
  const page = await api(`/api/episodes?${params}`);
  $("#list-total").textContent = `${page.total} matching`;
  const last = Math.min(page.total, offset + page.items.length);
  $("#page-info").textContent = page.total ? `${offset + 1}–${last} of ${page.total}` : "none";
  $("#prev-page").disabled = offset === 0;
  $("#next-page").disabled = last >= page.total;
  $("#prev-page").onclick = () => go(listHash(f, Math.max(0, offset - PAGE)));
  $("#next-page").onclick = () => go(listHash(f, offset + PAGE));
  const rows = page.items.map((e) => {
    const box = el("input", { type: "checkbox", "data-testid": `pick-${e.id}` });
    box.checked = state.selected.has(e.id);
    box.addEventListener("change", () => pick(e, box.checked));
    return el("tr", { "data-testid": `episode-row-${e.id}`, "data-id": e.id },
      el("td", {}, el("a", { href: `#/episode/${e.id}`, "data-testid": `open-${e.id}`, text: String(e.id) })),
      el("td", { class: "ckpt", text: e.checkpoint || "" }),
      el("td", { text: fmt(e.step) }), el("td", { text: fmt(e.version) }), el("td", { text: fmt(e.env) }),
      el("td", { text: e.task_id || fmt(e.data_idx) }), el("td", { text: fmt(e.category) }), el("td", { text: fmt(e.split) }),
      el("td", { text: fmt(e.turn_limit) }), el("td", { text: fmt(e.num_turns) }), el("td", { text: fmt(e.finish_reason) }),
      el("td", { text: fmt(e.reward) }), el("td", { class: e.success ? "ok" : "bad", text: e.success ? "yes" : "no" }),
      el("td", { text: fmt(e.accepted) }), el("td", {}, box));
  });
  $("#episodes tbody").replaceChildren(...rows);
}

function pick(e, on) {
  const key = `${e.env}/${e.data_idx}`;
  if (on) {
    if (state.selected.size && state.selectedTask !== key) state.selected.clear();
    state.selectedTask = key;
    state.selected.add(e.id);
    while (state.selected.size > 2) state.selected.delete(state.selected.values().next().value);
  } else {
    state.selected.delete(e.id);
  }
  for (const b of document.querySelectorAll("[data-testid^=pick-]")) b.checked = state.selected.has(Number(b.dataset.testid.slice(5)));
  const ids = [...state.selected];
  $("#compare-go").disabled = ids.length !== 2;
  $("#compare-pick").textContent = ids.length ? `Selected: ${ids.join(", ")} (task ${state.selectedTask})` : "Tick two episodes of the same task to compare them.";
}

// ------------------------------------------------------------------ one episode, turn by turn

async function getEpisode(id) {
  if (state.episode && state.episode.id === id) return state.episode;
  state.episode = await api(`/api/episode/${id}`);
  return state.episode;
}

function logprobSummary(ep) {
  let tok = 0, sum = 0, min = null;
  for (const t of ep.turns || []) {
    if (typeof t.logprob_mean === "number") { const n = t.num_tokens || 1; tok += n; sum += t.logprob_mean * n; }
    if (typeof t.logprob_min === "number") min = min === null ? t.logprob_min : Math.min(min, t.logprob_min);
  }
  return { mean: tok ? sum / tok : null, min };
}

function metaList(ep) {
  const lp = logprobSummary(ep);
  const versions = [...new Set((ep.turns || []).map((t) => t.policy_version))];
  const items = [
    ["env", ep.env], ["task", ep.task_id || ep.data_idx], ["data_idx", ep.data_idx], ["category", ep.category],
    ["split", ep.split], ["checkpoint", ep.checkpoint], ["step", ep.step], ["version", ep.version],
    ["policy versions", versions.join(", ")], ["turn limit", ep.turn_limit], ["turns", ep.num_turns],
    ["finish", ep.finish_reason], ["reward", ep.reward], ["success", ep.success], ["accepted", ep.accepted],
    ["drop reason", ep.drop_reason], ["error", ep.error], ["sample", ep.sample], ["tokens", ep.num_tokens], ["logprob mean", lp.mean], ["logprob min", lp.min],
    ["lease", ep.lease_id], ["actor", ep.actor_id], ["episode", ep.episode], ["group size", ep.group_size],
  ].filter(([, v]) => v !== undefined && v !== "");
  return items.map(([k, v]) => el("div", { "data-testid": `meta-${k.replace(/ /g, "-")}` }, el("dt", { text: k }), el("dd", { text: fmt(v) })));
}

function turnBlock(ep, t, prevObs, testid) {
  const kv = [["reward", t.reward], ["done", t.done], ["turn limit in force", ep.turn_limit], ["policy version", t.policy_version],
    ["tokens", t.num_tokens], ["logprob mean", t.logprob_mean], ["logprob min", t.logprob_min],
    ["gen latency s", t.gen_latency_s], ["env latency s", t.env_latency_s]];
  return el("div", { "data-testid": testid, class: "turn-block" },
    el("h4", { text: `Turn ${t.index + 1} of ${ep.turns.length}` }),
    el("div", { class: "label", text: "Observation the model saw" }),
    el("pre", { "data-testid": "turn-input", text: prevObs || "" }),
    el("div", { class: "label", text: "Model output" }),
    el("pre", { "data-testid": "turn-output", text: t.output_text || "" }),
    el("div", { class: "kv" },
      el("span", {}, el("b", { text: "parsed action" }), el("code", { "data-testid": "turn-action", text: t.parse_error ? "(parse error)" : (t.action || "") })),
      ...(t.parse_error ? [el("span", { class: "bad", "data-testid": "turn-parse-error", text: "parse error: no valid Action" })] : [])),
    el("div", { class: "label", text: "Environment response" }),
    el("pre", { "data-testid": "turn-observation", text: t.observation || "" }),
    el("div", { class: "kv", "data-testid": "turn-kv" }, ...kv.map(([k, v]) => el("span", { "data-testid": `turn-${k.replace(/ /g, "-")}` }, el("b", { text: k }), fmt(v, 4)))));
}

async function showEpisode(id, q) {
  const ep = await getEpisode(id);
  const n = (ep.turns || []).length;
  let k = parseInt(q.get("turn") || "0", 10);
  if (!(k >= 0)) k = 0;
  if (k > n - 1) k = Math.max(0, n - 1);
  $("#ep-title").textContent = `Episode ${ep.id}: ${ep.env} ${ep.task_id || ep.data_idx} — ${ep.success ? "success" : "failure"} (${ep.finish_reason})`;
  $("#ep-meta").replaceChildren(...metaList(ep));
  $("#ep-prompt").textContent = ep.prompt || "";
  $("#turn-pos").textContent = n ? `turn ${k + 1} / ${n}` : "no turns";
  const slider = $("#turn-slider");
  slider.max = Math.max(0, n - 1); slider.value = k;
  const to = (j) => go(`#/episode/${id}?turn=${Math.min(Math.max(0, j), Math.max(0, n - 1))}`);
  $("#turn-first").onclick = () => to(0);
  $("#turn-prev").onclick = () => to(k - 1);
  $("#turn-next").onclick = () => to(k + 1);
  $("#turn-last").onclick = () => to(n - 1);
  slider.oninput = () => to(Number(slider.value));
  $("#turn-prev").disabled = $("#turn-first").disabled = k === 0;
  $("#turn-next").disabled = $("#turn-last").disabled = k >= n - 1;
  const turnBox = $("#turn");
  if (n) {
    const prev = k === 0 ? ep.prompt : ep.turns[k - 1].observation;
    turnBox.replaceChildren(turnBlock(ep, ep.turns[k], prev, "turn-current"));
    turnBox.dataset.turn = k;
  } else {
    turnBox.replaceChildren(el("p", { text: "This episode has no turns." }));
  }
  $("#turn-table tbody").replaceChildren(...(ep.turns || []).map((t, j) => el("tr",
    { class: j === k ? "current" : "", "data-testid": `turn-row-${j}`, onclick: () => to(j) },
    el("td", { text: String(t.index + 1) }), el("td", { text: t.action || "" }), el("td", { class: t.parse_error ? "bad" : "", text: t.parse_error ? "yes" : "" }),
    el("td", { text: fmt(t.reward) }), el("td", { text: fmt(t.done) }), el("td", { text: fmt(t.policy_version) }), el("td", { text: fmt(t.num_tokens) }),
    el("td", { text: fmt(t.logprob_mean) }), el("td", { text: fmt(t.logprob_min) }), el("td", { text: fmt(t.gen_latency_s) }), el("td", { text: fmt(t.env_latency_s) }))));
  const same = $("#same-task");
  same.replaceChildren(...(ep.same_task || []).map((j) => el("option", { value: j, text: `episode ${j}` })));
  $("#same-task-go").disabled = !(ep.same_task || []).length;
  $("#same-task-go").onclick = () => go(`#/compare/${id}/${same.value}`);
}

// ------------------------------------------------------------------ compare

function firstDivergence(a, b) {
  const ta = a.turns || [], tb = b.turns || [];
  for (let j = 0; j < Math.min(ta.length, tb.length); j++) if (ta[j].action !== tb[j].action) return j;
  return ta.length === tb.length ? -1 : Math.min(ta.length, tb.length);
}

function compareColumn(ep, diverge) {
  const blocks = (ep.turns || []).map((t, j) => {
    const b = turnBlock(ep, t, j === 0 ? ep.prompt : ep.turns[j - 1].observation, `cmp-turn-${j}`);
    if (j === diverge) b.classList.add("diverge");
    return b;
  });
  return [el("h3", {}, el("a", { href: `#/episode/${ep.id}`, text: `Episode ${ep.id}` }), ` — ${ep.success ? "success" : "failure"}, reward ${fmt(ep.reward)}, ${ep.num_turns} turns`),
    el("dl", { class: "meta" }, ...metaList(ep)), ...blocks];
}

async function showCompare(a, b) {
  $("#cmp-title").textContent = `Loading episodes ${a} and ${b}…`;
  $("#cmp-a").replaceChildren();
  $("#cmp-b").replaceChildren();
  const [ea, eb] = await Promise.all([api(`/api/episode/${a}`), api(`/api/episode/${b}`)]);
  $("#cmp-title").textContent = `Compare episodes ${a} and ${b}: ${ea.env} ${ea.task_id || ea.data_idx}`;
  const warn = $("#cmp-warning");
  const same = ea.env === eb.env && ea.data_idx === eb.data_idx;
  warn.hidden = same;
  warn.textContent = same ? "" : `These episodes are of different tasks (${ea.env} ${ea.data_idx} vs ${eb.env} ${eb.data_idx}).`;
  const d = firstDivergence(ea, eb);
  $("#cmp-diverge").textContent = d < 0 ? "Both episodes took the same actions." : `First different action at turn ${d + 1}.`;
  $("#cmp-a").replaceChildren(...compareColumn(ea, d));
  $("#cmp-b").replaceChildren(...compareColumn(eb, d));
}

// ------------------------------------------------------------------ eval report

async function showEval() {
  const rep = await api("/api/eval");
  const rows = rep.rows || [];
  const ks = rep.k || [];
  const head = ["", "checkpoint", "turn limit", "env", "category", "tasks", "episodes", "errors", "success", "mean reward", "mean turns",
    ...ks.map((k) => `Avg@${k}`), ...ks.map((k) => `Pass@${k}`)];
  const table = el("table", { class: "grid", "data-testid": "eval-table" },
    el("thead", {}, el("tr", {}, ...head.map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows.map((r, i) => el("tr", { "data-testid": `eval-row-${i}` },
      el("td", {}, el("a", { href: evalLink(r), "data-testid": `eval-link-${i}`, text: "episodes" })),
      ...[r.checkpoint, r.turn_limit, r.env || "(all)", r.category || "(all)", r.tasks, r.episodes, r.errors, r.success, r.mean_reward, r.mean_turns,
        ...ks.map((k) => (r.avg_at_k || {})[k]), ...ks.map((k) => (r.pass_at_k || {})[k])].map((v) => el("td", { text: fmt(v) }))))));
  const plots = ((state.status || {}).files || {}).plots || [];
  $("#eval-body").replaceChildren(el("p", { class: "hint", text: rep.pass_rule || "" }), table,
    el("div", { class: "plots" }, ...plots.map((n) => el("img", { src: `/plots/${n}`, alt: n, "data-testid": `plot-${n}` }))));
}

function evalLink(r) {
  const f = { checkpoint: r.checkpoint, turn_limit: r.turn_limit };
  if (r.env) f.env = r.env;
  if (r.category) f.category = r.category;
  return listHash(f, 0);
}

// ------------------------------------------------------------------ router

const VIEWS = ["list", "episode", "compare", "eval"];
function showView(name) { for (const v of VIEWS) $(`#view-${v}`).hidden = v !== name; }

async function route() {
  const { parts, query } = parseHash();
  showError("");
  try {
    if (parts[0] === "episode" && parts[1] !== undefined) { showView("episode"); await showEpisode(Number(parts[1]), query); }
    else if (parts[0] === "compare" && parts.length === 3) { showView("compare"); await showCompare(Number(parts[1]), Number(parts[2])); }
    else if (parts[0] === "eval") { showView("eval"); await showEval(); }
    else { showView("list"); await showList(query); }
    document.body.dataset.ready = location.hash || "#/";
  } catch (e) {
    showError(e.message);
    document.body.dataset.ready = `error:${location.hash}`;
  }
}

function wire() {
  $("#filters").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const f = {};
    for (const [k, v] of new FormData($("#filters"))) if (v && k !== "step") f[k] = v;
    go(listHash(f, 0));
  });
  $("#f-reset").addEventListener("click", () => go("#/"));
  $("#compare-go").addEventListener("click", () => { const [a, b] = [...state.selected]; go(`#/compare/${a}/${b}`); });
  $("#curve-keys").addEventListener("change", () => {
    const { query } = parseHash();
    drawCharts(query.get("step") !== null ? Number(query.get("step")) : null);
  });
  window.addEventListener("hashchange", route);
  $("#reload").addEventListener("click", async () => {
    state.episode = null;
    try { await loadStatus(); await loadMetrics(); } catch (e) { showError(e.message); return; }
    await route();
  });
  document.addEventListener("keydown", (ev) => {
    if ($("#view-episode").hidden || ["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement.tagName)) return;
    if (ev.key === "ArrowRight" && !$("#turn-next").disabled) $("#turn-next").click();
    if (ev.key === "ArrowLeft" && !$("#turn-prev").disabled) $("#turn-prev").click();
  });
}

(async function start() {
  wire();
  try { await loadStatus(); await loadMetrics(); }
  catch (e) { showError(e.message); }
  await route();
})();
