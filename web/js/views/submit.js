// Submit: a form for the common fields and an editor holding the full spec (JSON, or YAML sent as
// application/yaml). Form and editor stay in step; the API's own 422 items are shown next to the
// form field they name, or under the editor for fields the form does not have.

import { api, ApiError } from "../api.js";
import { h, replace } from "../dom.js";
import { layoutText } from "../format.js";

const DRAFT = "megatrain.submit.draft";

// [spec path, label, input type, options]
const FIELDS = [
  ["name", "Name", "text", { wide: true, hint: "Letters, digits, dots, dashes, underscores." }],
  ["model.arch", "Architecture", "select", { options: ["llama", "gpt2"] }],
  ["model.num_layers", "Layers", "number"],
  ["model.hidden_size", "Hidden size", "number"],
  ["model.num_attention_heads", "Attention heads", "number"],
  ["model.seq_length", "Sequence length", "number"],
  ["data.train.0.path", "Training data", "text", { wide: true, hint: "file:///abs/path or s3://bucket/key, under your tenant's data prefix." }],
  ["data.train.0.dataset", "Dataset", "select", { wide: true, options: [""], labels: { "": "— none: read the path above —" },
    hint: "Or a ready dataset you uploaded (Datasets); the API fills in its path." }],
  ["training.train_iters", "Iterations", "number"],
  ["training.global_batch_size", "Global batch", "number"],
  ["training.micro_batch_size", "Micro batch", "number"],
  ["training.lr", "Learning rate", "number", { step: "any" }],
  // Short option labels: a third of the form's width holds them (a long one was cut off).
  ["training.precision", "Precision", "select", { options: ["auto", "bf16", "fp16", "fp32"],
    hint: "auto: bf16 where the device runs it natively, else fp32." }],
  ["resources.devices", "Devices", "number", { hint: "Processes: GPUs, or CPU slots on a CPU pool. Empty: tp × pp × dp." }],
  ["resources.pool", "Pool", "text"],
  ["resources.priority", "Priority", "number"],
];

// Until the server's example arrives (GET /v1/spec/example: a spec on data that exists), and when
// there is no data at all: no made-up path, the API then names the missing data source.
const NO_DATA = {
  name: "my-job",
  model: { arch: "llama", num_layers: 4, hidden_size: 128, num_attention_heads: 4, seq_length: 128 },
  data: { train: [{ path: "" }] },
  training: { train_iters: 200, global_batch_size: 16, micro_batch_size: 4, lr: 3e-3, precision: "auto" },
  resources: { devices: 1, pool: "default", priority: 0 },
};

function getPath(obj, path) {
  return path.split(".").reduce((o, k) => (o === null || o === undefined ? undefined : o[k]), obj);
}
function setPath(obj, path, value) {
  const keys = path.split(".");
  let o = obj;
  keys.slice(0, -1).forEach((k, i) => {
    if (o[k] === null || typeof o[k] !== "object") o[k] = /^\d+$/.test(keys[i + 1]) ? [] : {};
    o = o[k];
  });
  const last = keys[keys.length - 1];
  if (value === undefined) delete o[last]; else o[last] = value;
}

function isJson(text) { try { JSON.parse(text); return true; } catch (_) { return false; } }

export function renderSubmit(main, _params, { showBanner, hideBanner }) {
  const controller = new AbortController();
  const inputs = {};
  const errors = {};
  const formFields = FIELDS.map(([path, label, type, opt = {}]) => {
    const id = `f-${path.replace(/\./g, "-")}`;
    const input = type === "select"
      ? h("select", { id, name: path }, opt.options.map((o) => h("option", { value: o }, (opt.labels || {})[o] ?? o)))
      : h("input", { id, name: path, type, step: opt.step, inputmode: type === "number" ? "decimal" : null, spellcheck: "false" });
    input.dataset.field = path;
    inputs[path] = input;
    errors[path] = h("div", { class: "field-error", id: `${id}-error`, "data-error-for": path });
    input.setAttribute("aria-describedby", `${id}-error${opt.hint ? ` ${id}-hint` : ""}`);
    input.addEventListener("input", () => formToEditor());
    return h("div", { class: opt.wide ? "wide" : "" }, h("label", { for: id }, label), input,
      opt.hint && h("div", { class: "hint", id: `${id}-hint` }, opt.hint), errors[path]);
  });

  const editor = h("textarea", { id: "spec-editor", class: "editor", spellcheck: "false", "aria-describedby": "editor-hint editor-errors",
    "aria-label": "Full job spec, JSON or YAML" });
  const editorErrors = h("ul", { class: "errors-list", id: "editor-errors", role: "alert" });
  const result = h("div", { id: "submit-result", role: "status", "aria-live": "polite" });
  const validateBtn = h("button", { type: "button", class: "btn", id: "validate" }, "Validate");
  const submitBtn = h("button", { type: "submit", class: "btn btn-primary", id: "submit" }, "Submit job");
  const resetBtn = h("button", { type: "button", class: "btn btn-ghost", id: "reset-spec" }, "Reset to template");
  const templateNote = h("p", { class: "hint", id: "template-note", role: "status" });
  // With YAML in the editor the form cannot follow it (no YAML parser here): it is switched off, so
  // that no edit of it is silently left out of what Validate and Submit send.
  const formFieldset = h("fieldset", {}, h("legend", { class: "visually-hidden" }, "Common fields"), h("div", { class: "form-grid" }, formFields));
  const formNote = h("p", { class: "hint", id: "form-note", role: "status", hidden: true });

  const form = h("form", { class: "submit-grid", novalidate: true },
    h("section", { class: "card", "aria-labelledby": "common-h" },
      h("h2", { id: "common-h" }, "Common fields"), formNote, formFieldset),
    h("section", { class: "card", "aria-labelledby": "editor-h" },
      h("h2", { id: "editor-h" }, "Full spec"),
      templateNote,
      h("p", { class: "hint", id: "editor-hint" }, "Every JobSpec field (",
        h("a", { href: "/v1/spec/schema", target: "_blank", rel: "noopener" }, "schema"),
        "). JSON stays in step with the form; paste YAML to send it as YAML."),
      editor, editorErrors,
      h("div", { class: "row", style: { marginTop: "0.75rem" } }, submitBtn, validateBtn, resetBtn),
      result));

  replace(main,
    h("div", { class: "page-head" }, h("div", {}, h("h1", {}, "Submit a job"),
      h("div", { class: "sub" }, "The API checks the spec, its layout, the pool and the data paths before anything runs."))),
    form);

  function formToEditor() {
    const text = editor.value;
    if (!isJson(text)) return;  // YAML in the editor: the form does not overwrite it
    const spec = JSON.parse(text);
    for (const [path, , type] of FIELDS) {
      const raw = inputs[path].value.trim();
      let value = raw === "" ? undefined : type === "number" ? Number(raw) : raw;
      if (type === "number" && raw !== "" && Number.isNaN(value)) value = raw;  // the API names the bad field
      setPath(spec, path, value);
    }
    editor.value = JSON.stringify(spec, null, 2);
    sessionStorage.setItem(DRAFT, editor.value);
  }

  function editorToForm() {
    sessionStorage.setItem(DRAFT, editor.value);
    const json = isJson(editor.value);
    formFieldset.disabled = !json;
    formNote.hidden = json;
    formNote.textContent = editor.value.trim().startsWith("{")
      ? "The full spec is not valid JSON: fix it there; the form follows it again once it is."
      : "The full spec is YAML: edit it there (the form follows JSON only).";
    if (!json) return;
    const spec = JSON.parse(editor.value);
    for (const [path] of FIELDS) {
      const v = getPath(spec, path);
      inputs[path].value = v === undefined || v === null ? "" : String(v);
      // A select left unset by the spec shows its first option, the API's default (precision auto).
      if (inputs[path].tagName === "SELECT" && inputs[path].selectedIndex < 0) inputs[path].selectedIndex = 0;
    }
  }
  editor.addEventListener("input", editorToForm);
  let template = NO_DATA;
  resetBtn.addEventListener("click", () => { editor.value = JSON.stringify(template, null, 2); editorToForm(); clearErrors(); });

  function clearErrors() {
    Object.values(errors).forEach((e) => (e.textContent = ""));
    Object.values(inputs).forEach((i) => i.removeAttribute("aria-invalid"));
    editor.removeAttribute("aria-invalid");
    replace(editorErrors);
    replace(result);
  }

  function showErrors(err) {
    const items = err.fields.length ? err.fields : [{ field: "", message: err.message }];
    let firstInput = null;
    for (const { field, message } of items) {
      // Exact field, else the form field it lies under (data.train.0 -> data.train.0.path).
      // (None while the form is off: the editor's YAML is what was sent.)
      const path = formFieldset.disabled ? undefined : FIELDS.map(([p]) => p).find((p) => p === field || p.startsWith(`${field}.`));
      if (path) {
        errors[path].textContent = errors[path].textContent ? `${errors[path].textContent} ${message}` : message;
        inputs[path].setAttribute("aria-invalid", "true");
        firstInput = firstInput || inputs[path];
      } else {
        editor.setAttribute("aria-invalid", "true");
        editorErrors.append(h("li", {}, field ? h("code", {}, field) : null, field ? ": " : null, message));
        firstInput = firstInput || editor;
      }
    }
    firstInput?.focus();
  }

  async function send(path) {
    clearErrors();
    hideBanner();
    const text = editor.value;
    const json = isJson(text);
    validateBtn.disabled = submitBtn.disabled = true;
    try {
      const out = await api(path, { method: "POST", body: text, contentType: json ? "application/json" : "application/yaml", signal: controller.signal });
      return out;
    } catch (err) {
      if (err.name === "AbortError") return null;
      if (err instanceof ApiError && (err.status === 422 || err.status === 409 || err.status === 415)) showErrors(err);
      else showBanner(`Could not submit: ${err.message}`);
      return null;
    } finally {
      validateBtn.disabled = submitBtn.disabled = false;
    }
  }

  validateBtn.addEventListener("click", async () => {
    const check = await send("/v1/spec/validate");
    if (check) {
      replace(result, h("p", { class: "ok-note" }, `✓ Valid. Layout ${layoutText(check.layout)} on ${check.num_procs} process${check.num_procs === 1 ? "" : "es"}`));
    }
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const job = await send("/v1/jobs");
    if (job) {
      sessionStorage.removeItem(DRAFT);
      location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
    }
  });

  // Picking a dataset replaces the path; the ready datasets arrive after the form is drawn.
  const datasetSelect = inputs["data.train.0.dataset"];
  datasetSelect.addEventListener("change", () => {
    if (datasetSelect.value) inputs["data.train.0.path"].value = "";
    formToEditor();
  });
  api("/v1/datasets", { signal: controller.signal }).then(({ items }) => {
    const ready = items.filter((d) => d.state === "ready");
    datasetSelect.append(...ready.map((d) => h("option", { value: d.name }, `${d.name}${d.shared ? " (shared)" : ""}${d.tokens == null ? "" : ` · ${d.tokens.toLocaleString()} tokens`}`)));
    editorToForm();  // a draft naming one of them shows it selected
  }).catch((err) => { if (err.name !== "AbortError") showBanner(`Could not load datasets: ${err.message}`); });

  editor.value = sessionStorage.getItem(DRAFT) || JSON.stringify(template, null, 2);
  editorToForm();
  // The template trains on data that exists: a ready dataset, else the demo corpus, else none.
  api("/v1/spec/example", { signal: controller.signal }).then((example) => {
    templateNote.textContent = example.hint;
    if (!example.spec) return;
    template = example.spec;
    if (editor.value === JSON.stringify(NO_DATA, null, 2)) {  // not a draft of the user's
      editor.value = JSON.stringify(template, null, 2);
      editorToForm();
    }
  }).catch((err) => { if (err.name !== "AbortError") showBanner(`Could not load the example spec: ${err.message}`); });
  inputs.name.focus();
  return () => controller.abort();
}
