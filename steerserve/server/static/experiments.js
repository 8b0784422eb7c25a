"use strict";
/* /experiments: the server's A/B experiment, refreshed live from GET /v1/steering/experiments,
   whose numbers are `steerserve ab-report`'s (the server runs the same code). */
(() => {
  const $ = (id) => document.getElementById(id);
  const { el, num, ci } = steer;
  const ARMS = ["steered", "unsteered"];
  let timer = null;

  const minScored = () => Math.max(2, Math.floor(Number($("min_scored").value)) || 30);

  async function refresh() {
    clearTimeout(timer);
    try {
      render(await steer.json("/v1/steering/experiments?min_scored=" + minScored()));
      steer.status("updated " + new Date().toLocaleTimeString());
    } catch (e) {
      steer.status(e.message, true);
      if (e.status === 401 || e.status === 403) return; // wait for a key
    }
    const every = Number($("every").value);
    if (every) timer = setTimeout(refresh, every);
  }

  function setup(snap) {
    const exp = snap.experiment;
    const lines = [
      el("h2", { text: exp ? `Running: experiment ${exp.name}` : "No experiment runs on this server" }),
      el("p", {
        text: exp
          ? `${num(exp.split * 100)} % of subjects steered (steered arm: ${exp.steered_arm}); the rest unsteered.`
          : "Start one with --ab-split (and --ab-log for the numbers). Reports of an earlier log still show below.",
      }),
      el("p", {
        class: "muted",
        text: snap.log.enabled
          ? `Decision log on; replies ${snap.log.content ? "logged and shown below (--ab-log-content)" : "not logged"}; ${snap.log.write_failures} failed writes.`
          : snap.store ? "No JSONL export (--ab-log)." : "No decision log (--ab-log) or store (--ab-store): no scores, no report.",
      }),
    ];
    const st = snap.store;
    if (st) {
      lines.push(el("p", {
        class: st.up && !st.read_error && !st.dropped ? "muted store" : "store warn",
        text: `Experiment store ${st.url} (every replica's records): ${st.up ? "reachable" : "UNREACHABLE, records queue here"}; ` +
          `this process wrote ${st.written}, ${st.queued} queued, ${st.dropped} dropped.` +
          (st.read_error ? ` Cannot read it now: ${st.read_error}` : ""),
      }));
    }
    for (const [name, arms] of Object.entries(snap.served || {})) {
      const rows = Object.entries(arms).map(([arm, by]) => {
        const ok = by["200"] || 0;
        const other = Object.entries(by).filter(([s]) => s !== "200").map(([s, n]) => `${s}: ${n}`);
        return el("tr", { "data-arm": arm }, el("td", { text: arm }), el("td", { class: "num", text: ok }),
          el("td", { text: other.join(", ") || "–" }));
      });
      lines.push(el("p", { class: "muted", text: `Requests of ${name} since this process started (metrics):` }),
        el("table", { class: "served" }, el("tr", {}, el("th", { text: "arm" }), el("th", { text: "answered" }),
          el("th", { text: "other statuses" })), ...rows));
    }
    $("setup").replaceChildren(...lines);
  }

  function armRow(label, arm, a) {
    const s = a.score, lat = a.latency_ms;
    const td = (cls, text) => el("td", { class: "num " + cls, text });
    return el("tr", { "data-language": label, "data-arm": arm }, el("td", { text: label }), el("td", { text: arm }),
      td("requests", a.requests), td("scored", s.n), td("mean", num(s.mean)), td("ci", ci(s.ci95)),
      td("p50", num(lat.p50, 4)), td("p95", num(lat.p95, 4)), el("td"));
  }

  function diffRow(label, cmp) {
    const d = cmp.difference;
    return el("tr", { class: "diff", "data-language": label, "data-arm": "difference" }, el("td", { text: label }),
      el("td", { text: "steered − unsteered" }), el("td"), el("td"), el("td", { class: "num mean", text: num(d.diff) }),
      el("td", { class: "num ci", text: ci(d.ci95) }), el("td"), el("td"), el("td", { class: "verdict", text: cmp.verdict }));
  }

  function experiment(name, exp) {
    const o = exp.overall;
    const badge = o.winner
      ? el("span", { class: "badge called", text: `called: ${o.winner} wins` })
      : el("span", { class: "badge open", text: "not called" });
    const head = el("tr", {}, ...["language", "arm", "requests", "scored", "mean score", "95 % CI", "p50 ms", "p95 ms", "verdict"]
      .map((h) => el("th", { text: h })));
    const rows = [];
    for (const [label, cmp] of [["all", o], ...Object.entries(exp.per_language)]) {
      rows.push(...ARMS.map((arm) => armRow(label, arm, cmp.arms[arm])), diffRow(label, cmp));
    }
    // the sample-ratio check, in the report's own words; loud when the split is not what was assigned
    const srm = exp.srm
      ? el("p", { class: exp.srm.warning ? "srm warn" : "srm muted", text: exp.srm.warning || "Sample ratio: " + exp.srm.summary + "." })
      : null;
    return el("section", { class: "exp", "data-experiment": name },
      el("h2", {}, `Experiment ${name} `, badge),
      ...(srm && exp.srm.warning ? [srm] : []),
      el("p", { class: "verdict", text: "Verdict: " + o.verdict + "." }),
      el("table", { class: "report" }, head, ...rows),
      ...(srm && !exp.srm.warning ? [srm] : []));
  }

  function recent(snap) {
    const box = $("recent");
    box.hidden = !snap.log.content;
    if (!snap.log.content) { box.replaceChildren(); return; }
    const head = el("tr", {}, ...["time", "arm", "language", "prompt", "reply", "score"].map((h) => el("th", { text: h })));
    const rows = snap.recent.map((r) => el("tr", { "data-id": r.id },
      el("td", { text: r.ts ? new Date(r.ts * 1000).toLocaleTimeString() : "–" }), el("td", { text: r.arm }),
      el("td", { text: r.language || "–" }), el("td", { class: "prompt", text: (r.prompt || []).join("\n") }),
      el("td", { class: "reply", text: (r.reply || []).join("\n") }), el("td", { class: "num", text: num(r.score) })));
    box.replaceChildren(el("h2", { text: "Recent replies (--ab-log-content)" }), el("table", {}, head, ...rows));
  }

  function render(snap) {
    setup(snap);
    const rep = snap.report;
    const out = [];
    if (rep) {
      out.push(el("p", { class: "muted", text: `${rep.requests} logged requests, ${rep.not_enrolled} not enrolled. A winner needs ${rep.min_scored_per_arm} scored replies per arm and an always-valid 95 % CI of the difference (mSPRT: it stays valid however often this page refreshes) that excludes 0; the difference rows show that CI.` }));
      for (const [name, exp] of Object.entries(rep.experiments)) out.push(experiment(name, exp));
      if (!Object.keys(rep.experiments).length) out.push(el("p", { text: "No enrolled requests in the log yet." }));
    }
    $("experiments").replaceChildren(...out);
    recent(snap);
  }

  for (const b of document.querySelectorAll("button[data-format]")) {
    b.addEventListener("click", async () => {
      const f = b.dataset.format;
      try {
        await steer.download(`/v1/steering/experiments/report.${f}?min_scored=${minScored()}`, `report.${f}`);
      } catch (e) {
        steer.status(e.message, true);
      }
    });
  }
  $("every").addEventListener("change", refresh);
  $("min_scored").addEventListener("change", refresh);
  steer.onKey(refresh);
  refresh();
})();
