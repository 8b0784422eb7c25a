"""``steerserve ab-report LOG|STORE``: who won a server-side A/B experiment, read from its decision
log or its experiment store; the numbers ``/experiments`` shows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from steerserve.server.ab import comparison as cmp
from steerserve.server.ab import metrics as ab_metrics
from steerserve.server.ab import stats as ab_stats
from steerserve.server.ab.design import STEERED, UNSTEERED, DesignError, Phase
from steerserve.server.ab.experiment import PAIR, UNENROLLED
from steerserve.server.ab.pairs import pairs_report
from steerserve.server.ab.records import Ignored, Row, parse_line, read_log, scan, scan_log
from steerserve.server.ab.rendering import (
    FORMATS,
    ignored_note,
    render,
    report_markdown,
    store_line,
    write_report,
)

if TYPE_CHECKING:
    from steerserve.server.ab.store import Store

__all__ = [
    "FORMATS",
    "Ignored",
    "Row",
    "build_report",
    "ignored_note",
    "read_log",
    "render",
    "report",
    "report_markdown",
    "scan_log",
    "store_line",
    "write_report",
]

#: Fewer values than this in either arm: no verdict on that metric. Fixed by the server (the
#: page's viewers cannot lower it): the always-valid test needs no planned sample size, but a
#: winner on five thumbs convinces nobody.
MIN_SCORED = 30
#: The family's level: the chance that any verdict of the experiment, at any look, is false.
ALPHA = ab_stats.ALPHA
FAMILY_METHOD = "Bonferroni"
FIXED_HORIZON_NOTE = cmp.FIXED_HORIZON_NOTE
#: The ``splits`` key of a split that holds for every experiment (``ab-report --split``).
EVERY = "*"
ARMS = (STEERED, UNSTEERED)
#: Arms a row may have that are no arm of an experiment's design.
OUTSIDE = (UNENROLLED, PAIR)


def phase_report(
    rows: Sequence[Row],
    arms: Sequence[str],
    control: str,
    allocation: Mapping[str, float] | None,
    min_n: int,
    primary: str | None = None,
) -> dict[str, Any]:
    """One phase: overall (per treatment, the languages where its steering was applied), per
    language, the family's correction, the primary metric's sequence, the sample-ratio check
    against ``allocation``."""
    treatments = [a for a in arms if a != control]
    f = cmp.Frame.of(rows, arms)
    langs = sorted(set(f.language.tolist()))
    masks = {lang: f.language == lang for lang in langs}
    left_out = {
        t: [g for g in langs if cmp.applied_status(f, masks[g], t)["status"] == "not applied"]
        for t in treatments
    }
    everywhere = np.ones(len(f.rows), dtype=bool)
    overall = {
        t: ~np.isin(f.language, left_out[t]) if len(left_out[t]) < len(langs) else everywhere
        for t in treatments
    }
    present = [m for m in ab_metrics.registry().values() if not np.isnan(f.values(m.name)).all()]
    names = [m.name for m in present]
    primary = primary or (
        ab_metrics.FEEDBACK if "feedback" in names else ab_metrics.PRIMARY_FALLBACK
    )
    groups = {t: {m.tobytes() for m in (overall[t], *masks.values())} for t in treatments}
    n_groups = sum(len(g) for g in groups.values())
    size = max(len(present) * n_groups, 1)
    alpha = ab_stats.family_alpha(ALPHA, size)
    args = (present, primary, alpha, min_n, control)
    out: dict[str, Any] = {
        "arms": list(arms),
        "control": control,
        "treatments": treatments,
        "overall": cmp.group(f, overall, *args),
        "per_language": {
            lang: cmp.group(f, dict.fromkeys(treatments, masks[lang]), *args) for lang in langs
        },
        "primary": primary,
        # languages no treatment was applied in (by treatment: not_applied_by_arm)
        "not_applied": [g for g in langs if all(g in left_out[t] for t in treatments)],
        "not_applied_by_arm": left_out,
        "unit": "subjects" if f.by_subject else "requests (no subject hashes in this log)",
        "family": {
            "method": FAMILY_METHOD,
            "alpha": ALPHA,
            "size": size,
            "each": alpha,
            "metrics": names,
            "treatments": len(treatments),
            "groups": n_groups // max(len(treatments), 1),
        },
        "srm": cmp.sample_ratio(rows, arms, control, allocation),
    }
    if primary in names:
        m = ab_metrics.get(primary)
        seqs = {t: cmp.sequence(f, overall[t], m, alpha, (t, control)) for t in treatments}
        out["sequence"], out["sequences"] = seqs[treatments[0]], seqs
    for lang in out["not_applied"]:
        g = out["per_language"][lang]
        g["verdict"] = (
            f"steered arm not applied here (its prompts were answered unsteered): {g['verdict']}"
        )
    return out


def experiment_report(
    rows: Sequence[Row],
    min_n: int,
    split: float | None,
    primary: str | None = None,
    phases: Mapping[int, Mapping[str, Any]] | None = None,
    info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One experiment, phase by phase (its recorded phases; rows from before phases were
    recorded form one phase ``null``, checked against ``split`` where given). The experiment's
    own keys (``overall``, ``per_language``, ``srm``, ...) are its latest phase's with rows;
    ``phases`` lists every phase with its allocation, start, end, why and analysis."""
    recorded = _phases(phases or {})
    by_phase: dict[int | None, list[Row]] = {}
    for r in rows:
        by_phase.setdefault(r.phase if r.phase in recorded else None, []).append(r)
    listed: list[dict[str, Any]] = []
    for number in sorted(set(recorded) | set(by_phase), key=lambda n: (n is not None, n or 0)):
        ph, got = recorded.get(number), by_phase.get(number, [])
        if ph is not None:
            arms, control, allocation = ph.design.names, ph.design.control, ph.allocation
        elif recorded:  # rows whose phase is not recorded: the experiment's arms, no allocation
            last = recorded[max(recorded)].design
            arms, control, allocation = last.names, last.control, None
        else:
            arms, control = _seen_arms(got)
            allocation = _split(arms, control, split)
        meta: dict[str, Any] = {
            "phase": number,
            "arms": [a.record() for a in ph.design.arms] if ph else [{"name": a} for a in arms],
            "control": control,
            "allocation": allocation,
            "started": ph.started if ph else None,
            "ended": ph.ended if ph else None,
            "why": ph.why if ph else "before phases were recorded",
            "requests": len(got),
        }
        if got:
            meta |= phase_report(got, arms, control, allocation, min_n, primary)
        listed.append(meta)
    latest = next((p for p in reversed(listed) if p["requests"]), listed[-1])
    out = {k: v for k, v in latest.items()} | {"phases": listed}
    out["status"] = (info or {}).get("status")
    out["note"] = (info or {}).get("note") or None  # the store keeps no empty note
    out["current_phase"] = listed[-1]["phase"]
    return out


def _phases(recs: Mapping[int, Mapping[str, Any]]) -> dict[int, Phase]:
    out = {}
    for n, rec in recs.items():
        try:
            out[n] = Phase.of(rec)
        except (ValueError, KeyError, TypeError, DesignError):
            continue  # a phase line another version wrote: its rows report as unphased
    return out


def _seen_arms(rows: Sequence[Row]) -> tuple[tuple[str, ...], str]:
    """The arms of rows with no recorded phase: the two-arm shorthand's when they are those,
    else the arms seen (the control ``unsteered`` where there is one, else the first)."""
    seen = sorted({r.arm for r in rows if r.arm})
    if set(seen) <= set(ARMS) or len(seen) < 2:
        return tuple(dict.fromkeys([*ARMS, *seen])), UNSTEERED
    control = UNSTEERED if UNSTEERED in seen else seen[0]
    return tuple(seen), control


def _split(arms: Sequence[str], control: str, split: float | None) -> dict[str, float] | None:
    if split is None or len(arms) != 2:
        return None
    treat = next(a for a in arms if a != control)
    return {treat: split, control: 1.0 - split}


def build_report(
    rows: Sequence[Row],
    min_n: int = MIN_SCORED,
    ignored: Ignored | None = None,
    splits: Mapping[str, float] | None = None,
    store: Mapping[str, Any] | None = None,
    primary: str | None = None,
    phases: Mapping[str, Mapping[int, Mapping[str, Any]]] | None = None,
    experiments: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The report of every experiment in ``rows`` (``ignored``: the log's lines it does not
    stand on, said in the report; ``splits``: the share of subjects steered by experiment name,
    :data:`EVERY` for any, for rows from before phases were recorded; ``store``: an experiment
    store's own account of its replicas; ``primary``: the metric the winner is called on, else
    feedback where the experiment has any, else ``language_match``; ``phases`` and
    ``experiments``: the experiments' own records, as ``records.scan`` reads them)."""
    ignored = ignored or Ignored()
    splits, phases, experiments = splits or {}, phases or {}, experiments or {}
    enrolled = [r for r in rows if r.experiment and r.arm and r.arm not in OUTSIDE]
    pairs = [r for r in rows if r.experiment and r.arm == PAIR]
    out: dict[str, Any] = {
        "requests": len(rows) - len(pairs),
        "pairs": len(pairs),
        "skipped_lines": ignored.total,
        "unreadable_lines": ignored.unreadable,
        "orphan_feedback_lines": ignored.orphan_feedback,
        "unknown_metric_lines": ignored.unknown_metric,
        "not_enrolled": len(rows) - len(enrolled) - len(pairs),
        "min_scored_per_arm": min_n,
        "alpha": ALPHA,
        "metrics": [m.describe() for m in ab_metrics.registry().values()],
        "experiments": {},
        "preferences": pairs_report(pairs, min_n, ALPHA),
    }
    if store is not None:
        out["store"] = dict(store)
    by_name: dict[str, list[Row]] = {}
    for r in enrolled:
        by_name.setdefault(r.experiment, []).append(r)  # type: ignore[arg-type]
    for name in sorted(by_name):
        split = splits.get(name, splits.get(EVERY))
        out["experiments"][name] = experiment_report(
            by_name[name], min_n, split, primary, phases.get(name), experiments.get(name)
        )
    return out


def report(
    source: str | Path | Store,
    min_n: int = MIN_SCORED,
    splits: Mapping[str, float] | None = None,
    primary: str | None = None,
) -> dict[str, Any]:
    """The report of a decision log (a path) or an experiment store (its URL, or the server's
    open store): what ``steerserve ab-report`` prints and the server's ``/experiments`` page
    shows (one code path for both). ValueError: a store URL that cannot be read."""
    from steerserve.server.ab import store as ab_store

    if isinstance(source, ab_store.Store):
        got, account = scan(source.records()), source.status()
    elif ab_store.is_store_url(source):
        with ab_store.open_store(str(source), migrate=False) as store:
            return report(store, min_n, splits, primary)
    else:
        with open(source, encoding="utf-8", errors="replace") as f:
            got, account = scan(map(parse_line, f)), None
    return build_report(got.rows, min_n, got.ignored, splits, account, primary, got.phases,
                        got.experiments)  # fmt: skip
