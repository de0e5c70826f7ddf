// reasonkv inspect: colour each token by how many (layer, head) slots hold it after the chosen eviction,
// mark where each run departs from full, and show a clicked token's layer x head grid over the evictions.
// A policy's per-token signals at the chosen eviction: values as lines under the text (EPIKV's two bands, VASE's
// value range), a set of positions as outlined tokens (VASE's value-range reserve).
// Under an allocation (heads keep different numbers of tokens) a table of each (layer, kv-head)'s budget, and
// under adaptive what each head kept at the chosen eviction; a head's values (scores, ranks) are its own first,
// NaN / 0 after them, in rows as wide as the widest head.
"use strict";

const DATA = JSON.parse(document.getElementById("data").textContent);
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
const STATES = {
  kept: "kept at full precision",
  quantized: "kept quantized",
  protected: "protected (sink, window or prompt)",
  evicted: "evicted at this eviction",
  gone: "evicted earlier",
  window: "in a sliding layer's window",
  read: "read at this step (selection: every token is held)",
  current: "in the current block (selection: always read)",
  unread: "held, not read at this step (selection)",
};
const SELECTED = { kept: "read", protected: "current", evicted: "unread" };  // a selection policy's words
// Signals drawn as lines: their words and Okabe-Ito colour and dash (colour-blind safe); others get the rest.
const LINES = {
  band_a: ["band A (important layers)", "#0072B2", []],
  band_b: ["band B (filler layers)", "#E69F00", [5, 3]],
  value_range: ["value range max(v) - min(v)", "#009E73", []],
};
const SPARE = [["#CC79A7", [2, 2]], ["#56B4E9", [8, 3]], ["#000000", []]];
const RESERVE = "reserve";  // the set of positions outlined

function bytes(b64) {
  if (b64 === null) return null;
  const text = atob(b64);
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
  return out;
}

function halfs(b64) {
  // float16, little-endian, to numbers
  const raw = bytes(b64);
  if (raw === null) return null;
  const out = new Float32Array(raw.length / 2);
  for (let i = 0; i < out.length; i++) {
    const h = raw[2 * i] | (raw[2 * i + 1] << 8);
    const sign = h & 0x8000 ? -1 : 1, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
    if (exp === 0) out[i] = sign * Math.pow(2, -14) * (frac / 1024);
    else if (exp === 31) out[i] = frac ? NaN : sign * Infinity;
    else out[i] = sign * Math.pow(2, exp - 15) * (1 + frac / 1024);
  }
  return out;
}

// One eviction: masks [layers, heads, seen] packed eight positions to a byte, big-endian bits.
class Eviction {
  constructor(raw, run) {
    this.seen = raw.seen;
    this.run = run;
    this.stride = Math.ceil(raw.seen / 8);
    this.kept = bytes(raw.kept);
    this.before = bytes(raw.before);
    this.protected = bytes(raw.protected);
    this.quantized = bytes(raw.quantized);
    this.scores = halfs(raw.scores);
    const ranks = bytes(raw.ranks);
    this.ranks = ranks === null ? null : raw.rankBytes === 4 ? new Int32Array(ranks.buffer) : new Int16Array(ranks.buffer);
    // Values per (evicting layer, head) row: as many as the widest head held (every head, without an allocation).
    const rows = run.evicting.length * run.heads, values = this.scores || this.ranks;
    this.width = values === null || !rows ? 0 : values.length / rows;
    this.counts = raw.counts || null;  // under an allocation: [evicting layer][head] tokens kept
    this.signals = {};
    for (const [name, s] of Object.entries(raw.signals || {})) {
      this.signals[name] = { kind: s.kind, data: s.kind === "set" ? bytes(s.data) : halfs(s.data) };
    }
    this.held = null;
    this.sets = {};
  }
  // How many (layer, head) rows of a set signal hold each position (a token-granularity policy has one row).
  setCounts(name) {
    const signal = this.signals[name];
    if (!signal || signal.kind !== "set") return null;
    if (!(name in this.sets)) {
      const counts = new Uint16Array(this.seen), rows = signal.data.length / this.stride;
      for (let r = 0; r < rows; r++) for (let p = 0; p < this.seen; p++) counts[p] += this.bit(signal.data, r, p);
      this.sets[name] = counts;
    }
    return this.sets[name];
  }
  bit(mask, row, p) {
    return (mask[row * this.stride + (p >> 3)] >> (7 - (p & 7))) & 1;
  }
  // Slots of the evicting layers that hold each position afterwards.
  heldCounts() {
    if (this.held === null) {
      const run = this.run, held = new Uint16Array(this.seen);
      for (const t of run.evicting) {
        for (let h = 0; h < run.heads; h++) {
          for (let p = 0; p < this.seen; p++) held[p] += this.bit(this.kept, t * run.heads + h, p);
        }
      }
      this.held = held;
    }
    return this.held;
  }
  // State, score and rank of position p in traced layer t, head h.
  cell(t, h, p) {
    const run = this.run, row = t * run.heads + h;
    const kept = this.bit(this.kept, row, p);
    if (run.kinds[t] !== "full") return { state: kept ? "window" : "gone" };
    const e = run.evicting.indexOf(t), erow = e * run.heads + h;
    if (!this.bit(this.before, erow, p)) return { state: "gone" };
    let state = "evicted";
    if (kept) {
      if (this.quantized && this.bit(this.quantized, erow, p)) state = "quantized";
      else state = this.bit(this.protected, erow, p) ? "protected" : "kept";
    }
    if (run.settings.selects) state = SELECTED[state] || state;  // its records are decode steps' reads
    const out = { state };
    if (this.scores !== null || this.ranks !== null) {
      // scores and ranks hold the positions of the head's `before` in increasing order, then padding
      let j = 0, n = 0;
      for (let q = 0; q < this.seen; q++) {
        if (this.bit(this.before, erow, q)) {
          if (q < p) j++;
          n++;
        }
      }
      if (this.scores !== null) out.score = this.scores[erow * this.width + j];
      if (this.ranks !== null) Object.assign(out, { rank: this.ranks[erow * this.width + j], of: n });
    }
    out.budget = run.headBudget(this, e, h);
    return out;
  }
}

class Run {
  constructor(raw, index) {
    Object.assign(this, raw);
    this.index = index;
    this.evicting = this.kinds.map((k, i) => (k === "full" ? i : -1)).filter((i) => i >= 0);
    this.evictions = raw.evictions.map((e) => new Eviction(e, this));
    this.slots = this.evicting.length * this.heads;
    this.spans = [];
    this.budgets = this.settings.budgets || null;  // [evicting layer][head] under an allocation
    this.adaptive = this.settings.allocation === "adaptive";
  }
  // The budget of head h of the e-th evicting layer at eviction ev: adaptive, what the layer-wide selection
  // gave it there; another allocation, its table's; uniform, K.
  headBudget(ev, e, h) {
    if (this.adaptive && ev !== null && ev.counts) return ev.counts[e][h];
    return this.budgets ? this.budgets[e][h] : this.settings.budget;
  }
  // The last eviction at or before moment t (tokens seen), or null.
  at(t) {
    let found = null;
    for (const e of this.evictions) if (e.seen <= t) found = e;
    return found;
  }
}

const runs = DATA.runs.map((r, i) => new Run(r, i));
const moments = [...new Set(runs.flatMap((r) => r.evictions.map((e) => e.seen)))].sort((a, b) => a - b);
const slider = document.getElementById("moment");
let selected = null;

function viridis(f) {
  const x = Math.min(Math.max(f, 0), 1) * (VIRIDIS.length - 1), i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const a = VIRIDIS[i], b = VIRIDIS[i + 1], w = x - i;
  return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * w)).join(",")})`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

function options(settings) {
  const skip = new Set(["policy", "granularity", "budget", "buffer", "quantized", "bits", "seed", "budgets"]);
  return Object.entries(settings).filter(([k]) => !skip.has(k)).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ");
}

function renderSettings() {
  const head = el("tr", {}, ...["run", "K", "B", "Q", "bits", "seed", "evictions", "options"].map((t) => el("th", { text: t })));
  const rows = runs.map((r) => {
    const s = r.settings;
    const evicts = s.budget !== null && s.budget !== undefined && !s.selects;  // full, selection: no B or tier
    const cells = [r.name, s.budget, evicts ? s.buffer : "", evicts ? s.quantized : "", s.quantized ? s.bits : "",
      JSON.stringify(s.seed),
      r.evictions.length, options(s)];
    return el("tr", {}, ...cells.map((c) => el("td", { text: c === null || c === undefined ? "" : String(c) })));
  });
  const layers = runs[0].kinds.filter((k) => k === "full").length;
  const note = el("p", { text: `model ${DATA.model}: ${runs[0].layers.length} layers with tokens (${layers} evicting), ` +
    `${runs[0].heads} kv-heads each; prompt ${runs[0].prompt} tokens` });
  document.getElementById("settings").append(note, el("table", {}, head, ...rows));
}

function renderLegend() {
  const legend = document.getElementById("legend");
  legend.append(el("span", { text: "evicted from every head " }), el("span", { class: "ramp" }),
    el("span", { text: " held by every head of the evicting layers" }));
  const depart = el("span", { class: "tok depart", text: "token" });
  legend.append(el("span", {}, depart, " first departure from full"));
  legend.append(el("span", { text: "faded: not generated yet" }));
  for (const [state, words] of Object.entries(STATES)) {
    legend.append(el("span", {}, el("span", { class: `swatch s-${state}` }), words));
  }
  if (runs.some((r) => r.evictions.some((e) => e.signals[RESERVE]))) {
    legend.append(el("span", {}, el("span", { class: "tok reserve", text: "token" }),
      " in VASE's value-range reserve at this eviction (kept for its value range; the stronger, the more heads)"));
  }
}

// The value signals a run recorded, each with its words, colour and dash.
function lineStyles(run) {
  const names = [...new Set(run.evictions.flatMap((e) => Object.keys(e.signals).filter((n) => e.signals[n].kind === "values")))];
  let spare = 0;
  return names.map((name) => {
    const [words, colour, dash] = LINES[name] || [name, ...SPARE[spare++ % SPARE.length]];
    return { name, words, colour, dash };
  });
}

function continuation(run, from) {
  return run.pieces.slice(from, from + 24).join("");
}

function renderRuns() {
  const main = document.getElementById("runs"), full = runs.find((r) => r.name === "full");
  for (const run of runs) {
    const text = el("div", { class: "text" });
    run.pieces.forEach((piece, p) => {
      const span = el("span", { class: "tok" + (p < run.prompt ? " prompt" : ""), "data-run": run.index, "data-pos": p,
        text: piece });
      if (p === run.depart) span.classList.add("depart");
      span.addEventListener("click", () => showGrid(run, p));
      run.spans.push(span);
      text.append(span);
    });
    const box = el("section", { class: "run", id: `run-${run.name}` }, el("h2", { text: run.name }),
      el("div", { class: "options", text: options(run.settings) || "default options" }));
    if (run.depart !== null && run.depart !== undefined) {
      box.append(el("div", { class: "departure" }, `departs from full at position ${run.depart} ` +
        `(output token ${run.depart - run.prompt}). full: `, el("code", { text: continuation(full, run.depart) }),
      ` | ${run.name}: `, el("code", { text: continuation(run, run.depart) })));
    } else if (full && run !== full) {
      box.append(el("div", { class: "departure", text: "same output as full" }));
    }
    box.append(text);
    if (run.budgets) renderBudgets(run, box);
    if (run.evictions.some((e) => e.scores !== null)) {
      const lag = run.settings.variant === "lag";
      const what = !run.name.startsWith("epikv") ? "the policy's score" : lag ?
        "EPIKV's order (tokens not yet scored first, then band A minus band B)" : "EPIKV's score (band A minus band B)";
      const where = run.settings.granularity === "token" ? "" : ", first evicting layer, head 0";
      run.canvas = el("canvas", { class: "signal", width: "800", height: "40" });
      box.append(el("div", { class: "options", text: `${what} of each held token at the chosen eviction${where}; ` +
        "blue: kept, vermillion: evicted" }), run.canvas);
    }
    run.lines = lineStyles(run);
    if (run.lines.length) {
      const where = run.settings.granularity === "token" ? "" : " (first evicting layer, head 0)";
      const epikv = run.lines.some((l) => l.name === "band_a") ? ", each band's residual-stream change" +
        (run.settings.variant === "raw" ? "" : " as a z-score") : "";
      const key = el("div", { class: "options" },
        `the policy's signals of each held token at the chosen eviction${where}${epikv}: `);
      for (const line of run.lines) {
        const swatch = el("span", { class: "line-key" });
        swatch.style.borderTop = `2px ${line.dash.length ? "dashed" : "solid"} ${line.colour}`;
        key.append(el("span", { class: "line-name", "data-signal": line.name }, swatch, ` ${line.words} `));
      }
      run.lineCanvas = el("canvas", { class: "signal lines", width: "800", height: "60", "data-run": run.name });
      box.append(key, run.lineCanvas);
    }
    main.append(box);
  }
}

// Each (layer, kv-head)'s budget as a small table beside the text: rows the evicting layers, columns the kv-heads,
// then the layer's sum; adaptive: what each head kept at the chosen eviction (update fills it in).
function renderBudgets(run, box) {
  const s = run.settings, total = run.budgets.flat().reduce((a, b) => a + b, 0);
  // The colour scale: the most any head was given or kept (a loop: a long run has too many for Math.max(...)).
  run.budgetTop = 1;
  for (const table of [run.budgets, ...run.evictions.map((e) => e.counts || [])]) {
    for (const row of table) for (const v of row) run.budgetTop = Math.max(run.budgetTop, v);
  }
  const words = run.adaptive ?
    `allocation adaptive: what each head kept at the chosen eviction (one selection over the layer's heads, ` +
    `each at least ${s.adaptive_floor}, each layer ${s.budget} x ${run.heads}); before any eviction the uniform split` :
    `allocation ${s.allocation}: each head's budget, the tokens it keeps at an eviction (hover: what it kept ` +
    `at the chosen one)`;
  const table = el("table", { class: "budgets", "data-run": run.name, "data-allocation": s.allocation });
  table.append(el("tr", {}, el("th", { text: "layer" }),
    ...Array.from({ length: run.heads }, (_, h) => el("th", { text: `kv-head ${h}` })), el("th", { text: "sum" })));
  run.budgetCells = run.evicting.map((t, e) => {
    const cells = Array.from({ length: run.heads }, (_, h) => el("td", { class: "budget", "data-layer": run.layers[t],
      "data-head": h, "data-budget": run.budgets[e][h] }));
    const sum = el("td", { class: "sum" });
    table.append(el("tr", {}, el("th", { text: String(run.layers[t]) }), ...cells, sum));
    return { cells, sum };
  });
  box.append(el("div", { class: "options", text: `${words}; ${total} tokens in all ` +
    `(K x layers x kv-heads = ${s.budget} x ${run.evicting.length} x ${run.heads})` }),
  el("div", { class: "budget-box" }, table));
}

function drawBudgets(run, ev) {
  if (!run.budgetCells) return;
  run.budgetCells.forEach(({ cells, sum }, e) => {
    let layer = 0;
    cells.forEach((td, h) => {
      const budget = run.budgets[e][h], kept = ev !== null && ev.counts ? ev.counts[e][h] : null;
      const shown = run.adaptive && kept !== null ? kept : budget;
      layer += shown;
      td.textContent = String(shown);
      td.dataset.kept = kept === null ? "" : String(kept);
      const f = shown / run.budgetTop;
      td.style.background = viridis(f);
      td.style.color = f < 0.55 ? "#fff" : "#111";
      td.title = `layer ${run.layers[run.evicting[e]]} kv-head ${h}: ` + (run.adaptive ?
        `uniform split ${budget}` : `budget ${budget}`) +
        (kept === null ? ", no eviction yet" : `; kept ${kept} at the eviction at ${ev.seen} tokens seen`);
    });
    sum.textContent = String(layer);
  });
}

function update() {
  const i = Number(slider.value), t = i === 0 ? Infinity : moments[i - 1];
  const label = i === 0 ? "no eviction yet: the whole output" :
    `after the evictions at ${t} tokens seen (${i} of ${moments.length})`;
  document.getElementById("moment-label").textContent = label;
  for (const run of runs) {
    const e = i === 0 ? null : run.at(t), held = e === null ? null : e.heldCounts();
    const reserve = e === null ? null : e.setCounts(RESERVE);
    const most = reserve === null ? 0 : reserve.reduce((a, b) => Math.max(a, b), 0);
    drawSignal(run, e);
    drawLines(run, e);
    drawBudgets(run, e);
    run.spans.forEach((span, p) => {
      const future = p >= t;
      const reserved = reserve !== null && p < e.seen ? reserve[p] : 0;
      // The outline is as strong as the share of reserving (layer, head) slots, against the most any token has.
      span.classList.toggle("reserve", reserved > 0);
      span.dataset.reserve = String(reserved);
      span.style.boxShadow = reserved > 0 ? `inset 0 0 0 2px rgba(204, 121, 167, ${(reserved / most).toFixed(3)})` : "";
      span.title = reserved > 0 ? `in the value-range reserve of ${reserved} of ${run.slots} (layer, head) slots` : "";
      const count = future ? 0 : held === null || p >= e.seen ? run.slots : held[p];
      span.classList.toggle("future", future);
      span.dataset.held = String(count);
      const f = run.slots ? count / run.slots : 1;
      span.style.background = viridis(f);
      span.style.color = f < 0.55 ? "#fff" : "#111";
    });
  }
}

function drawSignal(run, e) {
  const canvas = run.canvas;
  if (!canvas) return;
  const ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  if (e === null || e.scores === null) return;
  const t = run.evicting[0], row = run.evicting.indexOf(t) * run.heads, held = [];
  for (let p = 0; p < e.seen; p++) if (e.bit(e.before, row, p)) held.push(p);
  const values = held.map((p, j) => e.scores[row * held.length + j]).filter(Number.isFinite);
  const top = Math.max(1e-9, ...values.map(Math.abs)), x = w / run.pieces.length;
  held.forEach((p, j) => {
    const v = e.scores[row * held.length + j];
    if (!Number.isFinite(v)) return;
    ctx.fillStyle = e.bit(e.kept, t * run.heads, p) ? "#0072B2" : "#D55E00";
    const y = (v / top) * (h / 2 - 1);
    ctx.fillRect(p * x, y > 0 ? h / 2 - y : h / 2, Math.max(1, x - 0.5), Math.abs(y));
  });
}

// The run's value signals at eviction e as lines over the positions (x: a position's share of the output),
// one scale for all so that the bands compare; a gap where a value is missing. Records what it drew.
function drawLines(run, e) {
  const canvas = run.lineCanvas;
  if (!canvas) return;
  const ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height, drawn = {};
  ctx.clearRect(0, 0, w, h);
  canvas.dataset.drawn = "{}";
  if (e === null) return;
  const row = 0, held = [];  // the first evicting layer's head 0 (a token-granularity signal has that row only)
  for (let p = 0; p < e.seen; p++) if (e.bit(e.before, row, p)) held.push(p);
  const series = run.lines.filter((l) => e.signals[l.name]).map((l) =>
    ({ ...l, values: held.map((p, j) => e.signals[l.name].data[row * held.length + j]) }));
  const finite = series.flatMap((s) => s.values.filter(Number.isFinite));
  if (!finite.length) return;
  const low = finite.reduce((a, b) => Math.min(a, b), 0), high = finite.reduce((a, b) => Math.max(a, b), 0);
  const span = Math.max(high - low, 1e-9);
  const y = (v) => h - 2 - ((v - low) / span) * (h - 4), x = w / run.pieces.length;
  ctx.strokeStyle = "#bbb";
  ctx.setLineDash([]);
  ctx.beginPath();
  ctx.moveTo(0, y(0));
  ctx.lineTo(w, y(0));
  ctx.stroke();
  for (const s of series) {
    ctx.strokeStyle = s.colour;
    ctx.lineWidth = 1.5;
    ctx.setLineDash(s.dash);
    ctx.beginPath();
    let open = false, count = 0;
    held.forEach((p, j) => {
      const v = s.values[j];
      if (!Number.isFinite(v)) { open = false; return; }
      if (open) ctx.lineTo((p + 0.5) * x, y(v)); else ctx.moveTo((p + 0.5) * x, y(v));
      open = true;
      count++;
    });
    ctx.stroke();
    drawn[s.name] = count;
  }
  canvas.dataset.drawn = JSON.stringify(drawn);
}

function showGrid(run, p) {
  if (selected) selected.classList.remove("selected");
  selected = run.spans[p];
  selected.classList.add("selected");
  const panel = document.getElementById("grid-panel");
  panel.replaceChildren();
  const close = el("button", { text: "close" });
  close.addEventListener("click", () => { panel.hidden = true; });
  const shown = run.evictions.filter((e) => e.seen > p);
  panel.append(close, el("h3", { text: `${run.name}: position ${p} ${JSON.stringify(run.pieces[p])}` +
    (p < run.prompt ? " (prompt)" : ` (output token ${p - run.prompt})`) }));
  if (!shown.length) {
    panel.append(el("p", { text: "no eviction after this token: every slot holds it" }));
    panel.hidden = false;
    return;
  }
  const grid = el("table", { class: "grid", "data-run": run.index, "data-pos": p });
  grid.append(el("tr", {}, el("th", { text: "layer" }), ...shown.map((e) =>
    el("th", { text: `#${run.evictions.indexOf(e) + 1} @${e.seen}` }))));
  const ranks = shown.map(() => []);
  run.layers.forEach((layer, t) => {
    const row = el("tr", {}, el("th", { text: `${layer} ${run.kinds[t]}` }));
    shown.forEach((e, c) => {
      const td = el("td");
      for (let h = 0; h < run.heads; h++) {
        const cell = e.cell(t, h, p);
        let title = `layer ${layer} head ${h}, eviction at ${e.seen}: ${STATES[cell.state]}`;
        if (cell.score !== undefined) title += `; score ${cell.score.toPrecision(4)}`;
        if (cell.rank !== undefined) {
          title += `; rank ${cell.rank} of ${cell.of} (budget ${cell.budget})`;
          ranks[c].push([cell.rank, cell.budget]);
        }
        td.append(el("span", { class: `cell s-${cell.state}`, title, "data-state": cell.state }));
      }
      row.append(td);
    });
    grid.append(row);
  });
  const median = (xs) => xs.length ? xs.map(([r]) => r).sort((a, b) => a - b)[Math.floor(xs.length / 2)] : "";
  grid.append(el("tr", { class: "ranks" }, el("th", { text: "median rank" }),
    ...ranks.map((xs) => el("td", { text: String(median(xs)) }))));
  const within = run.budgets ? "within each head's budget" : `within budget ${run.settings.budget}`;
  grid.append(el("tr", { class: "ranks" }, el("th", { text: within }),
    ...ranks.map((xs) => el("td", { text: xs.length ? `${xs.filter(([r, b]) => r <= b).length}/${xs.length}` : "" }))));
  panel.append(grid, el("p", { text: "each cell: one kv-head; hover for its score and rank against the budget" }));
  panel.hidden = false;
}

document.addEventListener("keydown", (event) => {
  if (event.target === slider || !["ArrowLeft", "ArrowRight"].includes(event.key)) return;
  const step = event.key === "ArrowRight" ? 1 : -1;
  slider.value = String(Math.min(Math.max(Number(slider.value) + step, 0), moments.length));
  update();
  event.preventDefault();
});
slider.addEventListener("input", update);
slider.max = String(moments.length);
slider.value = "0";
renderSettings();
renderLegend();
renderRuns();
update();
