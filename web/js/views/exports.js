// A checkpoint's Hugging Face exports on the job page: their states (pending → running → ready |
// failed, with the reason), a download per ready one, and the "Export to Hugging Face" action.

import { h } from "../dom.js";
import { fmtBytes } from "../format.js";

const EXPORT_BADGE = { pending: "queued", running: "running", ready: "succeeded", failed: "failed" };

export const exportActive = (e) => e.status === "pending" || e.status === "running";

function exportItem(e, onDownload) {
  const state = h("span", { class: `badge ${EXPORT_BADGE[e.status] || "queued"}` }, e.status);
  // A LoRA job's adapter export (PEFT's folder, from the CLI or SDK) is told apart from its model.
  const label = e.form === "adapter" ? `${e.dtype} adapter` : e.dtype;
  return h("li", { class: "export", dataset: { exportId: e.id, status: e.status, dtype: e.dtype } },
    h("span", { class: "mono" }, label), " ", state,
    e.status === "ready" ? [" ", h("span", { class: "muted" }, fmtBytes(e.size_bytes)), " ",
      h("button", { type: "button", class: "btn btn-small", "aria-label": `Download the ${label} Hugging Face export of step ${e.step}`,
        onclick: (ev) => onDownload(e, ev.currentTarget) }, "Download")] : null,
    e.status === "failed" && e.error ? h("div", { class: "hint export-error" }, e.error) : null);
}

/** The cell of one checkpoint row: its exports and the action that starts another. */
export function exportCell(step, exports, { onExport, onDownload }) {
  const mine = exports.filter((e) => e.step === step);
  const dtype = h("select", { "aria-label": `Export dtype for step ${step}`, class: "export-dtype" },
    h("option", { value: "bf16" }, "bf16"), h("option", { value: "fp32" }, "fp32"));
  const button = h("button", { type: "button", class: "btn btn-small", "aria-label": `Export step ${step} to Hugging Face`,
    onclick: (ev) => onExport(step, dtype.value, ev.currentTarget) }, "Export to Hugging Face");
  return h("div", { class: "exports" },
    mine.length ? h("ul", { class: "export-list" }, mine.map((e) => exportItem(e, onDownload))) : null,
    h("div", { class: "row" }, dtype, button));
}
