// Cluster: pools and nodes with their slots busy and free, and the queue in scheduling order with
// why each job waits. Other tenants' jobs are counted but never named (the API leaves them out).

import { api } from "../api.js";
import { h, replace } from "../dom.js";
import { fmtAge, fmtPct } from "../format.js";

const REFRESH_MS = 3000;
const KINDS_MS = 30_000;

// What each pool's slots are called ("GPUs", "CPU slots"), for the pages that count a job's
// processes; fetched once in a while, never per row.
let kinds = null;
export function slotKinds() {
  if (!kinds || performance.now() - kinds.at > KINDS_MS) {
    const promise = api("/v1/cluster").then((view) => new Map(view.pools.map((p) => [p.name, p.slot_kind])))
      .catch(() => { kinds = null; return new Map(); });
    kinds = { at: performance.now(), promise };
  }
  return kinds.promise;
}

function slots(node) {
  const cells = [];
  for (const j of node.jobs) for (let i = 0; i < j.slots; i++) cells.push(h("span", { class: `slot busy ${j.own ? "" : "other"}`, title: j.own ? `${j.name} (${j.status})` : "another tenant's job" }));
  // Slots held by jobs this snapshot does not list (a race) still count as busy.
  while (cells.length < node.slots_used) cells.push(h("span", { class: "slot busy other" }));
  while (cells.length < node.slots_total) cells.push(h("span", { class: "slot", title: "free" }));
  return h("div", { class: "slots", role: "img", "aria-label": `${node.slots_used} of ${node.slots_total} busy` }, cells);
}

const GIB = 2 ** 30;

// The pool's described hardware: by its operator, or as its worker measured this machine.
function hardware(pool) {
  const hw = pool.hardware;
  if (!hw) return h("p", { class: "hint hardware" }, "Hardware not described yet (megatrain pools apply, or a worker measures it).");
  const peaks = Object.entries(hw.peak_tflops).map(([p, v]) => `${p} ${Number(v.toPrecision(4))}`).join(", ");
  const fact = (label, value) => [h("dt", {}, label), h("dd", { class: "num" }, value)];
  return h("dl", { class: "kv hardware", dataset: { describedBy: pool.described_by || "" } },
    fact("Accelerator", hw.accelerator),
    fact("Memory per device", `${(hw.device_memory_bytes / GIB).toFixed(1)} GiB`),
    fact("Peak TFLOP/s per device", peaks),
    fact("Devices", `${hw.devices_per_node} per node × ${hw.nodes} node${hw.nodes === 1 ? "" : "s"}`),
    fact("Inside a node", `${hw.intra_node_bandwidth_gbps} GB/s · ${hw.intra_node_latency_us} µs`),
    fact("Across nodes", `${hw.inter_node_bandwidth_gbps} GB/s · ${hw.inter_node_latency_us} µs`),
    fact("Described by", pool.described_by === "operator" ? "the operator" : "measurement of this machine"));
}

function nodeLine(n) {
  if (n.status === "lost") {
    return h("span", { class: "muted num" }, `no heartbeat since ${fmtAge(n.last_seen_at)}: its slots are not offered, its jobs failed over`);
  }
  if (n.status === "quarantined") {
    return h("span", { class: "muted num quarantine" },
      `${n.quarantine_reason || "repeated failures"}: its slots are not offered until an operator runs \`megatrain nodes release ${n.hostname}\``);
  }
  const problems = (n.health && n.health.problems) || [];
  // The node's goodput: the productive share of the attempts placed on it (null before any ended).
  const good = n.goodput && n.goodput.goodput != null ? ` · goodput ${fmtPct(n.goodput.goodput)} over ${n.goodput.attempts} attempt${n.goodput.attempts === 1 ? "" : "s"}` : "";
  return h("span", { class: "muted num" }, `${n.slots_used}/${n.slots_total} busy · seen ${fmtAge(n.last_seen_at)}${good}${problems.length ? ` · ${problems.join("; ")}` : ""}`);
}

function poolCard(pool) {
  const lost = pool.nodes_lost || 0;
  const held = pool.nodes_quarantined || 0;
  return h("section", { class: "card", dataset: { pool: pool.name } },
    h("div", { class: "page-head", style: { marginBottom: "0.25rem" } },
      h("h2", { style: { margin: 0 } }, pool.name),
      h("span", { class: "muted" }, pool.accelerator)),
    h("p", { class: "num", style: { margin: "0 0 0.5rem" } },
      h("strong", {}, `${pool.slots_used} busy`), ` · ${pool.slots_free} free · ${pool.slots_total} ${pool.slot_kind}`,
      lost ? h("span", { class: "lost", style: { color: "var(--danger)", fontWeight: 600 } }, ` · ${lost} node${lost === 1 ? "" : "s"} lost`) : null,
      held ? h("span", { class: "quarantined", style: { color: "var(--danger)", fontWeight: 600 } }, ` · ${held} node${held === 1 ? "" : "s"} quarantined`) : null),
    hardware(pool),
    pool.nodes.length ? pool.nodes.map((n) => h("div", { class: `node ${n.status}`, dataset: { node: n.hostname, status: n.status }, style: { marginTop: "0.6rem" } },
      h("div", { class: "row" }, h("span", { class: "mono" }, n.hostname),
        h("span", { class: `badge ${n.status === "ready" ? "succeeded" : "failed"}` }, n.status),
        nodeLine(n)),
      n.status === "ready" ? slots(n) : null,
      n.jobs.filter((j) => j.own).map((j) => h("div", { class: "hint" }, h("a", { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.name), ` · ${j.status} · ${j.slots} slot${j.slots === 1 ? "" : "s"}`))))
      : h("p", { class: "muted" }, "No nodes registered."));
}

function queueTable(queue) {
  if (!queue.length) return h("div", { class: "empty" }, h("strong", {}, "The queue is empty"), "Every submitted job has been placed.");
  return h("div", { class: "table-wrap" }, h("table", { id: "queue-table", class: "cards" },
    h("thead", {}, h("tr", {}, ["#", "Job", "Pool", "Slots", "Priority", "Waiting", "Why it waits"].map((t) => h("th", { scope: "col", class: ["#", "Slots", "Priority"].includes(t) ? "num" : "" }, t)))),
    h("tbody", {}, queue.map((q) => h("tr", { dataset: { own: String(q.own) } },
      h("td", { class: "num", "data-label": "Position" }, q.position == null ? "–" : String(q.position)),
      h("td", { class: "primary" }, q.own ? [h("a", { class: "name", href: `#/jobs/${encodeURIComponent(q.id)}` }, q.name), h("span", { class: "id" }, q.id)] : h("span", { class: "muted" }, "another tenant's job")),
      h("td", { "data-label": "Pool" }, q.pool),
      h("td", { class: "num", "data-label": "Slots" }, String(q.slots)),
      h("td", { class: "num", "data-label": "Priority" }, String(q.priority)),
      h("td", { "data-label": "Waiting" }, fmtAge(q.queued_at).replace(" ago", "")),
      h("td", { "data-label": "Why" }, q.reason))))));
}

// The placement rule in the scheduler's own words (its module docstring, served by /v1/cluster):
// the page cannot describe a rule the scheduler no longer follows.
function showRules(scheduling, order, rules) {
  replace(order, `: ${scheduling.summary}`);
  const code = (text) => text.split("`").map((part, i) => (i % 2 ? h("code", {}, part) : part));
  rules.append(h("ol", {}, scheduling.rules.map((r) => h("li", {}, h("strong", {}, r.title), " ", code(r.text)))));
  rules.hidden = false;
}

export function renderCluster(main, _params, { showBanner, hideBanner }) {
  const controller = new AbortController();
  let timer = null;
  const pools = h("div", { class: "pools", id: "pools" }, h("div", { class: "loading" }, "Loading…"));
  const queue = h("div", { id: "queue" });
  const order = h("span", { id: "scheduling-order" });
  const rules = h("details", { class: "rules", id: "scheduling-rules", hidden: true }, h("summary", {}, "How the scheduler orders and places jobs"));
  replace(main,
    h("div", { class: "page-head" }, h("div", {}, h("h1", {}, "Cluster"),
      h("div", { class: "sub" }, "Pools (their hardware), nodes (ready or lost) and the queue in scheduling order", order, "."))),
    h("div", { class: "stack" }, pools, h("section", { class: "card", "aria-labelledby": "queue-h" }, h("h2", { id: "queue-h" }, "Queue"), queue, rules)));

  async function refresh() {
    try {
      const view = await api("/v1/cluster", { signal: controller.signal });
      hideBanner();
      replace(pools, view.pools.length ? view.pools.map(poolCard) : h("div", { class: "card empty" }, h("strong", {}, "No pools"), "Start a scheduler or worker to register nodes."));
      replace(queue, queueTable(view.queue));
      if (view.scheduling && rules.hidden) showRules(view.scheduling, order, rules);
    } catch (err) {
      if (err.name === "AbortError") return;
      showBanner(`Could not load the cluster: ${err.message}`);
    }
    timer = setTimeout(refresh, REFRESH_MS);
  }
  refresh();
  return () => { clearTimeout(timer); controller.abort(); };
}
