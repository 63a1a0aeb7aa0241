// The dashboard: the job list at /, a job page at /jobs/<id>. Plain DOM, no build step.
// Every text that comes from a job (names, logs, stacks, errors) goes in as a text node,
// never as HTML: workers print what they like.
"use strict";

const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED", "PREEMPTED"]);  // at rest: no controller runs it
const PALETTE = ["#0969da", "#cf222e", "#2da44e", "#8250df", "#bf8700", "#1b7c83", "#e16f24"];
const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: ${r.status} ${await r.text()}`);
  return r.json();
}

function badge(state) { return el("span", { class: "badge", "data-state": state }, state); }

function age(iso) {
  if (!iso) return "-";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  return s < 90 ? `${s.toFixed(0)}s ago` : s < 5400 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
}

function when(iso) { return iso ? new Date(iso).toLocaleString() : "-"; }

function replace(id, node) {
  const old = document.getElementById(id);
  node.id = id;
  if (old) old.replaceWith(node); else document.getElementById("main").append(node);
}

function stamp() { document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`; }

function problem(err) {
  replace("error", el("div", { class: "panel bad" }, String(err)));
}

// --- the job list ----------------------------------------------------------------------------

async function jobList() {
  document.title = "jobs · orchestrator";
  const main = document.getElementById("main");
  main.replaceChildren(el("h1", {}, "Jobs"));
  const refresh = async () => {
    let jobs;
    try { jobs = await getJSON("/api/jobs"); } catch (e) { problem(e); return; }
    const rows = jobs.slice().reverse().map(j => el("tr", { class: "job", "data-job": j.job_id, "data-state": j.state },
      el("td", {}, el("a", { href: `/jobs/${encodeURIComponent(j.job_id)}` }, j.job_id)),
      el("td", {}, j.name), el("td", {}, badge(j.state)), el("td", {}, j.attempt),
      el("td", {}, j.restarts), el("td", {}, when(j.submitted_at)), el("td", {}, when(j.ended_at))));
    replace("jobs", jobs.length ? el("table", {},
      el("thead", {}, el("tr", {}, ["JOB", "NAME", "STATE", "ATTEMPT", "RESTARTS", "SUBMITTED", "ENDED"].map(h => el("th", {}, h)))),
      el("tbody", {}, rows)) : el("p", { class: "muted" }, "No jobs yet: orchestrator submit jobspec.yaml"));
    stamp();
  };
  await refresh();
  setInterval(refresh, 3000);
}

// --- a job -----------------------------------------------------------------------------------

const view = { rank: "", logRank: "", job: null };

async function jobPage(id) {
  document.title = `${id} · orchestrator`;
  const main = document.getElementById("main");
  main.replaceChildren();
  let timer = null;
  const refresh = async () => {
    try {
      const job = await getJSON(`/api/jobs/${encodeURIComponent(id)}`);
      view.job = job;
      summary(job); failure(job); stragglers(job); grid(job); timeline(job);
      await Promise.all([metrics(job), logTail(job)]);
      stamp();
      if (TERMINAL.has(job.state) && timer !== null) { clearInterval(timer); timer = null; }
    } catch (e) { problem(e); }
  };
  await refresh();
  if (view.job && !TERMINAL.has(view.job.state)) timer = setInterval(refresh, 2000);
}

function summary(job) {
  const c = job.controller || {};
  const alive = c.alive === true ? "alive" : c.alive === false ? "NOT RUNNING" : "not visible from here";
  replace("summary", el("section", {},
    el("h1", {}, job.job_id, " ", el("span", { class: "muted" }, job.name)),
    el("div", { class: "summary" }, badge(job.state),
      el("span", { id: "attempt" }, `attempt ${job.attempt}`),
      el("span", {}, `restarts ${job.restarts}/${job.max_restarts}` + (job.free_restarts ? ` (+${job.free_restarts} not charged)` : "")),
      el("span", { class: "muted" }, `submitted ${when(job.submitted_at)}`),
      job.ended_at ? el("span", { class: "muted" }, `ended ${when(job.ended_at)}`) : null,
      TERMINAL.has(job.state) ? null : el("span", { class: "muted" }, `controller pid ${c.pid} on ${c.host}: ${alive}`)),
    progress(job.progress)));
}

// How far, how fast, and when it ends (orchestrator/progress.py); text only from numbers.
function span(s) {
  s = Math.round(s);
  if (s < 60) return `${s}s`;
  const pad = n => String(n).padStart(2, "0");
  if (s < 3600) return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${pad(Math.floor(s % 3600 / 60))}m`;
  return `${Math.floor(s / 86400)}d ${pad(Math.floor(s % 86400 / 3600))}h`;
}

function progress(p) {
  if (!p) return null;
  const parts = [p.step === null ? "no step yet" : `step ${p.step.toLocaleString()}`];
  if (p.total_steps !== null) parts[0] += ` of ${p.total_steps.toLocaleString()}` + (p.percent !== null ? ` (${p.percent.toFixed(1)}%)` : "");
  else parts.push("total unknown");
  if (p.steps_per_s !== null) parts.push(`${Number(p.steps_per_s.toPrecision(3))} steps/s`);
  if (p.eta_s !== null) parts.push(`ETA ${span(p.eta_s)} (${when(p.eta_at)})` + (p.lost_share ? `, counting ${Math.round(p.lost_share * 100)}% of the time lost to faults so far` : ""));
  return el("div", { id: "progress", class: "progress" },
    p.percent !== null ? el("progress", { max: 100, value: p.percent }) : null,
    el("span", {}, parts.join(" · ")));
}

function failure(job) {
  const f = job.failure;
  if (!f) { replace("failure", el("div")); return; }
  const where = [f.rank !== null && f.rank !== undefined ? `rank ${f.rank}` : null, f.host,
    f.exit_code !== null && f.exit_code !== undefined ? `exit code ${f.exit_code}` : null, f.signal].filter(Boolean).join(" · ");
  const stacks = f.stacks || {};
  replace("failure", el("section", { class: "panel bad" },
    el("strong", {}, `${f.cause}: `), el("span", { id: "failure-message" }, f.message),
    where ? el("div", { class: "muted" }, where) : null,
    f.failure_class ? el("div", { id: "failure-class" }, el("strong", {}, `${f.failure_class}: `), f.evidence || "") : null,
    f.diagnosis ? el("div", { id: "diagnosis" }, el("strong", {}, "diagnosis: "), f.diagnosis) : null,
    f.flight_recorder && f.flight_recorder.ranks && f.flight_recorder.ranks.length ? el("div", { id: "flight-recorder" },
      el("strong", {}, "flight recorder: "), `dumps of ${f.flight_recorder.ranks.length} ranks in ${f.flight_recorder.dir}`) : null,
    f.stderr_tail && f.stderr_tail.length ? el("div", {}, el("div", { class: "muted" }, "last stderr lines"), el("pre", {}, f.stderr_tail.join("\n"))) : null,
    Object.keys(stacks).length ? el("details", { id: "stacks", open: true },
      el("summary", {}, `stacks of ${Object.keys(stacks).length} ranks` + (f.stacks_method ? ` (${f.stacks_method})` : "")),
      Object.entries(stacks).map(([rank, text]) => el("details", { class: "stack", "data-rank": rank, open: oddOnes(f.diagnosis, stacks).has(rank) },
        el("summary", {}, el("strong", {}, `rank ${rank}`)), el("pre", {}, text)))) : null));
}

function oddOnes(diagnosis, stacks) {
  // The stacks shown open: all of a few ranks; of many, the group the diagnosis names first.
  const ranks = Object.keys(stacks);
  if (ranks.length <= 4 || !diagnosis) return new Set(ranks);
  const m = diagnosis.split("; ")[0].match(/^ranks? ([\d,-]+)/);
  const open = new Set();
  for (const part of m ? m[1].split(",") : []) {
    const [a, b] = part.split("-").map(Number);
    for (let r = a; r <= (b ?? a); r++) open.add(String(r));
  }
  return open;
}

function stragglers(job) {
  if (!job.stragglers || !job.stragglers.length) { replace("stragglers", el("div")); return; }
  const hosts = Object.fromEntries(job.ranks.map(r => [r.rank, r.host]));
  replace("stragglers", el("section", { class: "panel warn" }, el("strong", {}, "stragglers: "),
    job.stragglers.map(r => `rank ${r} (${hosts[r]})`).join(", "),
    el("span", { class: "muted" }, " — the other ranks spend their time waiting for these in collectives")));
}

// A node's checkpoints (orchestrator/checkpoints.py summary): what it holds, what its newest
// save held the training, where this attempt's ranks restored from; nothing for a job that
// never saves.
function held(c) {
  if (!c || !(c.memory_bytes || c.newest_persisted !== null)) return null;
  const mib = b => `${(b / 1048576).toFixed(0)} MiB`;
  const parts = [`checkpoints ${mib(c.memory_bytes)}` + (c.newest_in_memory !== null ? `, step ${c.newest_in_memory}` : "") +
    (c.newest_persisted !== null ? ` (persisted ${c.newest_persisted})` : "")];
  if (c.replicas && c.replicas.ranks) parts.push(`replicas of ${c.replicas.ranks} ranks, step ${c.replicas.newest}`);
  if (c.newest_elsewhere !== null && c.newest_elsewhere !== undefined) parts.push(`on other nodes: step ${c.newest_elsewhere}`);
  if (c.last_save) parts.push(`save of ${mib(c.last_save.bytes)} held ${c.last_save.block_s.toFixed(3)} s`);
  const loads = Object.values(c.restored || {});
  if (loads.length) parts.push(`restored from ${[...new Set(loads.map(l => l.source))].sort().join("/")} in ${Math.max(...loads.map(l => l.seconds)).toFixed(1)} s`);
  return el("div", { class: "muted checkpoint" }, parts.join(" · "));
}

function grid(job) {
  const byNode = {};
  for (const r of job.ranks) (byNode[r.node_index] = byNode[r.node_index] || []).push(r);
  const nodes = job.nodes.map(n => el("div", { class: "node", "data-node": n.node_index, "data-state": n.state },
    el("div", { class: "head" }, el("strong", {}, `node ${n.node_rank ?? "-"}`), ` ${n.host} `, badge(n.state),
      n.spare ? el("span", { class: "badge spare", title: "a hot spare: takes a lost or failed node's place" }, "spare") : null,
      n.drained ? el("span", { class: "badge drained", title: `drained since ${when(n.drained.since)}: the job moves off it at a step every rank saved` },
        `drained: ${n.drained.reason || "no reason given"}`) : null,
      n.notice ? el("span", { class: "badge notice", title: "told to go (orchestrator/drain.py): the job moves off it before then" },
        `notice (${n.notice.source}): stops by ${when(n.notice.deadline)}`) : null,
      el("div", { class: "muted" }, `heard ${age(n.last_heard)}`)),
    held(n.checkpoint),
    el("div", { class: "ranks" }, (byNode[n.node_index] || []).map(r => el("div", {
      class: "rank" + (r.straggler ? " straggler" : ""), "data-rank": r.rank, "data-state": r.state,
      title: `rank ${r.rank} (local ${r.local_rank}) ${r.state}` + (r.exit_code !== null ? ` exit ${r.exit_code}` : "") +
        (r.signal ? ` ${r.signal}` : "") + (r.steps_per_s ? ` · ${r.steps_per_s.toFixed(2)} steps/s` : "") +
        (r.wait_share !== null && r.wait_share !== undefined ? ` · waiting ${(100 * r.wait_share).toFixed(0)}%` : "") +
        ` · output ${age(r.last_output)}`,
    }, `${r.rank}` + (r.step !== null && r.step !== undefined ? ` @${r.step}` : ""))))));
  replace("grid-section", el("section", {}, el("h2", {}, `Nodes and ranks (attempt ${job.attempt})`), el("div", { id: "grid" }, nodes)));
}

function timeline(job) {
  const attempts = job.attempts;
  if (!attempts.length) { replace("timeline", el("div")); return; }
  const now = Date.now();
  const t0 = Date.parse(attempts[0].started_at);
  const t1 = Math.max(...attempts.map(a => a.ended_at ? Date.parse(a.ended_at) : now), t0 + 1000);
  const W = 1000, row = 26, H = 30 + attempts.length * row;
  const x = t => 60 + (W - 80) * (t - t0) / (t1 - t0);
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "attempts over time" });
  attempts.forEach((a, i) => {
    const s = Date.parse(a.started_at), e = a.ended_at ? Date.parse(a.ended_at) : now;
    const y = 10 + i * row;
    const colour = { SUCCEEDED: "#0969da", RUNNING: "#2da44e", FAILED: "#cf222e", HUNG: "#cf222e", CANCELLED: "#6e7781" }[a.outcome] || "#bf8700";
    chart.append(svg("text", { x: 0, y: y + 15 }, `#${a.attempt}`));
    const bar = svg("rect", { x: x(s), y, width: Math.max(2, x(e) - x(s)), height: row - 8, rx: 3, fill: colour, class: "attempt", "data-attempt": a.attempt, "data-outcome": a.outcome });
    bar.append(svg("title", {}, `attempt ${a.attempt}: ${a.outcome}` + (a.failure ? ` — ${a.failure.message}` : "")));
    chart.append(bar);
    const label = a.outcome + (a.failure ? ` — ${a.failure.cause}` : "") + (a.stragglers && a.stragglers.length ? ` · stragglers ${a.stragglers.join(",")}` : "");
    chart.append(svg("text", { x: Math.min(x(e) + 6, W - 300), y: y + 15 }, label));
    if (i > 0) chart.append(svg("line", { x1: x(s), x2: x(s), y1: 4, y2: H - 16, stroke: "#cf222e", "stroke-dasharray": "4 3", class: "restart" }));
  });
  chart.append(svg("text", { x: 60, y: H - 2 }, new Date(t0).toLocaleTimeString()));
  chart.append(svg("text", { x: W - 80, y: H - 2 }, new Date(t1).toLocaleTimeString()));
  const lost = job.time_lost || { incidents: [] };
  const incident = {};
  for (const i of lost.incidents) incident[i.attempt] = i;
  // An incident's cost: time until every rank trained again, plus the steps done twice.
  const cost = i => !i ? "" : (i.lost_s !== null ? `${i.lost_s.toFixed(1)} s` : "?") +
    (i.recovered_s !== null ? `: ${i.recovered_s.toFixed(1)} s down, ${i.steps_redone} steps redone` : "");
  // Unknown is not zero: incidents without steps are counted apart (see timelost.py).
  const unknown = lost.unknown || 0, known = lost.incidents.length - unknown;
  const total = lost.incidents.length ? el("p", { class: "muted", id: "time-lost" },
    (known ? `time lost: ${lost.seconds} s (${lost.gpu_seconds} GPU-s) in ${known} incident(s)` : "") +
    (unknown ? `${known ? "; " : "time lost: "}unknown for ${unknown} incident(s) (no steps reported: restarted ${lost.unknown_downtime_s} s after the fault, steps redone unknown)` : "") +
    (lost.goodput !== null ? ` · goodput ${lost.goodput.toFixed(2)}` : "")) : null;
  replace("timeline", el("section", {}, el("h2", {}, "Attempts"), chart, total,
    el("table", {}, el("thead", {}, el("tr", {}, ["#", "STARTED", "ENDED", "OUTCOME", "CLASS", "CAUSE", "STEPS/S", "WARM", "FROM STEP", "TIME LOST"].map(h => el("th", {}, h)))),
      el("tbody", {}, attempts.map(a => el("tr", { "data-attempt": a.attempt }, el("td", {}, a.attempt), el("td", {}, when(a.started_at)),
        el("td", {}, when(a.ended_at)), el("td", {}, badge(a.outcome)),
        el("td", { class: "failure-class" }, a.failure && a.failure.failure_class ? a.failure.failure_class : ""),
        el("td", {}, a.failure ? a.failure.message + (a.failure.decision ? `; ${a.failure.decision}` : "") : ""),
        el("td", {}, a.steps_per_s ? a.steps_per_s.toFixed(2) : "-"), el("td", {}, a.warm_starts || "-"),
        el("td", { class: "restored-step", title: "the checkpoint step its ranks resumed" }, a.restored_step ?? "-"),
        el("td", {}, cost(incident[a.attempt]))))))));
}

async function metrics(job) {
  const ranks = job.ranks.map(r => r.rank);
  const rank = view.rank !== "" ? view.rank : (ranks.length ? String(Math.min(...ranks)) : "0");
  const samples = await getJSON(`/api/jobs/${encodeURIComponent(job.job_id)}/samples?rank=${encodeURIComponent(rank)}`);
  const names = [...new Set(samples.flatMap(s => Object.keys(s.metrics)))].sort();
  const withSteps = samples.some(s => s.step !== null);
  if (withSteps) names.unshift("step");
  const picker = el("select", { id: "metric-rank" }, [...new Set(ranks)].sort((a, b) => a - b).map(r => el("option", { value: r, selected: String(r) === rank }, `rank ${r}`)));
  picker.addEventListener("change", () => { view.rank = picker.value; metrics(view.job); });
  const charts = names.map(name => chart(name, samples, name === "step"));
  replace("metrics", el("section", {}, el("h2", {}, "Metrics"),
    el("div", { class: "controls" }, picker, el("span", { class: "muted" }, names.length ? "by step, one line per attempt: a restart resumes where its checkpoint was" : "no metrics reported yet: call orchestrator.heartbeat(step, loss=...)")),
    el("div", { class: "charts" }, charts)));
}

function chart(name, samples, overTime) {
  // One metric: value by step (or the step by time), a line per attempt.
  const byAttempt = {};
  for (const s of samples) {
    const y = overTime ? s.step : s.metrics[name];
    const x = overTime ? s.at : (s.step ?? s.at);
    if (y === undefined || y === null || x === null) continue;
    (byAttempt[s.attempt] = byAttempt[s.attempt] || []).push([x, y]);
  }
  const points = Object.values(byAttempt).flat();
  const W = 440, H = 200, L = 50, B = 24;
  const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", "data-metric": name });
  if (points.length) {
    const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const sx = v => L + (W - L - 10) * (v - x0) / (x1 - x0), sy = v => 8 + (H - B - 8) * (1 - (v - y0) / (y1 - y0));
    box.append(svg("line", { x1: L, x2: W - 10, y1: H - B, y2: H - B, stroke: "#d0d7de" }),
      svg("line", { x1: L, x2: L, y1: 8, y2: H - B, stroke: "#d0d7de" }),
      svg("text", { x: 2, y: 14 }, fmt(y1)), svg("text", { x: 2, y: H - B }, fmt(y0)),
      svg("text", { x: L, y: H - 6 }, overTime ? "time" : `step ${fmt(x0)}`),
      svg("text", { x: W - 60, y: H - 6 }, overTime ? "" : fmt(x1)));
    Object.keys(byAttempt).sort((a, b) => a - b).forEach(a => {
      const pts = byAttempt[a].sort((p, q) => p[0] - q[0]);
      const colour = PALETTE[(a - 1) % PALETTE.length];
      box.append(svg("polyline", { points: pts.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "), fill: "none", stroke: colour, "stroke-width": 2, "data-attempt": a }));
      const [lx, ly] = pts[pts.length - 1];
      box.append(svg("circle", { cx: sx(lx), cy: sy(ly), r: 3, fill: colour }));
    });
  }
  const legend = el("div", { class: "legend" }, Object.keys(byAttempt).map(a => {
    const s = el("span", {}, `attempt ${a}`); s.style.setProperty("--c", PALETTE[(a - 1) % PALETTE.length]); return s;
  }));
  return el("div", { class: "chart" }, el("h3", {}, overTime ? "step (over time)" : name), box, legend);
}

function fmt(v) { return String(Number(Number(v).toPrecision(4))); }

async function logTail(job) {
  const rank = view.logRank;
  const data = await getJSON(`/api/jobs/${encodeURIComponent(job.job_id)}/logs?lines=300` + (rank !== "" ? `&rank=${encodeURIComponent(rank)}` : ""));
  const old = document.getElementById("log");
  const atBottom = !old || old.scrollTop + old.clientHeight >= old.scrollHeight - 4;
  const picker = el("select", { id: "log-rank" }, el("option", { value: "", selected: rank === "" }, "all ranks"),
    [...new Set(job.ranks.map(r => r.rank))].sort((a, b) => a - b).map(r => el("option", { value: r, selected: String(r) === rank }, `rank ${r}`)));
  picker.addEventListener("change", () => { view.logRank = picker.value; logTail(view.job); });
  const log = el("pre", { id: "log" }, data.lines.join("\n") || "(no output yet)");
  replace("logs", el("section", {}, el("h2", {}, `Log (attempt ${data.attempt}, last ${data.lines.length} lines)`),
    el("div", { class: "controls" }, picker, data.partial ? el("span", { class: "muted" }, "only the end of a large log was read") : null), log));
  if (atBottom) log.scrollTop = log.scrollHeight;
}

// --- routing ---------------------------------------------------------------------------------

const match = location.pathname.match(/^\/jobs\/([a-z0-9][a-z0-9-]{0,63})$/);
(match ? jobPage(match[1]) : jobList()).catch(problem);
