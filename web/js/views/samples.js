// The job page's "Sample" panel: a prompt continued by a worker from the job's latest checkpoint.
// Generate posts a sample (greedy, or sampled at the temperature given); the panel shows it at once
// (pending), polls while any is pending or running, then shows the text with its step and time, or
// the failure reason. Ctrl/Cmd+Enter in the prompt generates too.

import { api } from "../api.js";
import { h, replace } from "../dom.js";
import { fmtAge, fmtTime } from "../format.js";

const POLL_MS = 1000;
const BADGE = { pending: "queued", running: "running", ready: "succeeded", failed: "failed" };
const active = (s) => s.status === "pending" || s.status === "running";

function sampleItem(s) {
  const meta = [`step ${s.step.toLocaleString()}`];
  if (s.status === "ready") {
    meta.push(`${s.new_tokens ?? 0} tokens`);
    if (s.elapsed_s != null) meta.push(`${s.elapsed_s.toFixed(2)} s`);
  }
  meta.push(s.temperature == null ? "greedy" : `temperature ${s.temperature}`);
  return h("li", { class: "sample", dataset: { sampleId: s.id, status: s.status } },
    h("div", { class: "row sample-head" },
      h("span", { class: `badge ${BADGE[s.status] || "queued"}` }, s.status),
      h("span", { class: "muted sample-meta" }, meta.join(" · ")),
      h("time", { class: "muted", datetime: s.created_at, title: fmtTime(s.created_at) }, fmtAge(s.created_at))),
    // The prompt, then what the model wrote after it.
    h("pre", { class: "sample-text", tabindex: "0", "aria-label": `Sample ${s.id}` },
      h("span", { class: "sample-prompt" }, s.prompt),
      s.status === "ready" ? h("span", { class: "sample-output" }, s.text) : null),
    s.status === "failed" ? h("div", { class: "field-error sample-error" }, s.error || "failed") : null,
    active(s) ? h("div", { class: "hint" }, "Generating… (a worker loads the checkpoint first)") : null);
}

/** The panel; `setCheckpoints(list)` tells it whether there is anything to sample from. */
export function samplePanel(jobId, { signal, showBanner }) {
  const enc = encodeURIComponent(jobId);
  let samples = [];
  let timer = null;
  let steps = [];

  const prompt = h("textarea", { id: "sample-prompt", rows: "4", maxlength: "4000", required: true, spellcheck: "false",
    "aria-describedby": "sample-prompt-hint sample-form-error", placeholder: "def fibonacci(n):" });
  const maxTokens = h("input", { id: "sample-max-tokens", type: "number", min: "1", max: "256", step: "1", value: "64", inputmode: "numeric" });
  const temperature = h("input", { id: "sample-temperature", type: "number", min: "0.05", max: "10", step: "0.05",
    placeholder: "greedy", inputmode: "decimal", "aria-describedby": "sample-prompt-hint" });
  const generate = h("button", { type: "submit", class: "btn btn-primary", id: "sample-generate" }, "Generate");
  const formError = h("div", { class: "field-error", id: "sample-form-error", role: "alert" });
  const note = h("p", { class: "hint", id: "sample-note" });
  const list = h("ul", { class: "sample-list", id: "sample-list", "aria-live": "polite", "aria-label": "Samples, newest first" });
  const form = h("form", { id: "sample-form", class: "sample-form", novalidate: true, onsubmit: submit },
    h("label", { for: "sample-prompt" }, "Prompt"), prompt,
    h("div", { class: "hint", id: "sample-prompt-hint" }, "Continued from the latest checkpoint; greedy when the temperature is empty. Ctrl+Enter generates."),
    h("div", { class: "row sample-options" },
      h("div", {}, h("label", { for: "sample-max-tokens" }, "Max tokens"), maxTokens),
      h("div", {}, h("label", { for: "sample-temperature" }, "Temperature"), temperature),
      generate),
    formError);
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); form.requestSubmit(); }
  });
  const el = h("section", { class: "card", id: "sample-panel", "aria-labelledby": "sample-h" },
    h("h2", { id: "sample-h" }, "Sample"), note, form, list);

  function draw() {
    replace(list, samples.map(sampleItem));
    clearTimeout(timer);
    if (samples.some(active) && !signal.aborted) timer = setTimeout(refresh, POLL_MS);
  }

  async function refresh() {
    try {
      samples = await api(`/v1/jobs/${enc}/samples`, { signal });
      draw();
    } catch (err) {
      if (err.name === "AbortError") return;
      showBanner(`Could not load samples: ${err.message}`);
      timer = setTimeout(refresh, POLL_MS * 3);
    }
  }

  function invalid(input, message) {
    input.setAttribute("aria-invalid", "true");
    formError.textContent = message;
    input.focus();
  }

  async function submit(ev) {
    ev.preventDefault();
    for (const input of [prompt, maxTokens, temperature]) input.removeAttribute("aria-invalid");
    formError.textContent = "";
    if (!prompt.value.trim()) return invalid(prompt, "Write a prompt to continue.");
    const body = { prompt: prompt.value, max_new_tokens: Number(maxTokens.value || 64) };
    if (temperature.value !== "") body.temperature = Number(temperature.value);
    generate.disabled = true;
    try {
      const s = await api(`/v1/jobs/${enc}/samples`, { method: "POST", body, signal });
      samples = [s, ...samples.filter((x) => x.id !== s.id)];
      draw();
    } catch (err) {
      if (err.name === "AbortError") return;
      const field = err.fields?.[0]?.field;
      const input = { prompt, max_new_tokens: maxTokens, temperature }[field];
      if (input) invalid(input, `${field.replace(/_/g, " ")}: ${err.fields[0].message}`);
      else formError.textContent = `Could not sample: ${err.message}`;
    } finally {
      generate.disabled = steps.length === 0;
    }
  }

  function setCheckpoints(list) {
    steps = list.map((c) => c.step);
    generate.disabled = steps.length === 0;
    note.textContent = steps.length
      ? `Samples come from the latest checkpoint (step ${steps[steps.length - 1].toLocaleString()}).`
      : "Sampling needs a checkpoint: this job has none yet.";
  }

  setCheckpoints([]);
  refresh();
  return { el, setCheckpoints, stop: () => clearTimeout(timer) };
}
