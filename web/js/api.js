// The API client: the key lives in sessionStorage (gone when the tab closes), every request sends it
// as a Bearer token, and errors come back as ApiError with the API's own {field, message} items.

const KEY_STORAGE = "megatrain.key";

export function getKey() {
  try { return sessionStorage.getItem(KEY_STORAGE); } catch (_) { return null; }
}
export function setKey(key) { sessionStorage.setItem(KEY_STORAGE, key); }
export function clearKey() { sessionStorage.removeItem(KEY_STORAGE); }

export class ApiError extends Error {
  constructor(status, detail) {
    const fields = Array.isArray(detail) ? detail.filter((d) => d && typeof d === "object") : [];
    const message = typeof detail === "string" ? detail
      : fields.length ? fields.map((f) => f.message).join("; ") : `request failed (HTTP ${status})`;
    super(message);
    this.status = status;
    this.fields = fields;
  }
}

// Listeners for a 401 anywhere (the key was revoked mid-session): the app sends the user to sign-in.
const unauthorizedListeners = new Set();
export function onUnauthorized(fn) { unauthorizedListeners.add(fn); }

function headers(extra = {}) {
  const key = getKey();
  return { ...(key ? { Authorization: `Bearer ${key}` } : {}), ...extra };
}

async function fail(resp) {
  let detail = null;
  try { detail = (await resp.json()).detail; } catch (_) { /* not JSON */ }
  if (resp.status === 401) unauthorizedListeners.forEach((fn) => fn(detail));
  if (resp.status === 503 && !detail) detail = "the API is unavailable; retrying";
  return new ApiError(resp.status, detail);
}

/** fetch JSON from the API; `body` objects are sent as JSON, strings and Blobs (a File, streamed by
 * the browser) with `contentType`. */
export async function api(path, { method = "GET", body, contentType, signal, raw = false } = {}) {
  const init = { method, signal, headers: headers() };
  if (body !== undefined) {
    init.body = typeof body === "string" || body instanceof Blob ? body : JSON.stringify(body);
    init.headers["Content-Type"] = contentType || "application/json";
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "cannot reach the API (network error); retrying");
  }
  if (!resp.ok) throw await fail(resp);
  return raw ? resp : resp.json();
}

/**
 * Follow a Server-Sent Events endpoint with fetch (EventSource cannot send an Authorization
 * header). Reconnects after a drop, resuming with Last-Event-ID; stops at `event: end` or abort.
 * onEvent(data, id) per message; onEnd(data) once the stream says the job has finished.
 */
export function follow(path, { onEvent, onEnd, onError, signal }) {
  let lastId = null;
  let retryMs = 2000;
  const run = async () => {
    while (!signal.aborted) {
      try {
        const h = headers({ Accept: "text/event-stream" });
        if (lastId !== null) h["Last-Event-ID"] = lastId;
        const resp = await fetch(path, { headers: h, signal });
        if (!resp.ok) throw await fail(resp);
        const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            let event = "message", id = null, data = "";
            for (const line of block.split("\n")) {
              if (line.startsWith(":")) continue;
              const i = line.indexOf(":");
              const name = i < 0 ? line : line.slice(0, i);
              const val = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
              if (name === "event") event = val;
              else if (name === "id") id = val;
              else if (name === "data") data += (data ? "\n" : "") + val;
              else if (name === "retry") retryMs = Number(val) || retryMs;
            }
            if (!data) continue;
            const parsed = JSON.parse(data);
            if (event === "end") { onEnd && onEnd(parsed); return; }
            if (id !== null) lastId = id;
            onEvent(parsed, id);
          }
        }
      } catch (err) {
        if (signal.aborted) return;
        onError && onError(err);
        if (err instanceof ApiError && (err.status === 401 || err.status === 404)) return;
      }
      await new Promise((r) => setTimeout(r, retryMs));
    }
  };
  run();
}
