"use strict";
/* /compare: one question, both arms of POST /v1/chat/completions/ab streamed side by side, what
   was applied to each, tokens and latency, the differences highlighted once both are done, and
   the pair judged (A better, B better, tie: POST /v1/steering/preference, one per pair). */
(() => {
  const $ = (id) => document.getElementById(id);
  const { el, num } = steer;
  const ARMS = ["unsteered", "steered"];
  let artifacts = [];
  let pair = null; // the id of the pair shown, once both answers are done
  // who judges (the pairs' subject: one person's judgements move together); this page only
  const judge = "compare-" + Array.from(crypto.getRandomValues(new Uint8Array(8)), (b) => b.toString(16).padStart(2, "0")).join("");

  async function load() {
    try {
      const models = await steer.json("/v1/models");
      $("model").replaceChildren(...models.data.map((m) => el("option", { value: m.id, text: m.id })));
      const vecs = await steer.json("/v1/steering/vectors");
      artifacts = vecs.data;
      const opts = [
        // the A/B endpoint's steered arm always steers: auto means on there (its language gate aside)
        el("option", { value: "auto", text: "auto: as on here (the language is shown, not gated)" }),
        el("option", { value: "on", text: "on: the default artifact" }),
        ...artifacts.map((a) => el("option", { value: "art:" + a.id, text: a.id + ": per intervention" })),
      ];
      $("steering").replaceChildren(...opts);
      showMultipliers();
      steer.status(artifacts.length ? "" : "no steering artifact is loaded: the steered arm cannot be steered", !artifacts.length);
    } catch (e) {
      steer.status(e.message, true);
    }
  }

  function chosenArtifact() {
    const v = $("steering").value || "";
    return v.startsWith("art:") ? artifacts.find((a) => "art:" + a.id === v) : undefined;
  }

  function showMultipliers() {
    const art = chosenArtifact();
    $("multipliers").hidden = !art;
    if (!art) return;
    const rows = art.manifest.interventions.map((iv) => {
      const input = el("input", { type: "number", step: "0.1", value: "1", "data-name": iv.name });
      const sent = el("td", { class: "num", text: num(iv.scale) });
      input.addEventListener("input", () => { sent.textContent = num(iv.scale * Number(input.value)); });
      return el("tr", {}, el("td", { text: iv.name }), el("td", { class: "num", text: iv.layer }),
        el("td", { class: "num", text: num(iv.scale) }), el("td", { text: iv.positions }), el("td", {}, input), sent);
    });
    $("multipliers").querySelector("tbody").replaceChildren(...rows);
  }

  function steering() {
    const art = chosenArtifact();
    if (!art) return $("steering").value || "auto";
    const interventions = {};
    for (const input of $("multipliers").querySelectorAll("input[data-name]")) {
      interventions[input.dataset.name] = Number(input.value);
    }
    return { artifact: art.id, interventions };
  }

  function pane(arm, part) {
    return $("arm-" + arm).querySelector(part);
  }

  function showApplied(arm, info, id) {
    const ivs = info.interventions || [];
    const arts = [...new Set(ivs.map((iv) => iv.artifact + " " + iv.version))];
    const rows = [
      ["applied", info.applied ? "yes" : "no"],
      ["policy", info.policy],
      ["artifact, version", arts.join(", ") || "–"],
      ["layers", ivs.map((iv) => iv.layer).join(", ") || "–"],
      ["interventions", ivs.map((iv) => `${iv.name} @ layer ${iv.layer} × ${num(iv.scale)} (${iv.positions})`).join("; ") || "–"],
      ["detected language", info.detected_language || "–"],
      ["id", id],
    ];
    pane(arm, "dl").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
  }

  function showStats(arm, s) {
    const parts = [];
    if (s.usage) parts.push(`${s.usage.completion_tokens} tokens (prompt ${s.usage.prompt_tokens})`);
    if (s.first !== null) parts.push(`first token ${Math.round(s.first)} ms`);
    if (s.done !== null) parts.push(`done ${Math.round(s.done)} ms`);
    if (s.finish) parts.push(`finish: ${s.finish}`);
    pane(arm, ".stats").textContent = parts.join(" · ");
  }

  /** Words, spaces and single other characters (so CJK text compares by character). */
  function tokens(text) {
    return text.match(/\s+|(?:(?![\p{sc=Han}\p{sc=Hiragana}\p{sc=Katakana}])[\p{L}\p{N}_])+|[\s\S]/gu) || [];
  }

  /** Mark what differs: the unsteered text's tokens not in the longest common subsequence as
      <del>, the steered text's as <ins>; built with text nodes only. */
  function highlight(a, b) {
    const x = tokens(a), y = tokens(b);
    if (x.length * y.length > 4e6) return false;
    const n = x.length, m = y.length, w = m + 1;
    const L = new Uint32Array((n + 1) * w);
    for (let i = n - 1; i >= 0; i--) {
      for (let j = m - 1; j >= 0; j--) {
        L[i * w + j] = x[i] === y[j] ? L[(i + 1) * w + j + 1] + 1 : Math.max(L[(i + 1) * w + j], L[i * w + j + 1]);
      }
    }
    const outA = [], outB = [];
    let i = 0, j = 0;
    const push = (out, tag, t) => {
      const last = out[out.length - 1];
      if (last && last.tag === tag) last.text += t; else out.push({ tag, text: t });
    };
    while (i < n || j < m) {
      if (i < n && j < m && x[i] === y[j]) { push(outA, null, x[i++]); push(outB, null, y[j++]); }
      else if (j < m && (i === n || L[i * w + j + 1] >= L[(i + 1) * w + j])) push(outB, "ins", y[j++]);
      else push(outA, "del", x[i++]);
    }
    const nodes = (out) => out.map((p) => (p.tag ? el(p.tag, { text: p.text }) : document.createTextNode(p.text)));
    pane("unsteered", ".reply").replaceChildren(...nodes(outA));
    pane("steered", ".reply").replaceChildren(...nodes(outB));
    return true;
  }

  function onChunk(chunk, st, t0) {
    if (chunk.error) throw new steer.ApiError(chunk.error.code || 500, chunk.error.message);
    const s = st[chunk.arm];
    if (!s) return;
    if (chunk.steering && !s.applied) { s.applied = true; showApplied(chunk.arm, chunk.steering, chunk.id); }
    if (chunk.id) s.id = chunk.id;
    if (chunk.usage) s.usage = chunk.usage;
    for (const c of chunk.choices || []) {
      if (c.index !== 0) continue;
      if (c.delta && c.delta.content) {
        if (s.first === null) s.first = performance.now() - t0;
        s.text += c.delta.content;
        pane(chunk.arm, ".reply").textContent = s.text;
      }
      if (c.finish_reason) { s.finish = c.finish_reason; s.done = performance.now() - t0; }
    }
    showStats(chunk.arm, s);
  }

  async function readEvents(r, each) {
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, k);
        buf = buf.slice(k + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ") && line !== "data: [DONE]") each(JSON.parse(line.slice(6)));
        }
      }
    }
  }

  async function send(ev) {
    ev.preventDefault();
    const text = $("message").value.trim();
    if (!text) { steer.status("type a question first", true); return; }
    const body = {
      model: $("model").value,
      messages: [{ role: "user", content: text }],
      temperature: Number($("temperature").value),
      max_tokens: Number($("max_tokens").value),
      stream: true,
      stream_options: { include_usage: true },
      steering: steering(),
      user: judge,
    };
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    const st = {};
    for (const arm of ARMS) {
      st[arm] = { text: "", first: null, done: null, usage: null, finish: null, applied: false };
      pane(arm, ".reply").replaceChildren();
      pane(arm, "dl").replaceChildren();
      pane(arm, ".stats").textContent = "";
    }
    $("identical").hidden = true;
    $("judge").hidden = true;
    $("judged").textContent = "";
    pair = null;
    $("send").disabled = true;
    steer.status("generating both arms…");
    const t0 = performance.now();
    try {
      const r = await steer.request("/v1/chat/completions/ab", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body),
      });
      await readEvents(r, (chunk) => onChunk(chunk, st, t0));
      const [a, b] = ARMS.map((arm) => st[arm].text);
      $("identical").textContent = a === b ? "The two answers are identical." : "";
      $("identical").hidden = a !== b;
      const marked = a !== b && highlight(a, b);
      steer.status(a === b || marked ? "done" : "done (too long to highlight the differences)");
      pair = (st.unsteered.id || "").replace(/-a$/, "") || null;
      $("judge").hidden = !pair;
      for (const btn of $("judge").querySelectorAll("button")) btn.disabled = false;
    } catch (e) {
      steer.status(e.message, true);
    } finally {
      $("send").disabled = false;
    }
  }

  /** The person's judgement of the pair shown: recorded once (the server refuses a second). */
  async function prefer(choice) {
    if (!pair) return;
    const buttons = $("judge").querySelectorAll("button");
    for (const btn of buttons) btn.disabled = true;
    try {
      const got = await steer.json("/v1/steering/preference", {
        method: "POST", headers: { "content-type": "application/json" },
        body: JSON.stringify({ id: pair, preference: choice }),
      });
      const words = { a: "A (unsteered) better", b: "B (steered) better", tie: "a tie" }[got.preference];
      $("judged").textContent = `recorded: ${words} (pair ${got.id}, experiment ${got.experiment})`;
      $("judged").className = "muted recorded";
    } catch (e) {
      $("judged").textContent = e.message;
      $("judged").className = "error";
      if (e.status >= 500) for (const btn of buttons) btn.disabled = false; // retryable
    }
  }

  for (const btn of document.querySelectorAll("#judge button")) btn.addEventListener("click", () => prefer(btn.dataset.preference));
  $("steering").addEventListener("change", showMultipliers);
  $("ask").addEventListener("submit", send);
  $("message").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) $("ask").requestSubmit();
  });
  steer.onKey(load);
  load();
})();
