// polar-mitm dashboard: live refresh of the Run and Session pages, table filters, the token view. Plain JS, no build.
"use strict";

// -- live: fetch the page's <main> again (X-Polar-Fragment) and swap it in, keeping open <details> and filters
function liveRefresh() {
  const box = document.getElementById("live");
  const page = document.body.dataset.page;
  if (!box || page === "trajectory" || page === "problem") return;
  const every = (Number(document.body.dataset.refresh) || 3) * 1000;
  let last = null;
  async function tick() {
    if (!box.checked || document.hidden) return;
    try {
      const reply = await fetch(location.href, { headers: { "X-Polar-Fragment": "1" }, cache: "no-store" });
      const html = await reply.text();
      if (!reply.ok && reply.status >= 500) return;
      if (html === last) return;
      last = html;
      const main = document.getElementById("main");
      const open = new Set([...main.querySelectorAll("details[open]")].map(keyOf));
      const closed = new Set([...main.querySelectorAll("details:not([open])")].map(keyOf));
      const filters = [...main.querySelectorAll("input[data-filter]")].map((i) => [i.dataset.filter, i.value]);
      main.innerHTML = html;
      main.querySelectorAll("details").forEach((d) => { if (open.has(keyOf(d))) d.open = true; else if (closed.has(keyOf(d))) d.open = false; });
      filters.forEach(([table, value]) => { const i = main.querySelector(`input[data-filter="${table}"]`); if (i) { i.value = value; filter(i); } });
      bindFilters(main);
      const stamp = document.getElementById("rendered");
      if (stamp) stamp.textContent = new Date().toISOString().slice(0, 19).replace("T", " ");
      document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
    } catch (error) { /* the server is gone for now: try again next tick */ }
  }
  function keyOf(d) { return d.id || (d.querySelector("summary") || d).textContent.trim().slice(0, 80); }
  setInterval(tick, every);
}

// -- table filters: <input data-filter="TABLE_ID"> hides the rows that do not contain its text
function filter(input) {
  const table = document.getElementById(input.dataset.filter);
  if (!table) return;
  const needle = input.value.trim().toLowerCase();
  [...table.rows].slice(1).forEach((row) => { row.hidden = needle !== "" && !row.textContent.toLowerCase().includes(needle); });
}
function bindFilters(root) { root.querySelectorAll("input[data-filter]").forEach((i) => i.addEventListener("input", () => filter(i))); }

// -- the token view: details of a token, colour modes, search (text, #id, @index)
function tokenView() {
  const holder = document.getElementById("tokens");
  const dataNode = document.getElementById("token-data");
  if (!holder || !dataNode) return;
  const data = JSON.parse(dataNode.textContent);
  const spans = holder.querySelectorAll("span.t");
  const info = document.getElementById("token-info");
  const spanOf = (i) => data.spans.find((s) => i >= s.from && i < s.end);
  function describe(i) {
    const s = spanOf(i);
    const sampled = s && i >= s.start;
    const lp = data.lp[i];
    let line = `token ${i} · id ${data.ids[i]} · ${JSON.stringify(data.text[i])} · loss mask ${data.mask[i]}`;
    if (sampled) line += ` · sampled by seq ${s.seq} · logprob ${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(3)})` + (s.version !== null ? ` · policy v${s.version}` : "");
    else if (s) line += ` · context (prompt of seq ${s.seq})`;
    return line;
  }
  let selected = null;
  holder.addEventListener("mouseover", (event) => {
    const t = event.target.closest("span.t");
    if (t) info.textContent = describe(indexOf(t));
  });
  holder.addEventListener("click", (event) => {
    const t = event.target.closest("span.t");
    if (!t) return;
    if (selected) selected.classList.remove("sel");
    selected = t;
    t.classList.add("sel");
    info.textContent = describe(indexOf(t));
  });
  const index = new Map();
  spans.forEach((s, i) => index.set(s, i));
  function indexOf(t) { return index.get(t); }

  document.querySelectorAll('input[name="mode"]').forEach((radio) => radio.addEventListener("change", () => {
    holder.classList.remove("mode-mask", "mode-heat", "mode-version");
    holder.classList.add(`mode-${radio.value}`);
  }));

  // text search runs over the exact decoded text (not the drawn one), across token boundaries
  const starts = [];
  let full = "";
  data.text.forEach((t) => { starts.push(full.length); full += t; });
  const lower = full.toLowerCase();
  const box = document.getElementById("token-search");
  const count = document.getElementById("search-count");
  let hits = [];
  let current = -1;
  function tokenAt(offset) { let lo = 0, hi = starts.length - 1; while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (starts[mid] <= offset) lo = mid; else hi = mid - 1; } return lo; }
  function search() {
    holder.querySelectorAll(".hit, .cur").forEach((s) => s.classList.remove("hit", "cur"));
    hits = [];
    current = -1;
    const query = box.value;
    if (!query) { count.textContent = ""; return; }
    let m;
    if ((m = query.match(/^#(\d+)$/))) {
      data.ids.forEach((id, i) => { if (id === Number(m[1])) hits.push([i]); });
    } else if ((m = query.match(/^@(\d+)$/))) {
      if (Number(m[1]) < spans.length) hits.push([Number(m[1])]);
    } else {
      const needle = query.toLowerCase();
      for (let at = lower.indexOf(needle); at !== -1 && hits.length < 5000; at = lower.indexOf(needle, at + 1)) {
        const first = tokenAt(at), last = tokenAt(at + needle.length - 1);
        const run = [];
        for (let i = first; i <= last; i++) run.push(i);
        hits.push(run);
      }
    }
    hits.forEach((run) => run.forEach((i) => spans[i] && spans[i].classList.add("hit")));
    count.textContent = hits.length ? `${hits.length} match${hits.length === 1 ? "" : "es"}` : "no match";
    count.dataset.matches = String(hits.length);
    if (hits.length) go(0);
  }
  function go(step) {
    if (!hits.length) return;
    if (current >= 0) hits[current].forEach((i) => spans[i].classList.remove("cur"));
    current = (current + step + hits.length) % hits.length;
    if (step === 0) current = 0;
    hits[current].forEach((i) => spans[i].classList.add("cur"));
    const first = spans[hits[current][0]];
    first.scrollIntoView({ block: "center" });
    info.textContent = `match ${current + 1} of ${hits.length}: ` + describe(hits[current][0]);
  }
  box.addEventListener("input", search);
  box.addEventListener("keydown", (event) => { if (event.key === "Enter") { event.preventDefault(); go(event.shiftKey ? -1 : 1); } });
  document.getElementById("search-next").addEventListener("click", () => go(1));
  document.getElementById("search-prev").addEventListener("click", () => go(-1));
  if (box.value) search();
  document.body.dataset.ready = "1";
}

document.addEventListener("DOMContentLoaded", () => {
  bindFilters(document);
  liveRefresh();
  tokenView();
  if (document.body.dataset.page !== "trajectory") document.body.dataset.ready = "1";
});
