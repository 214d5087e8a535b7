// The Layout panel's "Predicted vs measured": the planner's prediction for the job's layout (the
// `submitted` event's plan) beside the medians of what the job measured, with the % difference.
import { h } from "../dom.js";
import { fmtBytes, fmtNum, fmtPct, fmtRate } from "../format.js";

// Medians over the last train rows: one slow interval (a checkpoint's) does not move them.
export const RECENT_ROWS = 5;
function median(values) {
  const v = values.filter((x) => typeof x === "number" && x > 0).sort((a, b) => a - b);
  if (!v.length) return null;
  const m = Math.floor(v.length / 2);
  return v.length % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// The host's other load over the same rows (the engine's host_* fields, megatrain.hostinfo.HostLoad):
// a step time measured while other processes took the job's cores measures their work too.
function hostLoad(recent) {
  const rows = recent.filter((r) => typeof r.host_other_cores === "number");
  if (!rows.length) return null;
  const other = rows.map((r) => r.host_other_cores).sort((a, b) => a - b);
  const m = Math.floor(other.length / 2);
  return {
    other: other.length % 2 ? other[m] : (other[m - 1] + other[m]) / 2,
    cores: rows[rows.length - 1].host_cores,
    // Under load when most of the intervals were (the engine's rule: hostinfo.under_load).
    loaded: 2 * rows.filter((r) => r.host_under_load).length > rows.length,
  };
}

function loadNote(load) {
  if (!load) return null;
  const of = `${fmtNum(load.other, 2)} of ${load.cores} core${load.cores === 1 ? "" : "s"}`;
  return h("p", { id: "host-load", class: load.loaded ? "hint under-load" : "hint" }, load.loaded
    ? `Taken under load: other processes kept ${of} busy beside the job, so the measured figures include their work (greyed).`
    : `Host's other load while measured: ${of}.`);
}

export function predictionPanel(predicted, rows) {
  const recent = rows.slice(-RECENT_ROWS);
  const load = hostLoad(recent);
  const grey = load?.loaded ? "under-load" : null;
  const measured = (k) => median(recent.map((r) => r[k]));
  const peak = recent.length ? recent[recent.length - 1].peak_memory_bytes ?? null : null;
  const diff = (want, got) => (want && got !== null ? `${got >= want ? "+" : ""}${(100 * (got - want) / want).toFixed(0)}%` : "—");
  const secs = (v) => (v === null || v === undefined ? "—" : `${fmtNum(v, 3)} s`);
  const lines = [
    ["step", "Step time", predicted.step_time_s, measured("iter_time_s"), secs],
    ["tokens", "Tokens/s", predicted.tokens_per_s, measured("tokens_per_s"), fmtRate],
    ["mfu", "MFU", predicted.mfu, measured("mfu"), fmtPct],
    ["memory", "Memory per device", predicted.memory_per_gpu_bytes, peak, (v) => (v === null || v === undefined ? "—" : fmtBytes(v))],
  ];
  return h("div", { id: "prediction" },
    h("h3", {}, "Predicted vs measured"),
    h("div", { class: "table-wrap" },  // scrolls inside its card on a phone, never the page
      h("table", { id: "prediction-table" },
        h("thead", {}, h("tr", {}, ["", "Predicted", "Measured", "Difference"].map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", {}, lines.map(([key, label, want, got, fmt]) => h("tr", { dataset: { quantity: key } },
          h("th", { scope: "row" }, label), h("td", {}, fmt(want)), h("td", { class: grey }, fmt(got)), h("td", { class: grey }, diff(want, got))))))),
    loadNote(load),
    h("p", { class: "hint" }, recent.length
      ? `Measured: medians of the last ${recent.length} logged intervals; memory is the allocator's peak (GPU only).`
      : "The measured figures appear with the first metrics."));
}
