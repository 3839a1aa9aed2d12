// archc report: draws the page from the JSON embedded in it (`archc report --json` prints the
// same). Every number shown is read from that data; this file only formats and draws. Text from
// the data is set with textContent, never parsed as HTML; the one HTML it inserts is the kernel
// sources Pygments highlighted at report time.
"use strict";

const DATA = JSON.parse(document.getElementById("report-data").textContent);
const HIGHLIGHTED = JSON.parse(document.getElementById("report-highlighted").textContent);
const SVG = "http://www.w3.org/2000/svg";
const NODE_W = 150, NODE_H = 30, MARGIN = 24;

// ---- small helpers ---------------------------------------------------------------------------

/** An element with attributes and children (strings become text nodes). */
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick") e.addEventListener("click", v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

/** An SVG element with attributes. */
function sv(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

/** 12345678 → "12.35 M" (base 1000), or with base 1024 "11.77 Mi": as archc.ui.si. */
function si(value, unit = "", base = 1000) {
  let v = Number(value), i = 0;
  while (Math.abs(v) >= base && i < 5) { v /= base; i += 1; }
  const prefix = ["", "K", "M", "G", "T", "P"][i] + (base === 1024 && i ? "i" : "");
  return i === 0 ? `${v.toFixed(0)} ${prefix}${unit}`.trim() : `${v.toFixed(2)} ${prefix}${unit}`;
}
const nbytes = (v) => si(v, "B", 1024);

/** Seconds in the unit that reads best. */
function seconds(s) {
  if (s >= 1) return `${s.toFixed(2)} s`;
  if (s >= 1e-3) return `${(s * 1e3).toFixed(2)} ms`;
  return `${(s * 1e6).toFixed(1)} µs`;
}

/** A table: `columns` are [title, numeric?]; rows are arrays of cells (strings or Nodes). */
function table(columns, rows, rowAttrs) {
  const t = el("table", {});
  t.append(el("tr", {}, ...columns.map(([c]) => el("th", {}, c))));
  rows.forEach((row, r) => {
    const tr = el("tr", rowAttrs ? rowAttrs(r) : {});
    row.forEach((cell, k) => tr.append(el("td", columns[k][1] ? { class: "num" } : {}, cell)));
    t.append(tr);
  });
  return t;
}

// ---- header and spec ---------------------------------------------------------------------------

function drawHeader() {
  const quant = Object.entries(DATA.quantized).map(([s, n]) => `${s} ×${n}`).join(", ");
  document.getElementById("top").append(
    el("h1", {}, `${DATA.model}: a compile`),
    el("div", { class: "sub" }, `source ${DATA.source} · ${DATA.dtype}` +
       (quant ? ` · quantized weights ${quant}` : "") + ` · archc ${DATA.archc}`));
  const nav = document.getElementById("sections");
  for (const [id, title] of [["spec", "Spec"], ["pipeline", "Passes"], ["kernels", "Kernels"],
                             ["roofline", "Roofline"], ["validation", "Validation"]]) {
    if (id === "roofline" && !DATA.roofline) continue;
    if (id === "validation" && !DATA.validation) continue;
    nav.append(el("a", { href: `#${id}` }, title));
  }
}

function drawSpec() {
  const s = document.getElementById("spec");
  s.append(el("h2", {}, "Spec and what it implies"));
  s.append(table([["", false], ["", false]], DATA.spec.facts.filter(([k, v]) => k || v)));
  s.append(el("details", {}, el("summary", {}, "spec YAML"), el("pre", {}, DATA.spec.yaml)));
}

// ---- the pass stepper ---------------------------------------------------------------------------

const state = { step: 0, chosen: null, lit: null };

/** The drawing of step k: its own, or the one of the step it is the same as. */
function drawing(k) {
  const s = DATA.drawn.steps[k];
  return s.graphs ? s : DATA.drawn.steps[s.same_as];
}

function drawPipeline() {
  const s = document.getElementById("pipeline");
  const rows = DATA.pipeline.rows;
  const last = rows.length - 1;
  s.append(el("h2", {}, "Passes"));
  const d = DATA.pipeline.dims;
  s.append(el("p", { class: "muted" },
    `The whole model (${DATA.spec.numbers.layers} blocks), costs per new token at ` +
    `B=${d.B}, T=${d.T}, P=${d.P}; kernels per block ${DATA.pipeline.kernels_per_block[0]} ` +
    `unfused → ${DATA.pipeline.kernels_per_block[1]} after the pipeline. Click a row, or use ` +
    "the slider, to see that pass."));
  s.append(table(
    [["#", true], ["pass", false], ["nodes", true], ["kernels", true], ["params", true],
     ["FLOPs/token", true], ["bytes/token", true], ["changed", false]],
    rows.map((r) => [r.index || "", r.name, r.stats.nodes, r.stats.kernels, si(r.stats.params),
                     si(r.stats.flops_per_token, "FLOP"), nbytes(r.stats.bytes_per_token),
                     r.changed]),
    (r) => ({ class: "clickable", "data-step": r, id: `pass-row-${r}`,
              onclick: () => selectStep(r) })));
  const slider = el("input", { type: "range", min: 0, max: last, value: 0, id: "pass-slider" });
  slider.addEventListener("input", () => selectStep(Number(slider.value)));
  const drawnNote = DATA.drawn.layers === DATA.drawn.of ? "the whole model" :
    `${DATA.drawn.layers} of ${DATA.drawn.of} blocks: one period of the layer pattern`;
  s.append(el("div", { class: "stepper" },
    el("button", { id: "pass-first", onclick: () => selectStep(0) }, "before the passes"),
    el("button", { id: "pass-prev", onclick: () => selectStep(Math.max(state.step - 1, 0)) }, "◀"),
    slider,
    el("button", { id: "pass-next", onclick: () => selectStep(Math.min(state.step + 1, last)) }, "▶"),
    el("button", { id: "pass-last", onclick: () => selectStep(last) }, "after the passes"),
    el("span", { class: "current", id: "pass-name" }, ""),
    el("span", {}, "nodes drawn: ", el("span", { id: "drawn-count" }, ""), ` (${drawnNote})`)));
  s.append(el("div", { class: "legend" }, ...["io", "param", "view", "matmul", "attention",
    "reduction", "pointwise", "recurrent", "collective", "other"].map(
    (f) => el("span", { style: `background: var(--${f})` }, f)),
    el("span", { class: "muted", style: "border: none" },
       "thick border: rewritten by a pass · dashed box: one kernel's nodes")));
  const panels = el("div", { class: "panels" },
    el("div", {}, el("h3", {}, "Node"), el("div", { id: "provenance" },
       el("span", { class: "muted" }, "click a node: its spec field, the passes that changed it"))),
    el("div", {}, el("h3", {}, "What the pass did (whole model)"), el("div", { id: "explain" })),
    el("div", {}, el("h3", {}, "Text diff (drawn blocks)"), el("pre", { id: "diff", class: "diff" })));
  s.append(el("div", { class: "workspace" }, el("div", { class: "graph-box", id: "graph-box" }),
                                             panels));
}

function selectStep(k) {
  state.step = k;
  document.getElementById("pass-slider").value = k;
  document.querySelectorAll("tr[data-step]").forEach(
    (tr) => tr.classList.toggle("selected", Number(tr.dataset.step) === k));
  const step = DATA.drawn.steps[k];
  const row = DATA.pipeline.rows[k];
  document.getElementById("pass-name").textContent =
    `${k}. ${row.name}` + (row.changed === "not applied" ? " (not applied)" : "");
  drawGraph(drawing(k));
  drawExplain(row);
  drawDiff(step.diff, row);
  state.chosen = null;
}

/** The graph of a drawing as SVG: edges, kernel groups, then nodes. */
function drawGraph(d) {
  const box = document.getElementById("graph-box");
  box.textContent = "";
  const svg = sv("svg", { class: "graph", id: "graph", width: d.width + 2 * MARGIN,
                          height: d.height + 2 * MARGIN + 20 });
  const root = sv("g", { transform: `translate(${MARGIN},${MARGIN + 20})` });
  svg.append(root);
  let drawn = 0;
  for (const g of d.graphs) {
    const label = sv("text", { x: g.left, y: -8, class: "graph-label" });
    label.textContent = `graph ${g.name}`;
    root.append(label);
    const at = (i) => g.nodes[i];
    for (const n of g.nodes) {            // edges: producer's bottom to consumer's top
      for (const j of n.inputs) {
        const p = at(j);
        const x1 = p.x + NODE_W / 2, y1 = p.y + NODE_H, x2 = n.x + NODE_W / 2, y2 = n.y;
        const mid = (y1 + y2) / 2;
        root.append(sv("path", { class: "edge", d: `M${x1},${y1} C${x1},${mid} ${x2},${mid} ${x2},${y2}` }));
      }
    }
    const members = {};                   // the kernel groups: a dashed box around each
    for (const n of g.nodes) if (n.group !== null) (members[n.group] = members[n.group] || []).push(n);
    for (const [head, ns] of Object.entries(members)) {
      const lead = at(Number(head));
      if (ns.length < 2 && !lead.passes.length) continue;
      const x0 = Math.min(...ns.map((n) => n.x)) - 5, y0 = Math.min(...ns.map((n) => n.y)) - 5;
      const x1 = Math.max(...ns.map((n) => n.x)) + NODE_W + 5;
      const y1 = Math.max(...ns.map((n) => n.y)) + NODE_H + 5;
      root.append(sv("rect", { class: "group", x: x0, y: y0, width: x1 - x0, height: y1 - y0 }));
      const t = sv("text", { class: "group-label", x: x0 + 2, y: y1 + 10 });
      t.textContent = lead.kernel || (lead.passes.length ? `by ${lead.passes[lead.passes.length - 1]}` : "");
      root.append(t);
    }
    for (const n of g.nodes) {
      const node = sv("g", { class: "node" + (n.passes.length ? " rewritten" : "") +
                                    (state.lit && n.kernel === state.lit ? " lit" : ""),
                             "data-graph": g.name, "data-id": n.id,
                             "data-kernel": n.kernel || "" });
      node.append(sv("rect", { x: n.x, y: n.y, width: NODE_W, height: NODE_H,
                               fill: `var(--${n.family})` }));
      const t1 = sv("text", { x: n.x + 5, y: n.y + 12 });
      t1.textContent = `%${n.id} ${n.op}`;
      const t2 = sv("text", { x: n.x + 5, y: n.y + 25 });
      t2.textContent = (n.name || n.shape).slice(0, 22);
      const title = sv("title", {});
      title.textContent = n.text;
      node.append(t1, t2, title);
      node.addEventListener("click", () => chooseNode(g, n, node));
      root.append(node);
      drawn += 1;
    }
  }
  box.append(svg);
  document.getElementById("drawn-count").textContent = drawn;
}

/** Provenance of a node: the spec field that made it and the pass that last changed it. */
function chooseNode(g, n, node) {
  document.querySelectorAll("svg.graph .node.chosen").forEach((x) => x.classList.remove("chosen"));
  node.classList.add("chosen");
  state.chosen = n;
  const p = document.getElementById("provenance");
  p.textContent = "";
  const last = n.passes.length ? n.passes[n.passes.length - 1] : null;
  p.append(el("pre", {}, n.text),
    table([["", false], ["", false]], [
      ["graph", g.name],
      ["spec field", n.origin || "—"],
      ["last changed by", last || "no pass: as lowered"],
      ["passes, in order", n.passes.join(" → ") || "—"],
      ["op family", n.family],
      ["kernel", n.kernel ? el("a", { href: "#kernels", onclick: () => openKernel(n.kernel) },
                                n.kernel) : "—"]]));
}

function drawExplain(row) {
  const e = document.getElementById("explain");
  e.textContent = "";
  e.append(el("div", {}, row.changed));
  const made = row.explain.made, refused = row.explain.refused;
  if (made.length) {
    e.append(el("h3", {}, "made"), table([["rule", false], ["count", true], ["note", false]],
      made.map((m) => [m.rule, m.count, m.note || ""])));
  }
  if (refused.length) {
    e.append(el("h3", {}, "refused"), table(
      [["rule", false], ["", false], ["count", true], ["why", false], ["at", false]],
      refused.map((r) => [r.rule, r.verdict === "legality" ? "not legal" : "not profitable",
                          r.count, r.reason, el("code", {}, r.node)])));
  }
  if (!made.length && !refused.length && row.index) {
    e.append(el("div", { class: "muted" }, "no candidates in this model"));
  }
}

function drawDiff(text, row) {
  const pre = document.getElementById("diff");
  pre.textContent = "";
  if (!text) {
    pre.textContent = row.index ? "the drawn blocks are unchanged by this pass" : "as lowered";
    return;
  }
  for (const line of text.split("\n")) {
    const cls = line.startsWith("@@") ? "hunk" : line.startsWith("+") ? "add" :
      line.startsWith("-") ? "del" : null;
    pre.append(cls ? el("span", { class: cls }, line) : line + "\n");
  }
}

// ---- kernels ------------------------------------------------------------------------------------

/** The ahead-of-time results of a unit's kernels (a unit may define several @triton.jit). */
function aotOf(name) {
  return DATA.aot ? DATA.aot.results.filter((r) => r.unit === name) : [];
}

/** One AOT column over a unit's kernels: "128" or "128 / 96" for two. */
function aotColumn(results, f) {
  return results.map((r) => (r.ok ? f(r) : "failed")).join(" / ");
}

/** The largest relative error of a unit's outputs against eager, or null. */
function errorOf(name) {
  if (!DATA.validation) return null;
  const errs = DATA.validation.kernels.filter((k) => k.kernel === name).map((k) => Number(k.relative));
  return errs.length ? Math.max(...errs) : null;
}

function drawKernels() {
  const s = document.getElementById("kernels");
  s.append(el("h2", {}, "Kernels"));
  s.append(el("p", { class: "muted" },
    `${DATA.kernels.length} unique kernels, ${DATA.launches} launches per forward pass` +
    (DATA.aot ? `; compiled ahead of time for ${DATA.aot.target}` : "") +
    ". Click a kernel for its source and the nodes it implements (lit in the graph)."));
  const cols = [["kernel", false], ["family", false], ["launches", true]];
  if (DATA.aot) cols.push(["registers", true], ["spill bytes", true], ["shared mem", true],
                          ["tensor-core ops", true]);
  if (DATA.validation) cols.push(["max relative error", true]);
  const rows = DATA.kernels.map((k) => {
    const row = [k.name, k.family, k.launches];
    const a = aotOf(k.name);
    if (DATA.aot) {
      row.push(aotColumn(a, (r) => r.registers), aotColumn(a, (r) => r.spill_bytes),
               aotColumn(a, (r) => nbytes(r.shared_bytes)), aotColumn(a, (r) => r.tensor_core_ops));
    }
    if (DATA.validation) {
      const e = errorOf(k.name);
      row.push(e === null ? "—" : el("span", { class: e > DATA.validation.tolerance ? "bad" : "good" },
                                    e.toExponential(2)));
    }
    return row;
  });
  s.append(el("div", { class: "kernel-view" },
    table(cols, rows, (r) => ({ class: "clickable", id: `kernel-row-${DATA.kernels[r].name}`,
                                 "data-kernel": DATA.kernels[r].name,
                                 onclick: () => openKernel(DATA.kernels[r].name) })),
    el("div", { id: "kernel-source" }, el("span", { class: "muted" }, "no kernel chosen"))));
  if (!DATA.attention.length) return;
  const a0 = DATA.attention[0];
  s.append(el("h3", {}, `Attention: modifiers and tiles at ${a0.length} tokens`));
  s.append(table([["nodes", false], ["score", false], ["mask", false], ["normalizer", false],
                  ["tile", false], ["full", true], ["partial", true], ["empty", true],
                  ["visited", true]],
    DATA.attention.map((a) => [`${a.graph} ${a.nodes.map((i) => "%" + i).join(", ")}`, a.score,
                               a.mask, a.normalizer, `${a.block_m} × ${a.block_n}`, a.full,
                               a.partial, a.empty, Number(a.visited).toFixed(4)])));
}

/** Open a kernel's source panel and light the drawn nodes it implements after the pipeline. */
function openKernel(name) {
  const k = DATA.kernels.find((x) => x.name === name);
  document.querySelectorAll("tr[data-kernel]").forEach(
    (tr) => tr.classList.toggle("selected", tr.dataset.kernel === name));
  const panel = document.getElementById("kernel-source");
  panel.textContent = "";
  panel.setAttribute("data-open", name);
  const a = aotOf(name);
  panel.append(el("h3", {}, `${k.name} (${k.family}): ${k.launches} launch${k.launches === 1 ? "" : "es"}`));
  for (const r of a) {
    panel.append(el("div", { class: r.ok ? "" : "bad" }, r.ok ?
      `${r.kernel} on ${DATA.aot.target}: ${r.registers} registers, ${r.spill_bytes} spill bytes, ` +
      `${nbytes(r.shared_bytes)} shared memory, ${r.tensor_core_ops} tensor-core ops` +
      `${r.mma.length ? " (" + r.mma.join(", ") + ")" : ""}, ${r.warps} warps; config ${r.config}` :
      `${r.kernel} does not compile for ${DATA.aot.target}: ${r.error}`));
  }
  panel.append(el("h3", {}, "implements"), table([["graph", false], ["node", false]],
    k.uses.map((u) => [u.graph, el("code", {}, u.text)])));
  const pre = el("pre", { class: "hl", id: "kernel-code" });
  pre.innerHTML = HIGHLIGHTED[name];       // Pygments' output, escaped by it at report time
  panel.append(el("h3", {}, "source"), pre);
  state.lit = name;
  selectStep(DATA.drawn.steps.length - 1);   // its nodes are drawn after the pipeline
}

// ---- roofline -----------------------------------------------------------------------------------

/** A log-log roofline plot of one phase's kernels: attainable FLOP/s against FLOP per byte. */
function rooflinePlot(phase, title) {
  const gpu = DATA.roofline.gpu, W = 520, H = 340, L = 60, B = 40, T = 20, R = 20;
  const pts = phase.rows.filter((r) => r.intensity !== null && r.flops > 0 && r.bound !== "link");
  const xs = pts.map((r) => r.intensity).concat([gpu.ridge]);
  const x0 = Math.pow(10, Math.floor(Math.log10(Math.min(...xs) / 2)));
  const x1 = Math.pow(10, Math.ceil(Math.log10(Math.max(...xs) * 2)));
  const perf = (i) => Math.min(gpu.peak_flops, i * gpu.bandwidth);
  const y1 = Math.pow(10, Math.ceil(Math.log10(gpu.peak_flops * 1.5)));
  const y0 = Math.pow(10, Math.floor(Math.log10(perf(x0))));
  const X = (v) => L + (Math.log10(v) - Math.log10(x0)) / (Math.log10(x1) - Math.log10(x0)) * (W - L - R);
  const Y = (v) => H - B - (Math.log10(v) - Math.log10(y0)) / (Math.log10(y1) - Math.log10(y0)) * (H - B - T);
  const svg = sv("svg", { class: "roof", width: W, height: H });
  for (let e = Math.log10(x0); e <= Math.log10(x1) + 1e-9; e++) {
    svg.append(sv("line", { class: "grid", x1: X(10 ** e), x2: X(10 ** e), y1: T, y2: H - B }));
    const t = sv("text", { x: X(10 ** e), y: H - B + 14, "text-anchor": "middle" });
    t.textContent = si(10 ** e);
    svg.append(t);
  }
  for (let e = Math.log10(y0); e <= Math.log10(y1) + 1e-9; e++) {
    svg.append(sv("line", { class: "grid", x1: L, x2: W - R, y1: Y(10 ** e), y2: Y(10 ** e) }));
    const t = sv("text", { x: L - 4, y: Y(10 ** e) + 4, "text-anchor": "end" });
    t.textContent = si(10 ** e);
    svg.append(t);
  }
  svg.append(sv("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
             sv("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  const roof = [x0, gpu.ridge, x1].map((v) => `${X(v)},${Y(perf(v))}`).join(" ");
  svg.append(sv("polyline", { class: "roof-line", points: roof }));
  const total = phase.rows.reduce((a, r) => a + r.time, 0) || 1;   // no kernel: no share
  for (const r of pts) {      // a kernel sits on the roof; its area is its share of the time
    const c = sv("circle", { class: `point ${r.bound}`, cx: X(r.intensity), cy: Y(perf(r.intensity)),
                             r: 3 + 12 * Math.sqrt(r.time / total) });
    const tip = sv("title", {});
    tip.textContent = `${r.op} ${r.label} (${r.kernels.join(", ")}): ${r.intensity.toFixed(1)} FLOP/B, ` +
      `${r.bound}-bound, ${seconds(r.time)} over ${r.launches} launches`;
    c.append(tip);
    svg.append(c);
  }
  const lx = sv("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle" });
  lx.textContent = "FLOP per byte";
  const ly = sv("text", { x: 12, y: T + (H - B - T) / 2, transform: `rotate(-90 12 ${T + (H - B - T) / 2})`,
                          "text-anchor": "middle" });
  ly.textContent = "FLOP/s";
  svg.append(lx, ly);
  return el("div", {}, el("h3", {}, title), svg);
}

function rooflineTable(phase) {
  const total = phase.rows.reduce((a, r) => a + r.time, 0) || 1;   // no kernel: no share
  return table([["kernel", false], ["reads", false], ["units", false], ["launches", true],
                ["FLOPs", true], ["bytes", true], ["FLOP/B", true], ["bound", false],
                ["time", true], ["share", true]],
    phase.rows.map((r) => [r.op, r.label, r.kernels.join(", "), r.launches, si(r.flops),
                           nbytes(r.bytes), r.intensity === null ? "—" : r.intensity.toFixed(1),
                           r.bound, seconds(r.time), `${(100 * r.time / total).toFixed(1)}%`]));
}

function drawRoofline() {
  const s = document.getElementById("roofline");
  if (!DATA.roofline) { s.remove(); return; }
  const r = DATA.roofline, g = r.gpu;
  s.append(el("h2", {}, `Roofline on ${g.name}`),
    el("p", { class: "muted" }, `${si(g.peak_flops, "FLOP/s")}, ${si(g.bandwidth, "B/s")}; ` +
       `ridge ${g.ridge.toFixed(0)} FLOP/B. Each kernel's time is max(FLOPs / peak, bytes / ` +
       "bandwidth) from its IR cost; hover a point for its kernel."));
  const pre = r.prefill.dims, plots = el("div", { class: "plots" });
  plots.append(rooflinePlot(r.prefill, `prefill: ${pre.T} tokens, batch ${pre.B}`));
  if (r.decode) plots.append(rooflinePlot(r.decode, `one decode step at context ${r.decode.dims.P + 1}`));
  s.append(plots);
  s.append(el("h3", {}, "prefill"), rooflineTable(r.prefill));
  if (r.decode) {
    const f = r.floor;
    s.append(el("h3", {}, "decode step"), rooflineTable(r.decode),
      el("p", {}, `decode floor ${seconds(f.seconds)}: weights ${nbytes(f.weight_bytes)} + KV cache ` +
         `${nbytes(f.kv_bytes)}` + (f.state_bytes ? ` + recurrent state ${nbytes(f.state_bytes)}` : "") +
         ` at ${si(g.bandwidth, "B/s")} → ${f.tokens_per_second.toFixed(0)} tokens/s`));
  }
}

// ---- validation ---------------------------------------------------------------------------------

function drawValidation() {
  const s = document.getElementById("validation");
  const v = DATA.validation;
  if (!v) { s.remove(); return; }
  s.append(el("h2", {}, "Validation against eager"),
    el("p", {}, `${v.model} (${v.dtype}): each kernel's output against eager on the fused graph, ` +
       `tolerance ${v.tolerance} of each output's scale: `,
       el("span", { class: v.ok ? "good" : "bad" }, v.ok ? "all agree" : "divergence")));
  s.append(table([["phase", false], ["output", false], ["max error", true], ["relative", true]],
    v.phases.map((p) => [p.phase, p.output, Number(p.max_error).toExponential(3),
                         Number(p.relative).toExponential(2)])));
  s.append(el("h3", {}, "per kernel"), table(
    [["phase", false], ["node", false], ["kernel", false], ["checks", false], ["max error", true],
     ["relative", true], ["", false]],
    v.kernels.map((k) => [k.phase, `${k.graph} %${k.node}`, k.kernel, k.what,
                          Number(k.max_error).toExponential(3), Number(k.relative).toExponential(2),
                          el("span", { class: Number(k.relative) > v.tolerance ? "bad" : "good" },
                             Number(k.relative) > v.tolerance ? "diverges" : "ok")])));
}

// ---- start --------------------------------------------------------------------------------------

drawHeader();
drawSpec();
drawPipeline();
drawKernels();
drawRoofline();
drawValidation();
selectStep(0);
// drawn: when, in ms since navigation started (what a test of the page's load time reads)
document.body.dataset.drawnAt = performance.now().toFixed(1);
