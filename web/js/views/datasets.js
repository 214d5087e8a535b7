// Datasets: the tenant's datasets and the shared ones (state, documents, tokens, size), refreshed
// while any is being preprocessed, and a form that uploads a JSONL file. The browser streams the
// file as the request body; the API's 422 items (a bad line, a taken name) appear by their field.

import { api, ApiError } from "../api.js";
import { h, replace } from "../dom.js";
import { fmtAge, fmtBytes } from "../format.js";

const REFRESH_MS = 2000;
// Dataset states drawn with the job badges' colours.
const BADGE = { pending: "queued", processing: "running", ready: "succeeded", failed: "failed" };

export function datasetBadge(state) { return h("span", { class: `badge ${BADGE[state] || "cancelled"}` }, state); }

function tokenizerText(t) {
  if (!t || !t.type) return "—";
  return t.name ? `${t.type}:${t.name}` : t.path ? `${t.type}:${t.path.split("/").pop()}` : t.type;
}

function count(v) { return v === null || v === undefined ? "—" : v.toLocaleString(); }

function row(ds, onDelete) {
  const td = (label, content, cls = "") => h("td", { "data-label": label, class: cls }, content);
  return h("tr", { dataset: { dataset: ds.name, state: ds.state } },
    td("Dataset", [h("span", { class: "name" }, ds.name), ds.shared && h("span", { class: "id" }, "shared")], "primary"),
    td("State", [datasetBadge(ds.state),
      ds.state === "failed" && h("div", { class: "field-error" }, ds.state_reason),
      ds.state === "processing" && h("div", { class: "hint" }, ds.state_reason)]),  // the workers' progress
    td("Documents", count(ds.documents), "num"),
    td("Tokens", count(ds.tokens), "num"),
    td("Size", fmtBytes(ds.output_bytes ?? ds.input_bytes), "num"),
    td("Tokenizer", tokenizerText(ds.tokenizer), "mono"),
    td("Age", h("span", { title: new Date(ds.created_at).toLocaleString() }, fmtAge(ds.created_at)), "num"),
    td("", ds.shared ? null : h("button", { type: "button", class: "btn btn-small btn-danger", "aria-label": `Delete dataset ${ds.name}`,
      onclick: () => onDelete(ds) }, "Delete")));
}

function field(id, label, input, hint) {
  input.id = id;
  const error = h("div", { class: "field-error", id: `${id}-error` });
  input.setAttribute("aria-describedby", `${id}-error${hint ? ` ${id}-hint` : ""}`);
  return [h("div", {}, h("label", { for: id }, label), input, hint && h("div", { class: "hint", id: `${id}-hint` }, hint), error), error];
}

export function renderDatasets(main, _params, { showBanner, hideBanner }) {
  const controller = new AbortController();
  let timer = null;
  let stopped = false;

  const fileInput = h("input", { type: "file", name: "file", accept: ".jsonl,.json,application/x-ndjson", required: true });
  const nameInput = h("input", { type: "text", name: "name", spellcheck: "false", required: true });
  const tokInput = h("input", { type: "text", name: "tokenizer", value: "byte", spellcheck: "false" });
  const keyInput = h("input", { type: "text", name: "json_key", value: "text", spellcheck: "false" });
  const eodInput = h("input", { type: "checkbox", name: "append_eod", id: "ds-eod", checked: true });
  const [fileField, fileError] = field("ds-file", "JSONL file", fileInput, "One JSON object per line, its text under the JSON key.");
  const [nameField, nameError] = field("ds-name", "Name", nameInput, "What a job spec names: data.train: [{dataset: NAME}].");
  const [tokField, tokError] = field("ds-tokenizer", "Tokenizer", tokInput, "byte, hf:URL, tiktoken:NAME or sentencepiece:URL");
  const [keyField, keyError] = field("ds-json-key", "JSON key", keyInput);
  const errorsFor = { file: fileError, name: nameError, tokenizer: tokError, "tokenizer.path": tokError, json_key: keyError };
  const inputsFor = { file: fileInput, name: nameInput, tokenizer: tokInput, "tokenizer.path": tokInput, json_key: keyInput };
  const formError = h("div", { class: "field-error", id: "ds-form-error", role: "alert" });
  const status = h("div", { id: "ds-upload-status", role: "status", "aria-live": "polite" });
  const uploadBtn = h("button", { type: "submit", class: "btn btn-primary", id: "ds-upload" }, "Upload");
  fileInput.addEventListener("change", () => {
    // A name from the file's, unless the user typed one.
    if (!nameInput.value && fileInput.files[0]) nameInput.value = fileInput.files[0].name.replace(/\.(jsonl|json)$/i, "").replace(/[^A-Za-z0-9._-]/g, "-");
  });

  const form = h("form", { class: "card", id: "ds-form", novalidate: true, "aria-labelledby": "ds-form-h" },
    h("h2", { id: "ds-form-h" }, "Upload a dataset"),
    h("div", { class: "form-grid" },
      h("div", { class: "wide" }, fileField), nameField, tokField, keyField,
      h("div", {}, h("label", { for: "ds-eod" }, "End-of-document token"), h("div", { class: "row" }, eodInput, h("span", { class: "hint" }, "append to each document")))),
    formError,
    h("div", { class: "row", style: { marginTop: "0.75rem" } }, uploadBtn, status));

  const body = h("div", { class: "card", id: "datasets-card" }, h("div", { class: "loading" }, "Loading datasets…"));
  replace(main,
    h("div", { class: "page-head" }, h("div", {}, h("h1", {}, "Datasets"),
      h("div", { class: "sub" }, "JSONL corpora preprocessed on the workers into indexed datasets that jobs name."))),
    h("div", { class: "stack" }, body, form));

  function clearErrors() {
    Object.values(errorsFor).forEach((e) => (e.textContent = ""));
    Object.values(inputsFor).forEach((i) => i.removeAttribute("aria-invalid"));
    formError.textContent = "";
  }

  function showErrors(err) {
    const items = err.fields.length ? err.fields : [{ field: "", message: err.message }];
    for (const { field: name, message } of items) {
      const target = errorsFor[name];
      if (target) {
        target.textContent = message;
        inputsFor[name].setAttribute("aria-invalid", "true");
      } else {
        formError.textContent = formError.textContent ? `${formError.textContent} ${message}` : message;
      }
    }
    (items.map((i) => inputsFor[i.field]).find(Boolean) || uploadBtn).focus();
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    clearErrors();
    const file = fileInput.files[0];
    if (!file) { fileError.textContent = "Choose a JSONL file."; fileInput.setAttribute("aria-invalid", "true"); fileInput.focus(); return; }
    if (!nameInput.value.trim()) { nameError.textContent = "Give the dataset a name."; nameInput.setAttribute("aria-invalid", "true"); nameInput.focus(); return; }
    const q = new URLSearchParams({ name: nameInput.value.trim(), tokenizer: tokInput.value.trim() || "byte",
      json_key: keyInput.value.trim() || "text", append_eod: String(eodInput.checked) });
    uploadBtn.disabled = true;
    status.textContent = `Uploading ${fmtBytes(file.size)}…`;
    try {
      const ds = await api(`/v1/datasets?${q}`, { method: "POST", body: file, contentType: "application/x-ndjson", signal: controller.signal });
      status.textContent = `Uploaded ${ds.name}: ${ds.state}.`;
      form.reset();
      tokInput.value = "byte"; keyInput.value = "text"; eodInput.checked = true;
      refresh();
    } catch (err) {
      if (err.name === "AbortError") return;
      status.textContent = "";
      if (err instanceof ApiError && [409, 413, 415, 422].includes(err.status)) showErrors(err);
      else showBanner(`Could not upload: ${err.message}`);
    } finally {
      uploadBtn.disabled = false;
    }
  });

  async function remove(ds) {
    if (!window.confirm(`Delete dataset ${ds.name} and its files?`)) return;
    try {
      await api(`/v1/datasets/${encodeURIComponent(ds.name)}`, { method: "DELETE", signal: controller.signal, raw: true });
      refresh();
    } catch (err) {
      if (err.name !== "AbortError") showBanner(`Could not delete ${ds.name}: ${err.message}`);
    }
  }

  async function refresh() {
    clearTimeout(timer);
    let busy = false;
    try {
      const { items } = await api("/v1/datasets", { signal: controller.signal });
      hideBanner();
      busy = items.some((d) => d.state === "pending" || d.state === "processing");
      if (!items.length) {
        replace(body, h("div", { class: "empty" }, h("strong", {}, "No datasets yet"), "Upload a JSONL file below."));
      } else {
        const headers = ["Dataset", "State", "Documents", "Tokens", "Size", "Tokenizer", "Age", ""];
        const numeric = new Set(["Documents", "Tokens", "Size", "Age"]);
        replace(body, h("div", { class: "table-wrap" }, h("table", { class: "cards", id: "datasets-table" },
          h("caption", { class: "visually-hidden" }, "Datasets"),
          h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col", class: numeric.has(t) ? "num" : "" }, t)))),
          h("tbody", {}, items.map((d) => row(d, remove))))));
      }
    } catch (err) {
      if (err.name === "AbortError") return;
      showBanner(`Could not load datasets: ${err.message}`);
    }
    // Poll quickly only while the workers have something to finish.
    if (!stopped) timer = setTimeout(refresh, busy ? REFRESH_MS : 5 * REFRESH_MS);
  }

  refresh();
  return () => { stopped = true; clearTimeout(timer); controller.abort(); };
}
