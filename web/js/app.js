// The dashboard shell: hash routes, sign-in gate, theme toggle and the error banner. Each view is
// `render(main, params, ctx)` returning a cleanup function (stops its polling and streams).

import { api, ApiError, clearKey, getKey, onUnauthorized, setKey } from "./api.js";
import { h, replace } from "./dom.js";
import { renderCluster } from "./views/cluster.js";
import { renderCompare } from "./views/compare.js";
import { renderDatasets } from "./views/datasets.js";
import { renderJob } from "./views/job.js";
import { renderJobs } from "./views/jobs.js";
import { renderSubmit } from "./views/submit.js";

const main = document.getElementById("main");
const banner = document.getElementById("banner");
let cleanup = null;
let signInMessage = null;

// -- banner ------------------------------------------------------------------------------------
export function showBanner(message, { kind = "error", action = null } = {}) {
  replace(banner, h("div", { class: `banner ${kind === "warn" ? "warn" : ""}` },
    h("span", {}, message),
    action,
    h("button", { type: "button", class: "btn btn-small btn-ghost", "aria-label": "Dismiss", onclick: hideBanner }, "✕")));
}
export function hideBanner() { replace(banner); }

// -- theme -------------------------------------------------------------------------------------
const THEMES = ["auto", "light", "dark"];
function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  const btn = document.getElementById("theme-toggle");
  btn.textContent = { auto: "◐ Auto", light: "☀ Light", dark: "☾ Dark" }[theme];
  btn.setAttribute("aria-label", `Colour theme: ${theme}. Change theme`);
  window.dispatchEvent(new CustomEvent("megatrain:theme"));
}
function currentTheme() { return localStorage.getItem("megatrain.theme") || "auto"; }
document.getElementById("theme-toggle").addEventListener("click", () => {
  const next = THEMES[(THEMES.indexOf(currentTheme()) + 1) % THEMES.length];
  localStorage.setItem("megatrain.theme", next);
  applyTheme(next);
});
applyTheme(currentTheme());

// -- sign-in -----------------------------------------------------------------------------------
function renderSignIn(el) {
  const error = h("div", { class: "field-error", id: "key-error", role: "alert" }, signInMessage || "");
  signInMessage = null;
  const input = h("input", { id: "api-key", name: "api-key", type: "password", autocomplete: "off", spellcheck: "false",
    placeholder: "mt_…", required: true, "aria-describedby": "key-hint key-error" });
  const button = h("button", { type: "submit", class: "btn btn-primary" }, "Sign in");
  const form = h("form", { class: "card stack", onsubmit: async (ev) => {
    ev.preventDefault();
    const key = input.value.trim();
    if (!key) { error.textContent = "Enter an API key."; input.setAttribute("aria-invalid", "true"); return; }
    button.disabled = true;
    error.textContent = "";
    try {
      const resp = await fetch("/v1/jobs?limit=1", { headers: { Authorization: `Bearer ${key}` } });
      if (resp.status === 401) {
        error.textContent = "This API key was not accepted: it is invalid or has been revoked. Check it and try again.";
        input.setAttribute("aria-invalid", "true");
        input.focus();
        return;
      }
      if (!resp.ok) throw new ApiError(resp.status, (await resp.json().catch(() => ({}))).detail);
      setKey(key);
      location.hash = sessionStorage.getItem("megatrain.after") || "#/jobs";
      sessionStorage.removeItem("megatrain.after");
      route();
    } catch (err) {
      error.textContent = `Could not sign in: ${err.message}`;
    } finally {
      button.disabled = false;
    }
  } },
    h("div", {}, h("label", { for: "api-key" }, "API key"), input,
      h("div", { class: "hint", id: "key-hint" }, "Kept in this tab's session storage only; closing the tab signs you out. ",
        "The local stack's key is in ~/.megatrain/credentials (megatrain up prints where).")),
    error,
    h("div", {}, button));
  replace(el, h("section", { class: "signin" },
    h("h1", {}, "Sign in"),
    h("p", {}, "Everything shown here belongs to the tenant of the key you sign in with."),
    form));
  input.focus();
  return () => {};
}

onUnauthorized(() => {
  clearKey();
  signInMessage = "Your API key is no longer accepted (revoked or invalid). Sign in again.";
  if (!location.hash.startsWith("#/signin")) sessionStorage.setItem("megatrain.after", location.hash);
  location.hash = "#/signin";
});

document.getElementById("sign-out").addEventListener("click", () => {
  clearKey();
  location.hash = "#/signin";
});

// -- routing -----------------------------------------------------------------------------------
const ROUTES = [
  [/^#\/jobs\/([^/]+)$/, renderJob, "jobs"],
  [/^#\/jobs\/?$/, renderJobs, "jobs"],
  [/^#\/submit$/, renderSubmit, "submit"],
  [/^#\/cluster$/, renderCluster, "cluster"],
  [/^#\/datasets$/, renderDatasets, "datasets"],
  [/^#\/compare\/([^/]+)$/, renderCompare, "jobs"],
];

async function showTenant() {
  const label = document.getElementById("tenant-label");
  label.hidden = true;
  // The key's prefix identifies it without showing it.
  const key = getKey();
  if (key) { label.textContent = `key ${key.slice(0, 7)}…`; label.hidden = false; }
}

export function route() {
  if (cleanup) { cleanup(); cleanup = null; }
  hideBanner();
  const hash = location.hash || "#/jobs";
  const signedIn = Boolean(getKey());
  document.getElementById("sign-out").hidden = !signedIn;
  showTenant();
  if (!signedIn || hash === "#/signin") {
    if (!signedIn && hash !== "#/signin") sessionStorage.setItem("megatrain.after", hash);
    document.querySelectorAll("[data-nav]").forEach((a) => a.removeAttribute("aria-current"));
    cleanup = renderSignIn(main);
    return;
  }
  for (const [pattern, view, nav] of ROUTES) {
    const m = hash.match(pattern);
    if (!m) continue;
    document.querySelectorAll("[data-nav]").forEach((a) =>
      a.dataset.nav === nav ? a.setAttribute("aria-current", "page") : a.removeAttribute("aria-current"));
    cleanup = view(main, m.slice(1).map(decodeURIComponent), { showBanner, hideBanner, api }) || null;
    return;
  }
  location.hash = "#/jobs";
}

window.addEventListener("hashchange", () => { route(); main.focus({ preventScroll: true }); });
route();
