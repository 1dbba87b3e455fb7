// Time-series charts for the operator page: hand-written SVG, no library.
// One chart is a few lines over a time range (one point a minute, a gap where
// a minute is missing or a value is null), the time-of-day windows as shaded
// bands, the farm's events as vertical markers, and one tooltip that reads the
// values (and windows) under the pointer or says who or what made a marker's
// decision and why.
"use strict";

const Charts = (() => {
  const SVG = "http://www.w3.org/2000/svg";
  const W = 520;
  const H = 200;
  const PAD = { left: 46, right: 12, top: 12, bottom: 24 };
  const MERGE_X = 6;

  function svg(tag, attrs = {}) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    return node;
  }

  function html(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /** The smallest 1, 2 or 5 times a power of ten at or above ``v`` (at least ``floor``). */
  function niceCeil(v, floor) {
    const top = Math.max(v, floor);
    const power = 10 ** Math.floor(Math.log10(top));
    for (const step of [1, 2, 5, 10]) if (step * power >= top) return step * power;
    return 10 * power;
  }

  function fmtValue(v) {
    if (v === null || v === undefined) return "—";
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  function fmtTime(ms, spanMs) {
    const d = new Date(ms);
    if (spanMs <= 86_400_000) return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    return d.toLocaleString([], { weekday: "short", hour: "2-digit", minute: "2-digit" });
  }

  /** Words for an event of GET /v1/admin/history: when, what, who or what, why. */
  function describeEvent(e) {
    const when = new Date(e.at).toLocaleString();
    const change =
      e.desired !== undefined && e.desired !== null ? `: ${e.previous ?? "?"} → ${e.desired} replicas` : "";
    const job = e.job_id ? ` (job ${e.job_id}${e.worker ? ` on ${e.worker}` : ""})` : "";
    return `${when} — ${e.kind}${change}, by ${e.by}: ${e.why || "no reason given"}${job}`;
  }

  /**
   * A chart as a <figure>.
   *
   * ``opts``: title, unit, start and end (ms), stepMs, times (ms, ascending),
   * series ([{label, values}], values aligned with times, null for none),
   * events (as GET /v1/admin/history gives them), windows ([{label, spans:
   * [[from ms, to ms], …]}]).
   */
  function timeSeries(opts) {
    const { title, unit, start, end, stepMs, times, series, events = [], windows = [] } = opts;
    const span = Math.max(end - start, 1);
    const plotW = W - PAD.left - PAD.right;
    const plotH = H - PAD.top - PAD.bottom;
    const x = (t) => PAD.left + ((t - start) / span) * plotW;
    let max = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
    const yMax = niceCeil(max, 1);
    const y = (v) => PAD.top + (1 - v / yMax) * plotH;

    const figure = html("figure", "chart");
    figure.dataset.chart = opts.key || title;
    const caption = html("figcaption");
    caption.append(html("span", "chart-title", unit ? `${title} (${unit})` : title));
    series.forEach((s, i) => {
      const item = html("span", "legend-item");
      item.append(html("span", `swatch s${i}`), document.createTextNode(s.label));
      caption.append(item);
    });
    figure.append(caption);

    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`,
      class: "chart-svg",
      role: "img",
      "aria-label": `${title} from ${new Date(start).toLocaleString()} to ${new Date(end).toLocaleString()}`,
    });
    for (const fraction of [0, 0.5, 1]) {
      const value = yMax * fraction;
      root.append(svg("line", { class: "grid", x1: PAD.left, x2: W - PAD.right, y1: y(value), y2: y(value) }));
      const label = svg("text", { class: "axis", x: PAD.left - 6, y: y(value) + 4, "text-anchor": "end" });
      label.textContent = fmtValue(value);
      root.append(label);
    }
    for (let k = 0; k <= 4; k++) {
      const t = start + (span * k) / 4;
      const anchor = k === 0 ? "start" : k === 4 ? "end" : "middle";
      const label = svg("text", { class: "axis", x: x(t), y: H - 6, "text-anchor": anchor });
      label.textContent = fmtTime(t, span);
      root.append(label);
    }

    let bands = 0;
    for (const w of windows) {
      for (const [from, to] of w.spans) {
        const x1 = x(Math.max(from, start));
        const x2 = x(Math.min(to, end));
        if (x2 <= x1) continue;
        const band = svg("rect", { class: "window-band", x: x1, y: PAD.top, width: x2 - x1, height: plotH });
        band.dataset.window = w.label;
        root.append(band);
        bands++;
      }
    }
    if (bands) {
      const item = html("span", "legend-item");
      item.append(html("span", "swatch window"), document.createTextNode("time-of-day window"));
      caption.append(item);
    }

    series.forEach((s, i) => {
      let d = "";
      let points = 0;
      let open = false;
      s.values.forEach((v, j) => {
        const t = times[j];
        if (v === null || v === undefined || t < start || t > end) {
          open = false;
          return;
        }
        const joined = open && t - times[j - 1] <= 1.5 * stepMs;
        // A zero-length segment: a lone point shows as a dot (round caps).
        d += joined ? `L${x(t).toFixed(1)} ${y(v).toFixed(1)}` : `M${x(t).toFixed(1)} ${y(v).toFixed(1)}l0 0`;
        open = true;
        points++;
      });
      root.append(svg("path", { class: `line s${i}`, d: d || "M0 0", "data-points": points }));
    });

    const tip = html("div", "chart-tip");
    tip.setAttribute("role", "tooltip");
    tip.hidden = true;
    const show = (text, clientX, clientY) => {
      tip.textContent = text;
      tip.hidden = false;
      const box = figure.getBoundingClientRect();
      const left = Math.min(Math.max(clientX - box.left + 12, 0), Math.max(box.width - tip.offsetWidth, 0));
      tip.style.left = `${left}px`;
      tip.style.top = `${clientY - box.top + 14}px`;
    };
    const hide = () => {
      tip.hidden = true;
    };

    // Events closer than MERGE_X apart share one marker, which lists them all.
    const groups = [];
    for (const e of events) {
      const t = Date.parse(e.at);
      if (t < start || t > end) continue;
      const last = groups[groups.length - 1];
      if (last && Math.abs(x(t) - last.x) < MERGE_X) last.events.push(e);
      else groups.push({ x: x(t), events: [e] });
    }
    for (const group of groups) {
      const at = group.x;
      const kinds = [...new Set(group.events.map((e) => e.kind))];
      const marker = svg("g", {
        class: `marker kind-${kinds[0]}`,
        tabindex: "0",
        "data-kinds": kinds.join(" "),
      });
      const words = group.events.map(describeEvent).join("\n");
      marker.setAttribute("aria-label", words);
      marker.append(
        svg("line", { class: "marker-line", x1: at, x2: at, y1: PAD.top, y2: H - PAD.bottom }),
        svg("line", { class: "marker-hit", x1: at, x2: at, y1: PAD.top, y2: H - PAD.bottom }),
        svg("circle", { class: "marker-dot", cx: at, cy: PAD.top, r: 4 })
      );
      const reveal = (ev) => {
        const r = marker.getBoundingClientRect();
        show(words, ev.clientX ?? r.left, ev.clientY ?? r.top);
      };
      marker.addEventListener("mouseenter", (ev) => {
        ev.stopPropagation();
        reveal(ev);
      });
      marker.addEventListener("mousemove", (ev) => ev.stopPropagation());
      marker.addEventListener("mouseleave", hide);
      marker.addEventListener("focus", () => {
        const r = marker.getBoundingClientRect();
        show(words, r.left, r.top);
      });
      marker.addEventListener("blur", hide);
      root.append(marker);
    }

    // Values under the pointer: the nearest recorded minute.
    root.addEventListener("mousemove", (ev) => {
      if (ev.target.closest && ev.target.closest(".marker")) return;
      if (!times.length) return;
      const box = root.getBoundingClientRect();
      const t = start + ((((ev.clientX - box.left) / box.width) * W - PAD.left) / plotW) * span;
      let lo = 0;
      let hi = times.length - 1;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (times[mid] < t) lo = mid + 1;
        else hi = mid;
      }
      const j = lo > 0 && t - times[lo - 1] < times[lo] - t ? lo - 1 : lo;
      const values = series.map((s) => `${s.label} ${fmtValue(s.values[j])}`).join(", ");
      const active = windows.filter((w) => w.spans.some(([from, to]) => times[j] >= from && times[j] < to));
      const inWindow = active.length ? ` · in window ${active.map((w) => w.label).join("; ")}` : "";
      show(`${fmtTime(times[j], span)}: ${values}${inWindow}`, ev.clientX, ev.clientY);
    });
    root.addEventListener("mouseleave", hide);

    figure.append(root, tip);
    return figure;
  }

  return { timeSeries, describeEvent };
})();
