// One job: live charts (metrics over SSE), event timeline, layout and memory plan, logs, checkpoints,
// cancel. The job row, events and checkpoints are polled while the job is active.

import { api, ApiError, follow } from "../api.js";
import { LineChart } from "../charts.js";
import { h, replace } from "../dom.js";
import { RECENT_ROWS, predictionPanel } from "./prediction.js";
import { ACTIVE, attemptText, devicesWord, fmtAge, fmtBytes, fmtCount, fmtDuration, fmtNum, fmtPct, fmtRate, fmtTime, layoutText, paramsText } from "../format.js";
import { exportActive, exportCell } from "./exports.js";
import { samplePanel } from "./samples.js";
import { slotKinds } from "./cluster.js";
import { badge, headerLine, progress } from "./jobs.js";

const POLL_MS = 2000;
const MAX_POINTS = 2000;    // asked of the server per kind; it keeps min/max loss per bucket
const REFETCH_AT = 4000;    // live points beyond this: fetch a fresh downsampled series
const LOG_TAIL = 200;
const MAX_LOG_LINES = 2000;

// The engine reports gpu_util on a GPU (NVML, percent of time a kernel ran) and cpu_util on a CPU
// (the rank's CPU time over its cores, percent); one chart shows whichever a run reports, titled to
// match. Both report the device's memory in use beside the peak the run allocated.
const utilization = (r) => r.gpu_util ?? r.cpu_util ?? null;
const onCpu = (r) => r.gpu_util == null && r.cpu_util != null;
const CHARTS = [
  { id: "loss", title: "Loss", series: [{ label: "train", color: "--chart-1" }, { label: "validation", color: "--chart-2", points: true }],
    values: (t, v) => [t?.loss ?? null, v?.val_loss ?? null], format: (x) => fmtNum(x, 4) },
  { id: "lr", title: "Learning rate", series: [{ label: "lr" }], values: (t) => [t?.lr ?? null], format: (x) => fmtNum(x, 6) },
  { id: "grad_norm", title: "Grad norm", series: [{ label: "grad norm" }], values: (t) => [t?.grad_norm ?? null], format: (x) => fmtNum(x, 3) },
  { id: "tokens_per_s", title: "Tokens/s", series: [{ label: "tokens/s" }], values: (t) => [t?.tokens_per_s ?? null], format: fmtCount },
  { id: "mfu", title: "MFU", series: [{ label: "MFU" }], values: (t) => [t?.mfu ?? null], format: fmtPct },
  // Like for like with the planner: the model state measured from the run's tensors on every device;
  // on a GPU the allocator's peak (all tensors) and the device's memory in use; on a CPU the
  // process's resident set, labelled as such (it holds far more than tensors).
  { id: "memory", title: "Memory per device", titleOf: (t) => (onCpu(t) ? "Memory per rank (CPU)" : "Memory per GPU"),
    series: [{ label: "model state (measured)" }, { label: "peak allocated (tensors)", color: "--chart-2" },
      { label: "device in use", color: "--s-scheduled" }],
    labelsOf: (t) => ["model state (measured)", onCpu(t) ? "peak allocated (n/a on a CPU)" : "peak allocated (tensors)", onCpu(t) ? "process RSS" : "device in use"],
    values: (t) => [t?.model_state_bytes ?? null, t?.peak_memory_bytes ?? null,
      (t && onCpu(t) ? t.process_rss_bytes : null) ?? t?.device_memory_used_bytes ?? null], format: fmtBytes },
  { id: "utilization", title: "GPU utilization", titleOf: (t) => (onCpu(t) ? "CPU utilization" : "GPU utilization"),
    series: [{ label: "utilization" }], optional: true,
    values: (t) => [t ? utilization(t) : null], format: (x) => fmtPct(x / 100) },
  // Mixture-of-experts runs only (megatrain.engine.moe_metrics): the routers' losses and balance.
  { id: "moe_aux_loss", title: "Router losses", optional: true,
    series: [{ label: "aux (load balancing)" }, { label: "z-loss", color: "--chart-2" }],
    values: (t) => [t?.moe_aux_loss ?? null, t?.moe_z_loss ?? null], format: (x) => fmtNum(x, 4) },
  { id: "moe_load_imbalance", title: "Expert load imbalance (max / mean tokens)", optional: true,
    series: [{ label: "imbalance" }], values: (t) => [t?.moe_load_imbalance ?? null], format: (x) => fmtNum(x, 3) },
  // Preference training (kind dpo) only, under TRL's names: the implicit rewards β·(log π − log π_ref)
  // of the chosen and rejected responses, their margin, and how often chosen wins.
  { id: "dpo_rewards", title: "Rewards (DPO)", optional: true,
    series: [{ label: "margin" }, { label: "chosen", color: "--chart-2" }, { label: "rejected", color: "--s-failed" }],
    values: (t) => [t?.["rewards/margins"] ?? null, t?.["rewards/chosen"] ?? null, t?.["rewards/rejected"] ?? null],
    format: (x) => fmtNum(x, 4) },
  { id: "dpo_accuracy", title: "Preference accuracy (chosen rewarded above rejected)", optional: true,
    series: [{ label: "accuracy" }], values: (t) => [t?.["rewards/accuracies"] ?? null], format: fmtPct },
  // BERT (model.arch bert) only: the share of masked word pieces predicted (the engine's token
  // accuracy counts the masked positions) and, with the binary head, of sentence pairs whose order
  // was told right (Megatron's SOP).
  { id: "mlm_accuracy", title: "Masked-token accuracy (MLM)", when: (job) => job.spec?.model?.arch === "bert",
    series: [{ label: "train" }, { label: "validation", color: "--chart-2", points: true }],
    values: (t, v) => [t?.token_accuracy ?? null, v?.valid_mean_token_accuracy ?? null], format: fmtPct },
  { id: "sop_accuracy", title: "Sentence-order accuracy (SOP)", optional: true,
    when: (job) => job.spec?.model?.arch === "bert",
    series: [{ label: "accuracy" }], values: (t) => [t?.sop_accuracy ?? null], format: fmtPct },
];

const EVENT_LABELS = {
  queued: "Queued", scheduled: "Scheduled", running: "Running", started: "Engine started", resumed: "Resumed",
  checkpoint_saved: "Checkpoint saved", checkpoints_deleted: "Checkpoints deleted (retention)",
  checkpoint_corrupt: "Corrupt checkpoint skipped", checkpoints_set_aside: "Corrupt checkpoints set aside",
  cancel_requested: "Cancel requested", succeeded: "Succeeded",
  failed: "Failed", cancelled: "Cancelled", info: "Info", preempted: "Preempted",
  straggler: "Straggler rank", warning: "Warning", profiled: "Profile written",
};

function eventLabel(ev) {
  if (ev.kind === "queued" && ev.from_status && ev.from_status !== "queued") {
    return /preempt/i.test(ev.reason) ? "Preempted" : "Retried";
  }
  return EVENT_LABELS[ev.kind] || ev.kind.replace(/_/g, " ");
}

// A reason's first line: the worker writes one line (the traceback is in the log), but jobs that
// failed before it did hold the engine's last output after it.
const firstLine = (text) => (text || "").split("\n").find((l) => l.trim()) || "";

function tile(label, value, id) {
  return h("div", { class: "tile" }, h("div", { class: "tile-label" }, label), h("div", { class: "tile-value", id }, value));
}

const MEMORY_PARTS = [["params", "Parameters", "--chart-1"], ["grads", "Gradients", "--s-succeeded"], ["optimizer", "Optimizer", "--chart-2"], ["activations", "Activations", "--s-scheduled"]];

// The planner's estimate beside what the run measured, like for like: its static part (parameters,
// gradients, optimizer state) against the same tensors' bytes; on a GPU its total against the
// allocator's peak. A CPU's process RSS is shown for what it is, not as a measure of the estimate.
function memoryMeasured(estimate, row) {
  if (!row || row.model_state_bytes == null) return [h("p", { class: "hint" }, "The measured figures appear with the first metrics.")];
  const value = (k) => estimate[`${k}_bytes`] ?? 0;
  const planned = value("params") + value("grads") + value("optimizer");
  const off = (got, want) => (want ? ` (${got >= want ? "+" : ""}${(100 * (got - want) / want).toFixed(1)}% of the plan)` : "");
  const lines = [h("p", { id: "memory-model-state" }, h("strong", {}, "Measured model state: "),
    `${fmtBytes(row.model_state_bytes)} of parameters, gradients and optimizer state; the planner's ${fmtBytes(planned)}${off(row.model_state_bytes, planned)}.`)];
  if (row.peak_memory_bytes != null) {
    lines.push(h("p", { id: "memory-peak" }, h("strong", {}, "Measured peak allocated: "),
      `${fmtBytes(row.peak_memory_bytes)} of tensors, activations included; the planner's total ${fmtBytes(estimate.total_bytes)}${off(row.peak_memory_bytes, estimate.total_bytes)}.`));
  }
  if (row.process_rss_bytes != null) {
    lines.push(h("p", { class: "hint", id: "memory-rss" }, h("strong", {}, "Process RSS: "),
      `${fmtBytes(row.process_rss_bytes)}, the whole process (Python, torch's libraries, allocator caches), not only tensors: no measure of the plan.`));
  }
  return lines;
}

// The goodput ledger (GET /v1/jobs/{id}: its ended attempts' seconds): productive time and each loss.
const GOODPUT_PARTS = [["productive_s", "productive", "--s-succeeded"], ["queued_s", "queued", "--s-queued"],
  ["restart_s", "restarts", "--s-scheduled"], ["checkpoint_stall_s", "checkpoint stalls", "--chart-2"], ["hang_s", "hangs", "--s-failed"], ["preempt_s", "preemptions", "--s-cancelled"],
  ["eval_s", "evaluation", "--chart-1"]];

// The series of the evaluation scores chart, one per task and metric (at most this many).
const SCORE_COLORS = ["--chart-1", "--chart-2", "--s-succeeded", "--s-scheduled", "--s-failed", "--s-cancelled"];

function goodputPanel(g) {
  if (!g || !g.attempts) return h("p", { class: "hint", id: "goodput-none" }, "The ledger fills in as attempts end.");
  const total = GOODPUT_PARTS.reduce((sum, [k]) => sum + (g[k] || 0), 0) || 1;
  const parts = GOODPUT_PARTS.filter(([k]) => g[k] > 0);
  return h("div", { id: "goodput" },
    h("h3", { id: "goodput-share" }, `${fmtPct(g.goodput)} productive over ${g.attempts} attempt${g.attempts === 1 ? "" : "s"}`),
    h("div", { class: "membar", role: "img", "aria-label": parts.map(([k, l]) => `${l} ${fmtDuration(g[k])}`).join(", ") },
      parts.map(([k, , c]) => h("span", { style: { width: `${(100 * g[k]) / total}%`, background: `var(${c})` } }))),
    h("div", { class: "legend", id: "goodput-legend" },
      parts.map(([k, l, c]) => h("span", { dataset: { part: k } }, h("i", { style: { background: `var(${c})` } }), `${l} ${fmtDuration(g[k])}`))));
}

function memoryPlan(estimate) {
  const value = (k) => estimate[`${k}_bytes`] ?? estimate[k] ?? 0;
  const total = estimate.total_bytes ?? MEMORY_PARTS.reduce((s, [k]) => s + value(k), 0);
  if (!total) return null;
  return h("div", { id: "memory-plan" },
    h("h3", {}, `Planner's memory per device: ${fmtBytes(total)}`),
    h("div", { class: "membar", role: "img", "aria-label": MEMORY_PARTS.map(([k, l]) => `${l} ${fmtBytes(value(k))}`).join(", ") },
      MEMORY_PARTS.map(([k, , c]) => h("span", { style: { width: `${(100 * value(k)) / total}%`, background: `var(${c})` } }))),
    h("div", { class: "legend" }, MEMORY_PARTS.map(([k, l, c]) => h("span", {}, h("i", { style: { background: `var(${c})` } }), `${l} ${fmtBytes(value(k))}`))),
    h("div", { id: "memory-measured" }));
}

export function renderJob(main, [jobId], { showBanner, hideBanner }) {
  const controller = new AbortController();
  const signal = controller.signal;
  const t0 = performance.now();
  const enc = encodeURIComponent(jobId);
  let job = null;
  let checkpoints = [];
  let exports = [];  // the job's Hugging Face exports, drawn in the checkpoints table
  let samples = null;  // the "Sample" panel (it polls its own samples while one is pending)
  let timer = null;
  let stopped = false;
  let charts = {};
  let store = { steps: [], byStep: new Map() };   // step -> {t: train row, v: val row}
  let lastStep = -1;
  let totalRows = 0;
  let metricsFollowing = false;
  // A first load that failed (a restarting API, a dropped connection) is tried again on the next poll.
  let metricsLoaded = false;
  let logsLoaded = false;
  // Evaluation results: asked on the first poll, then on every poll while the job runs if it is an
  // eval job or has scored tasks during training.
  let resultsWanted = true;
  let flushPending = false;
  let logsFollowing = null;
  let lastSeq = 0;
  let estimate = null;  // the planner's, from the started event
  let predicted = null;  // the planner's step time, tokens/s, MFU and memory, from the submitted event
  let kinds = new Map();  // pool -> what its slots are called ("GPUs", "CPU slots")
  slotKinds().then((k) => { kinds = k; if (job && !stopped) drawJob(); });
  window.megatrainPerf = { jobId, chartsReadyMs: null, points: 0 };

  replace(main, h("div", { class: "loading" }, "Loading job…"));

  // -- skeleton (built once the job is known) --------------------------------------------------
  const el = {};
  function skeleton() {
    el.badge = h("span", { id: "job-status" });
    el.reason = h("div", { class: "sub", id: "job-reason" });
    el.showLog = h("button", { type: "button", class: "btn btn-small", id: "show-log", hidden: true, onclick: showLog }, "Show the traceback in the log");
    el.cancel = h("button", { type: "button", class: "btn btn-danger", id: "cancel-job", onclick: cancel }, "Cancel job");
    el.tiles = h("div", { class: "tiles", id: "job-tiles" });
    el.charts = h("div", { class: "charts", id: "charts" });
    el.chartNote = h("p", { class: "hint", id: "chart-note" });
    el.timeline = h("ol", { class: "timeline", id: "timeline", "aria-label": "Event timeline" });
    el.layout = h("div", { id: "layout" });
    el.logs = h("pre", { class: "logs", id: "logs", tabindex: "0", "aria-label": "Job logs" });
    el.follow = h("input", { type: "checkbox", id: "follow-logs" });
    el.checkpoints = h("div", { id: "checkpoints" });
    el.goodput = h("div", { id: "goodput-panel" });
    el.profile = h("div", { id: "profile-traces" });
    el.profileCard = h("section", { class: "card", id: "profile-card", "aria-labelledby": "profile-h", hidden: true },
      h("h2", { id: "profile-h" }, "Profile"), el.profile);
    el.results = h("div", { id: "results" });
    // Built once (the table is redrawn on every poll; what is typed here stays).
    const others = h("input", { type: "text", id: "compare-with", placeholder: "job ids, comma-separated", "aria-label": "Jobs to compare with" });
    const ids = () => [jobId, ...others.value.split(",").map((x) => x.trim()).filter(Boolean)];
    const compare = h("form", { class: "row", id: "compare-form", style: { marginTop: "0.6rem" },
      onsubmit: (e) => { e.preventDefault(); location.hash = `#/compare/${ids().map(encodeURIComponent).join(",")}`; } },
      others, h("button", { type: "submit", class: "btn btn-small" }, "Compare with…"));
    // A training job's scores at each eval step (training.eval_tasks), one line per task and metric.
    el.scores = h("div", { class: "chart", id: "chart-eval-scores", hidden: true });
    el.resultsCard = h("section", { class: "card", id: "results-card", "aria-labelledby": "results-h", hidden: true },
      h("h2", { id: "results-h" }, "Evaluation"), el.results, el.scores, compare);
    el.spec = h("pre", { class: "mono", style: { overflow: "auto", maxHeight: "360px" } });
    samples = samplePanel(jobId, { signal, showBanner });
    replace(main,
      h("nav", { "aria-label": "Breadcrumb", class: "sub", style: { marginBottom: "0.5rem" } }, h("a", { href: "#/jobs" }, "← Jobs")),
      h("div", { class: "page-head" },
        h("div", { style: { minWidth: 0 } },
          h("div", { class: "row" }, h("h1", { id: "job-name" }, job.name), el.badge),
          h("div", { class: "sub mono" }, job.id), el.reason, el.showLog),
        h("div", { class: "row" }, el.cancel)),
      h("div", { class: "stack" },
        el.tiles,
        el.resultsCard,
        h("section", { "aria-labelledby": "charts-h" }, h("h2", { id: "charts-h", class: "visually-hidden" }, "Charts"), el.charts, el.chartNote),
        h("div", { class: "two-col" },
          h("section", { class: "card", "aria-labelledby": "timeline-h" }, h("h2", { id: "timeline-h" }, "Timeline"), el.timeline),
          h("section", { class: "card", "aria-labelledby": "layout-h" }, h("h2", { id: "layout-h" }, "Layout"), el.layout)),
        h("section", { class: "card", "aria-labelledby": "logs-h" },
          h("div", { class: "page-head", style: { marginBottom: "0.5rem" } }, h("h2", { id: "logs-h", style: { margin: 0 } }, "Logs"),
            h("label", { class: "switch", for: "follow-logs" }, el.follow, "Follow")),
          el.logs),
        h("section", { class: "card", "aria-labelledby": "ckpt-h" }, h("h2", { id: "ckpt-h" }, "Checkpoints"), el.checkpoints),
        el.profileCard,
        h("section", { class: "card", "aria-labelledby": "goodput-h" }, h("h2", { id: "goodput-h" }, "Goodput"), el.goodput),
        samples.el,
        h("details", { class: "card" }, h("summary", {}, "Spec"), el.spec)));
    for (const def of CHARTS) {
      if (def.when && !def.when(job)) continue;  // another kind of model's chart
      const box = h("div", { class: "chart" });
      const card = h("section", { class: "card chart-card", id: `chart-${def.id}`, dataset: { points: "0" }, hidden: def.optional },
        h("h3", {}, h("span", { id: `chart-${def.id}-title` }, def.title), h("span", { class: "muted", id: `chart-${def.id}-latest` })), box);
      el.charts.append(card);
      charts[def.id] = { def, card, chart: new LineChart(box, { series: def.series, format: def.format }) };
    }
    el.follow.addEventListener("change", () => (el.follow.checked ? followLogs() : stopLogs()));
    el.spec.textContent = JSON.stringify(job.spec, null, 2);
  }

  // -- job, events, checkpoints ----------------------------------------------------------------
  function drawJob() {
    replace(el.badge, badge(job.status));
    el.reason.textContent = headerLine(job, firstLine(job.status_reason));
    el.showLog.hidden = job.status !== "failed";
    const active = ACTIVE.has(job.status);
    el.cancel.hidden = !active;
    el.cancel.disabled = job.cancel_requested;
    el.cancel.textContent = job.cancel_requested ? "Cancelling…" : "Cancel job";
    const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
    const runtime = job.started_at ? fmtDuration((end - Date.parse(job.started_at)) / 1000) : "—";
    replace(el.tiles,
      h("div", { class: "tile" }, h("div", { class: "tile-label" }, "Progress"), h("div", { class: "tile-value" }, progress(job))),
      tile("Latest loss", fmtNum(job.latest_loss, 4), "tile-loss"),
      tile("Tokens/s", fmtRate(job.latest_tokens_per_s)),
      tile("MFU", fmtPct(job.latest_mfu)),
      tile("Parameters", paramsText(job)),
      tile("Layout", layoutText(job.layout)),
      tile(devicesWord([job.pool], kinds), String(job.num_procs), "tile-devices"),
      tile("Attempt", attemptText(job)),
      tile("Runtime", runtime),
      tile("Submitted", h("span", { title: fmtTime(job.created_at) }, fmtAge(job.created_at))));
    replace(el.goodput, goodputPanel(job.goodput));
  }

  function drawEvents(events) {
    if (!events.length) { replace(el.timeline, h("li", { class: "muted" }, "No events yet.")); return; }
    // The newest event is the last: keep the box scrolled to it, unless the reader scrolled up.
    const box = el.timeline;
    const atEnd = !box.dataset.drawn || box.scrollHeight - box.scrollTop - box.clientHeight < 24;
    const kept = box.scrollTop;
    replace(el.timeline, events.map((ev) => h("li", { dataset: { kind: ev.kind } },
      h("span", { class: `dot ${ev.kind}`, "aria-hidden": "true" }),
      h("div", { style: { minWidth: 0 } },  // lets a long reason end in an ellipsis, not widen the list
        h("span", { class: "what" }, eventLabel(ev)),
        h("time", { class: "when", datetime: ev.created_at, title: fmtTime(ev.created_at) }, fmtAge(ev.created_at)),
        ev.reason && h("div", { class: "why", title: ev.reason, style: { whiteSpace: "nowrap", overflow: "hidden", textOverflow: "ellipsis" } }, firstLine(ev.reason))))));
    box.dataset.drawn = "1";
    box.scrollTop = atEnd ? box.scrollHeight : kept;
    const started = [...events].reverse().find((e) => e.kind === "started");
    drawProfile([...events].reverse().find((e) => e.kind === "profiled"));
    predicted = events.find((e) => e.reason === "submitted")?.data?.plan?.predicted || null;
    drawLayout(started?.data || {});
  }

  // training.profile_steps: one Chrome trace per rank, next to the checkpoints.
  function drawProfile(ev) {
    const files = ev?.data?.files;
    if (!Array.isArray(files) || el.profile.dataset.steps === String(ev.data.steps)) return;
    el.profile.dataset.steps = String(ev.data.steps);
    el.profileCard.hidden = false;
    const [first, last] = ev.data.steps || [];
    replace(el.profile,
      h("p", { class: "hint" }, `torch.profiler's trace of steps ${first}-${last}, one per rank: open it in `,
        h("a", { href: "https://ui.perfetto.dev", target: "_blank", rel: "noopener" }, "Perfetto"), " or chrome://tracing."),
      h("ul", { class: "plain", id: "profile-files" }, files.map((name) => h("li", {},
        h("button", { type: "button", class: "btn btn-small", dataset: { file: name }, "aria-label": `Download ${name}`,
          onclick: (e) => download(`/v1/jobs/${enc}/profile/${encodeURIComponent(name)}`, `${jobId}-${name}`, e.currentTarget) }, name)))));
  }

  function drawLayout(startedData) {
    const L = job.layout || {};
    const rows = [["Tensor parallel (tp)", L.tp], ["Pipeline parallel (pp)", L.pp], ["Data parallel (dp)", L.dp],
      ["Context parallel (cp)", L.cp], ["Expert parallel (ep)", L.ep], ["Virtual stages", L.virtual_stages],
      ["Sequence parallel", L.sequence_parallel ? "on" : "off"], ["Processes", job.num_procs], ["Pool", job.pool]];
    if (startedData.device) rows.push(["Device", startedData.device]);
    if (startedData.precision) rows.push(["Precision", startedData.precision]);
    estimate = startedData.memory_estimate || null;
    replace(el.layout,
      h("dl", { class: "kv" }, rows.filter(([, v]) => v !== undefined && v !== null).map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))])),
      estimate ? memoryPlan(estimate) : h("p", { class: "hint" }, "The planner's memory breakdown appears here once the engine reports it at start."),
      predicted && h("div", { id: "prediction-box" }));
    drawMeasured();
  }

  function trainRows() {
    const rows = [];
    for (let i = store.steps.length - 1; i >= 0 && rows.length < RECENT_ROWS; i--) {
      const t = store.byStep.get(store.steps[i]).t;
      if (t) rows.unshift(t);
    }
    return rows;
  }

  function latestTrain(has = null) {
    for (let i = store.steps.length - 1; i >= 0; i--) {
      const t = store.byStep.get(store.steps[i]).t;
      if (t && (has === null || t[has] != null)) return t;
    }
    return null;
  }

  function drawMeasured() {
    const box = document.getElementById("memory-measured");
    if (box && estimate) replace(box, memoryMeasured(estimate, latestTrain("model_state_bytes")));
    const pbox = document.getElementById("prediction-box");
    if (pbox && predicted) replace(pbox, predictionPanel(predicted, trainRows()));
  }

  // A checkpoint's or an export's download: a tar through the API, or presigned links from S3.
  async function download(path, fallbackName, button) {
    button.disabled = true;
    const label = button.textContent;
    button.textContent = "Preparing…";
    try {
      const resp = await api(path, { raw: true, signal });
      if ((resp.headers.get("content-type") || "").includes("application/json")) {
        // Object storage: one presigned link per file, straight from the bucket.
        const listing = await resp.json();
        const links = h("ul", { class: "hint" }, listing.files.map((f) => h("li", {}, h("a", { href: f.url, download: f.path.split("/").pop() }, f.path), ` (${fmtBytes(f.size)})`)));
        button.after(links);
      } else {
        const name = /filename="([^"]+)"/.exec(resp.headers.get("content-disposition") || "")?.[1] || fallbackName;
        const url = URL.createObjectURL(await resp.blob());
        const a = h("a", { href: url, download: name, hidden: true });
        document.body.append(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(url), 60_000);
      }
    } catch (err) {
      if (err.name !== "AbortError") showBanner(`Download failed: ${err.message}`);
    } finally {
      button.disabled = false;
      button.textContent = label;
    }
  }

  function drawCheckpoints(list) {
    if (!list.length) {
      replace(el.checkpoints, h("p", { class: "muted" }, ACTIVE.has(job.status) ? "No checkpoint saved yet." : "This job saved no checkpoints."));
      return;
    }
    const actions = { onExport: exportCheckpoint, onDownload: (e, button) =>
      download(`/v1/jobs/${enc}/exports/${encodeURIComponent(e.id)}/download`, `${jobId}-step${e.step}-${e.dtype}${e.form === "adapter" ? "-adapter" : ""}.tar`, button) };
    replace(el.checkpoints, h("div", { class: "table-wrap" }, h("table", { id: "checkpoint-table" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col", class: "num" }, "Step"), h("th", { scope: "col", class: "num" }, "Size"), h("th", { scope: "col" }, "Saved"), h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Actions")), h("th", { scope: "col" }, "Hugging Face"))),
      h("tbody", {}, list.map((c) => h("tr", { dataset: { step: String(c.step) } },
        h("td", { class: "num" }, c.step.toLocaleString()),
        h("td", { class: "num" }, fmtBytes(c.size_bytes)),
        h("td", {}, h("span", { title: fmtTime(c.created_at) }, fmtAge(c.created_at))),
        h("td", {}, h("button", { type: "button", class: "btn btn-small", "aria-label": `Download checkpoint at step ${c.step}`,
          onclick: (ev) => download(`/v1/jobs/${enc}/checkpoints/${c.step}/download`, `${jobId}-step${c.step}.tar`, ev.currentTarget) }, "Download")),
        h("td", {}, exportCell(c.step, exports, actions))))))));
  }

  async function exportCheckpoint(step, dtype, button) {
    button.disabled = true;
    try {
      const e = await api(`/v1/jobs/${enc}/exports`, { method: "POST", body: { step, format: "hf", dtype }, signal });
      exports = [...exports.filter((x) => x.id !== e.id), e];
      drawCheckpoints(checkpoints);
      poll();
    } catch (err) {
      if (err.name !== "AbortError") showBanner(`Could not export step ${step}: ${err.message}`);
      button.disabled = false;
    }
  }

  async function cancel() {
    if (!confirm(`Cancel job ${job.name}?`)) return;
    el.cancel.disabled = true;
    try {
      job = await api(`/v1/jobs/${enc}/cancel`, { method: "POST", signal });
      drawJob();
      poll();
    } catch (err) {
      if (err.name === "AbortError") return;
      showBanner(`Could not cancel: ${err.message}`);
      el.cancel.disabled = false;
    }
  }

  async function poll() {
    clearTimeout(timer);
    try {
      const [j, events, ckpts, exps] = await Promise.all([
        api(`/v1/jobs/${enc}`, { signal }), api(`/v1/jobs/${enc}/events`, { signal }), api(`/v1/jobs/${enc}/checkpoints`, { signal }),
        api(`/v1/jobs/${enc}/exports`, { signal })]);
      checkpoints = ckpts;
      exports = exps;
      const first = job === null;
      job = j;
      if (first) skeleton();
      if (!metricsLoaded) { metricsLoaded = true; startMetrics(); }
      if (!logsLoaded) { logsLoaded = true; startLogs(); }
      if (resultsWanted) loadResults();
      hideBanner();
      drawJob();
      drawEvents(events);
      drawCheckpoints(ckpts);
      samples.setCheckpoints(ckpts);
    } catch (err) {
      if (err.name === "AbortError") return;
      if (err instanceof ApiError && err.status === 404) {
        stopped = true;
        replace(main, h("div", { class: "empty", id: "not-found" }, h("strong", {}, "Job not found"),
          "No job with this id belongs to your tenant. ", h("a", { href: "#/jobs" }, "Back to jobs")));
        return;
      }
      showBanner(`Could not refresh the job: ${err.message}`);
    }
    // Exports run after a job has ended too: keep polling while one is pending or running.
    if (!stopped && (job === null || ACTIVE.has(job.status) || exports.some(exportActive))) timer = setTimeout(poll, POLL_MS);
  }

  // -- evaluation results ------------------------------------------------------------------------
  async function loadResults() {
    try {
      const r = await api(`/v1/jobs/${enc}/results`, { signal });
      resultsWanted = ACTIVE.has(job.status) && (job.kind === "eval" || r.history.length > 0);
      drawResults(r);
    } catch (err) {
      if (err.name !== "AbortError") showBanner(`Could not load the evaluation results: ${err.message}`);
    }
  }

  function drawResults(r) {
    el.resultsCard.hidden = !r.history.length;
    if (!r.history.length) return;
    const rows = [];
    for (const task of Object.keys(r.tasks).sort()) {
      for (const metric of Object.keys(r.tasks[task]).sort()) {
        const m = r.tasks[task][metric];
        const value = m.value === null ? "—" : m.value.toFixed(4);
        const stderr = m.stderr === null ? "" : ` ± ${m.stderr.toFixed(4)}`;
        rows.push(h("tr", {}, h("td", {}, task), h("td", {}, metric), h("td", { class: "num" }, value + stderr),
          h("td", { class: "num" }, String(m.n))));
      }
    }
    drawScores(r.history);
    const when = job.kind === "eval" ? "" : `at step ${r.step}`;
    replace(el.results,
      when ? h("p", { class: "sub" }, when) : null,
      h("table", { class: "table", id: "results-table" },
        h("thead", {}, h("tr", {}, h("th", {}, "Task"), h("th", {}, "Metric"), h("th", { class: "num" }, "Value"), h("th", { class: "num" }, "Items"))),
        h("tbody", {}, ...rows)));
  }

  // Scores over the steps they were taken at: shown once a job has scored at two steps or more.
  let scores = null;
  let scoresKey = "";
  function drawScores(history) {
    const names = new Map();  // "task / metric" -> [task, metric]
    for (const row of history) {
      for (const [task, metrics] of Object.entries(row.tasks)) {
        for (const metric of Object.keys(metrics)) names.set(`${task} / ${metric}`, [task, metric]);
      }
    }
    const shown = [...names.keys()].sort().slice(0, SCORE_COLORS.length);
    el.scores.hidden = history.length < 2 || !shown.length;
    if (el.scores.hidden) return;
    const key = shown.join("\n");
    if (key !== scoresKey) {  // a task or metric appeared: new series
      if (scores) scores.destroy();
      replace(el.scores);
      scores = new LineChart(el.scores, { series: shown.map((label, i) => ({ label, color: SCORE_COLORS[i], points: true })),
        format: (x) => fmtNum(x, 4) });
      scoresKey = key;
    }
    const ys = shown.map((k) => { const [task, metric] = names.get(k); return history.map((row) => row.tasks[task]?.[metric]?.value ?? null); });
    scores.setData(history.map((row) => row.step), ys);
    Object.assign(el.scores.dataset, { points: String(history.length), series: String(shown.length) });
  }

  // -- metrics -----------------------------------------------------------------------------------
  function put(row) {
    if (row.kind === "eval") return;  // evaluation results: the Evaluation card
    let entry = store.byStep.get(row.step);
    if (!entry) {
      entry = { t: null, v: null };
      store.byStep.set(row.step, entry);
      if (row.step > lastStep || !store.steps.length) store.steps.push(row.step);
      else { store.steps.push(row.step); store.steps.sort((a, b) => a - b); }
      lastStep = Math.max(lastStep, row.step);
    }
    if (row.kind === "val") entry.v = row; else entry.t = row;
  }

  function flush() {
    if (flushPending) return;
    flushPending = true;
    requestAnimationFrame(() => {
      flushPending = false;
      const xs = store.steps;
      const entries = xs.map((s) => store.byStep.get(s));
      const lastTrain = latestTrain();
      for (const { def, card, chart } of Object.values(charts)) {
        const cols = def.series.map(() => new Array(xs.length));
        let count = 0;
        entries.forEach((e, i) => def.values(e.t, e.v).forEach((v, k) => { cols[k][i] = v; if (v !== null && k === 0) count++; }));
        chart.setData(xs.slice(), cols);
        card.dataset.points = String(count);
        if (def.optional) card.hidden = count === 0;
        const last = [...entries].reverse().find((e) => def.values(e.t, e.v)[0] !== null);
        document.getElementById(`chart-${def.id}-latest`).textContent = last ? `latest ${def.format(def.values(last.t, last.v)[0])}` : "no data yet";
        // Titles and labels follow the run's device, known from any train row.
        if (def.titleOf && lastTrain) document.getElementById(`chart-${def.id}-title`).textContent = def.titleOf(lastTrain);
        if (def.labelsOf && lastTrain) chart.relabel(def.labelsOf(lastTrain));
      }
      drawMeasured();
      const shown = xs.length;
      const held = entries.reduce((n, e) => n + (e.t ? 1 : 0) + (e.v ? 1 : 0), 0);
      el.chartNote.textContent = totalRows > held
        ? `Showing ${held.toLocaleString()} of ${totalRows.toLocaleString()} metric rows: each step bucket keeps its lowest and highest loss, so spikes stay visible. Drag across a chart to zoom; double-click to reset.`
        : "Drag across a chart to zoom; double-click to reset.";
      window.megatrainPerf.points = shown;
      if (window.megatrainPerf.chartsReadyMs === null && shown > 0) {
        requestAnimationFrame(() => { window.megatrainPerf.chartsReadyMs = performance.now() - t0; });
      }
    });
  }

  async function loadMetrics() {
    const resp = await api(`/v1/jobs/${enc}/metrics?max_points=${MAX_POINTS}`, { raw: true, signal });
    const rows = await resp.json();
    totalRows = Number(resp.headers.get("X-Total-Rows") || rows.length);
    store = { steps: [], byStep: new Map() };
    lastStep = -1;
    rows.forEach(put);
    flush();
  }

  async function startMetrics() {
    try {
      await loadMetrics();
    } catch (err) {
      if (err.name !== "AbortError") { metricsLoaded = false; showBanner(`Could not load metrics: ${err.message}`); }
      return;
    }
    if (!ACTIVE.has(job.status) || metricsFollowing) return;
    metricsFollowing = true;
    follow(`/v1/jobs/${enc}/metrics?since_step=${lastStep}`, {
      signal,
      onEvent: (row) => {
        put(row);
        totalRows += 1;
        if (store.steps.length > REFETCH_AT) loadMetrics().catch(() => {});
        else flush();
      },
      onEnd: () => { metricsFollowing = false; poll(); },
    });
  }

  // -- logs --------------------------------------------------------------------------------------
  function addLines(lines) {
    const atBottom = el.logs.scrollTop + el.logs.clientHeight >= el.logs.scrollHeight - 8;
    el.logs.append(lines.map((l) => `${l.line}\n`).join(""));
    // Keep the DOM small: drop the oldest text beyond MAX_LOG_LINES.
    const text = el.logs.textContent;
    const count = (text.match(/\n/g) || []).length;
    if (count > MAX_LOG_LINES) {
      let cut = 0;
      for (let i = 0; i < count - MAX_LOG_LINES; i++) cut = text.indexOf("\n", cut) + 1;
      el.logs.textContent = text.slice(cut);
    }
    if (atBottom) el.logs.scrollTop = el.logs.scrollHeight;
  }

  async function startLogs() {
    try {
      const lines = await api(`/v1/jobs/${enc}/logs?tail=${LOG_TAIL}`, { signal });
      if (lines.length) { lastSeq = lines[lines.length - 1].seq; addLines(lines); }
      else el.logs.textContent = "";
      el.logs.dataset.empty = String(!lines.length);
    } catch (err) {
      if (err.name !== "AbortError") { logsLoaded = false; showBanner(`Could not load logs: ${err.message}`); }
      return;
    }
    el.follow.checked = ACTIVE.has(job.status);
    if (el.follow.checked) followLogs();
  }

  function followLogs() {
    if (logsFollowing) return;
    logsFollowing = new AbortController();
    signal.addEventListener("abort", () => logsFollowing?.abort());
    follow(`/v1/jobs/${enc}/logs?after_seq=${lastSeq}`, {
      signal: logsFollowing.signal,
      onEvent: (line) => { lastSeq = Math.max(lastSeq, line.seq); addLines([line]); },
      onEnd: () => { logsFollowing = null; el.follow.checked = false; },
    });
  }

  // The failed job's traceback is the log's last lines: bring the log into view at its end.
  function showLog() {
    el.logs.scrollIntoView({ block: "center" });
    el.logs.scrollTop = el.logs.scrollHeight;
    el.logs.focus({ preventScroll: true });
  }

  function stopLogs() { if (logsFollowing) { logsFollowing.abort(); logsFollowing = null; } }

  poll();
  return () => {
    stopped = true;
    clearTimeout(timer);
    controller.abort();
    samples?.stop();
    Object.values(charts).forEach(({ chart }) => chart.destroy());
    if (scores) scores.destroy();
  };
}
