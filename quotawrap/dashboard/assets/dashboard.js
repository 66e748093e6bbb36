// quotawrap's dashboard: polls data.json (the same figures as `quotawrap status --json`) and draws them.
// No library: the bars and the day's chart are SVG made here (docs/dashboard.md says why).
// Every text from the store goes in through textContent, never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const DAY_S = 86400;
const ZOOM = 20; // the chart zooms to the day's usage when that is under a twentieth of its highest limit
const beijingTime = new Intl.DateTimeFormat("en-GB", {
  timeZone: "Asia/Shanghai", hour: "2-digit", minute: "2-digit", hour12: false,
});
const beijingParts = new Intl.DateTimeFormat("en-US", {
  timeZone: "Asia/Shanghai", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", hourCycle: "h23",
});
// 12-08 01:07, the form `quotawrap status` uses.
const beijingDateTime = {
  format(ms) {
    const part = Object.fromEntries(beijingParts.formatToParts(ms).map((p) => [p.type, p.value]));
    return `${part.month}-${part.day} ${part.hour}:${part.minute}`;
  },
};

function tokens(n) {
  return Number(n).toLocaleString("en-US");
}

function compact(n) {
  if (n >= 1e6) return Number((n / 1e6).toFixed(2)) + "M";
  if (n >= 1e3) return Number((n / 1e3).toFixed(1)) + "k";
  return String(Math.round(n));
}

function cny(micro) {
  return "¥" + (micro / 1e6).toFixed(6);
}

function ago(seconds) {
  if (seconds < 90) return Math.round(seconds) + " s ago";
  if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  for (const child of children) node.append(child);
  return node;
}

function figure(field, value) {
  return el("b", { "data-field": field }, tokens(value));
}

// The seed's live bar: settled solid, in flight shaded, against the limit; a bar that passes the limit shows by how much.
// A share bar (`marked` false: the spend by tag) draws no limit mark: its length is relative to the largest row.
function bar(settled, inFlight, limit, label, marked = true) {
  const width = 1000;
  const scale = Math.max(limit, settled + inFlight, 1);
  const x = (v) => (Math.min(v, scale) / scale) * width;
  const root = svg("svg", { viewBox: `0 0 ${width} 28`, class: "bar", role: "img", "aria-label": label, preserveAspectRatio: "none" });
  root.append(
    svg("rect", { x: 0, y: 4, width: x(limit), height: 20, class: "track" }),
    svg("rect", { x: 0, y: 4, width: x(settled), height: 20, class: "settled" }),
    svg("rect", { x: x(settled), y: 4, width: x(settled + inFlight) - x(settled), height: 20, class: "in-flight" }),
  );
  if (marked) root.append(svg("line", { x1: x(limit), x2: x(limit), y1: 0, y2: 28, class: "limit" }));
  return root;
}

// The smallest of 1, 2, 2.5 or 5 times a power of ten that is at least n.
function roundUp(n) {
  const power = 10 ** Math.floor(Math.log10(n));
  return [1, 2, 2.5, 5, 10].map((m) => m * power).find((v) => v >= n);
}

function percent(used, limit) {
  return limit > 0 ? Math.floor((100 * used) / limit) + "%" : used > 0 ? "over" : "0%";
}

// The day's usage (settled, a step per minute) with the limits drawn over it: v6's, the lag-aware one, the walls.
function dayChart(row, curve, now, dayStart) {
  const W = 720, H = 220, left = 64, right = 24, top = 14, bottom = 28;
  const usage = curve ? curve.usage : [];
  const syncs = curve ? curve.syncs : [];
  const walls = row.limits.walls.filter((w) => w.cap > 1); // a wall at 1 token ("evicted once used") is said in words
  const lines = [
    ...walls.map((w) => ({ value: w.cap, cls: "wall", label: `wall (${w.name})`, atLeft: true })),
    ...(row.limits.v6 !== row.limits.lag_aware ? [{ value: row.limits.v6, cls: "v6", label: "v6 limit" }] : []),
    { value: row.limits.lag_aware, cls: "lag-aware", label: row.limits.v6 === row.limits.lag_aware ? "limit (v6 = lag-aware)" : "lag-aware limit" },
  ];
  // A day that used a sliver of its limit is drawn at its own scale, the limits above it named at the top;
  // otherwise the scale reaches the highest line.
  const used = Math.max(row.usage + row.in_flight, 1);
  const highest = Math.max(...lines.map((l) => l.value), 1);
  const peak = highest <= ZOOM * used ? highest : Math.max(used * 1.25, ...lines.map((l) => l.value).filter((v) => v <= used * 1.25));
  const step = roundUp((peak * 1.05) / 4); // a round step, so the axis reads 0, 2.5k, 5k, not 0, 1.3k, 2.5k
  const ymax = step * Math.ceil((peak * 1.05) / step);
  const X = (t) => left + ((Math.min(Math.max(t, dayStart), dayStart + DAY_S) - dayStart) / DAY_S) * (W - left - right);
  const Y = (v) => top + (1 - v / ymax) * (H - top - bottom);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": `${row.model}: today's usage and limits` });
  for (let v = 0; v <= ymax; v += step) {
    root.append(
      svg("line", { x1: left, x2: W - right, y1: Y(v), y2: Y(v), class: "grid" }),
      svg("text", { x: left - 6, y: Y(v) + 4, class: "axis", "text-anchor": "end" }, compact(v)),
    );
  }
  for (let hour = 0; hour <= 24; hour += 6) {
    root.append(svg("text", { x: X(dayStart + hour * 3600), y: H - 8, class: "axis", "text-anchor": "middle" }, `${String(hour).padStart(2, "0")}:00`));
  }
  for (const [t] of syncs) {
    root.append(svg("line", { x1: X(t), x2: X(t), y1: H - bottom, y2: H - bottom - 8, class: "sync" }, svg("title", {}, `balance sync at ${beijingTime.format(t * 1000)}`)));
  }
  // Limits are labelled at the right end above their line (below it when another limit's line runs just above),
  // walls at the left end below theirs: close lines stay legible.
  const shown = lines.filter((l) => l.value <= peak);
  const crowded = (l) => shown.some((o) => !o.atLeft && o !== l && Y(o.value) < Y(l.value) && Y(l.value) - Y(o.value) < 16);
  for (const l of shown) {
    const label = `${l.label} ${tokens(l.value)}`;
    root.append(
      svg("line", { x1: left, x2: W - right, y1: Y(l.value), y2: Y(l.value), class: l.cls }),
      l.atLeft
        ? svg("text", { x: left + 4, y: Y(l.value) + 13, class: `label ${l.cls}` }, label)
        : svg("text", { x: W - right - 4, y: Y(l.value) + (crowded(l) ? 13 : -4), class: `label ${l.cls}`, "text-anchor": "end" }, label),
    );
  }
  const above = lines.filter((l) => l.value > peak);
  if (above.length) {
    root.append(svg("text", { x: W - right - 4, y: top + 10, class: "axis above", "text-anchor": "end" },
      "above this scale: " + above.map((l) => `${l.label} ${tokens(l.value)}`).join(" · ")));
  }
  let path = `M${X(dayStart)},${Y(0)}`;
  for (const [t, cumulative] of usage) path += ` H${X(t)} V${Y(cumulative)}`;
  path += ` H${X(now)} V${Y(row.usage)}`;
  root.append(svg("path", { d: path, class: "usage" }));
  if (row.in_flight > 0) {
    root.append(svg("rect", { x: X(now) - 3, y: Y(row.usage + row.in_flight), width: 6, height: Y(row.usage) - Y(row.usage + row.in_flight), class: "in-flight" }));
  }
  root.append(svg("line", { x1: X(now), x2: X(now), y1: top, y2: H - bottom, class: "now" }));
  return root;
}

function modelCard(row, curve, data, dayStart) {
  const card = el("article", { class: "model", "data-model": row.model });
  const state = row.evicted ? `EVICTED (${row.evicted_by})` : "open";
  card.append(el("h3", {}, el("span", { class: "name" }, row.model), " ", el("span", { class: row.evicted ? "state evicted" : "state" }, state)));
  const used = row.usage + row.in_flight;
  card.append(bar(row.usage, row.in_flight, row.effective_limit, `${row.model}: settled and in flight against the limit`));
  card.append(el("p", { class: "figures" },
    figure("usage", row.usage), " settled + ", figure("in_flight", row.in_flight), " in flight of ",
    figure("effective_limit", row.effective_limit), ` (${percent(used, row.effective_limit)}; bound by `,
    el("span", { "data-field": "binding" }, row.binding), "; headroom ", figure("headroom", row.headroom), ")"));
  card.append(el("p", { class: "detail" }, "limit: " + row.limit_detail));
  if (row.evicted) card.append(el("p", { class: "detail evicted" }, "evicted: " + row.evicted_detail));
  card.append(el("p", { class: "detail" },
    "v6 limit ", figure("v6", row.limits.v6), " · lag-aware limit ", figure("lag_aware", row.limits.lag_aware),
    " · daily cap ", figure("daily_cap", row.limits.daily_cap)));
  const waitsAndRefusals = el("p", { class: "detail" },
    figure("waiting", row.waiting), " waiting for room now · ", figure("refused", row.refused), " refused today");
  card.append(waitsAndRefusals);
  card.append(el("p", { class: "detail", "data-field": "balance" }, row.balance_known
    ? `balance at sync ${tokens(row.balance_at_sync)} (${row.sync_source}, ${ago(data.now - row.synced_at)}, at ${beijingTime.format(row.synced_at * 1000)} Beijing, usage then ${tokens(row.usage_at_sync)})`
    : "balance: unknown today, so this model is guarded by its daily cap alone"));
  if (row.keep_alive_advice) card.append(el("p", { class: "detail" }, row.keep_alive_advice));
  card.append(dayChart(row, curve, data.now, dayStart));
  return card;
}

function table(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows);
  document.getElementById(id).classList.toggle("empty", rows.length === 0);
}

function cells(...values) {
  return el("tr", {}, ...values.map((v) => (v instanceof Node ? el("td", {}, v) : el("td", {}, String(v)))));
}

function render(data) {
  const dayStart = data.now + data.seconds_to_reset - DAY_S;
  const hours = Math.floor(data.seconds_to_reset / 3600), minutes = Math.floor((data.seconds_to_reset % 3600) / 60);
  document.getElementById("where").textContent =
    `store ${data.store} · Beijing day ${data.day} · resets at Beijing midnight in ${hours}h${String(minutes).padStart(2, "0")}m`;
  const models = document.getElementById("models");
  models.replaceChildren(...(data.models.length
    ? data.models.map((row) => modelCard(row, data.curves[row.model], data, dayStart))
    : [el("p", { class: "empty" }, "the ledger has no models yet (no guarded call, no balance sync)")]));

  const budgets = data.budgets || [];
  document.getElementById("budgets-section").hidden = budgets.length === 0;
  table("budgets", budgets.map((b) => {
    // a money budget counts micro-CNY
    const amount = b.unit === "cny" ? cny : (n) => `${tokens(n)} tokens`;
    const row = cells(b.name, bar(b.used, b.in_flight, b.limit, `budget ${b.name}`),
      amount(b.used), amount(b.in_flight), amount(b.left), amount(b.limit),
      b.resets_at ? beijingDateTime.format(b.resets_at * 1000) : "at the run's end");
    row.setAttribute("data-budget", b.name);
    return row;
  }));

  const names = [...new Set([...data.models.map((r) => r.model), ...Object.keys(data.waiting), ...Object.keys(data.refused)])];
  table("calls", names.map((name) => {
    const row = cells(name, tokens(data.waiting[name] || 0), tokens(data.refused[name] || 0));
    row.setAttribute("data-model", name);
    return row;
  }));

  const tags = document.getElementById("tags");
  tags.replaceChildren(...Object.entries(data.by_tag).map(([key, rows]) => {
    const most = Math.max(1, ...rows.map((r) => r.settled_tokens));
    const body = rows.map((r) => {
      const row = cells(r.key, bar(r.settled_tokens, 0, most, `${key} ${r.key}`, false), tokens(r.settled_tokens), tokens(r.calls), tokens(r.blocked_calls), cny(r.cost_micro_cny));
      row.setAttribute("data-tag-value", r.key);
      return row;
    });
    const head = el("thead", {}, el("tr", {}, ...[key, "", "tokens", "calls", "refused", "cost"].map((h) => el("th", {}, h))));
    return el("table", { class: rows.length ? "tag" : "tag empty", "data-tag": key }, head, el("tbody", {}, ...body));
  }));

  table("sessions", data.sessions.slice().reverse().map((s) => {
    const row = cells(s.session, beijingDateTime.format(s.started_at * 1000), s.state, tokens(s.calls), tokens(s.blocked_calls),
      tokens(s.settled_tokens), cny(s.cost_micro_cny), s.command.length > 80 ? s.command.slice(0, 79) + "…" : s.command);
    row.setAttribute("data-session", s.session);
    return row;
  }));

  const alerts = document.getElementById("alerts");
  const outside = data.unguarded_processes || [];
  alerts.hidden = outside.length === 0;
  alerts.replaceChildren(...(outside.length ? [
    el("h2", {}, "Processes outside the guard (their LLM calls are NOT guarded)"),
    el("ul", {}, ...outside.map((p) => el("li", {}, `session ${p.session}: pid ${p.pid} (${p.command}): ${p.stopped ? "stopped by --strict" : p.reason}`))),
  ] : []));
}

function say(state, text) {
  const line = document.getElementById("freshness");
  line.dataset.state = state;
  line.textContent = text;
}

async function poll() {
  let wait = 2;
  try {
    const answer = await fetch("data.json", { cache: "no-store" });
    const data = await answer.json();
    if (!answer.ok) {
      say("error", `the store did not answer: ${data.error}`);
    } else {
      wait = data.refresh_s;
      render(data);
      say("ok", `updated ${new Date().toLocaleTimeString("en-GB")} · every ${wait} s`);
    }
  } catch (error) {
    say("offline", "the dashboard's server does not answer; trying again");
  }
  setTimeout(poll, wait * 1000);
}

poll();
