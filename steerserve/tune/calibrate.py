"""Joint calibration of the recall and translation vectors: alone (coarse), the top few jointly,
finer scales around the best pair (the best vector alone need not be in the best pair).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steerserve.engine.spec import SteeringEntry
from steerserve.tune import reporting as R
from steerserve.tune.arms import UNSTEERED
from steerserve.tune.evaluate import generate, record_prompts
from steerserve.tune.extract import NORM_KEY, Candidates, unit_scaled
from steerserve.tune.scorer import rules
from steerserve.tune.scoring import by_lang, lang_mean, non_english, score_all

#: Where the vectors are tried, as fractions of the depth: recall in the middle of the stack,
#: translation late (on an 18-block model blocks 4, 6, 8, 10 and 12, 14, 15, 16).
RECALL_DEPTHS: tuple[float, ...] = (4 / 18, 6 / 18, 8 / 18, 10 / 18)
TRANSLATION_DEPTHS: tuple[float, ...] = (12 / 18, 14 / 18, 15 / 18, 16 / 18)
DESCRIPTION = (
    "recall task vector + translation difference vector, calibrated jointly on the calibration "
    "split"
)


OBJECTIVES: tuple[str, ...] = ("accuracy", "logp")


def depth_layers(num_layers: int, depths: Sequence[float]) -> tuple[int, ...]:
    """The blocks at fractional ``depths`` of a ``num_layers``-block model, deduplicated."""
    return tuple(sorted({min(num_layers - 1, round(d * num_layers)) for d in depths}))


@dataclass
class Grid:
    """The sweep (~30 configurations with the defaults: a 2-core CPU runs them in minutes for a
    270M model); :meth:`for_layers` places the layers on a model's depth."""

    recall_variants: tuple[str, ...] = ("recall.native.diff", "recall.mixed.diff", "recall.en.diff")
    recall_layers: tuple[int, ...] = ()
    recall_scales: tuple[float, ...] = (0.25, 0.5)
    translation_layers: tuple[int, ...] = ()
    translation_scales: tuple[float, ...] = (0.25, 0.5)
    positions: tuple[str, ...] = ("last_prompt_and_generated",)
    top_k: int = 3  # per vector, carried into the joint stage
    fine_factors: tuple[float, ...] = (0.5, 1.5)
    max_en_drop: float = 0.01
    #: ``accuracy``: greedy accuracy through the engine (:func:`calibrate`); ``logp``: the
    #: paired mean change in teacher-forced log P(gold) (``calibrate_logp.calibrate_logp``).
    objective: str = "accuracy"
    max_en_logp_drop: float = 0.1  # nats of English mean log P(gold) a logp winner may cost

    def __post_init__(self) -> None:
        from steerserve.engine.spec import POSITIONS

        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: {self.objective!r}; known: {', '.join(OBJECTIVES)}")
        # Fail before the engine starts, not after half an hour of sweeping.
        bad = [p for p in self.positions if p not in POSITIONS]
        if bad or not self.positions:
            raise ValueError(f"positions: {bad or '(none)'}; known: {', '.join(POSITIONS)}")
        if not self.recall_layers or not self.translation_layers:
            raise ValueError("layers: none given; Grid.for_layers(num_layers) places them")

    @classmethod
    def for_layers(cls, num_layers: int, **kw: Any) -> Grid:
        """The grid on a ``num_layers``-block model (layers at :data:`RECALL_DEPTHS` and
        :data:`TRANSLATION_DEPTHS` unless given)."""
        kw.setdefault("recall_layers", depth_layers(num_layers, RECALL_DEPTHS))
        kw.setdefault("translation_layers", depth_layers(num_layers, TRANSLATION_DEPTHS))
        return cls(**kw)


@dataclass(frozen=True)
class Setting:
    """A candidate's placement: the steering ``entry`` that applies candidate ``variant`` (its
    vector ``cand/<variant>/L<layer>``, scale in residual-norm units)."""

    variant: str
    entry: SteeringEntry

    @classmethod
    def at(
        cls, variant: str, layer: int, scale: float, positions: str = "last_prompt_and_generated"
    ) -> Setting:
        """``variant`` at ``layer`` (a sweep steers from the last prompt token by default)."""
        return cls(variant, SteeringEntry(f"cand/{variant}/L{layer}", layer, scale, positions))

    def moved(self, **change: Any) -> Setting:
        """This setting with another ``scale`` or ``positions``."""
        return Setting.at(**self.as_dict() | change)

    def as_dict(self) -> dict[str, Any]:
        """The flat form results files keep (read back by ``Setting.at(**d)``)."""
        e = self.entry
        return {
            "variant": self.variant,
            "layer": e.layer,
            "scale": e.scale,
            "positions": e.positions,
        }


@dataclass
class Row:
    stage: str
    recall: Setting | None
    translation: Setting | None
    non_en: float = 0.0
    en: float = 0.0
    english_rate: float = 0.0
    recall_any: float = 0.0
    chinese_rate: float = 0.0
    per_lang: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # logp objective: non-English mean teacher-forced log P(gold), its paired change against
    # the unsteered arm on the same items (95 % CI), and the English change
    logp: float | None = None
    d_logp: float | None = None
    d_logp_ci95: tuple[float, float] | None = None
    en_d_logp: float | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {
            "stage": self.stage,
            "recall": self.recall.as_dict() if self.recall else None,
            "translation": self.translation.as_dict() if self.translation else None,
        }
        d.update(
            non_en=round(self.non_en, 4),
            en=round(self.en, 4),
            english_rate=round(self.english_rate, 4),
            recall_any=round(self.recall_any, 4),
            chinese_rate=round(self.chinese_rate, 4),
            per_lang={k: round(v, 4) for k, v in self.per_lang.items()},
            seconds=round(self.seconds, 1),
        )
        if self.logp is not None:
            d.update(
                logp=round(self.logp, 4),
                d_logp=round(self.d_logp or 0.0, 4),
                d_logp_ci95=[round(x, 4) for x in self.d_logp_ci95 or (0.0, 0.0)],
                en_d_logp=round(self.en_d_logp or 0.0, 4),
            )
        return d


def run_config(
    engine: Any,
    records: Sequence[dict],
    entries: Sequence[SteeringEntry] | None,
    max_tokens: int = 8,
) -> tuple[list[str], float]:
    """Greedy answers of every record under one steering config, and the seconds it took."""
    t0 = time.perf_counter()
    from steerserve.tune.records import dataset_form

    prompts = record_prompts(engine, records)
    gens = generate(
        engine,
        prompts,
        [entries] * len(prompts),
        max_tokens,
        form=dataset_form(records),
    )
    return [g.text for g in gens], time.perf_counter() - t0


def summarise(records: Sequence[dict], texts: Sequence[str], row: Row) -> Row:
    r = score_all(records, texts)
    acc = by_lang(records, r.correct)
    row.per_lang = {k: sum(v) / len(v) for k, v in acc.items()}
    row.non_en = lang_mean(non_english(acc))
    row.english_rate = lang_mean(non_english(by_lang(records, r.english)))
    row.recall_any = lang_mean(non_english(by_lang(records, r.recall_any)))
    row.chinese_rate = lang_mean(non_english(by_lang(records, r.chinese)))
    row.en = row.per_lang.get("en", 0.0)
    return row


Pair = tuple[Setting | None, Setting | None]  # (recall, translation)


class SweepBook:
    """What every sweep keeps, whatever it scores by: each (recall, translation) pair's row once,
    in the order they ran, and a log line per row."""

    def __init__(self, log: Any = print) -> None:
        self.rows: list[Row] = []
        self.seen: dict[Pair, Row] = {}
        self.log = log

    @staticmethod
    def stage_name(stage: str, pair: Pair) -> str:
        """A coarse row is named by what it steers: unsteered, recall or translation."""
        if stage != "coarse":
            return stage
        return "recall" if pair[0] else "translation" if pair[1] else UNSTEERED

    def run_many(self, stage: str, pairs: Sequence[Pair]) -> list[Row]:  # pragma: no cover
        raise NotImplementedError

    def keep(self, stage: str, pair: Pair, row: Row, scores: str) -> Row:
        """Remember ``row`` as ``pair``'s and log it with its ``scores``."""
        self.rows.append(row)
        self.seen[pair] = row
        self.log(f"[{stage}] R={fmt_setting(pair[0])} T={fmt_setting(pair[1])}: {scores}")
        return row


class Sweep(SweepBook):
    """Runs and remembers configs; registers each candidate vector once."""

    def __init__(
        self,
        engine: Any,
        cands: Candidates,
        records: Sequence[dict],
        max_tokens: int = 8,
        log: Any = print,
    ) -> None:
        super().__init__(log)
        self.engine, self.cands, self.records = engine, cands, records
        self.max_tokens = max_tokens

    def register(self, s: Setting) -> None:
        if s.entry.vector not in self.engine.registry:
            self.engine.register_vector(
                s.entry.vector, unit_scaled(self.cands, s.variant, s.entry.layer)
            )

    def run_many(self, stage: str, pairs: Sequence[Pair]) -> list[Row]:
        return [self.run(self.stage_name(stage, p), *p) for p in pairs]

    def run(self, stage: str, recall: Setting | None, translation: Setting | None) -> Row:
        key = (recall, translation)
        if key in self.seen:
            return self.seen[key]
        entries = []
        for s in (recall, translation):
            if s is not None:
                self.register(s)
                entries.append(s.entry)
        texts, secs = run_config(self.engine, self.records, entries or None, self.max_tokens)
        row = summarise(self.records, texts, Row(stage, recall, translation, seconds=secs))
        return self.keep(
            stage,
            key,
            row,
            f"non-en {row.non_en:.3f} en {row.en:.3f} en-rate {row.english_rate:.3f} "
            f"zh-rate {row.chinese_rate:.3f} any {row.recall_any:.3f} ({secs:.0f}s)",
        )


def fmt_setting(s: Setting | None) -> str:
    if s is None:
        return "-"
    e = s.entry
    pos = "" if e.positions == "last_prompt_and_generated" else f"/{e.positions}"
    return f"{s.variant.removeprefix('recall.')}@L{e.layer}x{e.scale:g}{pos}"


# --- the plan, one for both objectives (accuracy here, log P in calibrate_logp) ----------------


def coarse_settings(grid: Grid) -> tuple[list[Setting], list[Setting]]:
    """Stage one, each vector alone at the first positions: every recall variant x layer x scale,
    then every translation layer x scale."""
    pos0 = grid.positions[0]
    rec = [
        Setting.at(v, layer, s, pos0)
        for v in grid.recall_variants
        for layer in grid.recall_layers
        for s in grid.recall_scales
    ]
    tr = [
        Setting.at("translation", layer, s, pos0)
        for layer in grid.translation_layers
        for s in grid.translation_scales
    ]
    return rec, tr


def joint_pairs(top_r: Sequence[Row], top_t: Sequence[Row]) -> list[Pair]:
    """Stage two: every pair of the top-k of each vector (the marginal winners may not be the
    best pair, whatever their cost alone)."""
    return [(a.recall, b.translation) for a in top_r for b in top_t]


def fine_pairs(cur: Row, grid: Grid) -> tuple[list[Pair], list[Pair]]:
    """Stage three, around the best joint pair ``cur``: each vector's scale times each fine
    factor (the other kept), then both at each other positions."""
    assert cur.recall and cur.translation
    scaled: list[Pair] = []
    for f in grid.fine_factors:
        r2 = cur.recall.moved(scale=round(cur.recall.entry.scale * f, 4))
        t2 = cur.translation.moved(scale=round(cur.translation.entry.scale * f, 4))
        scaled += [(r2, cur.translation), (cur.recall, t2)]
    moved: list[Pair] = [
        (cur.recall.moved(positions=p), cur.translation.moved(positions=p))
        for p in grid.positions[1:]
    ]
    return scaled, moved


@dataclass(frozen=True)
class Objective:
    """How the plan ranks rows: the top ``k`` carried into the joint stage, the best row
    within the English guard (None: no row is), and the score that orders rows when none is."""

    carry: Callable[[Sequence[Row], Row, int], list[Row]]
    best: Callable[[Sequence[Row], Row], Row | None]
    score: Callable[[Row], float]


def run_plan(sw: SweepBook, grid: Grid, obj: Objective) -> tuple[Row, Row]:
    """The one plan of both objectives: coarse, joint, fine; the unsteered row and the winner (the
    best pair within the guard, else the joint stage's best)."""
    rec, tr = coarse_settings(grid)
    coarse = [(None, None)] + [(r, None) for r in rec] + [(None, t) for t in tr]
    rows = sw.run_many("coarse", coarse)
    base, rec_rows, tr_rows = rows[0], rows[1 : 1 + len(rec)], rows[1 + len(rec) :]
    top_r, top_t = obj.carry(rec_rows, base, grid.top_k), obj.carry(tr_rows, base, grid.top_k)
    joint = sw.run_many("joint", joint_pairs(top_r, top_t))
    cur = obj.best(joint, base) or max(joint, key=obj.score)
    scaled, moved = fine_pairs(cur, grid)
    sw.run_many("fine", scaled)
    sw.run_many("positions", moved)
    both = [r for r in sw.rows if r.recall is not None and r.translation is not None]
    return base, obj.best(both, base) or cur


def accuracy_objective(grid: Grid) -> Objective:
    """Greedy non-English accuracy, English accuracy within ``grid.max_en_drop``."""
    return Objective(
        carry=lambda rows, base, k: sorted(rows, key=lambda r: -r.non_en)[:k],
        best=lambda rows, base: next(iter(best(rows, base, grid.max_en_drop)), None),
        score=lambda r: r.non_en,
    )


def feasible(row: Row, base: Row, max_en_drop: float) -> bool:
    return row.en >= base.en - max_en_drop - 1e-9


def best(rows: Sequence[Row], base: Row, max_en_drop: float, k: int = 1) -> list[Row]:
    """Top ``k`` feasible rows by non-English accuracy (ties: fewer English answers)."""
    ok = [r for r in rows if feasible(r, base, max_en_drop)]
    return sorted(ok, key=lambda r: (-r.non_en, r.english_rate, -r.recall_any))[:k]


def calibrate(
    engine: Any,
    cands: Candidates,
    records: Sequence[dict],
    grid: Grid,
    max_tokens: int = 8,
    log: Any = print,
) -> dict[str, Any]:
    """Coarse marginal sweeps, a joint stage over the top-k of each, a fine scale stage."""
    t0 = time.perf_counter()
    sw = Sweep(engine, cands, records, max_tokens, log)
    base, winner = run_plan(sw, grid, accuracy_objective(grid))
    chat = any("messages" in r for r in records)
    return {
        "objective": (
            f"max mean non-English accuracy s.t. English accuracy >= {UNSTEERED} - "
            f"{grid.max_en_drop:g} (calibration split)"
        ),
        "chosen": winner.as_dict(),
        UNSTEERED: base.as_dict(),
        "feasible": feasible(winner, base, grid.max_en_drop),
        "grid": dataclasses.asdict(grid),
        "n_items": len(records),
        "n_per_lang": {k: sum(r["lang"] == k for r in records) for k in winner.per_lang},
        "scoring": {"form": "chat" if chat else "completion", **rules(chat)},
        "scale_unit": "multiples of the layer's mean last-token residual norm (zero-shot prompts)",
        "seconds": round(time.perf_counter() - t0, 1),
        "sweep": [r.as_dict() for r in sw.rows],
        "_winner": winner,
    }


def build_artifact(
    cands: Candidates,
    result: dict[str, Any],
    model_dir: str | Path,
    out_dir: str | Path,
    name: str,
    version: str,
    overwrite: bool = False,
    extra_provenance: dict[str, Any] | None = None,
    description: str = DESCRIPTION,
    languages: dict[str, Any] | None = None,
) -> Any:
    """Save the winner as ``recall`` + ``translation``, the sweep in each entry's ``calibration``
    (one joint decision, so both carry it) and ``auto``'s gate (``languages``; None: all)."""
    from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact

    winner: Row = result["_winner"]
    cal = {k: v for k, v in result.items() if not k.startswith("_")}
    ivs, tensors = [], {}
    for iv_name, s in (("recall", winner.recall), ("translation", winner.translation)):
        assert s is not None
        e = s.entry
        tensors[iv_name] = unit_scaled(cands, s.variant, e.layer)
        prov = {
            "variant": s.variant,
            "definition": cands.meta.get("definitions", {}),
            "extraction": {k: cands.meta.get(k) for k in ("config", "groups", "fact_split")},
            "layer_resid_norm": float(cands.tensors[NORM_KEY][e.layer]),
            "vector_norm": "unit direction x layer_resid_norm; scale in residual-norm units",
            **(extra_provenance or {}),
        }
        ivs.append(
            Intervention(
                name=iv_name,
                tensor=iv_name,
                layer=e.layer,
                scale=e.scale,
                positions=e.positions,  # type: ignore[arg-type]
                provenance=prov,
                calibration=cal,
            )
        )
    manifest = Manifest(
        name=name,
        version=version,
        model=binding_for_model(model_dir),
        interventions=ivs,
        description=description,
        languages=languages,
    )
    return save_artifact(out_dir, manifest, tensors, overwrite=overwrite)


def calib_records(
    per_lang: int = 10,
    en_items: int = 30,
    shots: int | None = None,
    part: tuple[int, int] = (0, 1),
    form: str = "completion",
) -> list[dict]:
    """Calibration-split items from ``part`` of each language's facts: ``per_lang`` per
    non-English language and ``en_items`` English ones (the guard needs more than a handful)."""
    from steerserve.tune.facts import LANGS, eval_records

    kw = dict(split="calib", shots=shots, part=part, form=form)
    out = eval_records(langs=["en"], limit_per_lang=en_items, **kw)
    non_en = [lang for lang in LANGS if lang != "en"]
    return out + eval_records(langs=non_en, limit_per_lang=per_lang, **kw)


def split_records(records: Sequence[dict], holdout: bool) -> tuple[list[dict], list[dict]]:
    """A given dataset as (sweep, held-out check) records: every other record of each
    language, so both halves have every language (without ``holdout``: all, none)."""
    if not holdout:
        return list(records), []
    sweep, held = round_robin(records, 2)
    return sweep, held


def round_robin(records: Sequence[dict], n: int) -> list[list[dict]]:
    """``n`` parts with no record in two: the i-th record of each language goes to part
    ``i % n``, so every part has every language."""
    seen: dict[str, int] = {}
    parts: list[list[dict]] = [[] for _ in range(n)]
    for r in records:
        k = seen.get(r["lang"], 0)
        parts[k % n].append(r)
        seen[r["lang"]] = k + 1
    return parts


def confirm(
    engine: Any,
    cands: Candidates,
    result: dict[str, Any],
    records: Sequence[dict],
    max_tokens: int = 8,
    log: Any = print,
) -> dict[str, Any]:
    """The unsteered arm and the chosen pair again on held-out facts (``result["holdout"]``): a
    sweep picks the luckiest setting, so only fresh items check it; the choice is not changed."""
    winner: Row = result["_winner"]
    sw = Sweep(engine, cands, records, max_tokens, log)
    base = sw.run("holdout", None, None)
    row = sw.run("holdout", winner.recall, winner.translation)
    gain = row.non_en - base.non_en
    result["holdout"] = {
        "n_items": len(records),
        UNSTEERED: base.as_dict(),
        "chosen": row.as_dict(),
        "non_en_gain": round(gain, 4),
        "en_change": round(row.en - base.en, 4),
        "confirms": gain > 0 and feasible(row, base, result["grid"]["max_en_drop"]),
    }
    return result


def write_summary(result: dict[str, Any], out_dir: str | Path) -> Path:
    """``calibration.json`` (the whole sweep) and ``calibration.md`` (a readable table)."""
    import json

    clean = {k: v for k, v in result.items() if not k.startswith("_")}
    b = result[UNSTEERED]
    lines = [
        "# Calibration sweep (calibration split)",
        "",
        f"- objective: {result['objective']}",
        f"- items: {result['n_items']} ({result['n_per_lang']})",
        f"- scale unit: {result['scale_unit']}",
        f"- timings (s): {json.dumps(result.get('timings_s', {}))}",
        f"- {UNSTEERED}: non-English {b['non_en']:.3f}, English {b['en']:.3f}, "
        f"answered in English {b['english_rate']:.3f}",
        f"- chosen: recall {_fmt_d(result['chosen']['recall'])}, translation "
        f"{_fmt_d(result['chosen']['translation'])} (feasible: {result['feasible']})",
    ]
    if h := result.get("holdout"):
        lines.append(
            f"- held-out check ({h['n_items']} other calibration facts): non-English "
            f"{h[UNSTEERED]['non_en']:.3f} -> {h['chosen']['non_en']:.3f}, English "
            f"{h[UNSTEERED]['en']:.3f} -> {h['chosen']['en']:.3f} (confirms: {h['confirms']})"
        )
    if h and "d_logp" in h:
        lines.append(
            f"- held-out Δ log P(gold), non-English: {h['d_logp']:+.3f} "
            f"[{h['d_logp_ci95'][0]:+.3f}, {h['d_logp_ci95'][1]:+.3f}]; Δ accuracy "
            f"{h['non_en_gain']:+.3f} [{h['non_en_gain_ci95'][0]:+.3f}, "
            f"{h['non_en_gain_ci95'][1]:+.3f}] (paired bootstrap 95 % CIs)"
        )
    if sc := result.get("scoring"):
        lines.append(f"- scoring ({sc['form']} records): correct = {sc['correct']}")
    lp = any("d_logp" in r for r in result["sweep"])
    extra = " Δ log P [95 % CI] | en Δ log P |" if lp else ""
    lines += [
        "",
        "| stage | recall | translation | non-en acc | en acc | en-rate | zh-rate | recall-any "
        "| s |" + extra,
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if lp else ""),
    ]
    for r in result["sweep"]:
        cells = (
            f" {r['d_logp']:+.3f} [{r['d_logp_ci95'][0]:+.3f}, {r['d_logp_ci95'][1]:+.3f}] | "
            f"{r['en_d_logp']:+.3f} |"
            if lp and "d_logp" in r
            else (" — | — |" if lp else "")
        )
        lines.append(
            f"| {r['stage']} | {_fmt_d(r['recall'])} | {_fmt_d(r['translation'])} | "
            f"{r['non_en']:.3f} | {r['en']:.3f} | {r['english_rate']:.3f} | "
            f"{r.get('chinese_rate', 0):.3f} | {r['recall_any']:.3f} | {r['seconds']:.0f} |" + cells
        )
    return R.write(out_dir, clean, "\n".join(lines) + "\n", stem="calibration")


def _fmt_d(d: dict[str, Any] | None) -> str:
    return fmt_setting(Setting.at(**d)) if d else "-"
