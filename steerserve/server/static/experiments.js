"use strict";
/* /experiments: the server's A/B experiment, refreshed live from GET /v1/steering/experiments,
   whose numbers are `steerserve ab-report`'s (the server runs the same code). The charts are SVG
   built here from those numbers, with text set as text only. */
(() => {
  const $ = (id) => document.getElementById(id);
  const { el, num, ci } = steer;
  const NS = "http://www.w3.org/2000/svg";
  let timer = null;

  /** An SVG element; ``text`` sets its text (never markup). */
  function svg(tag, attrs = {}, ...children) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === undefined || v === null) continue;
      if (k === "text") e.textContent = String(v);
      else e.setAttribute(k, String(v));
    }
    for (const c of children) if (c) e.append(c);
    return e;
  }

  const pct = (x) => (x >= 0 ? "+" : "") + (x * 100).toFixed(1) + " %";
  function diffText(d) {
    if (!d || d.diff === null || d.diff === undefined) return "–";
    if (d.relative) return pct(d.diff) + (d.ci ? ` [${pct(d.ci[0])}, ${pct(d.ci[1])}]` : "");
    return (d.diff >= 0 ? "+" : "") + num(d.diff) + (d.ci ? " " + ci(d.ci) : "");
  }

  const ago = (ts) => {
    const s = Math.max(0, Math.round(Date.now() / 1000 - ts));
    return s < 90 ? `${s} s ago` : `${Math.round(s / 60)} min ago`;
  };

  async function refresh() {
    clearTimeout(timer);
    try {
      const snap = await steer.json("/v1/steering/experiments");
      render(snap);
      if (snap.report_stale) {
        steer.status(`The experiment store cannot be read now: showing the results read at ${new Date(snap.report_read_at * 1000).toLocaleTimeString()} (${ago(snap.report_read_at)}).`, true);
      } else {
        steer.status("updated " + new Date().toLocaleTimeString());
      }
    } catch (e) {
      steer.status(e.message, true);
      if (e.status === 401 || e.status === 403) return; // wait for a key
    }
    const every = Number($("every").value);
    if (every) timer = setTimeout(refresh, every);
  }

  const share = (x) => num(x * 100) + " %";
  const when = (ts) => (ts ? new Date(ts * 1000).toLocaleString() : "–");
  const allocationText = (al) => (al ? Object.entries(al).map(([a, x]) => `${a} ${share(x)}`).join(", ") : "not recorded");

  /** POST to one of the experiment's admin routes; the page then shows the new record. */
  async function control(name, action, body) {
    try {
      await steer.json(`/v1/steering/experiments/${encodeURIComponent(name)}/${action}`, {
        method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
      });
      steer.status(`${action}: done`);
      refresh();
    } catch (e) {
      steer.status(e.message, true);
    }
  }

  /** Start / stop, and a new allocation (a new phase): the admin key opens them. */
  function controls(exp) {
    const why = el("input", { type: "text", placeholder: "why (recorded with the phase)", class: "why", "aria-label": "why" });
    const toggle = exp.status === "running"
      ? el("button", { type: "button", class: "plain", "data-action": "stop", text: "Stop the experiment" })
      : el("button", { type: "button", "data-action": "start", text: "Start it again" });
    toggle.addEventListener("click", () => control(exp.name, toggle.dataset.action, { why: why.value }));
    const inputs = exp.arms.map((a) => el("input", {
      type: "number", min: "0", max: "1", step: "0.05", value: String(exp.allocation[a.name] ?? 0), "data-arm": a.name,
      "aria-label": `share of ${a.name}`,
    }));
    const apply = el("button", { type: "button", class: "plain", "data-action": "phases", text: "New allocation (a new phase)" });
    apply.addEventListener("click", () => {
      const allocation = {};
      for (const i of inputs) allocation[i.dataset.arm] = Number(i.value);
      control(exp.name, "phases", { allocation, why: why.value });
    });
    return el("div", { class: "controls row" },
      ...inputs.map((i) => el("label", {}, i.dataset.arm, i)), apply, el("label", {}, "why", why), toggle,
      el("span", { class: "muted", text: "(the admin key: --admin-key)" }));
  }

  function phasesTable(exp) {
    const head = el("tr", {}, ...["phase", "allocation", "started", "ended", "why"].map((h) => el("th", { text: h })));
    const rows = exp.phases.map((p) => el("tr", { "data-phase": p.phase, class: p.phase === exp.phase ? "current" : "" },
      el("td", { class: "num", text: p.phase }), el("td", { text: allocationText(p.allocation) }),
      el("td", { text: when(p.started) }), el("td", { text: p.ended ? when(p.ended) : (exp.status === "running" ? "running" : "–") }),
      el("td", { text: p.why || "–" })));
    return el("table", { class: "phases" }, head, ...rows);
  }

  function setup(snap) {
    const exp = snap.experiment;
    const lines = [
      el("h2", { text: exp ? `Experiment ${exp.name}: ${exp.status}` : "No experiment runs on this server" }),
    ];
    if (exp) {
      lines.push(
        el("p", { class: "arms-line", text: "Arms: " + exp.arms.map((a) => `${a.name} = ${a.spec}${a.name === exp.control ? " (control)" : ""}`).join("; ") +
          `. Phase ${exp.phase}, allocation ${allocationText(exp.allocation)}.` }),
        ...(exp.note ? [el("p", { class: "muted", text: "Note: " + exp.note })] : []),
        ...(exp.read_error ? [el("p", { class: "store warn", text: `The registry cannot be read now (the last record read is shown): ${exp.read_error}` })] : []),
        phasesTable(exp), controls(exp));
    } else {
      lines.push(el("p", { text: "Start one with --ab-split or --ab-arm (and --ab-store or --ab-log for the numbers). Reports of an earlier log still show below." }));
    }
    lines.push(el("p", {
      class: "muted",
      text: snap.log.enabled
        ? `Decision log on; replies ${snap.log.content ? "logged and shown below (--ab-log-content)" : "not logged"}; ${snap.log.write_failures} failed writes.`
        : snap.store ? "No JSONL export (--ab-log)." : "No decision log (--ab-log) or store (--ab-store): no scores, no report.",
    }));
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

  const groupsOf = (exp) => [["all", exp.overall], ...Object.entries(exp.per_language)];
  const label = (lang, exp) => (exp.not_applied.includes(lang) ? lang + " (not applied)" : lang);
  /** Each (group, treatment) of a phase: one comparison with the control. */
  const comparisonsOf = (exp) => groupsOf(exp).flatMap(([lang, g]) =>
    Object.entries(g.comparisons || { [exp.treatments[0]]: g }).map(([t, c]) => [lang, t, c]));

  /** One metric's treatment − control per group (and treatment), each with its always-valid interval. */
  function forest(exp, metric) {
    const several = exp.treatments.length > 1;
    const rowsOf = comparisonsOf(exp);
    const W = several ? 360 : 330, L = several ? 142 : 112, R = 12, top = 24, rowH = 22, H = top + rowH * rowsOf.length + 22;
    const ds = rowsOf.map(([, , c]) => c.metrics[metric].difference);
    const ends = ds.flatMap((d) => (d.ci ? d.ci : [])).concat([0]);
    let lo = Math.min(...ends), hi = Math.max(...ends);
    if (hi - lo < 1e-9) { lo -= 1; hi += 1; }
    const pad = (hi - lo) * 0.08; lo -= pad; hi += pad;
    const x = (v) => L + (v - lo) / (hi - lo) * (W - L - R);
    const rel = ds[0].relative;
    const fmt = (v) => (rel ? pct(v) : num(v, 2));
    const vs = several ? "treatment" : exp.treatments[0];
    const kids = [
      svg("text", { x: 4, y: 15, class: "title", text: `${metric}: ${vs} − ${exp.control}${rel ? " (relative)" : ""}` }),
      svg("line", { x1: x(0), x2: x(0), y1: top - 4, y2: H - 20, class: "zero" }),
      svg("text", { x: x(lo), y: H - 6, class: "tick", text: fmt(lo) }),
      svg("text", { x: x(hi), y: H - 6, class: "tick end", text: fmt(hi) }),
    ];
    rowsOf.forEach(([lang, t, c], i) => {
      const r = c.metrics[metric], d = r.difference, y = top + rowH * i + rowH / 2;
      const cls = r.status === "called" ? (r.harm ? "harm" : "called") : r.status === "open" ? "open" : "few";
      kids.push(svg("text", { x: 4, y: y + 4, class: "lang", text: label(lang, exp) + (several ? ": " + t : "") }));
      if (d.ci) {
        kids.push(svg("line", { x1: x(d.ci[0]), x2: x(d.ci[1]), y1: y, y2: y, class: "ci " + cls }));
        kids.push(svg("circle", { cx: x(d.diff), cy: y, r: 4, class: "pt " + cls }));
      } else {
        kids.push(svg("text", { x: L, y: y + 4, class: "tick", text: r.status === "missing" ? "missing" : "too few" }));
      }
      kids.push(svg("title", { text: `${lang}${several ? " " + t : ""}: ${r.verdict}` }));
    });
    return svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "forest", "data-metric": metric }, ...kids);
  }

  /** The primary metric's confidence sequence over time: the interval narrows as values come. */
  function sequence(seq) {
    if (!seq || seq.diff.length < 2) return null;
    const W = 420, H = 200, L = 52, B = 28, T = 24, R = 10;
    const xs = seq.values, n = xs.length;
    // the scale of the later looks: the first, on a handful of values, are wide and clipped
    const from = Math.floor(n / 10);
    const lo = Math.min(0, ...seq.lo.slice(from)), hi = Math.max(0, ...seq.hi.slice(from));
    const x = (v) => L + (v - xs[0]) / Math.max(xs[n - 1] - xs[0], 1) * (W - L - R);
    const y = (v) => T + (hi - Math.min(Math.max(v, lo), hi)) / Math.max(hi - lo, 1e-9) * (H - T - B);
    const fmt = (v) => (seq.relative ? pct(v) : num(v, 2));
    const band = xs.map((v, i) => `${x(v)},${y(seq.hi[i])}`).concat(
      xs.map((v, i) => `${x(v)},${y(seq.lo[i])}`).reverse()).join(" ");
    const line = xs.map((v, i) => `${x(v)},${y(seq.diff[i])}`).join(" ");
    const arms = seq.arms ? ` (${seq.arms[0]} − ${seq.arms[1]})` : "";
    return svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "sequence" },
      svg("text", { x: 4, y: 15, class: "title", text: `${seq.metric}${arms} over time: confidence sequence at ${num(seq.alpha, 2)}` }),
      svg("polygon", { points: band, class: "band" }),
      svg("polyline", { points: line, class: "mid" }),
      svg("line", { x1: L, x2: W - R, y1: y(0), y2: y(0), class: "zero" }),
      svg("text", { x: L - 4, y: y(hi) + 4, class: "tick end", text: fmt(hi) }),
      svg("text", { x: L - 4, y: y(lo) + 4, class: "tick end", text: fmt(lo) }),
      svg("text", { x: L, y: H - 8, class: "tick", text: `${xs[0]} values` }),
      svg("text", { x: W - R, y: H - 8, class: "tick end", text: `${xs[n - 1]} values` }));
  }

  function needed(r) {
    if (r.status === "called") return "called";
    const n = r.needed;
    if (!n) return "–";
    const eff = r.difference.relative ? (n.effect * 100).toFixed(0) + " %" : num(n.effect);
    return n.subjects || n.values ? `~${n.subjects} more subjects (${n.values} values) for ${eff}` : `enough for ${eff}`;
  }

  /** A metric's verdict in a word or three (the whole sentence is the cell's tooltip). */
  function call(r) {
    if (r.status === "called") return `${r.better} better` + (r.harm ? " (guardrail harmed)" : "");
    return { open: "no difference yet", "too few": "too few values" }[r.status] || r.status;
  }

  function metricRow(lang, t, name, r, exp) {
    const td = (cls, text) => el("td", { class: "num " + cls, text });
    const c = exp.control;
    const cells = [el("td", { text: name }), el("td", { text: label(lang, exp) }), el("td", { text: t })];
    if (r.status === "missing") {
      return el("tr", { "data-language": lang, "data-metric": name, "data-treatment": t, class: "missing" }, ...cells,
        el("td", { colspan: 6, class: "verdict", text: "missing: no values here" }));
    }
    return el("tr", { "data-language": lang, "data-metric": name, "data-treatment": t, class: r.status }, ...cells,
      td("n-treatment", `${r.n[t]} (${r.subjects[t]})`), td("n-control", `${r.n[c]} (${r.subjects[c]})`),
      td("means", `${num(r.mean[t])} / ${num(r.mean[c])}`), td("diff", diffText(r.difference)),
      el("td", { class: "verdict", title: r.verdict, text: call(r) }), el("td", { class: "needed", text: needed(r) }));
  }

  function armRow(lang, arm, a, exp) {
    const s = a.score, lat = a.latency_ms;
    const td = (cls, text) => el("td", { class: "num " + cls, text });
    return el("tr", { "data-language": lang, "data-arm": arm }, el("td", { text: lang }), el("td", { text: arm }),
      td("requests", a.requests), td("subjects", a.subjects), td("applied", arm === exp.control ? "–" : a.applied),
      td("scored", s.n), td("mean", num(s.mean)), td("ci", ci(s.ci95)), td("p50", num(lat.p50, 4)), td("p95", num(lat.p95, 4)));
  }

  /** One phase with requests: its verdict, family, charts and tables. */
  function phase(exp) {
    const o = exp.overall, fam = exp.family;
    const srm = exp.srm
      ? el("p", { class: exp.srm.warning ? "srm warn" : "srm muted", text: exp.srm.warning || "Sample ratio: " + exp.srm.summary + "." })
      : null;
    // the primary metric first, its confidence sequence beside it, then every other metric
    const order = fam.metrics.includes(exp.primary) ? [exp.primary, ...fam.metrics.filter((m) => m !== exp.primary)] : fam.metrics;
    const seqs = Object.values(exp.sequences || (exp.sequence ? { one: exp.sequence } : {})).map(sequence);
    const charts = el("div", { class: "charts" }, ...order.slice(0, 1).map((m) => forest(exp, m)), ...seqs,
      ...order.slice(1).map((m) => forest(exp, m)));
    const mhead = el("tr", {}, ...["metric", "language", "treatment", "treatment n (subjects)", `${exp.control} n (subjects)`,
      `treatment / ${exp.control}`, `treatment − ${exp.control} [always-valid CI]`, "call", "still needed"].map((h) => el("th", { text: h })));
    const mrows = [];
    for (const [lang, t, c] of comparisonsOf(exp)) for (const m of fam.metrics) mrows.push(metricRow(lang, t, m, c.metrics[m], exp));
    const ahead = el("tr", {}, ...["language", "arm", "requests", "subjects", "applied", "scored", "mean feedback", "95 % CI", "p50 ms", "p95 ms"]
      .map((h) => el("th", { text: h })));
    const arows = [];
    for (const [lang, g] of groupsOf(exp)) arows.push(...Object.entries(g.arms).map(([arm, a]) => armRow(lang, arm, a, exp)));
    const notApplied = Object.entries(exp.not_applied_by_arm || {}).filter(([, l]) => l.length)
      .map(([t, l]) => `${t} not applied in: ${l.join(", ")}`);
    return [
      ...(srm && exp.srm.warning ? [srm] : []),
      el("p", { class: "verdict", text: `Verdict (primary metric ${exp.primary}, control ${exp.control}): ${o.verdict}.` }),
      el("p", { class: "family muted", text: `Family correction: ${fam.method} over ${fam.size} verdicts (${fam.metrics.length} metrics × ${fam.groups} groups${fam.treatments > 1 ? ` × ${fam.treatments} treatments` : ""}), each at ${num(fam.each, 2)}: all of them, read at every refresh, call a false winner with probability ≤ ${fam.alpha}. Unit: ${exp.unit}.` }),
      notApplied.length
        ? el("p", { class: "not-applied", text: `${notApplied.join("; ")} (those prompts were answered unsteered; shown per language, left out of "all").` })
        : null,
      charts,
      el("table", { class: "metrics" }, mhead, ...mrows),
      el("table", { class: "report" }, ahead, ...arows),
      ...(srm && !exp.srm.warning ? [srm] : []),
    ];
  }

  function experiment(name, exp) {
    const o = exp.overall;
    const badge = o.winner
      ? el("span", { class: "badge called", text: `called: ${o.winner} wins` })
      : el("span", { class: "badge open", text: "not called" });
    const shown = exp.phase;
    const earlier = (exp.phases || []).filter((p) => p.phase !== shown);
    const past = earlier.map((p) => el("li", { "data-phase": p.phase === null ? "none" : p.phase },
      `Phase ${p.phase === null ? "(before phases were recorded)" : p.phase} (${allocationText(p.allocation)}): ${p.requests} requests` +
      (p.overall ? `; ${p.overall.verdict}` : "") + (p.srm ? `; sample ratio: ${p.srm.summary}` : "")));
    return el("section", { class: "exp", "data-experiment": name, "data-phase": shown === null ? "none" : shown },
      el("h2", {}, `Experiment ${name}, phase ${shown === null ? "(none recorded)" : shown} (${allocationText(exp.allocation)}) `, badge),
      ...phase(exp),
      past.length ? el("div", { class: "earlier" }, el("p", { class: "muted", text: "Earlier phases, each analysed alone (never pooled with this one):" }), el("ul", {}, ...past)) : null);
  }

  function preferences(prefs) {
    const out = [];
    for (const [name, e] of Object.entries(prefs || {})) {
      const head = el("tr", {}, ...["treatment (B)", "group", "pairs", "judged (subjects)", "B better", "A better", "ties",
        "mean [always-valid CI]", "call"].map((h) => el("th", { text: h })));
      const rows = [];
      for (const [t, by] of Object.entries(e.treatments)) {
        for (const [lang, r] of [["all", by.overall], ...Object.entries(by.per_language)]) {
          rows.push(el("tr", { "data-treatment": t, "data-language": lang, class: r.status },
            el("td", { text: t }), el("td", { text: lang }), el("td", { class: "num", text: r.pairs }),
            el("td", { class: "num", text: `${r.judged} (${r.subjects})` }), el("td", { class: "num b", text: r.b }),
            el("td", { class: "num a", text: r.a }), el("td", { class: "num tie", text: r.tie }),
            el("td", { class: "num", text: r.mean === null ? "–" : (r.mean >= 0 ? "+" : "") + num(r.mean) + " " + ci(r.ci) }),
            el("td", { class: "verdict", title: r.verdict, text: r.verdict })));
        }
      }
      out.push(el("section", { class: "exp prefs", "data-preferences": name },
        el("h2", { text: `Paired preferences: ${name}` }),
        el("p", { class: "muted", text: `A/B answers judged side by side on /compare or through POST /v1/steering/preference (B is the steered answer): +1 B better, −1 A better, 0 a tie, per subject, tested against 0, always valid; ${e.family.method} over ${e.family.size} verdicts, each at ${num(e.family.each, 2)}.` }),
        el("table", { class: "preferences" }, head, ...rows)));
    }
    return out;
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
      $("threshold").textContent = `A verdict needs ${rep.min_scored_per_arm} values per arm (fixed by the server) and an always-valid interval that excludes 0.`;
      out.push(el("p", { class: "muted", text: `${rep.requests} logged requests, ${rep.not_enrolled} not enrolled. Every verdict is an always-valid confidence sequence (mSPRT) at the subject level, corrected for the experiment's family of metrics and languages: it stays valid however often this page refreshes.` }));
      for (const [name, exp] of Object.entries(rep.experiments)) out.push(experiment(name, exp));
      out.push(...preferences(rep.preferences));
      if (!Object.keys(rep.experiments).length && !rep.pairs) out.push(el("p", { text: "No enrolled requests in the log yet." }));
    }
    $("experiments").replaceChildren(...out);
    recent(snap);
  }

  for (const b of document.querySelectorAll("button[data-format]")) {
    b.addEventListener("click", async () => {
      const f = b.dataset.format;
      try {
        await steer.download(`/v1/steering/experiments/report.${f}`, `report.${f}`);
      } catch (e) {
        steer.status(e.message, true);
      }
    });
  }
  $("every").addEventListener("change", refresh);
  steer.onKey(refresh);
  refresh();
})();
