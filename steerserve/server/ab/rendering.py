"""The A/B report as people read it: markdown (what ``ab-report`` prints and report.md holds),
JSON and a PNG (a forest plot of every metric's difference per language, and the primary metric's
confidence sequence over time). Words said in several places (the sample-ratio line, what was
skipped) are made here once.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from steerserve.server.ab.experiment import STEERED, UNSTEERED

ARMS = (STEERED, UNSTEERED)
#: The formats :func:`render` writes, and their media types.
FORMATS = {"md": "text/markdown; charset=utf-8", "json": "application/json", "png": "image/png"}
#: Experiments drawn in report.png (each is a row of panels); the rest are in report.md.
PLOTTED = 8


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}g}"


def _ci(c: Sequence[float] | None) -> str:
    return "–" if c is None else f"[{c[0]:.3g}, {c[1]:.3g}]"


def diff_text(d: Mapping[str, Any]) -> str:
    """A difference and its interval (a relative one in %)."""
    if d["diff"] is None:
        return "–"
    if d.get("relative"):
        ci = "" if d["ci"] is None else f" [{d['ci'][0]:+.1%}, {d['ci'][1]:+.1%}]"
        return f"{d['diff']:+.1%}{ci}"
    ci = "" if d["ci"] is None else f" [{d['ci'][0]:.3g}, {d['ci'][1]:.3g}]"
    return f"{d['diff']:+.3g}{ci}"


def _needed(r: Mapping[str, Any]) -> str:
    n = r.get("needed")
    if r["status"] == "called":
        return "called"
    if not n:
        return "–"
    eff = f"{n['effect']:.0%}" if r["difference"]["relative"] else f"{n['effect']:g}"
    if not (n["subjects"] or n["values"]):
        return f"enough for {eff}"
    return f"~{n['subjects']} more subjects ({n['values']} values) for {eff}"


def _call(r: Mapping[str, Any]) -> str:
    """A metric's verdict in a few words (the page says the same; the sentence is in JSON)."""
    if r["status"] == "called":
        return f"{r['better']} better" + (" (guardrail harmed)" if r["harm"] else "")
    return {"open": "no difference yet", "too few": "too few values"}.get(r["status"], r["status"])


def _metric_rows(label: str, group: Mapping[str, Any], several: bool) -> list[str]:
    out = []
    for t, c in group.get("comparisons", {"": group}).items():
        vs = [t] if several else []
        for name, r in c["metrics"].items():
            if r["status"] == "missing":
                cells = [name, label, *vs, "–", "–", "–", "–", "missing: no values here", "", ""]
                out.append("| " + " | ".join(cells).rstrip() + " |")
                continue
            treat, control = r.get("arms") or ARMS
            n, s, mean = r["n"], r["subjects"], r["mean"]
            cells = [
                name,
                label,
                *vs,
                f"{n[treat]} ({s[treat]})",
                f"{n[control]} ({s[control]})",
                _fmt(mean[treat]),
                _fmt(mean[control]),
                diff_text(r["difference"]),
                _call(r),
                _needed(r),
            ]
            out.append("| " + " | ".join(cells) + " |")
    return out


def _arm_table(label: str, cmp: Mapping[str, Any]) -> list[str]:
    lines = []
    for arm, a in cmp["arms"].items():
        sc, lat = a["score"], a["latency_ms"]
        lines.append(
            f"| {label} | {arm} | {a['requests']} | {a['subjects']} | {sc['n']} | "
            f"{_fmt(sc['mean'])} {_ci(sc['ci95'])} | {_fmt(lat['p50'], 4)} | {_fmt(lat['p95'], 4)} |"
        )
    return lines


def _when(ts: float | None) -> str:
    if ts is None:
        return "–"
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def allocation_text(allocation: Mapping[str, float] | None) -> str:
    if not allocation:
        return "not recorded"
    return ", ".join(f"{arm} {share:.4g}" for arm, share in allocation.items())


def phases_table(exp: Mapping[str, Any]) -> list[str]:
    """Every phase of an experiment: its allocation, when, why, how many requests, its
    sample-ratio check (each phase its own: a ramp is never one period)."""
    lines = [
        "| phase | allocation | started | ended | why | requests | sample ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in exp.get("phases", []):
        srm = p.get("srm")
        check = "–" if srm is None else ("MISMATCH" if srm["flagged"] else
                                          f"p = {srm['p_value']:.2g}" if srm["checked"] else "not checked")  # fmt: skip
        lines.append(
            f"| {p['phase'] if p['phase'] is not None else '(none)'} | "
            f"{allocation_text(p['allocation'])} | {_when(p['started'])} | {_when(p['ended'])} | "
            f"{p['why'] or '–'} | {p['requests']} | {check} |"
        )
    return lines


def experiment_markdown(name: str, exp: Mapping[str, Any]) -> list[str]:
    """One experiment's section: its phases, then each phase with requests analysed alone."""
    lines = ["", f"## Experiment `{name}`", ""]
    status = exp.get("status")
    if status or exp.get("note"):
        lines += [
            f"Status: {status or 'not recorded'}."
            + (f" Note: {exp['note']}" if exp.get("note") else ""),
            "",
        ]
    lines += phases_table(exp)
    analysed = [p for p in exp.get("phases", []) if p["requests"]]
    for p in analysed:
        title = (
            "rows from before phases were recorded" if p["phase"] is None else f"Phase {p['phase']}"
        )
        lines += ["", f"### {title} ({allocation_text(p['allocation'])})"]
        lines += phase_markdown(p)
    return lines


def phase_markdown(exp: Mapping[str, Any]) -> list[str]:
    """One phase: its verdict, family, sample-ratio check and tables."""
    o, fam = exp["overall"], exp["family"]
    treatments, control = exp["treatments"], exp["control"]
    several = len(treatments) > 1
    lines = [""]
    if warning := srm_warning(exp.get("srm")):
        lines += [f"**{warning}**", ""]
    lines += [
        f"**Verdict: {o['verdict']}.** (Primary metric: {exp['primary']}; unit: {exp['unit']}; "
        f"control: {control}.)",
        "",
        f"- Family: {fam['method']} over {fam['size']} verdicts ({len(fam['metrics'])} metrics x "
        f"{fam['groups']} groups"
        + (f" x {fam['treatments']} treatments" if several else "")
        + f"): each at {fam['each']:.2g}, so all of them at every look call a false winner with "
        f"probability <= {fam['alpha']:g}.",
    ]
    for t, langs in exp["not_applied_by_arm"].items():
        if langs and not several:
            lines.append(
                f"- Steered arm not applied in: {', '.join(langs)} (those prompts were answered "
                "unsteered in both arms; shown per language, left out of the overall)."
            )
        elif langs:
            lines.append(
                f"- {t} not applied in: {', '.join(langs)} (those prompts were answered "
                f"unsteered in {t} too; shown per language, left out of {t}'s overall)."
            )
    fh = o["fixed_horizon"]
    if fh.get("diff") is not None and not several:
        lines.append(
            f"- Fixed-horizon view ({exp['primary']}, overall): {fh['diff']:+.3g} "
            f"{_ci(fh['ci95'])}, p = {fh['p_value']:.2g}. {fh['note']}."
        )
    if "srm" in exp:
        lines.append(f"- Sample ratio: {srm_line(exp['srm'])}.")
    if several:
        head = ("| metric | group | treatment | treatment n (subjects) | control n (subjects) | "
                "treatment | control | treatment − control [always-valid CI] | call | still needed |")  # fmt: skip
    else:
        t = treatments[0]
        head = (f"| metric | group | {t} n (subjects) | {control} n (subjects) | {t} | {control} "
                f"| {t} − {control} [always-valid CI] | call | still needed |")  # fmt: skip
    lines += ["", head, "|---" * (10 if several else 9) + "|", *_metric_rows("all", o, several)]
    for lang, g in exp["per_language"].items():
        lines += _metric_rows(lang, g, several)
    lines += [
        "",
        "| language | arm | requests | subjects | scored | mean feedback [95 % CI] | p50 ms | "
        "p95 ms |",
        "|---|---|---|---|---|---|---|---|",
        *_arm_table("all", o),
    ]
    for lang, g in exp["per_language"].items():
        lines += _arm_table(lang, g)
    lines += ["", "Per language:"]
    lines += [f"- {lang}: {g['verdict']}" for lang, g in exp["per_language"].items()]
    return lines


def preferences_markdown(prefs: Mapping[str, Any]) -> list[str]:
    """The judged pairs: per experiment and treatment, overall and per language."""
    lines: list[str] = []
    for name, e in prefs.items():
        fam = e["family"]
        lines += [
            "",
            f"## Paired preferences `{name}`",
            "",
            "Each pair is one A/B request's two answers judged side by side (B is the steered "
            "one): the mean of +1 (B better), -1 (A better) and 0 (a tie) per subject, tested "
            f"against 0, always valid, {fam['method']} over {fam['size']} verdicts (each at "
            f"{fam['each']:.2g}).",
            "",
            "| treatment (B) | group | pairs | judged (subjects) | B better | A better | ties | "
            "mean [always-valid CI] | call | sign test p (fixed horizon) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t, by in e["treatments"].items():
            for label, r in [("all", by["overall"]), *by["per_language"].items()]:
                mean = "–" if r["mean"] is None else f"{r['mean']:+.3g} {_ci(r['ci'])}"
                sign = r["sign_test"]["p_value"]
                lines.append(
                    f"| {t} | {label} | {r['pairs']} | {r['judged']} ({r['subjects']}) | {r['b']} | "
                    f"{r['a']} | {r['tie']} | {mean} | {r['verdict']} | {_fmt(sign, 2)} |"
                )
    return lines


def report_markdown(rep: Mapping[str, Any]) -> str:
    lines = [
        "# A/B report",
        "",
        f"{rep['requests']} logged requests, {rep['not_enrolled']} not enrolled (no subject, "
        "explicit steering, or no experiment). Every verdict stands on an always-valid "
        "interval (mSPRT) at the unit of randomisation (the subject), corrected for the family "
        "of the experiment's metrics, languages and treatments: read at every refresh, all of "
        "an experiment's verdicts together call a false winner with probability at most "
        f"{rep['alpha']:g}, so it may be watched live and stopped at any time. Each phase (a "
        "change of allocation or arms) is analysed alone, against its recorded allocation. A "
        f"verdict needs {rep['min_scored_per_arm']} values per arm.",
    ]
    if note := ignored_note(rep):
        lines += ["", f"{note}."]
    if (st := rep.get("store")) is not None:
        lines += ["", store_line(st)]
    if not rep["experiments"] and not rep.get("preferences"):
        lines += ["", "No enrolled requests in this log."]
    for name, exp in rep["experiments"].items():
        lines += experiment_markdown(name, exp)
    lines += preferences_markdown(rep.get("preferences") or {})
    return "\n".join(lines) + "\n"


def srm_line(srm: Mapping[str, Any]) -> str:
    """The sample-ratio check in words."""
    c = srm["counts"]
    line = " / ".join(f"{n} {arm}" for arm, n in c.items()) + f" {srm['unit']}"
    if srm.get("subjects_in_both_arms"):
        line += f" ({srm['subjects_in_both_arms']} in more than one arm)"
    if srm.get("split") is not None and set(c) == set(ARMS):
        line += f", split {srm['split']:.3g} steered"
    elif srm.get("allocation"):
        line += f", allocation {allocation_text(srm['allocation'])}"
    if srm["p_value"] is not None and srm["checked"]:
        line += f": chi-square p = {srm['p_value']:.2g}"
        line += " (mismatch)" if srm["flagged"] else " (no mismatch)"
    elif note := srm.get("note"):
        line += f": {note}"
    return line


def srm_warning(srm: Mapping[str, Any] | None) -> str | None:
    """A loud line when the arms did not get the share of subjects the split assigns, else None:
    then no number below can be trusted, a winner least of all."""
    if not srm or not srm["flagged"]:
        return None
    return (
        f"WARNING: SAMPLE RATIO MISMATCH (p < {srm['alpha']:g}): {srm_line(srm)}. The arms did "
        "not get the shares the allocation assigns (requests failing or not logged in one arm, "
        "a changed split outside the record, bots): find the cause before trusting any result "
        "below"
    )


def ignored_note(rep: Mapping[str, Any]) -> str | None:
    """What the report left out of the log and why (or, from a store, what never reached it),
    or None: the log needs a look when any."""
    notes = []
    if rep.get("skipped_lines"):
        why = []
        if n := rep.get("unreadable_lines"):
            why.append(f"{n} unreadable line(s)")
        if n := rep.get("orphan_feedback_lines"):
            why.append(f"{n} feedback line(s) for an answer with no decision in the log")
        if n := rep.get("unknown_metric_lines"):
            why.append(f"{n} feedback line(s) for a metric not in this registry")
        notes.append(f"{rep['skipped_lines']} line(s) of the log skipped: {', '.join(why)}")
    if dropped := (rep.get("store") or {}).get("dropped"):
        notes.append(
            f"{dropped} record(s) dropped by the servers before they reached the store (a full "
            "queue while it was unreachable, feedback over the cap, a line a crash tore): not "
            "in these numbers"
        )
    if lost := (rep.get("store") or {}).get("unaccounted"):
        who = ", ".join(rep["store"].get("unaccounted_replicas") or [])
        notes.append(
            f"{lost} record(s) still queued on replica(s) silent for over a minute ({who}): "
            "lost unless a process replays their write-ahead file"
        )
    return "; ".join(notes) or None


def store_line(st: Mapping[str, Any]) -> str:
    """An experiment store's account in one sentence."""
    line = (
        f"Experiment store {st['url']}: {st['replicas']} server process(es) wrote "
        f"{st['written']} records"
    )
    if st.get("queued"):
        line += f"; {st['queued']} were still queued at their last report"
    if st.get("dropped"):
        line += f"; {st['dropped']} dropped"
    return line + "."


def render(rep: Mapping[str, Any], fmt: str) -> bytes:
    """``rep`` as report.md, report.json or report.png (see :data:`FORMATS`)."""
    if fmt == "md":
        return report_markdown(rep).encode()
    if fmt == "json":
        return (json.dumps(_finite(rep), indent=2, allow_nan=False) + "\n").encode()
    if fmt == "png":
        buf = io.BytesIO()
        plot(rep, buf)
        return buf.getvalue()
    raise ValueError(f"format: {fmt!r} is not one of {', '.join(FORMATS)}")


def _finite(v: Any) -> Any:
    """``v`` with non-finite floats as None: JSON has no NaN or Infinity."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, Mapping):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def _forest(ax: Any, name: str, exp: Mapping[str, Any]) -> None:
    """One metric's difference per group (and treatment) with its always-valid interval."""
    groups = {"all": exp["overall"], **exp["per_language"]}
    several = len(exp.get("treatments") or [1]) > 1
    labels, rel, y = [], False, 0
    for label, g in groups.items():
        for t, c in g.get("comparisons", {"": g}).items():
            r = c["metrics"][name]
            d = r["difference"]
            rel = d["relative"]
            labels.append(f"{label}: {t}" if several else label)
            if d["ci"] is not None:
                scale = 100 if rel else 1
                lo, hi = d["ci"][0] * scale, d["ci"][1] * scale
                color = {"called": "tab:red" if r["harm"] else "tab:green"}.get(
                    r["status"], "tab:gray"
                )
                ax.plot([lo, hi], [y, y], color=color, lw=2)
                ax.plot([d["diff"] * scale], [y], "o", color=color)
            y += 1
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_title(name + (" (%)" if rel else ""), fontsize=9)


def _sequence(ax: Any, seq: Mapping[str, Any]) -> None:
    x = np.arange(len(seq["diff"]))
    xs = seq["values"] or x
    scale = 100 if seq["relative"] else 1
    ax.fill_between(xs, np.array(seq["lo"]) * scale, np.array(seq["hi"]) * scale, alpha=0.3)
    ax.plot(xs, np.array(seq["diff"]) * scale)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("values so far")
    ax.set_title(f"{seq['metric']}: confidence sequence", fontsize=9)


def plot(rep: Mapping[str, Any], path: str | Path | IO[bytes]) -> None:
    """Per experiment (the first :data:`PLOTTED`), a forest plot per metric (steered −
    unsteered per group, always-valid interval, green where called, red a guardrail harmed) and
    the primary metric's confidence sequence over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exps = list(rep["experiments"].items())[:PLOTTED] or [("(none)", None)]  # each its latest phase
    cols = max([len(e["family"]["metrics"]) + 1 for _, e in exps if e] or [1])
    fig, axes = plt.subplots(
        len(exps), cols, figsize=(2.6 * cols + 1, 2.8 * len(exps)), squeeze=False
    )
    for row, (name, exp) in zip(axes, exps, strict=True):
        row[0].set_ylabel(f"experiment {name}")
        for ax in row:
            ax.set_axis_off()
        if exp is None:
            continue
        for ax, metric in zip(row, exp["family"]["metrics"], strict=False):
            ax.set_axis_on()
            _forest(ax, metric, exp)
        if (seq := exp.get("sequence")) and seq["diff"]:
            ax = row[len(exp["family"]["metrics"])]
            ax.set_axis_on()
            _sequence(ax, seq)
    fig.tight_layout()
    fig.savefig(path, dpi=90, format="png")
    plt.close(fig)


def write_report(rep: Mapping[str, Any], out_dir: str | Path) -> Path:
    """report.json, report.md and report.png in ``out_dir``; returns the markdown's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in FORMATS:
        (out / f"report.{fmt}").write_bytes(render(rep, fmt))
    return out / "report.md"
