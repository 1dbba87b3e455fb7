// The operator page: per model, desired vs ready replicas, queue depth,
// tokens/s, its workers, its scaling schedule; scale by hand or hand back to
// the automatic policy. Refreshed every REFRESH_MS while "Refresh live" is on.
// Under them, charts of the farm's one-minute history (GET /v1/admin/history)
// over the range picked, with its scaling events as markers, and tables of
// recent events and failed jobs, reloaded every HISTORY_REFRESH_MS.
"use strict";

const $ = (id) => document.getElementById(id);
const REFRESH_MS = 2000;
const HISTORY_REFRESH_MS = 60_000;
// A worker lost longer than this (seconds) folds into a closed "lost workers" list.
const LOST_FOLD_S = 180;
const TABLE_ROWS = 20;
const RANGES = new Set(["1h", "1d", "7d"]);

// What each chart of a model draws: [key, title, unit, [[column, label], …]].
const CHARTS = [
  ["queue", "Queue depth and running jobs", "", [["queue_depth", "queued"], ["running", "running"]]],
  ["replicas", "Replicas", "", [["desired", "desired"], ["ready", "ready"], ["starting", "starting"]]],
  ["tokens", "Tokens per second", "tok/s", [["tokens_per_s", "tokens/s"]]],
  ["ttft", "Time to first token", "s", [["ttft_p50_s", "p50"], ["ttft_p95_s", "p95"]]],
  ["wait", "Queue wait", "s", [["queue_wait_p50_s", "p50"], ["queue_wait_p95_s", "p95"]]],
];

const state = {
  timer: null,
  historyTimer: null,
  scaling: {},
  editing: new Set(),
  history: null, // the last GET /v1/admin/history answer
  charts: new Map(), // model -> its charts' node, kept across the 2 s card rebuilds
  openLost: new Set(), // models whose lost-worker list the operator opened
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function stat(label, value) {
  return el("div", {}, el("dt", {}, label), el("dd", {}, String(value)));
}

function badge(status) {
  const kind = { ready: "ok", starting: "warn", draining: "warn", lost: "bad", failed: "bad" }[status] || "muted";
  return el("span", { class: `badge ${kind}` }, status);
}

function fmtRate(value) {
  return value ? `${Number(value).toFixed(1)}` : "0";
}

function describeWindow(w) {
  const bounds = [];
  if (w.min_replicas !== null && w.min_replicas !== undefined) bounds.push(`min ${w.min_replicas}`);
  if (w.max_replicas !== null && w.max_replicas !== undefined) bounds.push(`max ${w.max_replicas}`);
  const origin = w.source === "schedule" ? "added at run time" : "from the model definition";
  return `${w.cron} (${w.timezone || "UTC"}): ${bounds.join(", ") || "no bounds"} — ${origin}`;
}

function manualOf(scaling) {
  return scaling && scaling.manual ? scaling.manual : null;
}

function modelCard(model, workers, scaling) {
  const name = model.model;
  const mine = workers.filter((w) => w.model === name);
  const rate = mine.filter((w) => !w.lost).reduce((sum, w) => sum + (w.tokens_per_s || 0), 0);
  const manual = manualOf(scaling);
  const current = (scaling && scaling.current) || {};
  const desired = current.desired ?? model.replicas_desired ?? "—";
  const why = current.reason || model.desired_from;
  const mode = manual
    ? `manual: ${manual.replicas}${manual.until ? ` until ${new Date(manual.until).toLocaleString()}` : ""}`
    : `automatic${why ? ` (${why})` : ""}`;

  const heading = el(
    "h3",
    { id: `model-${name}` },
    name,
    el("span", { class: `badge ${manual ? "warn" : "ok"}` }, mode)
  );
  const stats = el(
    "dl",
    { class: "stats" },
    stat("Desired replicas", desired),
    stat("Ready replicas", model.replicas_ready ?? 0),
    stat("Starting", model.replicas_starting ?? 0),
    stat("Queue depth", model.queue_depth ?? 0),
    stat("Running jobs", model.running ?? 0),
    stat("Tokens/s", fmtRate(rate))
  );

  const folded = mine.filter((w) => w.lost && (w.heartbeat_age_s ?? 0) > LOST_FOLD_S);
  const shown = mine.filter((w) => !folded.includes(w));
  const row = (w) =>
    el(
      "tr",
      {},
      el("td", {}, w.id),
      el("td", {}, badge(w.lost ? "lost" : w.status || w.state || "unknown")),
      el("td", {}, `${w.busy_slots ?? 0}/${w.total_slots ?? 0}`),
      el("td", {}, fmtRate(w.tokens_per_s)),
      el("td", {}, w.device || ""),
      el("td", {}, w.host || "")
    );
  const workersTable = (list, caption) =>
    el(
      "div",
      { class: "table-wrap" },
      el(
        "table",
        {},
        el("caption", { class: "visually-hidden" }, caption),
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ...["Worker", "State", "Busy slots", "Tokens/s", "Device", "Host"].map((h) =>
              el("th", { scope: "col" }, h)
            )
          )
        ),
        el("tbody", {}, ...list.map(row))
      )
    );
  const table = shown.length
    ? workersTable(shown, `Workers of ${name}`)
    : el("p", { class: "muted" }, folded.length ? "No live workers." : "No workers.");
  let lostList = "";
  if (folded.length) {
    lostList = el(
      "details",
      { class: "lost-workers", open: state.openLost.has(name) ? "" : null },
      el(
        "summary",
        {},
        `${folded.length} lost worker${folded.length === 1 ? "" : "s"} (no heartbeat for over ${Math.round(LOST_FOLD_S / 60)} minutes)`
      ),
      workersTable(folded, `Lost workers of ${name}`)
    );
    lostList.addEventListener("toggle", () => {
      if (lostList.open) state.openLost.add(name);
      else state.openLost.delete(name);
    });
  }

  const windows = (scaling && scaling.windows) || [];
  const effective = (scaling && scaling.effective) || {};
  const bounds =
    effective.min_replicas !== undefined
      ? `Between ${effective.min_replicas} and ${effective.max_replicas} replicas` +
        (effective.target_jobs_per_replica ? `, ${effective.target_jobs_per_replica} jobs per replica` : "") +
        "."
      : "";
  const schedule = el(
    "div",
    {},
    el("h4", {}, "Scaling schedule"),
    bounds ? el("p", { class: "muted" }, bounds) : "",
    windows.length
      ? el("ul", { class: "schedule" }, ...windows.map((w) => el("li", {}, describeWindow(w))))
      : el("p", { class: "muted" }, scaling ? "No time-of-day windows." : "Scaling details are not available.")
  );

  const inputId = `replicas-${name}`;
  const input = el("input", { id: inputId, type: "number", min: "0", step: "1", inputmode: "numeric", required: true });
  input.value = manual ? manual.replicas : typeof desired === "number" ? desired : 0;
  input.addEventListener("focus", () => state.editing.add(name));
  input.addEventListener("blur", () => state.editing.delete(name));
  const form = el(
    "form",
    { class: "scale-form", "aria-label": `Scale ${name}` },
    el("label", { for: inputId }, "Replicas"),
    input,
    el("button", { type: "submit" }, "Scale"),
    el("button", { type: "button", class: "secondary", onclick: () => setAutomatic(name), disabled: !manual }, "Back to automatic")
  );
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    scale(name, parseInt(input.value, 10));
  });

  return el(
    "section",
    { class: "model-card", "aria-labelledby": `model-${name}`, "data-model": name },
    heading,
    stats,
    form,
    el("h4", {}, "Workers"),
    table,
    lostList,
    schedule,
    chartsOf(name)
  );
}

// ---------------------------------------------------------------- history

/** The history charts of one model, built from ``state.history`` once per load. */
function chartsOf(name) {
  if (state.charts.has(name)) return state.charts.get(name);
  const node = buildCharts(name);
  state.charts.set(name, node);
  return node;
}

function buildCharts(name) {
  const box = el("div", { class: "history", "data-history": name }, el("h4", {}, "History"));
  const history = state.history;
  if (!history) {
    box.append(el("p", { class: "muted" }, "Loading the history…"));
    return box;
  }
  const columns = history.models[name];
  if (!columns || !columns.minute.length) {
    box.append(
      el("p", { class: "muted" }, "Nothing recorded in this range (the scaler leader writes the history each minute).")
    );
    return box;
  }
  const start = Date.parse(history.from);
  const end = Date.parse(history.to);
  const times = columns.minute.map((m) => Date.parse(m));
  const events = history.events.filter((e) => e.model === name);
  const windows = ((history.windows || {})[name] || []).map((w) => ({
    label: describeWindow(w),
    spans: w.spans.map(([from, to]) => [Date.parse(from), Date.parse(to)]),
  }));
  const grid = el("div", { class: "charts" });
  for (const [key, title, unit, lines] of CHARTS) {
    grid.append(
      Charts.timeSeries({
        key,
        title,
        unit,
        start,
        end,
        stepMs: history.step_s * 1000,
        times,
        series: lines.map(([column, label]) => ({ label, values: columns[column] })),
        events,
        windows,
      })
    );
  }
  box.append(grid);
  return box;
}

function timeCell(iso) {
  return el("td", {}, iso ? el("time", { datetime: iso }, new Date(iso).toLocaleString()) : "—");
}

function historyTable(caption, headings, rows, empty) {
  if (!rows.length) return el("p", { class: "muted" }, empty);
  return el(
    "div",
    { class: "table-wrap" },
    el(
      "table",
      { class: "wrap" },
      el("caption", { class: "visually-hidden" }, caption),
      el("thead", {}, el("tr", {}, ...headings.map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, ...rows)
    )
  );
}

function renderHistoryTables() {
  const history = state.history;
  if (!history) return;
  const events = history.events.slice(0, TABLE_ROWS).map((e) => {
    const change = e.desired !== undefined && e.desired !== null ? `${e.previous ?? "?"} → ${e.desired}` : "";
    return el(
      "tr",
      { "data-kind": e.kind },
      timeCell(e.at),
      el("td", {}, e.model),
      el("td", {}, e.kind),
      el("td", {}, change),
      el("td", {}, e.by || ""),
      el("td", {}, e.why || "")
    );
  });
  const failed = history.failed_jobs.slice(0, TABLE_ROWS).map((j) =>
    el(
      "tr",
      {},
      timeCell(j.finished_at),
      el("td", {}, j.model),
      el("td", {}, j.error || ""),
      el("td", {}, String(j.attempts ?? "")),
      el("td", {}, j.worker || ""),
      el("td", {}, el("code", {}, j.id)),
      el("td", {}, j.request_id || "")
    )
  );
  $("recent-events").replaceChildren(
    historyTable(
      "Recent scaling events",
      ["Time", "Model", "Kind", "Replicas", "By", "Why"],
      events,
      "No scaling event in this range."
    )
  );
  $("recent-failures").replaceChildren(
    historyTable(
      "Recent failed jobs",
      ["Finished", "Model", "Error", "Attempts", "Worker", "Job", "Request id"],
      failed,
      "No job failed in this range."
    )
  );
}

async function loadHistory() {
  const range = RANGES.has($("range").value) ? $("range").value : "1h";
  try {
    state.history = await Session.api("GET", `/v1/admin/history?last=${range}&events=200&failed=${TABLE_ROWS}`);
  } catch (err) {
    if (err.status === 401 || err.status === 403) return signOut(Session.describe(err));
    $("ops-error").textContent = `The history could not be read: ${Session.describe(err)}`;
    return;
  }
  // Rebuild every model's charts and swap them into the cards in place.
  const old = state.charts;
  state.charts = new Map();
  for (const [name, node] of old) if (node.isConnected) node.replaceWith(chartsOf(name));
  renderHistoryTables();
  $("history-range").textContent = `${new Date(state.history.from).toLocaleString()} to ${new Date(
    state.history.to
  ).toLocaleString()}`;
}

async function loadScaling(names) {
  const results = await Promise.all(
    names.map((name) =>
      Session.api("GET", `/v1/admin/models/${encodeURIComponent(name)}/scaling`).then(
        (body) => [name, body],
        (err) => [name, err]
      )
    )
  );
  for (const [name, value] of results) {
    if (value instanceof Session.ApiError) {
      if (value.status === 401 || value.status === 403) throw value;
      state.scaling[name] = null;
    } else {
      state.scaling[name] = value;
    }
  }
}

async function refresh() {
  let fleet;
  try {
    fleet = await Session.api("GET", "/v1/admin/workers");
    await loadScaling(fleet.models.map((m) => m.model));
  } catch (err) {
    if (err.status === 401 || err.status === 403) return signOut(Session.describe(err));
    $("ops-error").textContent = Session.describe(err);
    return;
  }
  $("ops-error").textContent = "";
  // Do not rebuild a card whose replica box is being typed in.
  const container = $("models");
  const focused = document.activeElement && document.activeElement.id;
  const cards = fleet.models.map((m) => {
    if (state.editing.has(m.model)) {
      const existing = container.querySelector(`[data-model="${CSS.escape(m.model)}"]`);
      if (existing) return existing;
    }
    return modelCard(m, fleet.workers, state.scaling[m.model]);
  });
  container.replaceChildren(...cards);
  if (focused && $(focused)) $(focused).focus();
  $("refreshed").textContent = `Updated ${new Date().toLocaleTimeString()}`;
}

async function scale(name, replicas) {
  if (!Number.isInteger(replicas) || replicas < 0) {
    $("ops-error").textContent = "Replicas must be a whole number, 0 or more.";
    return;
  }
  try {
    await Session.api("PUT", `/v1/admin/models/${encodeURIComponent(name)}/scaling`, { replicas });
    state.editing.delete(name);
    await refresh();
  } catch (err) {
    $("ops-error").textContent = Session.describe(err);
  }
}

async function setAutomatic(name) {
  try {
    await Session.api("PUT", `/v1/admin/models/${encodeURIComponent(name)}/scaling`, { auto: true });
    await refresh();
  } catch (err) {
    $("ops-error").textContent = Session.describe(err);
  }
}

function schedule() {
  clearInterval(state.timer);
  clearInterval(state.historyTimer);
  state.timer = $("live").checked ? setInterval(refresh, REFRESH_MS) : null;
  state.historyTimer = $("live").checked ? setInterval(loadHistory, HISTORY_REFRESH_MS) : null;
}

function signOut(message) {
  clearInterval(state.timer);
  clearInterval(state.historyTimer);
  Session.forget();
  $("ops-app").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  $("sign-in-error").textContent = message || "";
  $("token-input").focus();
}

async function enter() {
  $("sign-in").hidden = true;
  $("ops-app").hidden = false;
  $("sign-out").hidden = false;
  await Promise.all([refresh(), loadHistory()]);
  if (!$("ops-app").hidden) schedule();
}

$("sign-in-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const value = $("token-input").value.trim();
  if (!value) return;
  Session.save(value, $("remember").checked);
  $("token-input").value = "";
  $("sign-in-error").textContent = "";
  await enter();
});
$("sign-out").addEventListener("click", () => signOut(""));
$("live").addEventListener("change", schedule);
$("range").addEventListener("change", loadHistory);

if (Session.token()) enter();
else signOut("");
