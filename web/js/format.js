// Number, size and time formatting for tables and tiles (tabular numerals come from CSS).

export const STATES = ["queued", "scheduled", "running", "succeeded", "failed", "cancelled"];
export const ACTIVE = new Set(["queued", "scheduled", "running"]);

export function fmtNum(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (v !== 0 && (Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3)) return v.toExponential(2);
  return Number(v).toLocaleString(undefined, { maximumFractionDigits: digits });
}

export function fmtCount(v) {
  if (v === null || v === undefined) return "—";
  const units = [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]];
  for (const [u, s] of units) if (Math.abs(v) >= s) return `${(v / s).toFixed(v / s >= 100 ? 0 : 1)}${u}`;
  return String(Math.round(v));
}

export function fmtRate(v) { return v === null || v === undefined ? "—" : `${fmtCount(v)}/s`; }
export function fmtPct(v) { return v === null || v === undefined ? "—" : `${(v * 100).toFixed(1)}%`; }

export function fmtBytes(v) {
  if (v === null || v === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

export function fmtAge(iso, now = Date.now()) {
  if (!iso) return "—";
  const s = Math.max(0, (now - Date.parse(iso)) / 1000);
  if (s < 5) return "just now";
  if (s < 60) return `${Math.floor(s)}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ago`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
  return `${Math.floor(s / 86400)}d ago`;
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

// Jobs run one process per device: a GPU, or a CPU slot on a pool without GPUs. `kinds` maps pool
// names to the cluster's slot_kind; a pool it does not know, or a mix of kinds, reads "Devices".
export function devicesWord(pools, kinds) {
  const words = new Set(pools.map((p) => kinds.get(p) || "Devices"));
  return words.size === 1 ? [...words][0] : "Devices";
}

export function fmtTime(iso) { return iso ? new Date(iso).toLocaleString() : "—"; }

export function layoutText(layout) {
  if (!layout) return "—";
  const parts = [`tp${layout.tp}`, `pp${layout.pp}`, `dp${layout.dp}`];
  if (layout.cp > 1) parts.push(`cp${layout.cp}`);
  return parts.join(" · ");
}

export function paramsText(job) {
  // The engine's exact count once it started, else the spec's (plan.shapes, experts included).
  const total = job.num_params || job.params_estimate;
  if (!total) return "—";
  const text = job.num_params ? fmtCount(total) : `≈${fmtCount(total)}`;
  const active = job.params_active_estimate;
  const base = active && active !== job.params_estimate ? `${text} (${fmtCount(active)} active)` : text;
  // LoRA / QLoRA: the adapters it trains, beside the frozen model (and their share of it).
  const trainable = job.params_trainable_estimate;
  if (!trainable) return base;
  const share = (100 * trainable / (total + trainable)).toFixed(2);
  return `${base} · ${fmtCount(trainable)} trainable (${share}%)`;
}

// "2 of 3" counts the failed starts against max_retries; preempted and continued attempts are not
// failures and never spend the user's retries, so they are named apart.
export function attemptText(job) {
  const apart = (job.preemptions || 0) + (job.continuations || 0);
  let text = `${job.attempt - apart} of ${job.max_retries + 1}`;
  if (job.preemptions) text += ` · preempted ${job.preemptions}/${job.max_preemptions}`;
  if (job.continuations) text += ` · continued ${job.continuations}`;
  return text;
}
