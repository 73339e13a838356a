// The Resource Guard tab: plain DOM and SVG, no framework, nothing fetched but this plugin's routes.
// TensorBoard loads this module in an iframe whose <base> is data/plugin/resource_guard/, so the
// relative URLs below are the plugin's routes.

const SVG = "http://www.w3.org/2000/svg";
const PHASE_COLORS = {
  data_wait: "#e8710a",
  forward: "#1a73e8",
  backward: "#12b5cb",
  optimizer: "#9334e6",
  host: "#f9ab00",
  evaluation: "#7cb342",
  checkpoint: "#795548",
  logging: "#e52592",
  communication: "#d93025",
  other: "#9aa0a6",
};
const MEMORY_COLORS = ["#1a73e8", "#12b5cb", "#9334e6", "#e8710a"];
const VIEWS = [
  ["overview", "Overview"],
  ["steps", "Step time"],
  ["memory", "Memory"],
  ["plan", "Plan"],
  ["ops", "Ops"],
  ["compare", "Compare"],
];

const state = { runs: [], run: null, view: "overview", other: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === "text") node.textContent = v;
    else if (k === "onclick" || k === "onchange") node[k] = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function fmt(value, digits = 1) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  return value.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function withUnit(value, unit) {
  const text = fmt(value, unit === "ms" || unit === "MiB" || unit === "%" ? 1 : 2);
  if (value === null || value === undefined || !unit) return text;
  return unit === "%" ? `${text}%` : `${text} ${unit}`;
}

async function getJSON(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

function table(headers, rows, attrs = {}) {
  const head = el("tr", {}, ...headers.map((h) => el("th", { text: h })));
  const body = rows.map((r) => el("tr", r.attrs || {}, ...r.cells.map((c) => el("td", { text: c }))));
  return el("table", attrs, el("thead", {}, head), el("tbody", {}, ...body));
}

function factsTable(facts, id) {
  return table(
    ["", ""],
    facts.map((f) => ({ cells: [f.name, withUnit(f.value, f.unit)] })),
    { id, class: "facts" },
  );
}

// -- views ---------------------------------------------------------------------------------------
async function renderOverview(main) {
  const data = await getJSON(`overview?run=${encodeURIComponent(state.run)}`);
  main.append(el("p", { id: "verdict", class: `verdict ${data.verdict || ""}`, text: data.verdict_text }));
  const list = el("ol", { id: "findings", class: "findings" });
  for (const f of data.findings) {
    const numbers = [];
    if (f.share_pct !== null) numbers.push(`${fmt(f.share_pct)}% of the step`);
    if (f.cost_ms !== null) numbers.push(`costs ${fmt(f.cost_ms)} ms per step`);
    if (f.gain_pct !== null) numbers.push(`about ${fmt(f.gain_pct)}% faster without it`);
    const item = el(
      "li",
      { class: `finding ${f.severity}`, "data-id": f.id },
      el(
        "div",
        { class: "finding-head" },
        el("span", { class: "severity", text: f.severity }),
        el("span", { class: "title", text: f.title }),
      ),
      numbers.length ? el("div", { class: "share", text: numbers.join(" · ") }) : null,
    );
    if (f.fix.length) item.append(el("ul", { class: "fix" }, ...f.fix.map((a) => el("li", { text: a }))));
    if (f.call_sites.length) {
      item.append(
        el("div", { class: "sites" }, el("b", { text: "call sites: " }), f.call_sites.join("; ")),
      );
    }
    list.append(item);
  }
  main.append(el("h3", { text: "Findings, by the time they cost" }), list);
  main.append(el("h3", { text: "Run" }), factsTable(data.facts, "facts"));
  if (data.notes.length) main.append(el("ul", { class: "notes" }, ...data.notes.map((n) => el("li", { text: n }))));
}

function axes(g, x0, y0, width, height, yMax, yUnit, xTicks) {
  g.append(svg("line", { x1: x0, y1: y0, x2: x0 + width, y2: y0, class: "axis" }));
  g.append(svg("line", { x1: x0, y1: y0, x2: x0, y2: y0 - height, class: "axis" }));
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    const y = y0 - (height * i) / 4;
    g.append(svg("line", { x1: x0, y1: y, x2: x0 + width, y2: y, class: "grid" }));
    const label = svg("text", { x: x0 - 6, y: y + 4, class: "tick", "text-anchor": "end" });
    label.textContent = fmt(v, v < 10 ? 2 : 0);
    g.append(label);
  }
  const unit = svg("text", { x: x0 - 6, y: y0 - height - 12, class: "tick", "text-anchor": "end" });
  unit.textContent = yUnit;
  g.append(unit);
  for (const [x, text] of xTicks) {
    const label = svg("text", { x, y: y0 + 16, class: "tick", "text-anchor": "middle" });
    label.textContent = text;
    g.append(label);
  }
}

async function renderSteps(main) {
  const data = await getJSON(`steps?run=${encodeURIComponent(state.run)}`);
  const wrap = el("div", { class: "side-by-side" });
  const W = 720, H = 360, x0 = 70, y0 = H - 40, width = W - x0 - 20, height = H - 80;
  const chart = svg("svg", { id: "step-chart", width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const totals = data.bars.map((b) => data.series.reduce((s, p) => s + (b.phases_ms[p] || 0), 0));
  const yMax = Math.max(1e-9, ...totals) * 1.05;
  const slot = width / Math.max(1, data.bars.length);
  const barWidth = Math.min(80, slot * 0.7);
  const g = svg("g");
  chart.append(g);
  axes(g, x0, y0, width, height, yMax, "ms", data.bars.map((b, i) => [x0 + slot * (i + 0.5), `step ${b.step}`]));
  const stacked = data.bars.map(() => 0);
  for (const phase of data.series) {
    const series = svg("g", { class: "series", "data-phase": phase, fill: PHASE_COLORS[phase] || "#999" });
    data.bars.forEach((b, i) => {
      const v = b.phases_ms[phase] || 0;
      const h = (v / yMax) * height;
      const rect = svg("rect", {
        x: x0 + slot * (i + 0.5) - barWidth / 2,
        y: y0 - ((stacked[i] + v) / yMax) * height,
        width: barWidth,
        height: Math.max(0, h),
      });
      const tip = svg("title");
      tip.textContent = `step ${b.step}: ${data.labels[phase]} ${fmt(v, 2)} ms`;
      rect.append(tip);
      series.append(rect);
      stacked[i] += v;
    });
    g.append(series);
  }
  const legend = el(
    "div",
    { class: "legend", id: "step-legend" },
    ...data.series.map((p) =>
      el("span", { class: "key" }, el("i", { style: `background:${PHASE_COLORS[p]}` }), data.labels[p]),
    ),
  );
  const left = el("div", {}, el("h3", { text: "Step time by phase, per logged step (ms)" }), chart, legend);
  if (!data.bars.length) left.append(el("p", { class: "empty", text: "No phase scalars in this run's events." }));
  const right = el(
    "div",
    {},
    el("h3", { text: `Mean step: ${withUnit(data.mean_step_ms, "ms")} (first step left out)` }),
    table(
      ["phase", "ms/step", "share"],
      data.table.map((r) => ({ cells: [r.label, fmt(r.ms, 2), `${fmt(r.share_pct)}%`] })),
      { id: "share-table" },
    ),
  );
  wrap.append(left, right);
  main.append(wrap);
}

async function renderMemory(main) {
  const data = await getJSON(`memory?run=${encodeURIComponent(state.run)}`);
  const W = 760, H = 380, x0 = 80, y0 = H - 40, width = W - x0 - 170, height = H - 80;
  const chart = svg("svg", { id: "memory-chart", width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const values = data.series.flatMap((s) => s.points.map((p) => p[1]));
  const lines = [
    ["capacity", data.capacity_mib, `capacity ${fmt(data.capacity_mib)} MiB (${data.capacity_source})`],
    ["usable", data.usable_mib, `usable ${fmt(data.usable_mib)} MiB`],
    ["estimate", data.estimate_mib, `${data.estimate_source === "plan" ? "predicted peak" : "pre-flight estimate"} ${fmt(data.estimate_mib)} MiB`],
  ].filter((l) => l[1] !== null && l[1] !== undefined);
  const yMax = Math.max(1e-9, ...values, ...lines.map((l) => l[1])) * 1.08;
  const steps = [...new Set(data.series.flatMap((s) => s.points.map((p) => p[0])))].sort((a, b) => a - b);
  const sMin = steps.length ? steps[0] : 0;
  const sMax = steps.length ? steps[steps.length - 1] : 1;
  const xOf = (s) => (sMax === sMin ? x0 + width / 2 : x0 + ((s - sMin) / (sMax - sMin)) * width);
  const yOf = (v) => y0 - (v / yMax) * height;
  const g = svg("g");
  chart.append(g);
  axes(g, x0, y0, width, height, yMax, "MiB", steps.map((s) => [xOf(s), `step ${s}`]));
  for (const [kind, value, label] of lines) {
    const y = yOf(value);
    g.append(svg("line", { x1: x0, y1: y, x2: x0 + width, y2: y, class: `limit ${kind}`, "data-mib": value }));
    const text = svg("text", { x: x0 + width + 6, y: y + 4, class: `limit-label ${kind}` });
    text.textContent = label;
    g.append(text);
  }
  data.series.forEach((s, i) => {
    const color = MEMORY_COLORS[i % MEMORY_COLORS.length];
    const group = svg("g", { class: "series", "data-tag": s.tag, stroke: color, fill: color });
    group.append(
      svg("polyline", { points: s.points.map((p) => `${xOf(p[0])},${yOf(p[1])}`).join(" "), fill: "none" }),
    );
    for (const p of s.points) {
      const dot = svg("circle", { cx: xOf(p[0]), cy: yOf(p[1]), r: 4 });
      const tip = svg("title");
      tip.textContent = `${s.label} at step ${p[0]}: ${fmt(p[1])} MiB`;
      dot.append(tip);
      group.append(dot);
    }
    g.append(group);
  });
  const legend = el(
    "div",
    { class: "legend" },
    ...data.series.map((s, i) =>
      el("span", { class: "key" }, el("i", { style: `background:${MEMORY_COLORS[i % MEMORY_COLORS.length]}` }), s.label),
    ),
  );
  main.append(el("h3", { text: "Memory over the logged steps (MiB)" }), chart, legend);
  if (data.peak_source === "rss") {
    main.append(
      el("p", {
        class: "note",
        text: "On a CPU the peak is the whole process's resident set (interpreter and libraries included): it is not the pre-flight estimate's quantity.",
      }),
    );
  }
  if (data.picture) {
    main.append(
      el("h3", { text: "Pre-flight memory of one step" }),
      el("img", { id: "memory-picture", src: `memory.png?run=${encodeURIComponent(state.run)}`, alt: "memory.png" }),
    );
  }
}

async function renderPlan(main) {
  const data = await getJSON(`plan?run=${encodeURIComponent(state.run)}`);
  if (!data.has_plan) {
    main.append(el("p", { class: "empty", text: "This run wrote no plan." }));
    return;
  }
  if (data.markdown) {
    main.append(el("h3", { text: "Plan" }), el("pre", { id: "plan-text", text: data.markdown }));
    return;
  }
  main.append(el("h3", { text: "Configuration" }), factsTable(data.configuration, "plan-config"));
  main.append(el("h3", { text: "Reasons" }), el("ul", { id: "plan-reasons" }, ...data.reasons.map((r) => el("li", { text: r }))));
  main.append(
    el("h3", { text: "Alternatives" }),
    table(
      ["configuration", "fits", "predicted peak", "relative cost"],
      data.alternatives.map((a) => ({
        attrs: a.chosen ? { class: "chosen" } : {},
        cells: [a.config + (a.chosen ? " (chosen)" : ""), a.fits ? "yes" : "no", withUnit(a.predicted_mib, "MiB"), fmt(a.relative_cost, 2)],
      })),
      { id: "plan-alternatives" },
    ),
  );
  main.append(el("h3", { text: "Estimate" }), factsTable(data.estimate, "plan-estimate"));
  if (data.warnings.length) main.append(el("ul", { class: "notes" }, ...data.warnings.map((w) => el("li", { text: w }))));
}

async function renderOps(main) {
  const data = await getJSON(`ops?run=${encodeURIComponent(state.run)}`);
  if (!data.profiled) {
    main.append(el("p", { class: "empty", text: "This run profiled no step (profile=False, or it ended before the window closed)." }));
    return;
  }
  const clock = data.timeline === "device" ? "device" : "host";
  main.append(
    el("p", {
      id: "ops-window",
      text: `${data.steps} profiled step(s), ${fmt(data.step_ms)} ms per profiled step (median); times per step, on the ${clock} clock.`,
    }),
  );
  main.append(
    el("h3", { text: "By class (ms per step)" }),
    table(
      ["class", "ms", "± spread", "share of the step"],
      data.classes.map((c) => ({ cells: [c.class, fmt(c.ms, 2), fmt(c.spread_ms, 2), c.share_pct === null ? "–" : `${fmt(c.share_pct)}%`] })),
      { id: "ops-classes" },
    ),
  );
  main.append(
    el("h3", { text: "Top operators" }),
    table(
      ["operator", "calls", "ms", "share of the step"],
      data.top_ops.map((o) => ({ cells: [o.op, fmt(o.calls, 0), fmt(o.ms, 2), o.share_pct === null ? "–" : `${fmt(o.share_pct)}%`] })),
      { id: "ops-top" },
    ),
  );
  for (const [key, title] of [["cast_sites", "Casts and copies: call sites"], ["sync_sites", "Host syncs: call sites"]]) {
    if (!data[key].length) continue;
    main.append(
      el("h3", { text: title }),
      table(["call site", "calls", "ms"], data[key].map((r) => ({ cells: [r.site, fmt(r.calls, 0), fmt(r.ms, 2)] })), { id: `ops-${key}` }),
    );
  }
  if (data.stalls.length) {
    main.append(el("h3", { text: "Stalls (one op far above its usual time)" }), el("pre", { id: "ops-stalls", text: JSON.stringify(data.stalls, null, 1) }));
  }
  if (data.trace_path) main.append(el("p", { class: "notes", text: `Trace: ${data.trace_path} (open in Perfetto or chrome://tracing)` }));
}

async function renderCompare(main) {
  const others = state.runs.filter((r) => r.report && r.name !== state.run);
  if (!others.length) {
    main.append(el("p", { class: "empty", text: "Compare needs a second run with a report below the log dir." }));
    return;
  }
  if (!state.other || !others.some((r) => r.name === state.other)) state.other = others[0].name;
  const select = el("select", {
    id: "run-b",
    onchange: (e) => {
      state.other = e.target.value;
      show();
    },
  });
  for (const r of others) select.append(el("option", { value: r.name, text: r.name }));
  select.value = state.other;
  main.append(el("p", {}, `Run A: ${state.run}  ·  run B: `, select));
  const data = await getJSON(`compare?a=${encodeURIComponent(state.run)}&b=${encodeURIComponent(state.other)}`);
  main.append(el("p", { id: "compare-headline", class: "verdict", text: data.headline }));
  main.append(el("p", { text: `A: ${data.verdict_a}` }), el("p", { text: `B: ${data.verdict_b}` }));
  const delta = (d, unit) => (d.delta === null ? "–" : `${d.delta > 0 ? "+" : ""}${fmt(d.delta, 2)} ${unit}`);
  const rows = [
    { cells: ["step", fmt(data.step_ms.a, 2), fmt(data.step_ms.b, 2), delta(data.step_ms, "ms")] },
    ...data.phases.map((p) => ({
      attrs: p.phase === data.changed_phase ? { class: "changed", "data-phase": p.phase } : { "data-phase": p.phase },
      cells: [`  ${p.label}`, fmt(p.a, 2), fmt(p.b, 2), delta(p, "ms")],
    })),
  ];
  main.append(el("h3", { text: "Time per step (ms)" }), table(["", "A", "B", "change"], rows, { id: "compare-phases" }));
  const mem = data.memory;
  main.append(
    el("h3", { text: "Memory (MiB)" }),
    table(
      ["", "A", "B", "change"],
      [
        { cells: ["peak", fmt(mem.peak_mib.a), fmt(mem.peak_mib.b), delta(mem.peak_mib, "MiB")] },
        { cells: ["pre-flight estimate", fmt(mem.estimate_mib.a), fmt(mem.estimate_mib.b), delta(mem.estimate_mib, "MiB")] },
      ],
      { id: "compare-memory" },
    ),
  );
  main.append(
    el("h3", { text: "Findings" }),
    table(
      ["finding", "status", "A", "B"],
      data.findings.map((f) => ({ cells: [f.id, f.status, f.title_a || "–", f.title_b || "–"] })),
      { id: "compare-findings" },
    ),
  );
}

const RENDER = { overview: renderOverview, steps: renderSteps, memory: renderMemory, plan: renderPlan, ops: renderOps, compare: renderCompare };

async function show() {
  const main = document.getElementById("rg-main");
  main.replaceChildren();
  main.setAttribute("data-state", "loading");
  document.querySelectorAll("nav.views button").forEach((b) => {
    b.classList.toggle("active", b.dataset.view === state.view);
  });
  if (!state.run) {
    main.append(el("p", { class: "empty", text: "No run below the log dir has written report.json or guard.json yet." }));
    main.setAttribute("data-state", "ready");
    return;
  }
  try {
    await RENDER[state.view](main);
  } catch (error) {
    main.append(el("p", { class: "error", text: String(error) }));
  }
  main.setAttribute("data-view", state.view);
  main.setAttribute("data-state", "ready");
}

export async function render() {
  document.head.append(el("link", { rel: "stylesheet", href: "static/style.css" }));
  const runSelect = el("select", {
    id: "run-a",
    onchange: (e) => {
      state.run = e.target.value;
      show();
    },
  });
  const nav = el("nav", { class: "views" });
  for (const [key, label] of VIEWS) {
    nav.append(
      el("button", {
        "data-view": key,
        text: label,
        onclick: () => {
          state.view = key;
          show();
        },
      }),
    );
  }
  document.body.append(
    el("header", { class: "rg-header" }, el("b", { text: "Resource Guard" }), el("label", {}, "run ", runSelect), nav),
    el("main", { id: "rg-main" }),
  );
  state.runs = await getJSON("runs");
  for (const r of state.runs) runSelect.append(el("option", { value: r.name, text: r.name }));
  state.run = state.runs.length ? state.runs[0].name : null;
  await show();
}
