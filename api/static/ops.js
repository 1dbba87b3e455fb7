// The operator page: per model, desired vs ready replicas, queue depth,
// tokens/s, its workers, its scaling schedule; scale by hand or hand back to
// the automatic policy. Refreshed every REFRESH_MS while "Refresh live" is on.
"use strict";

const $ = (id) => document.getElementById(id);
const REFRESH_MS = 2000;

const state = { timer: null, scaling: {}, editing: new Set() };

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

  const rows = mine.map((w) =>
    el(
      "tr",
      {},
      el("td", {}, w.id),
      el("td", {}, badge(w.lost ? "lost" : w.status || w.state || "unknown")),
      el("td", {}, `${w.busy_slots ?? 0}/${w.total_slots ?? 0}`),
      el("td", {}, fmtRate(w.tokens_per_s)),
      el("td", {}, w.device || ""),
      el("td", {}, w.host || "")
    )
  );
  const table = mine.length
    ? el(
        "div",
        { class: "table-wrap" },
        el(
          "table",
          {},
          el("caption", { class: "visually-hidden" }, `Workers of ${name}`),
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
          el("tbody", {}, ...rows)
        )
      )
    : el("p", { class: "muted" }, "No workers.");

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

  return el("section", { class: "model-card", "aria-labelledby": `model-${name}`, "data-model": name }, heading, stats, form, el("h4", {}, "Workers"), table, schedule);
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
  state.timer = $("live").checked ? setInterval(refresh, REFRESH_MS) : null;
}

function signOut(message) {
  clearInterval(state.timer);
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
  await refresh();
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

if (Session.token()) enter();
else signOut("");
