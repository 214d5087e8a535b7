// Evaluation results of several jobs side by side (#/compare/ID1,ID2,...): one row per task and
// metric, one column per job (value ± stderr), the best value of each row marked. From a job's
// Evaluation card ("Compare with…") or typed by hand.
import { api, ApiError } from "../api.js";
import { h, replace } from "../dom.js";

// lm-eval's own sense of "better" for the metrics our tasks report (and eval.perplexity's loss);
// others are shown unmarked.
const LOWER_IS_BETTER = new Set(["perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "loss"]);
const HIGHER_IS_BETTER = new Set(["acc", "acc_norm", "exact_match", "f1", "mcc", "bleu", "rouge1", "rougeL"]);

function cell(m) {
  if (!m || m.value === null) return "—";
  return m.value.toFixed(4) + (m.stderr === null ? "" : ` ± ${m.stderr.toFixed(4)}`);
}

function best(metric, values) {
  const known = values.filter((v) => v !== null);
  if (known.length < 2) return null;
  if (LOWER_IS_BETTER.has(metric)) return Math.min(...known);
  if (HIGHER_IS_BETTER.has(metric)) return Math.max(...known);
  return null;
}

export function renderCompare(main, [list], { showBanner, hideBanner }) {
  const controller = new AbortController();
  const ids = [...new Set((list || "").split(",").map((s) => s.trim()).filter(Boolean))];
  replace(main, h("div", { class: "loading" }, "Loading results…"));

  async function load() {
    try {
      const answers = await Promise.all(ids.map(async (id) => {
        const enc = encodeURIComponent(id);
        try {
          const [job, results] = await Promise.all([api(`/v1/jobs/${enc}`, { signal: controller.signal }),
            api(`/v1/jobs/${enc}/results`, { signal: controller.signal })]);
          return { id, job, results };
        } catch (err) {
          if (err instanceof ApiError && err.status === 404) return { id, missing: true };
          throw err;
        }
      }));
      hideBanner();
      draw(answers);
    } catch (err) {
      if (err.name !== "AbortError") showBanner(`Could not load the results: ${err.message}`);
    }
  }

  function draw(answers) {
    const keys = new Set();
    for (const a of answers) for (const [task, ms] of Object.entries(a.results?.tasks || {})) for (const m of Object.keys(ms)) keys.add(`${task}\t${m}`);
    const rows = [...keys].sort().map((key) => {
      const [task, metric] = key.split("\t");
      const ms = answers.map((a) => a.results?.tasks?.[task]?.[metric] || null);
      const top = best(metric, ms.map((m) => (m ? m.value : null)));
      return h("tr", {}, h("td", {}, task), h("td", {}, metric),
        ms.map((m) => h("td", { class: m && top !== null && m.value === top ? "num best" : "num" }, cell(m))));
    });
    const head = answers.map((a) => h("th", { scope: "col", class: "num" },
      a.missing ? h("span", { class: "muted" }, `${a.id} (not found)`) : h("a", { href: `#/jobs/${encodeURIComponent(a.id)}` }, a.job.name),
      a.missing ? null : h("div", { class: "sub mono" }, a.id)));
    replace(main,
      h("nav", { "aria-label": "Breadcrumb", class: "sub", style: { marginBottom: "0.5rem" } }, h("a", { href: "#/jobs" }, "← Jobs")),
      h("div", { class: "page-head" }, h("div", {}, h("h1", {}, "Compare results"),
        h("div", { class: "sub" }, `${answers.length} jobs; the best value of a row is in bold where the metric says which way is better.`))),
      h("section", { class: "card" }, rows.length
        ? h("div", { class: "table-wrap" }, h("table", { class: "table", id: "compare-table" },
          h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Task"), h("th", { scope: "col" }, "Metric"), head)),
          h("tbody", {}, rows)))
        : h("div", { class: "empty", id: "compare-empty" }, h("strong", {}, "No results yet"), "None of these jobs has evaluation results.")));
  }

  load();
  return () => controller.abort();
}
