"""The report a tune publishes beside its artifact: enough to decide whether to serve it, and
the verdict line ``steerserve vectors show`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from steerserve.tune import reporting as R
from steerserve.tune.arms import COMBINED
from steerserve.tune.testing import AUTO


def _ci(d: Mapping[str, Any], key: str = "ci95") -> str:
    lo, hi = d[key]
    return f"[{lo:+.3f}, {hi:+.3f}]"


def verdict(gates: Mapping[str, Any], test: Mapping[str, Any]) -> str:
    """One line: which languages ``auto`` steers and what the test split says of it."""
    langs = gates["languages"]
    opened = [k for k, v in langs.items() if v["open"]]
    which = ", ".join(opened) if opened else "no language"
    line = f"auto steers {which} ({len(opened)} of {len(langs)} confirmed)"
    arms = test["arms"]
    if AUTO in arms and not test.get("auto_is_unsteered"):
        line += f"; test: auto {arms[AUTO]['vs_unsteered']['diff']:+.3f} {_ci(arms[AUTO]['vs_unsteered'])}"
    else:
        line += "; test: auto = unsteered"
    both = arms[COMBINED]["vs_unsteered"]
    return line + f", steering on {both['diff']:+.3f} {_ci(both)} (non-English mean accuracy)"


def build(ctx: Any) -> dict[str, Any]:
    """The report's data, from the work folder's stage outputs."""
    from steerserve.tune.reporting import read_json

    w = ctx.work
    cal, gates, test = (read_json(w / f) for f in ("calibration.json", "gates.json", "test.json"))
    state = read_json(w / "state.json")
    chosen = cal["chosen"]
    return {
        "verdict": verdict(gates, test),
        "artifact": f"{ctx.cfg.name}/{ctx.cfg.version}",
        "model": str(ctx.cfg.model),
        "records": ctx.parts.source,
        "form": ctx.parts.form,
        "n_items": {k: len(v) for k, v in ctx.parts.ids().items()},
        "chosen": {k: chosen[k] for k in ("recall", "translation")},
        "selection": {k: chosen.get(k) for k in ("d_logp", "d_logp_ci95", "en_d_logp", "non_en")},
        "confirmation": read_json(w / "confirm.json")["holdout"],
        "gates": gates,
        "test": test,
        "stage_seconds": {k: v["seconds"] for k, v in state["stages"].items()},
    }


def markdown(rep: Mapping[str, Any]) -> str:
    g = rep["gates"]
    out = [
        f"# {rep['artifact']}: steerserve tune report",
        "",
        f"**Verdict:** {rep['verdict']}",
        "",
        f"Model `{rep['model']}`; records: {rep['records']} ({rep['form']} form); items: "
        + ", ".join(f"{k} {n}" for k, n in rep["n_items"].items())
        + ".",
        "",
        "## Chosen on the selection half",
        "",
        "| vector | variant | layer | scale | positions |",
        "|---|---|---|---|---|",
    ]
    for k, s in rep["chosen"].items():
        out.append(f"| {k} | {s['variant']} | {s['layer']} | {s['scale']:g} | {s['positions']} |")
    sel = rep["selection"]
    out += [
        "",
        f"Selection half: non-English Δ log P(gold) {sel['d_logp']:+.3f} "
        f"{_ci(sel, 'd_logp_ci95')} nats, English Δ log P {sel['en_d_logp']:+.3f}.",
        "",
        "## Confirmation half, per language (the gates)",
        "",
        f"Rule: {g['rule']}.",
        "",
        f"k = {g['k']} languages; a gate needs >= {g['items_needed']} items (+"
        f"{g['settings']['min_effect']:g} at 80 % power) and p < {g['settings']['alpha']:g}/{g['k']}. "
        f"English guard: {g['english']['why']} (Δ accuracy {g['english'].get('d_accuracy', 0):+.3f}, "
        f"Δ log P {g['english'].get('d_logp', 0):+.3f}, n {g['english']['n']}).",
        "",
        "| lang | n | unsteered | steered | gain [95 % CI] | Δ log P [95 % CI] | wins/losses | p | gate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lang, r in g["languages"].items():
        out.append(
            f"| {lang} | {r['n']} | {R.pct(r['unsteered'])} | {R.pct(r['steered'])} | "
            f"{r['gain']:+.3f} {_ci(r, 'gain_ci95')} | {r['d_logp']:+.3f} {_ci(r, 'd_logp_ci95')} | "
            f"{r['wins']}/{r['losses']} | {r['p_one_sided']:.3g} | {r['why']} |"
        )
    t = rep["test"]
    out += ["", f"## Test split (run once, after the gates; {t['n_items']} items)", ""]
    out += ["| arm | non-English mean | vs unsteered [95 % CI] |", "|---|---|---|"]
    for arm, a in t["arms"].items():
        vs = a.get("vs_unsteered")
        diff = f"{vs['diff']:+.3f} {_ci(vs)}" if vs else ""
        out.append(f"| {arm} | {R.pct(a['non_english_mean'])} | {diff} |")
    out += ["", "## Stage times (s)", ""]
    out += [f"- {k}: {v}" for k, v in rep["stage_seconds"].items()]
    return "\n".join(out) + "\n"


def plot(rep: Mapping[str, Any], path: Path) -> None:
    """Per language: the confirmation gain and the test's auto and steering-on differences,
    each with its 95 % interval."""
    plt = R.pyplot()
    langs = list(rep["gates"]["languages"])
    gates = rep["gates"]["languages"]
    series = [
        ("confirmation (steered)", {k: (v["gain"], v["gain_ci95"]) for k, v in gates.items()})
    ]
    for arm in (AUTO, COMBINED):
        per = rep["test"]["arms"].get(arm, {}).get("per_language", {})
        vs = {k: per[k]["vs_unsteered"] for k in langs if k in per}
        if vs:
            series.append((f"test: {arm}", {k: (d["diff"], d["ci95"]) for k, d in vs.items()}))
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(langs)), 4))
    w = 0.8 / len(series)
    for i, (label, vals) in enumerate(series):
        keys = [k for k in langs if k in vals]
        xs = [langs.index(k) + (i - (len(series) - 1) / 2) * w for k in keys]
        ys = [vals[k][0] for k in keys]
        err = [
            [vals[k][0] - vals[k][1][0] for k in keys],
            [vals[k][1][1] - vals[k][0] for k in keys],
        ]
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=label)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(langs)), langs)
    ax.set_ylabel("Δ accuracy vs unsteered")
    ax.legend(fontsize=8)
    ax.set_title(f"{rep['artifact']}: per-language differences (95 % CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(ctx: Any, out: Path) -> dict[str, Any]:
    rep = build(ctx)
    R.write(out, rep, markdown(rep), {"gates.png": lambda p: plot(rep, p)})
    return rep
