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

export function predictionPanel(predicted, rows) {
  const recent = rows.slice(-RECENT_ROWS);
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
          h("th", { scope: "row" }, label), h("td", {}, fmt(want)), h("td", {}, fmt(got)), h("td", {}, diff(want, got))))))),
    h("p", { class: "hint" }, recent.length
      ? `Measured: medians of the last ${recent.length} logged intervals; memory is the allocator's peak (GPU only).`
      : "The measured figures appear with the first metrics."));
}
