"""The report page: HTML template, style and script (plain JavaScript, no library, nothing loaded).

The script reads the dialogs from the JSON element ``rollout-data``, draws the table (sort by a
header click, filter by text, reward, version and group), and opens a dialog on a row click: its
turns with the response tokens coloured by log-prob or by version. ``#traj=ID`` opens a dialog too.
Kept as Python strings so the package needs no data files.
"""

PAGE_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{title}}</title>
<style>{{style}}</style>
</head>
<body>
<header>
  <h1 id="title">{{title}}</h1>
  <p id="summary"></p>
</header>
<section id="controls" aria-label="filters">
  <label>Search <input id="filter-text" type="search" placeholder="prompt or response text"></label>
  <label>Reward &ge; <input id="filter-reward-min" type="number" step="any"></label>
  <label>&le; <input id="filter-reward-max" type="number" step="any"></label>
  <label>Version <select id="filter-version"><option value="">all</option></select></label>
  <label>Group <input id="filter-group" type="text" placeholder="group id" list="group-ids"></label>
  <datalist id="group-ids"></datalist>
  <button id="filter-clear" type="button">Clear filters</button>
  <span id="row-count" aria-live="polite"></span>
</section>
<main>
  <table id="dialogs">
    <thead><tr id="dialog-headers"></tr></thead>
    <tbody id="dialog-rows"></tbody>
  </table>
  <p id="no-rows" hidden>No dialog matches the filters.</p>
  <p><button id="show-more" type="button" hidden></button></p>
</main>
<aside id="dialog" role="dialog" aria-labelledby="dialog-title" hidden>
  <div id="dialog-bar">
    <h2 id="dialog-title"></h2>
    <button id="dialog-prev" type="button" title="previous dialog (k)">&#9664;</button>
    <button id="dialog-next" type="button" title="next dialog (j)">&#9654;</button>
    <button id="dialog-close" type="button" title="close (Esc)">&#10005;</button>
  </div>
  <p id="dialog-meta"></p>
  <div id="colour-controls">
    Colour tokens by
    <label><input type="radio" name="colour-by" value="log_prob" checked> log-prob</label>
    <label><input type="radio" name="colour-by" value="version"> <span id="version-mode-label">version</span></label>
    <span id="legend"></span>
  </div>
  <ol id="turns"></ol>
</aside>
<script type="application/json" id="rollout-data">{{data}}</script>
<script>{{script}}</script>
</body>
</html>
"""

PAGE_STYLE = r"""
:root { --line: #d9dde3; --muted: #667085; --accent: #2563eb; --bg: #f6f7f9; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, "Liberation Sans", sans-serif; color: #1d2433; background: var(--bg); }
header { padding: 14px 20px 4px; }
h1 { font-size: 20px; margin: 0 0 4px; }
#summary { margin: 0; color: var(--muted); }
#controls { position: sticky; top: 0; z-index: 1; display: flex; flex-wrap: wrap; gap: 8px 16px; align-items: center;
  padding: 10px 20px; background: var(--bg); border-bottom: 1px solid var(--line); }
#controls input[type=number] { width: 6em; }
#controls input[type=text] { width: 14em; }
#row-count { color: var(--muted); margin-left: auto; }
input, select, button { font: inherit; }
button { cursor: pointer; border: 1px solid var(--line); background: white; border-radius: 4px; padding: 2px 8px; }
main { padding: 10px 20px 40px; }
table { border-collapse: collapse; background: white; border: 1px solid var(--line); width: 100%; }
th, td { padding: 5px 8px; border-bottom: 1px solid var(--line); text-align: left; white-space: nowrap; }
th { position: sticky; top: 49px; background: #eef1f5; cursor: pointer; user-select: none; font-weight: 600; }
th[aria-sort=ascending]::after { content: " \25B2"; font-size: 10px; }
th[aria-sort=descending]::after { content: " \25BC"; font-size: 10px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.id { font: 12px ui-monospace, "Liberation Mono", monospace; color: #344054; }
td.preview { max-width: 26em; overflow: hidden; text-overflow: ellipsis; color: #344054; }
tr.dialog-row { cursor: pointer; }
tr.dialog-row:hover { background: #f0f5ff; }
tr.dialog-row.selected { background: #dbe7ff; }
.reward-pos { color: #067647; font-weight: 600; }
.reward-neg { color: #b42318; font-weight: 600; }
.open-dialog { color: #b54708; }
button.link { border: none; background: none; padding: 0; color: var(--accent); font: inherit; text-decoration: underline dotted; }
#dialog { position: fixed; top: 0; right: 0; bottom: 0; width: min(62vw, 1000px); background: white; overflow: auto;
  border-left: 1px solid var(--line); box-shadow: -8px 0 24px rgba(16, 24, 40, .15); padding: 0 20px 30px; z-index: 2; }
#dialog-bar { position: sticky; top: 0; background: white; display: flex; gap: 6px; align-items: center; padding: 12px 0 8px;
  border-bottom: 1px solid var(--line); }
#dialog-title { font-size: 16px; margin: 0 auto 0 0; font-weight: 600; }
#dialog-meta { color: var(--muted); margin: 8px 0; }
#colour-controls { display: flex; flex-wrap: wrap; gap: 6px 12px; align-items: center; margin: 0 0 10px; color: #344054; }
#legend { display: inline-flex; gap: 6px; align-items: center; color: var(--muted); font-size: 12px; }
.gradient { display: inline-block; width: 140px; height: 12px; border: 1px solid var(--line); }
.swatch { display: inline-block; padding: 0 6px; border-radius: 3px; color: #1d2433; }
#turns { list-style: none; padding: 0; margin: 0; }
.turn { border: 1px solid var(--line); border-radius: 6px; margin: 0 0 12px; padding: 8px 12px; }
.turn-head { font-weight: 600; margin-bottom: 6px; }
.turn-head span { font-weight: normal; color: var(--muted); margin-left: 10px; }
.label { font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); margin: 6px 0 2px; }
pre.prompt, pre.response-text { margin: 0; padding: 6px 8px; background: #f8f9fb; border-radius: 4px;
  white-space: pre-wrap; word-break: break-word; font: 13px/1.45 ui-monospace, "Liberation Mono", monospace; }
.special { color: #98a2b3; }
.tokens { white-space: pre-wrap; word-break: break-word; font: 13px/1.9 ui-monospace, "Liberation Mono", monospace; }
.tok { border-right: 1px solid white; border-radius: 2px; padding: 1px 0; }
.tok.id { padding: 1px 4px; margin-right: 2px; }
.tok.special { color: #475467; }
.empty { color: var(--muted); font-style: italic; }
"""

PAGE_SCRIPT = r"""
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("rollout-data").textContent);
  const dialogs = DATA.dialogs;
  dialogs.forEach((d, i) => { d.index = i + 1; });
  const LOG_PROB_FLOOR = -8;  // log-probs at or below this get the reddest colour
  const ROWS_PER_PAGE = 500;  // rows drawn at a time: laying out thousands of table rows takes seconds
  const PALETTE = ["#bfdbfe", "#fde68a", "#bbf7d0", "#fbcfe8", "#ddd6fe", "#fed7aa", "#a5f3fc", "#e5e7eb", "#d9f99d", "#fecaca"];
  const $ = (id) => document.getElementById(id);
  const state = { sortKey: "index", sortDir: 1, shown: [], numRows: ROWS_PER_PAGE, open: null, colourBy: "log_prob" };

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    Object.assign(node, props || {});
    for (const child of children) node.append(child);
    return node;
  }
  function compareValues(a, b) {
    if (a === b) return 0;
    if (a === null || a === undefined) return -1;
    if (b === null || b === undefined) return 1;
    const numeric = (x) => typeof x === "number" || typeof x === "bigint";
    if (numeric(a) && numeric(b)) return a < b ? -1 : a > b ? 1 : 0;
    return String(a).localeCompare(String(b));
  }
  function distinct(values) { return Array.from(new Set(values)); }
  function fmt(x) {
    if (x === null || x === undefined) return "n/a";
    return Number.isInteger(x) ? String(x) : x.toFixed(3);
  }
  function versionLabel(versions) {
    const sorted = versions.slice().sort(compareValues);
    const short = (v) => (typeof v === "string" && v.length > 10 ? v.slice(0, 8) + "\u2026" : String(v));
    return sorted.length === 1 ? short(sorted[0]) : short(sorted[0]) + "\u2013" + short(sorted[sorted.length - 1]);
  }
  function maxVersion(d) { return d.versions.slice().sort(compareValues).pop(); }
  function lastResponse(d) { return d.turns[d.turns.length - 1].response; }
  function searchText(d) {
    if (d._text === undefined) d._text = d.turns.map((t) => t.prompt + "\n" + t.response).join("\n").toLowerCase();
    return d._text;
  }
  const allVersions = distinct(dialogs.flatMap((d) => d.versions.concat(d.turns.flatMap((t) => t.token_versions || []))))
    .sort(compareValues);

  // ------------------------------------------------------------------------------------- table
  const COLUMNS = [
    { key: "index", label: "#", value: (d) => d.index, cls: "num" },
    { key: "traj", label: "trajectory", value: (d) => BigInt(d.traj), cls: "id" },
    { key: "group", label: "group", value: (d) => (d.group === null ? null : BigInt(d.group)), cls: "id", cell: groupCell },
    { key: "prompt_id", label: "prompt id", value: (d) => d.prompt_id, cls: "num" },
    { key: "turns", label: "turns", value: (d) => d.turns.length, cls: "num" },
    { key: "reward", label: "reward", value: (d) => d.reward, cls: "num", cell: rewardCell },
    { key: "version", label: "version", value: maxVersion, cls: "num", cell: (d) => versionLabel(d.versions) },
    { key: "done", label: "done", value: (d) => (d.done ? 1 : 0), cell: doneCell },
    { key: "prompt_tokens", label: "prompt tokens", value: (d) => d.prompt_tokens, cls: "num" },
    { key: "response_tokens", label: "response tokens", value: (d) => d.response_tokens, cls: "num" },
    { key: "last_response", label: "last response", value: lastResponse, cls: "preview" },
  ];
  function groupCell(d) {
    if (d.group === null) return "";
    const button = el("button", { className: "link group-link", type: "button", textContent: d.group, title: "show only this group" });
    button.addEventListener("click", (event) => { event.stopPropagation(); $("filter-group").value = d.group; renderTable(); });
    return button;
  }
  function rewardCell(d) {
    const cls = d.reward > 0 ? "reward-pos" : d.reward < 0 ? "reward-neg" : "";
    return el("span", { className: cls, textContent: fmt(d.reward) });
  }
  function doneCell(d) { return d.done ? "yes" : el("span", { className: "open-dialog", textContent: "open" }); }

  function readFilters() {
    const number = (id) => ($(id).value === "" ? null : Number($(id).value));
    return {
      text: $("filter-text").value.trim().toLowerCase(),
      rewardMin: number("filter-reward-min"),
      rewardMax: number("filter-reward-max"),
      version: $("filter-version").value,
      group: $("filter-group").value.trim(),
    };
  }
  function matches(d, f) {
    if (f.rewardMin !== null && !(d.reward !== null && d.reward >= f.rewardMin)) return false;
    if (f.rewardMax !== null && !(d.reward !== null && d.reward <= f.rewardMax)) return false;
    if (f.version !== "" && !d.versions.some((v) => String(v) === f.version)) return false;
    if (f.group !== "" && d.group !== f.group) return false;
    return !f.text || searchText(d).includes(f.text);
  }
  function renderHeaders() {
    const row = $("dialog-headers");
    for (const column of COLUMNS) {
      const th = el("th", { textContent: column.label, scope: "col", title: "sort by " + column.label });
      th.dataset.key = column.key;
      th.addEventListener("click", () => {
        state.sortDir = state.sortKey === column.key ? -state.sortDir : column.key === "index" ? 1 : -1;
        state.sortKey = column.key;
        renderTable();
      });
      row.append(th);
    }
  }
  function renderTable(fromTop = true) {  // fromTop: list the first page again (a new sort or filter)
    if (fromTop) state.numRows = ROWS_PER_PAGE;
    const filters = readFilters();
    const column = COLUMNS.find((c) => c.key === state.sortKey);
    const rows = dialogs.filter((d) => matches(d, filters));
    rows.sort((a, b) => state.sortDir * compareValues(column.value(a), column.value(b)) || a.index - b.index);
    state.shown = rows;
    const drawn = rows.slice(0, state.numRows);
    const body = document.createDocumentFragment();
    for (const d of drawn) body.append(rowElement(d));
    $("dialog-rows").replaceChildren(body);
    $("no-rows").hidden = rows.length > 0;
    $("row-count").textContent = rows.length + " of " + dialogs.length + " dialogs" +
      (drawn.length < rows.length ? " (first " + drawn.length + " listed)" : "");
    const more = Math.min(ROWS_PER_PAGE, rows.length - drawn.length);
    $("show-more").hidden = more <= 0;
    $("show-more").textContent = "List " + more + " more";
    for (const th of $("dialog-headers").children) {
      const sorted = th.dataset.key === state.sortKey;
      if (sorted) th.setAttribute("aria-sort", state.sortDir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    }
  }
  function rowElement(d) {
    const tr = el("tr", { className: "dialog-row" + (state.open === d ? " selected" : ""), tabIndex: 0 });
    tr.dataset.traj = d.traj;
    for (const column of COLUMNS) {
      const content = column.cell ? column.cell(d) : String(column.value(d) ?? "");
      const td = el("td", { className: column.cls || "" }, content);
      td.dataset.key = column.key;
      if (column.key === "last_response") td.title = lastResponse(d);
      tr.append(td);
    }
    tr.addEventListener("click", () => openDialog(d));
    tr.addEventListener("keydown", (event) => { if (event.key === "Enter") openDialog(d); });
    return tr;
  }

  // ------------------------------------------------------------------------------------- one dialog
  function openDialog(d) {
    state.open = d;
    $("dialog").hidden = false;
    $("dialog-title").textContent = "Trajectory " + d.traj;
    $("dialog-meta").textContent = [
      "group " + (d.group ?? "n/a"), "prompt id " + (d.prompt_id ?? "n/a"), d.turns.length + " turn" + (d.turns.length === 1 ? "" : "s"),
      "reward " + fmt(d.reward), "version " + versionLabel(d.versions), d.done ? "done" : "open (not done in this file)",
    ].join(" \u00b7 ");
    renderTurns(d);
    for (const tr of $("dialog-rows").children) tr.classList.toggle("selected", tr.dataset.traj === d.traj);
    try { history.replaceState(null, "", "#traj=" + d.traj); } catch (error) { /* some file:// setups refuse: the hash is a convenience */ }
  }
  function closeDialog() {
    state.open = null;
    $("dialog").hidden = true;
    for (const tr of $("dialog-rows").children) tr.classList.remove("selected");
    try { history.replaceState(null, "", "#"); } catch (error) { /* as above */ }
  }
  function stepDialog(offset) {
    if (!state.open || state.shown.length === 0) return;
    const at = state.shown.indexOf(state.open);
    const next = state.shown[Math.min(Math.max(at + offset, 0), state.shown.length - 1)];
    if (next) openDialog(next);
  }
  function renderTurns(d) {
    $("turns").replaceChildren(...d.turns.map(turnElement));
    renderLegend(d);
  }
  function turnElement(t) {
    const head = el("div", { className: "turn-head" }, "Turn " + t.step,
      el("span", { textContent: "reward " + fmt(t.reward) }),
      el("span", { textContent: "version " + versionLabel([t.version]) }),
      el("span", { textContent: t.tokens.length + " response tokens, " + t.prompt_tokens + " prompt tokens" }),
      el("span", { textContent: t.done ? "done" : "" }));
    const prompt = el("pre", { className: "prompt" });
    appendTemplateText(prompt, t.prompt);
    const parts = [head, el("div", { className: "label", textContent: t.prompt_is_continuation ? "new prompt text" : "prompt" }), prompt,
      el("div", { className: "label", textContent: "response" })];
    if (!t.token_texts) parts.push(el("pre", { className: "response-text", textContent: t.response || "(empty)" }));
    parts.push(tokensElement(t));
    const li = el("li", { className: "turn" }, ...parts);
    li.dataset.step = t.step;
    return li;
  }
  function appendTemplateText(parent, text) {
    // chat-template markers such as <|im_start|> are dimmed: the words are what matters
    text.split(/(<\|[^<>|]*\|>)/).forEach((part, i) => {
      parent.append(i % 2 ? el("span", { className: "special", textContent: part }) : part);
    });
  }
  function tokensElement(t) {
    const box = el("div", { className: "tokens" });
    if (t.tokens.length === 0) box.append(el("span", { className: "empty", textContent: "(no tokens)" }));
    t.tokens.forEach((id, i) => {
      const text = t.token_texts ? t.token_texts[i] : null;
      const span = el("span", { className: "tok" + (text === null ? " id" : "") + (/^<\|.*\|>$/.test(text || "") ? " special" : "") });
      span.textContent = text === null ? String(id) : visibleText(text);
      const logProb = t.log_probs[i];
      const version = t.token_versions ? t.token_versions[i] : t.version;
      span.dataset.logProb = logProb === null ? "" : String(logProb);
      span.dataset.version = String(version);
      span.style.background = state.colourBy === "version" ? versionColour(version) : logProbColour(logProb);
      span.title = "token " + id + (text === null ? "" : " " + JSON.stringify(text)) +
        "\nlog p " + (logProb === null ? "n/a" : logProb.toFixed(3) + "  (p " + (100 * Math.exp(logProb)).toPrecision(3) + "%)") +
        "\nversion " + version;
      box.append(span);
    });
    return box;
  }
  function visibleText(text) {
    if (text === "") return "\u2205";
    return text.replace(/[\x00-\x08\x0b-\x1f\x7f]/g, (c) => "\\x" + c.charCodeAt(0).toString(16).padStart(2, "0"))
      .replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u2192\t");
  }
  function logProbColour(logProb) {
    if (logProb === null) return "#e5e7eb";
    const t = Math.min(Math.max(1 - logProb / LOG_PROB_FLOOR, 0), 1);  // 0 at the floor, 1 at log p = 0
    return "hsl(" + Math.round(120 * t) + ", 75%, 82%)";
  }
  function versionColour(version) {
    const rank = allVersions.findIndex((v) => String(v) === String(version));
    return PALETTE[(rank < 0 ? 0 : rank) % PALETTE.length];
  }
  function renderLegend(d) {
    const legend = $("legend");
    if (state.colourBy === "log_prob") {
      const stops = [0, 0.25, 0.5, 0.75, 1].map((t) => "hsl(" + Math.round(120 * t) + ", 75%, 82%)").join(", ");
      const bar = el("span", { className: "gradient" });
      bar.style.background = "linear-gradient(to right, " + stops + ")";
      legend.replaceChildren("log p \u2264 " + LOG_PROB_FLOOR, bar, "0 (p = 1)");
      return;
    }
    const versions = distinct(d.turns.flatMap((t) => (t.token_versions || []).concat([t.version]))).sort(compareValues);
    legend.replaceChildren(...versions.map((v) => {
      const swatch = el("span", { className: "swatch", textContent: "v " + versionLabel([v]) });
      swatch.style.background = versionColour(v);
      return swatch;
    }));
  }

  // ------------------------------------------------------------------------------------- page
  function renderSummary() {
    const turns = dialogs.reduce((n, d) => n + d.turns.length, 0);
    const rewards = dialogs.map((d) => d.reward).filter((r) => r !== null);
    const meanReward = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
    const groups = distinct(dialogs.map((d) => d.group).filter((g) => g !== null && g !== "-1"));
    const parts = [
      turns + " turns in " + dialogs.length + " dialogs", groups.length + " groups", "mean reward " + fmt(meanReward),
      allVersions.length ? "versions " + versionLabel(allVersions) : "no versions",
      "from " + DATA.source, "written " + DATA.written,
    ];
    if (dialogs.length < DATA.num_dialogs_in_source) parts.push("the last " + dialogs.length + " of " + DATA.num_dialogs_in_source + " dialogs");
    if (!DATA.has_token_texts) parts.push("token ids shown (pass a tokenizer for token text)");
    $("summary").textContent = parts.join(" \u00b7 ");
    for (const v of allVersions) $("filter-version").append(el("option", { value: String(v), textContent: String(v) }));
    for (const g of groups) $("group-ids").append(el("option", { value: g }));
    $("version-mode-label").textContent = DATA.has_token_versions ? "version (per token)" : "version (per turn)";
  }
  function bindControls() {
    for (const id of ["filter-text", "filter-reward-min", "filter-reward-max", "filter-group"]) {
      $(id).addEventListener("input", () => renderTable());
    }
    $("filter-version").addEventListener("change", () => renderTable());
    $("filter-clear").addEventListener("click", () => {
      for (const id of ["filter-text", "filter-reward-min", "filter-reward-max", "filter-version", "filter-group"]) $(id).value = "";
      renderTable();
    });
    $("show-more").addEventListener("click", () => { state.numRows += ROWS_PER_PAGE; renderTable(false); });
    $("dialog-close").addEventListener("click", closeDialog);
    $("dialog-prev").addEventListener("click", () => stepDialog(-1));
    $("dialog-next").addEventListener("click", () => stepDialog(1));
    for (const radio of document.querySelectorAll("input[name=colour-by]")) {
      radio.addEventListener("change", () => { state.colourBy = radio.value; if (state.open) renderTurns(state.open); });
    }
    window.addEventListener("hashchange", openFromHash);
    document.addEventListener("keydown", (event) => {
      if (!state.open || ["INPUT", "SELECT"].includes(document.activeElement.tagName) && event.key !== "Escape") return;
      if (event.key === "Escape") closeDialog();
      else if (event.key === "j" || event.key === "ArrowDown") { event.preventDefault(); stepDialog(1); }
      else if (event.key === "k" || event.key === "ArrowUp") { event.preventDefault(); stepDialog(-1); }
    });
  }
  function openFromHash() {
    const match = /^#traj=(-?\d+)$/.exec(location.hash);
    const d = match && dialogs.find((x) => x.traj === match[1]);
    if (d && d !== state.open) openDialog(d);
  }

  renderHeaders();
  renderSummary();
  bindControls();
  renderTable();
  openFromHash();
  document.body.dataset.ready = "true";
})();
"""
