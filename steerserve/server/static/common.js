"use strict";
/* Shared by steerserve's pages: the API key (kept in this page's memory only, never stored),
   API calls that send it, and DOM building that only ever sets text: replies are untrusted. */
const steer = (() => {
  let key = "";
  const onKeyFns = [];

  /** An element with text children only (append() of a string makes a text node). */
  function el(tag, props = {}, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (v === undefined || v === null) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = String(v);
      else e.setAttribute(k, String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function needKey() {
    const s = document.getElementById("keystate");
    s.textContent = "this server needs its API key";
    s.className = "needed";
    document.getElementById("key").focus();
  }

  /** fetch() with the key; a non-2xx answer throws its OpenAI-format error message. */
  async function request(path, opts = {}) {
    const headers = Object.assign({}, opts.headers || {});
    if (key) headers.Authorization = "Bearer " + key;
    const r = await fetch(path, Object.assign({}, opts, { headers }));
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try {
        const body = await r.json();
        if (body && body.error && body.error.message) msg = body.error.message;
      } catch (e) { /* not JSON: keep the status line */ }
      if (r.status === 401) needKey();
      throw new ApiError(r.status, msg);
    }
    return r;
  }

  async function json(path, opts) {
    return (await request(path, opts)).json();
  }

  /** Save what ``path`` answers as ``filename`` (fetched with the key, so no key in a URL). */
  async function download(path, filename) {
    const blob = await (await request(path)).blob();
    const url = URL.createObjectURL(blob);
    const a = el("a", { href: url, download: filename });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  }

  /** Like Python's ``f"{x:.3g}"`` for the numbers shown here; "–" for none. */
  function num(x, digits = 3) {
    if (x === null || x === undefined) return "–";
    return String(parseFloat(Number(x).toPrecision(digits)));
  }

  function ci(c) {
    return c ? "[" + num(c[0]) + ", " + num(c[1]) + "]" : "–";
  }

  function status(text, error = false) {
    const s = document.getElementById("status");
    s.textContent = text;
    s.className = error ? "error" : "";
  }

  document.getElementById("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    key = document.getElementById("key").value.trim();
    const s = document.getElementById("keystate");
    s.textContent = key ? "key set (kept in this page only)" : "";
    s.className = "";
    onKeyFns.forEach((fn) => fn());
  });

  return { el, request, json, download, num, ci, status, ApiError, onKey: (fn) => onKeyFns.push(fn) };
})();
