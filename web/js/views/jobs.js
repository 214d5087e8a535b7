// Jobs list: the tenant's jobs, newest first, filtered by state, refreshed every few seconds.

import { api } from "../api.js";
import { h, replace } from "../dom.js";
import { ACTIVE, STATES, devicesWord, fmtAge, fmtDuration, fmtNum, fmtPct, fmtRate, layoutText, paramsText } from "../format.js";
import { slotKinds } from "./cluster.js";

const REFRESH_MS = 2500;
const PAGE = 50;

export function badge(status) { return h("span", { class: `badge ${status}` }, status); }

export function progress(job) {
  const pct = job.total_steps ? Math.min(100, (100 * job.current_step) / job.total_steps) : 0;
  return h("div", { class: "progress-cell" },
    h("div", { class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": Math.round(pct),
      "aria-label": `step ${job.current_step} of ${job.total_steps}` }, h("span", { style: { width: `${pct}%` } })),
    h("span", { class: "num" }, `${job.current_step.toLocaleString()} / ${job.total_steps.toLocaleString()}`));
}

export function ordinal(n) {
  const tens = n % 100, ones = n % 10;
  const suffix = tens >= 11 && tens <= 13 ? "th" : ({ 1: "st", 2: "nd", 3: "rd" }[ones] || "th");
  return `${n}${suffix}`;
}

// Where a job stands, in a few words: "3rd in queue" while it waits, "ETA 12m 5s" while it runs
// (steps left at the median of its recent measured step times); "" otherwise.
export function standing(job) {
  if (job.status === "queued" && job.queue_position) return `${ordinal(job.queue_position)} in queue`;
  if (job.status === "running" && job.eta_s !== null && job.eta_s !== undefined) return `ETA ${fmtDuration(job.eta_s)}`;
  return "";
}

// The job page's header line: "3rd in queue: needs 8 free slots in pool 'gpu'; …" for a queued
// job, the reason followed by the ETA and pace for a running one.
export function headerLine(job, reason) {
  const where = standing(job);
  if (job.status === "queued" && where) return `${where}: ${reason.replace(/^waiting: /, "")}`;
  if (job.status === "running" && where) {
    const pace = job.step_time_s ? ` (${job.step_time_s.toPrecision(3)} s/step)` : "";
    return [reason, `${where}${pace}`].filter(Boolean).join(" · ");
  }
  return reason;
}

function row(job, devices) {
  const td = (label, content, cls = "") => h("td", { "data-label": label, class: cls }, content);
  return h("tr", { dataset: { jobId: job.id, status: job.status } },
    td("Job", [h("a", { class: "name", href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name), h("span", { class: "id" }, job.id)], "primary"),
    td("State", [badge(job.status), standing(job) && h("span", { class: "muted standing" }, ` ${standing(job)}`)]),
    td("Params", paramsText(job), "num"),
    td("Layout", layoutText(job.layout), "mono"),
    td(devices, String(job.num_procs), "num"),
    td("Progress", progress(job)),
    td("Loss", fmtNum(job.latest_loss, 4), "num"),
    td("Tokens/s", fmtRate(job.latest_tokens_per_s), "num"),
    td("MFU", fmtPct(job.latest_mfu), "num"),
    td("Age", h("span", { title: new Date(job.created_at).toLocaleString() }, fmtAge(job.created_at)), "num"));
}

export function renderJobs(main, _params, { showBanner, hideBanner }) {
  let filter = sessionStorage.getItem("megatrain.jobs.filter") || "";
  let limit = PAGE;
  let timer = null;
  let stopped = false;
  const controller = new AbortController();

  const chips = h("div", { class: "chips", role: "group", "aria-label": "Filter by state" },
    ["", ...STATES].map((s) => h("button", { type: "button", class: "chip", "aria-pressed": String(s === filter), dataset: { state: s },
      onclick: () => {
        filter = s; limit = PAGE;
        sessionStorage.setItem("megatrain.jobs.filter", s);
        chips.querySelectorAll(".chip").forEach((c) => c.setAttribute("aria-pressed", String(c.dataset.state === s)));
        refresh();
      } }, s || "all")));
  const body = h("div", { class: "card", id: "jobs-card" }, h("div", { class: "loading" }, "Loading jobs…"));
  const updated = h("span", { class: "muted", "aria-live": "off" });
  replace(main,
    h("div", { class: "page-head" },
      h("div", {}, h("h1", {}, "Jobs"), h("div", { class: "sub" }, "Your tenant's training jobs, live. ", updated)),
      h("a", { class: "btn btn-primary", href: "#/submit" }, "+ New job")),
    h("div", { class: "stack" }, chips, body));

  async function refresh() {
    clearTimeout(timer);
    try {
      const q = new URLSearchParams({ limit: String(limit) });
      if (filter) q.set("status", filter);
      const [page, kinds] = await Promise.all([api(`/v1/jobs?${q}`, { signal: controller.signal }), slotKinds()]);
      hideBanner();
      draw(page, kinds);
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}.`;
    } catch (err) {
      if (err.name === "AbortError") return;
      showBanner(`Could not load jobs: ${err.message}`);
    }
    if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
  }

  function draw(page, kinds) {
    if (!page.items.length) {
      replace(body, h("div", { class: "empty" },
        h("strong", {}, filter ? `No ${filter} jobs` : "No jobs yet"),
        filter ? "Try another state filter." : "Submit a job spec to start training.",
        !filter && h("div", { style: { marginTop: "0.8rem" } }, h("a", { class: "btn btn-primary", href: "#/submit" }, "Submit a job"))));
      return;
    }
    // The processes column: "GPUs" or "CPU slots" when every listed job's pool agrees, else "Devices".
    const devices = devicesWord(page.items.map((j) => j.pool), kinds);
    const headers = ["Job", "State", "Params", "Layout", devices, "Progress", "Loss", "Tokens/s", "MFU", "Age"];
    const numeric = new Set(["Params", devices, "Loss", "Tokens/s", "MFU", "Age"]);
    const focused = document.activeElement && document.activeElement.closest && document.activeElement.closest("tr")?.dataset.jobId;
    const table = h("table", { class: "cards", id: "jobs-table" },
      h("caption", { class: "visually-hidden" }, "Jobs"),
      h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col", class: numeric.has(t) ? "num" : "" }, t)))),
      h("tbody", {}, page.items.map((j) => row(j, devices))));
    const more = page.next_cursor && h("div", { style: { textAlign: "center", marginTop: "0.75rem" } },
      h("button", { type: "button", class: "btn", onclick: () => { limit = Math.min(500, limit + PAGE); refresh(); } }, "Show more"));
    replace(body, h("div", { class: "table-wrap" }, table), more);
    // Keep keyboard focus on the same job's link across refreshes.
    if (focused) body.querySelector(`tr[data-job-id="${CSS.escape(focused)}"] a`)?.focus();
    const anyActive = page.items.some((j) => ACTIVE.has(j.status));
    body.dataset.active = String(anyActive);
  }

  refresh();
  return () => { stopped = true; clearTimeout(timer); controller.abort(); };
}
