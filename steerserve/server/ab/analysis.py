"""``steerserve ab-report LOG|STORE``: who won a server-side A/B experiment, read from its decision
log or its experiment store.

Per experiment, arm and detected language: requests, mean feedback score with a 95 % CI, the
steered - unsteered difference with its always-valid 95 % CI and p-value (an mSPRT, see
:mod:`steerserve.server.ab.stats`), and latency p50/p95; per experiment a sample-ratio-mismatch check
when the split is known. The winner is called on the always-valid test, because the report is
read live (``/experiments`` refreshes every 2 s) and a fixed-horizon CI read at every refresh
calls false winners far above 5 %; the fixed-horizon (Welch) numbers stay as a labelled second
view. It says plainly when there are too few scored replies to call a winner.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from steerserve.engine.spec import finite_number
from steerserve.server.ab import stats as ab_stats
from steerserve.server.ab.experiment import STEERED, UNSTEERED, check_score

if TYPE_CHECKING:
    from steerserve.server.ab.store import Store

#: Fewer scored replies than this in either arm: no winner is called. A display floor only: the
#: always-valid test needs no planned sample size, but its plug-in variance is rough on a handful
#: of replies and a winner on five thumbs convinces nobody.
MIN_SCORED = 30
Z95 = 1.959964
#: Level of the always-valid test the verdict uses: the chance of ever calling a false winner,
#: however often the report is read.
ALPHA = ab_stats.ALPHA
#: What the fixed-horizon view is good for, said wherever it is shown.
FIXED_HORIZON_NOTE = (
    "Welch, normal approximation: valid only when read once, at a sample size planned in "
    "advance; read again and again (the live page refreshes every 2 s) it calls false winners "
    "far more often than 5 %"
)


@dataclass
class Row:
    """One answered request joined with its feedback (the last score given wins)."""

    id: str
    experiment: str | None
    arm: str | None
    language: str | None
    latency_ms: float | None
    score: float | None = None
    subject_hash: str | None = None  # who the split assigned (the unit of the SRM check)


def read_log(path: str | Path) -> list[Row]:
    """Decisions joined with their feedback by completion id (see :func:`scan_log`)."""
    return scan_log(path)[0]


@dataclass
class Ignored:
    """The lines of a log the report does not stand on, by why: every one is counted."""

    unreadable: int = 0  # not JSON (a torn line), wrong field types, a score out of range
    orphan_feedback: int = 0  # a score for an id with no decision line in the log

    @property
    def total(self) -> int:
        return self.unreadable + self.orphan_feedback


def scan_log(path: str | Path) -> tuple[list[Row], Ignored]:
    """Decisions joined with their feedback by completion id (an answer's last score counts),
    and the lines ignored: unreadable ones (not JSON, a torn last line included; a record whose
    fields have the wrong types or a score outside the server's range) and feedback for an id
    with no decision in the log (its decision line was lost)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return scan_records(map(_parse, f))


def _parse(line: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None  # a torn line: counted unreadable


def scan_records(records: Iterable[Any]) -> tuple[list[Row], Ignored]:
    """:func:`scan_log` of records already parsed (a log's lines, or an experiment store's rows
    in the same shape: one join for both)."""
    rows: dict[str, Row] = {}
    scores: dict[str, list[float]] = {}
    ignored = Ignored()
    for rec in records:
        kind = rec.get("type") if isinstance(rec, dict) else None
        if kind == "decision" and (row := _decision(rec)) is not None:
            rows[row.id] = row
        elif kind == "feedback" and (score := _score(rec)) is not None:
            scores.setdefault(rec["id"], []).append(score)
        else:
            ignored.unreadable += 1
    for rid, given in scores.items():
        if rid in rows:
            rows[rid].score = given[-1]
        else:
            ignored.orphan_feedback += len(given)
    return list(rows.values()), ignored


def _decision(rec: dict[str, Any]) -> Row | None:
    """A decision line as a :class:`Row`, or None when a field has the wrong type."""
    rid, latency = rec.get("id"), rec.get("latency_ms")
    names = [rec.get(k) for k in ("experiment", "arm", "language")]
    if not isinstance(rid, str) or not all(v is None or isinstance(v, str) for v in names):
        return None
    if latency is not None and (finite_number(latency) is None or latency < 0):
        return None
    ms = None if latency is None else float(latency)
    subject = rec.get("subject_hash")  # logs before it, or a wrong type: the SRM counts requests
    return Row(rid, names[0], names[1], names[2], ms, subject_hash=_str_or_none(subject))


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _score(rec: dict[str, Any]) -> float | None:
    """A feedback line's score, or None (no string id; not a number in the server's range:
    a ``true``, a NaN, a -1e308 a server before bounds took)."""
    if not isinstance(rec.get("id"), str):
        return None
    try:
        return check_score(rec.get("score"))
    except ValueError:
        return None


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
    """Mean and normal-approximation 95 % CI (None where n < 2)."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "ci95": None}
    x = np.asarray(values, dtype=float)
    m = float(x.mean())
    if n < 2:
        return {"n": n, "mean": m, "ci95": None}
    half = Z95 * float(x.std(ddof=1)) / math.sqrt(n)
    return {"n": n, "mean": m, "ci95": [m - half, m + half]}


def diff_ci(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """mean(a) - mean(b) with a fixed-horizon Welch 95 % CI and two-sided p-value (None where
    either side has n < 2): valid read once at a planned sample size, not under peeking."""
    if len(a) < 2 or len(b) < 2:
        return {"diff": None, "ci95": None, "p_value": None}
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = float(xa.mean() - xb.mean())
    se = math.sqrt(xa.var(ddof=1) / len(xa) + xb.var(ddof=1) / len(xb))
    p = math.erfc(abs(d) / se / math.sqrt(2)) if se > 0 else float(d == 0)
    return {"diff": d, "ci95": [d - Z95 * se, d + Z95 * se], "p_value": p}


def always_valid_ci(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA) -> dict[str, Any]:
    """mean(a) - mean(b) with its always-valid (1 - alpha) CI and p-value (the mSPRT of
    :func:`steerserve.server.ab.stats.always_valid`; None where either side has n < 2): valid at every
    look, so the verdict stands on it."""
    av = ab_stats.always_valid(a, b, alpha)
    return {
        "diff": av["diff"],
        "ci95": av["ci"],
        "p_value": av["p_value"],
        "method": f"always-valid (mSPRT, normal mixture, tau = {math.sqrt(ab_stats.TAU2):g})",
        "alpha": alpha,
    }


def _arm_stats(rows: Iterable[Row]) -> dict[str, Any]:
    rows = list(rows)
    lat = [r.latency_ms for r in rows if r.latency_ms is not None]
    scored = [r.score for r in rows if r.score is not None]
    return {
        "requests": len(rows),
        "score": mean_ci(scored),
        "latency_ms": {
            "p50": float(np.percentile(lat, 50)) if lat else None,
            "p95": float(np.percentile(lat, 95)) if lat else None,
        },
    }


def verdict(
    steered: Sequence[float],
    unsteered: Sequence[float],
    min_n: int = MIN_SCORED,
    alpha: float = ALPHA,
) -> str:
    """One sentence: the winner, no difference, or too few samples to say (the always-valid CI
    of the difference and its p-value: a verdict that holds however often it is read)."""
    if min(len(steered), len(unsteered)) < min_n:
        return (
            f"too few scored replies to call a winner (need {min_n} per arm; steered "
            f"{len(steered)}, unsteered {len(unsteered)})"
        )
    d = always_valid_ci(steered, unsteered, alpha)
    lo, hi = d["ci95"]
    why = f"[{lo:.3g}, {hi:.3g}] always-valid, p = {d['p_value']:.2g}"
    if lo > 0:
        return f"steered wins: +{d['diff']:.3g} {why}"
    if hi < 0:
        return f"unsteered wins: steered {d['diff']:.3g} {why}"
    return f"no significant difference: {d['diff']:+.3g} {why}"


def winner(
    steered: Sequence[float],
    unsteered: Sequence[float],
    min_n: int = MIN_SCORED,
    alpha: float = ALPHA,
) -> str | None:
    """The arm :func:`verdict` calls the winner, or None (too few replies, or no difference)."""
    if min(len(steered), len(unsteered)) < min_n:
        return None
    lo, hi = always_valid_ci(steered, unsteered, alpha)["ci95"]
    return STEERED if lo > 0 else UNSTEERED if hi < 0 else None


def _compare(rows: Sequence[Row], min_n: int) -> dict[str, Any]:
    by_arm = {arm: [r for r in rows if r.arm == arm] for arm in (STEERED, UNSTEERED)}
    s = [r.score for r in by_arm[STEERED] if r.score is not None]
    u = [r.score for r in by_arm[UNSTEERED] if r.score is not None]
    return {
        "arms": {arm: _arm_stats(rs) for arm, rs in by_arm.items()},
        "difference": always_valid_ci(s, u),
        "fixed_horizon": {**diff_ci(s, u), "note": FIXED_HORIZON_NOTE},
        "verdict": verdict(s, u, min_n),
        "winner": winner(s, u, min_n),
    }


def sample_ratio(rows: Sequence[Row], split: float | None) -> dict[str, Any]:
    """The sample-ratio-mismatch check of one experiment's rows against ``split`` (the share of
    subjects steered; None: not known, nothing tested). It counts distinct subjects per arm, the
    unit the split assigns (a heavy user's requests all land in one arm, so request counts would
    flag healthy splits); a log without subject hashes falls back to requests."""
    requests = {arm: sum(r.arm == arm for r in rows) for arm in (STEERED, UNSTEERED)}
    by_subject = all(r.subject_hash is not None for r in rows)
    if by_subject:
        seen = {arm: {r.subject_hash for r in rows if r.arm == arm} for arm in (STEERED, UNSTEERED)}
        counts = {arm: len(x) for arm, x in seen.items()}
        both = len(seen[STEERED] & seen[UNSTEERED])
    else:
        counts, both = dict(requests), None
    out: dict[str, Any] = {
        "unit": "subjects" if by_subject else "requests",
        "counts": counts,
        "requests": requests,
        "subjects_in_both_arms": both,  # the sticky split moved someone: a changed split?
        "split": split,
        "observed_share": None,
        "p_value": None,
        "alpha": ab_stats.SRM_ALPHA,
        "checked": False,
        "flagged": False,
    }
    if split is None:
        out["note"] = (
            "not checked: the split is not in the log (the server's /experiments report checks it)"
        )
    else:
        check = ab_stats.srm(counts[STEERED], counts[UNSTEERED], split, unit=out["unit"])
        out.update({k: check[k] for k in ("observed_share", "p_value", "checked", "flagged")})
        if not check["checked"]:
            out["note"] = "not checked: too few to test"
    # The words, here once: the markdown report and the live page both show these.
    out["summary"], out["warning"] = srm_line(out), srm_warning(out)
    return out


#: The ``splits`` key of a split that holds for every experiment (``ab-report --split``).
EVERY = "*"


def build_report(
    rows: Sequence[Row],
    min_n: int = MIN_SCORED,
    ignored: Ignored | None = None,
    splits: Mapping[str, float] | None = None,
    store: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report of every experiment in ``rows``, overall and per detected language
    (``ignored``: the log's lines it does not stand on, said in the report; ``skipped_lines``
    is their total; ``splits``: the share of subjects steered by experiment name (:data:`EVERY`
    for any experiment), for the sample-ratio check of those it names: the log does not record
    it; ``store``: an experiment
    store's own account of its replicas, records dropped before they reached it included)."""
    ignored = ignored or Ignored()
    splits = splits or {}
    enrolled = [r for r in rows if r.experiment and r.arm in (STEERED, UNSTEERED)]
    out: dict[str, Any] = {
        "requests": len(rows),
        "skipped_lines": ignored.total,
        "unreadable_lines": ignored.unreadable,
        "orphan_feedback_lines": ignored.orphan_feedback,
        "not_enrolled": len(rows) - len(enrolled),
        "min_scored_per_arm": min_n,
        "alpha": ALPHA,
        "experiments": {},
    }
    if store is not None:
        out["store"] = dict(store)
    for name in sorted({r.experiment for r in enrolled}):  # type: ignore[type-var]
        mine = [r for r in enrolled if r.experiment == name]
        langs = sorted({r.language or "unknown" for r in mine})
        out["experiments"][name] = {
            "overall": _compare(mine, min_n),
            "per_language": {
                lang: _compare([r for r in mine if (r.language or "unknown") == lang], min_n)
                for lang in langs
            },
            "srm": sample_ratio(mine, splits.get(name, splits.get(EVERY))),
        }
    return out


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}g}"


def _ci(c: Sequence[float] | None) -> str:
    return "–" if c is None else f"[{c[0]:.3g}, {c[1]:.3g}]"


def _table(label: str, cmp: Mapping[str, Any]) -> list[str]:
    lines = []
    for arm in (STEERED, UNSTEERED):
        a = cmp["arms"][arm]
        sc, lat = a["score"], a["latency_ms"]
        lines.append(
            f"| {label} | {arm} | {a['requests']} | {sc['n']} | {_fmt(sc['mean'])} "
            f"{_ci(sc['ci95'])} | {_fmt(lat['p50'], 4)} | {_fmt(lat['p95'], 4)} |"
        )
    d = cmp["difference"]
    lines.append(f"| {label} | steered − unsteered | | | {_fmt(d['diff'])} {_ci(d['ci95'])} | | |")
    return lines


def report_markdown(rep: Mapping[str, Any]) -> str:
    lines = [
        "# A/B report",
        "",
        f"{rep['requests']} logged requests, {rep['not_enrolled']} not enrolled (no subject, "
        f"explicit steering, or no experiment). A winner needs {rep['min_scored_per_arm']} "
        "scored replies per arm and an always-valid 95 % CI of the difference (mSPRT) that "
        "excludes 0: it stays valid however often the report is read, so it may be watched "
        "live and the experiment stopped at any time.",
    ]
    if note := ignored_note(rep):
        lines += ["", f"{note}."]
    if (st := rep.get("store")) is not None:
        lines += ["", store_line(st)]
    if not rep["experiments"]:
        lines += ["", "No enrolled requests in this log."]
    for name, exp in rep["experiments"].items():
        o = exp["overall"]
        lines += ["", f"## Experiment `{name}`", ""]
        if warning := srm_warning(exp.get("srm")):
            lines += [f"**{warning}**", ""]
        lines += [
            f"**Verdict: {o['verdict']}.**",
            "",
            "- Steered − unsteered, always-valid (what the verdict stands on): "
            f"{_diff_line(o['difference'])}.",
            f"- Fixed-horizon view: {_diff_line(o['fixed_horizon'])}. "
            f"{o['fixed_horizon']['note']}.",
        ]
        if "srm" in exp:
            lines.append(f"- Sample ratio: {srm_line(exp['srm'])}.")
        lines += [
            "",
            "| language | arm | requests | scored | mean score [95 % CI] | p50 ms | p95 ms |",
            "|---|---|---|---|---|---|---|",
            *_table("all", o),
        ]
        for lang, cmp in exp["per_language"].items():
            lines += _table(lang, cmp)
        lines += [
            "",
            "Arm rows: the mean with a fixed-horizon 95 % CI (a description of the arm); "
            "difference rows: the always-valid 95 % CI.",
            "",
            "Per language:",
        ]
        lines += [f"- {lang}: {cmp['verdict']}" for lang, cmp in exp["per_language"].items()]
    return "\n".join(lines) + "\n"


def _diff_line(d: Mapping[str, Any]) -> str:
    if d["diff"] is None:
        return "– (fewer than 2 scored replies in an arm)"
    return f"{d['diff']:+.3g} {_ci(d['ci95'])}, p = {d['p_value']:.2g}"


def srm_line(srm: Mapping[str, Any]) -> str:
    """The sample-ratio check in words."""
    c = srm["counts"]
    line = f"{c[STEERED]} steered / {c[UNSTEERED]} unsteered {srm['unit']}"
    if srm.get("subjects_in_both_arms"):
        line += f" ({srm['subjects_in_both_arms']} in both arms)"
    if srm["split"] is not None:
        line += f", split {srm['split']:.3g} steered"
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
        "not get the share the split assigns (requests failing or not logged in one arm, a "
        "changed split, bots): find the cause before trusting any result below"
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
        notes.append(f"{rep['skipped_lines']} line(s) of the log skipped: {', '.join(why)}")
    if dropped := (rep.get("store") or {}).get("dropped"):
        notes.append(
            f"{dropped} record(s) dropped by the servers before they reached the store (a full "
            "queue while it was unreachable, feedback over the cap): not in these numbers"
        )
    return "; ".join(notes) or None


def store_line(st: Mapping[str, Any]) -> str:
    """An experiment store's account in one sentence."""
    line = (
        f"Experiment store {st['url']}: {st['replicas']} server process(es) wrote "
        f"{st['written']} records"
    )
    if st.get("queued"):
        line += f"; {st['queued']} were still queued at their last write"
    return line + "."


def report(
    source: str | Path | Store, min_n: int = MIN_SCORED, splits: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The report of a decision log (a path) or an experiment store (its URL, or the server's
    open store): what ``steerserve ab-report`` prints and the server's ``/experiments`` page
    shows (one code path for both; the server passes its experiment's split in ``splits`` for
    the sample-ratio check). ValueError: a store URL that cannot be read."""
    from steerserve.server.ab import store as ab_store

    if isinstance(source, ab_store.Store):
        rows, ignored = scan_records(source.records())
        return build_report(rows, min_n, ignored, splits, store=source.status())
    if ab_store.is_store_url(source):
        with ab_store.open_store(str(source), migrate=False) as store:
            return report(store, min_n, splits)
    rows, ignored = scan_log(source)
    return build_report(rows, min_n=min_n, ignored=ignored, splits=splits)


#: The formats :func:`render` writes, and their media types.
FORMATS = {"md": "text/markdown; charset=utf-8", "json": "application/json", "png": "image/png"}


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


def plot(rep: Mapping[str, Any], path: str | Path | IO[bytes]) -> None:
    """Mean score per language and arm with 95 % CIs, one panel per experiment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exps = list(rep["experiments"].items()) or [("(none)", None)]
    fig, axes = plt.subplots(len(exps), 1, figsize=(8, 3.2 * len(exps)), squeeze=False)
    for ax, (name, exp) in zip(axes[:, 0], exps, strict=True):
        ax.set_title(f"experiment {name}")
        if exp is None:
            continue
        groups = {"all": exp["overall"], **exp["per_language"]}
        xs = np.arange(len(groups))
        for k, arm in enumerate((STEERED, UNSTEERED)):
            means, errs = [], []
            for cmp in groups.values():
                sc = cmp["arms"][arm]["score"]
                means.append(np.nan if sc["mean"] is None else sc["mean"])
                errs.append(0.0 if sc["ci95"] is None else (sc["ci95"][1] - sc["ci95"][0]) / 2)
            ax.bar(xs + (k - 0.5) * 0.38, means, 0.38, yerr=errs, capsize=3, label=arm)
        ax.set_xticks(xs, list(groups))
        ax.set_ylabel("mean score")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def write_report(rep: Mapping[str, Any], out_dir: str | Path) -> Path:
    """report.json, report.md and report.png in ``out_dir``; returns the markdown's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in FORMATS:
        (out / f"report.{fmt}").write_bytes(render(rep, fmt))
    return out / "report.md"
