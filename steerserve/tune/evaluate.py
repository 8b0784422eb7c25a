"""An artifact's arms through the vLLM engine: greedy answers of every record under every arm,
scored, with paired intervals against the unsteered arm and the controls, a report and a plot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from steerserve.engine.defaults import RESEARCH_KV_CACHE_MEMORY_BYTES
from steerserve.engine.spec import SteeringEntry
from steerserve.tune import reporting as R
from steerserve.tune.arms import (
    COMBINED,
    CONTROLS,
    UNSTEERED,
    arm_entries,
    arm_names,
    arm_vectors,
    check_arms,
)
from steerserve.tune.replies import (
    SCRIPTS,
    Generation,
    check_cuts,
    cut_share,
    judge,
    stop_strings,
    write_replies,
)
from steerserve.tune.scorer import rules
from steerserve.tune.scoring import (
    ArmResult,
    bootstrap_mean,
    by_lang,
    lang_mean,
    non_english,
    paired_bootstrap,
    score_all,
    wilson,
)

Entries = Sequence[SteeringEntry] | None


# --- through the engine --------------------------------------------------------------------------


def register_artifact(engine: Any, artifact: Any) -> None:
    """Register the artifact's vectors and their controls in the engine."""
    for name, t in arm_vectors(artifact).items():
        if name not in engine.registry:
            engine.register_vector(name, t)


def record_prompts(engine: Any, records: Sequence[dict]) -> list[str | list[int]]:
    """The engine's prompts for ``records``: chat messages rendered with the engine's tokenizer
    exactly as the server renders them (``steerserve.models.chat.chat_ids``), completion text as is."""
    from steerserve.tune.records import engine_prompts

    needs_tok = any("messages" in r for r in records)
    return engine_prompts(engine.llm.get_tokenizer() if needs_tok else None, records)


def generate(
    engine: Any,
    prompts: Sequence[str | Sequence[int]],
    steering: Sequence[Entries],
    max_tokens: int = 8,
    chunk: int = 256,
    progress: Callable[[int], None] | None = None,
    form: str = "completion",
) -> list[Generation]:
    """Greedy replies, each ended by EOS, the form's stop or ``max_tokens``; steered requests
    reuse the unsteered prompt KV up to their first steered token (sweeps ~3x cheaper)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop_strings(form))
    out: list[Generation] = []
    for i in range(0, len(prompts), chunk):
        ps, st = prompts[i : i + chunk], steering[i : i + chunk]
        res = engine.generate(ps, sp, steering=st)
        for r in res:
            o = r.outputs[0]
            out.append(Generation(o.text, len(o.token_ids), o.finish_reason == "length"))
        if progress:
            progress(len(res))
    return out


# --- report -----------------------------------------------------------------------------------


def build_report(
    records: Sequence[dict],
    results: Mapping[str, ArmResult],
    meta: Mapping[str, Any],
    base_arm: str = UNSTEERED,
) -> dict:
    """``{"arms": {ARM: {"per_language": {...}, "non_english_mean": x, ...}}, ...}``."""
    arms: dict[str, Any] = {}
    base = results.get(base_arm)
    for arm, r in results.items():
        corr = by_lang(records, r.correct)
        eng = by_lang(records, r.english)
        rany = by_lang(records, r.recall_any)
        zh = by_lang(records, r.chinese) if r.chinese else None
        per = {}
        for lang, v in corr.items():
            n, k = len(v), int(sum(v))
            lo, hi = wilson(k, n)
            per[lang] = {
                "n": n,
                "accuracy": k / n,
                "ci95": [lo, hi],
                "english_rate": sum(eng[lang]) / n if lang != "en" else 0.0,
                "chinese_rate": sum(zh[lang]) / n if zh and lang != "zh" else 0.0,
                "recall_any": sum(rany[lang]) / n,
            }
            if r.replies:
                per[lang]["script"] = _scripts(r.replies, lang)
            if base is not None and arm != base_arm:
                b = by_lang(records, base.correct)[lang]
                per[lang][f"vs_{base_arm}"] = paired_bootstrap({lang: v}, {lang: b})
        ne = non_english(corr)
        a: dict[str, Any] = {
            "per_language": per,
            "non_english_mean": lang_mean(ne),
            "non_english_mean_ci95": list(bootstrap_mean(ne)) if ne else [0.0, 0.0],
            "non_english_recall_any_mean": lang_mean(non_english(rany)),
            "non_english_english_rate_mean": lang_mean(non_english(eng)),
            "non_english_chinese_rate_mean": lang_mean(non_english(zh)) if zh else 0.0,
        }
        if r.replies:
            cuts = [x.cut for x in r.replies]
            a["replies"] = len(cuts)
            a["cut"] = sum(cuts)
            a["cut_share"] = cut_share(cuts)
            a["loops"] = sum(x.loop for x in r.replies)
        if base is not None and arm != base_arm and ne:
            a[f"vs_{base_arm}"] = paired_bootstrap(ne, non_english(by_lang(records, base.correct)))
        arms[arm] = a
    for ctl in CONTROLS:
        if COMBINED in results and ctl in results:
            ne_b = non_english(by_lang(records, results[COMBINED].correct))
            ne_r = non_english(by_lang(records, results[ctl].correct))
            if ne_b:
                arms[COMBINED][f"vs_{ctl}"] = paired_bootstrap(ne_b, ne_r)
    chat = any("messages" in r for r in records)
    scoring = {"form": "chat" if chat else "completion", **rules(chat)}
    return {
        "arms": arms,
        "base_arm": base_arm,
        "acceptance": acceptance(arms),
        "scoring": scoring,
        **meta,
    }


def _scripts(replies: Sequence[Any], lang: str) -> dict[str, float]:
    """Shares of a language's answers written in its own script, in Latin letters, in Han."""
    mine = [x.script for x in replies if x.lang == lang]
    return {k: mine.count(k) / len(mine) for k in SCRIPTS} if mine else {}


def all_replies(results: Mapping[str, ArmResult]) -> list[Any]:
    """Every kept reply of every arm, arm by arm."""
    return [x for r in results.values() for x in r.replies]


def check_budget(results: Mapping[str, ArmResult], budget: int, limit: float) -> None:
    """Stop a run whose replies the budget cut too often (``replies.check_cuts``)."""
    check_cuts([x.cut for x in all_replies(results)], budget, limit)


def acceptance(arms: Mapping[str, Any]) -> dict[str, Any]:
    """Does ``both`` help: beats unsteered and the controls beyond the paired CI, lifts the weakest
    language, keeps English within 1 point; each a boolean with its numbers."""
    if not {UNSTEERED, COMBINED} <= set(arms):
        return {}
    b, base = arms[COMBINED], arms[UNSTEERED]
    out: dict[str, Any] = {}
    vb = b.get(f"vs_{UNSTEERED}", {})
    out[f"beats_{UNSTEERED}_beyond_ci"] = bool(vb and vb["ci95"][0] > 0)
    for ctl in CONTROLS:
        if f"vs_{ctl}" in b:
            out[f"beats_{ctl}_beyond_ci"] = bool(b[f"vs_{ctl}"]["ci95"][0] > 0)
    ne = {k: v for k, v in base["per_language"].items() if k != "en"}
    if ne:
        low = min(ne, key=lambda k: ne[k]["accuracy"])
        out["lowest_language"] = low
        out["lowest_language_delta"] = (
            b["per_language"][low]["accuracy"] - base["per_language"][low]["accuracy"]
        )
        out["lifts_lowest_language"] = out["lowest_language_delta"] > 0
    if "en" in base["per_language"]:
        d = b["per_language"]["en"]["accuracy"] - base["per_language"]["en"]["accuracy"]
        out["english_delta"] = d
        out["english_within_1pt"] = d >= -0.01
    return out


def _lang_table(
    title: str, langs: Sequence[str], names: Sequence[str], cell: Callable[[str, str], str]
) -> list[str]:
    """A markdown table, one row per language and one column per arm; ``cell(arm, lang)``."""
    lines = ["", f"## {title}", "", "| lang | " + " | ".join(names) + " |"]
    lines.append("|---|" + "---|" * len(names))
    return lines + [f"| {g} | " + " | ".join(cell(a, g) for a in names) + " |" for g in langs]


def _pct_ci(d: Mapping[str, Any], key: str = "ci95") -> str:
    lo, hi = d[key]
    return f"{100 * d['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def report_markdown(report: Mapping[str, Any]) -> str:
    arms = report["arms"]
    names = list(arms)
    langs = list(next(iter(arms.values()))["per_language"])
    lines = _header(report, names) + _language_tables(report, names, langs)
    return "\n".join(lines + _comparisons(report, names)) + "\n"


def _header(report: Mapping[str, Any], names: list[str]) -> list[str]:
    """The run's settings, the scoring rule, the budget's cuts and the declared plan."""
    arms = report["arms"]
    lines = ["# Evaluation report", ""]
    for k in ("model", "artifact", "dataset", "n_items", "max_tokens", "interventions"):
        if k in report:
            lines.append(f"- **{k}**: `{json.dumps(report[k], ensure_ascii=False)}`")
    if "timings_s" in report:
        lines.append(f"- **timings_s**: `{json.dumps(report['timings_s'])}`")
    if sc := report.get("scoring"):
        lines.append(f"- **scoring** ({sc['form']} records): correct = {sc['correct']}")
    if any("cut_share" in a for a in arms.values()):
        cut = ", ".join(f"{a} {arms[a]['cut']}/{arms[a]['replies']}" for a in names)
        lines.append(
            f"- **replies cut by the {report.get('max_tokens')}-token budget** before their "
            f"answer ended: {cut}; stopped by it while repeating themselves (loops, wrong "
            f"whatever the budget, not cuts): "
            + ", ".join(f"{a} {arms[a].get('loops', 0)}" for a in names)
            + " (every reply is in `replies.jsonl`)"
        )
    if plan := report.get("plan"):
        lines += ["", f"## Plan, declared before the run (`{plan['file']}`)", "", plan["text"]]
    return lines


def _language_tables(report: Mapping[str, Any], names: list[str], langs: list[str]) -> list[str]:
    """Per language and arm: accuracy, the paired difference, answer script, English, Chinese
    and recall-any rates."""
    arms, sc = report["arms"], report.get("scoring")
    non_en = [g for g in langs if g != "en"]
    lines: list[str] = []

    def acc(a: str, g: str) -> str:
        p = arms[a]["per_language"][g]
        return f"{R.pct(p['accuracy'])} [{R.pct(p['ci95'][0])}, {R.pct(p['ci95'][1])}] (n={p['n']})"

    lines += _lang_table("Accuracy in the query language (%, Wilson 95 % CI)", langs, names, acc)
    row = []
    for a in names:
        lo, hi = arms[a]["non_english_mean_ci95"]
        row.append(f"**{R.pct(arms[a]['non_english_mean'])}** [{R.pct(lo)}, {R.pct(hi)}]")
    lines.append("| non-English mean | " + " | ".join(row) + " |")
    base = report.get("base_arm", UNSTEERED)
    steered = [a for a in names if a != base]
    if steered and f"vs_{base}" in arms[steered[0]]["per_language"][langs[0]]:

        def delta(a: str, g: str) -> str:
            return _pct_ci(arms[a]["per_language"][g][f"vs_{base}"])

        title = f"Paired difference vs {base} per language (pts, 95 % bootstrap CI)"
        lines += _lang_table(title, langs, steered, delta)
    if all("script" in arms[a]["per_language"][langs[0]] for a in names):

        def script(a: str, g: str) -> str:
            s = arms[a]["per_language"][g]["script"]
            return " / ".join(R.pct(s[k]) for k in SCRIPTS)

        title = "Answer script: query language / Latin / Han / other (% of replies)"
        lines += _lang_table(title, langs, names, script)
        if sc:
            lines += ["", f"Script: {sc.get('script', '')}."]
    lines += _lang_table(
        "Answered in English instead of the query language (%)",
        non_en,
        names,
        lambda a, g: R.pct(arms[a]["per_language"][g]["english_rate"]),
    )
    if sc:
        lines += ["", f"English: {sc['english']}."]
    lines += _lang_table(
        "Answered in Chinese instead of the query language (%)",
        [g for g in langs if g != "zh"],
        names,
        lambda a, g: R.pct(arms[a]["per_language"][g].get("chinese_rate")),
    )
    if sc:
        lines += ["", f"Chinese: {sc['chinese']}."]
    lines += _lang_table(
        "Recall-any: correct in the query language or in English (%)",
        langs,
        names,
        lambda a, g: R.pct(arms[a]["per_language"][g]["recall_any"]),
    )
    cells = [R.pct(arms[a]["non_english_recall_any_mean"]) for a in names]
    lines.append("| non-English mean | " + " | ".join(cells) + " |")
    return lines


def _comparisons(report: Mapping[str, Any], names: list[str]) -> list[str]:
    """Each arm against the base arm, unsteered and the controls; the acceptance checks."""
    arms, base = report["arms"], report.get("base_arm", UNSTEERED)
    lines = ["", "## Paired comparisons (non-English mean accuracy, paired bootstrap)", ""]
    lines.append("| comparison | difference (pts) | 95 % CI | P(diff <= 0) |")
    lines.append("|---|---|---|---|")
    for a in names:
        for other in dict.fromkeys((base, UNSTEERED, *CONTROLS)):
            key = f"vs_{other}"
            c = arms[a].get(key)
            if c:
                lo, hi = c["ci95"]
                lines.append(
                    f"| {a} - {other} | {100 * c['diff']:+.1f} | "
                    f"[{100 * lo:+.1f}, {100 * hi:+.1f}] | {c['p_le_0']:.3f} |"
                )
    acc_ = report.get("acceptance") or {}
    if acc_:
        lines += ["", f"## Acceptance (arm `{COMBINED}`)", ""]
        lines += [f"- {k}: `{v}`" for k, v in acc_.items()]
    return lines


def plot(report: Mapping[str, Any], path: str | Path) -> None:
    """Per-language accuracy bars, one colour per arm, Wilson whiskers."""
    plt = R.pyplot()
    arms = report["arms"]
    names = list(arms)
    langs = list(next(iter(arms.values()))["per_language"])
    w = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(langs)), 4.5))
    for i, a in enumerate(names):
        per = arms[a]["per_language"]
        xs = [j + (i - (len(names) - 1) / 2) * w for j in range(len(langs))]
        ys = [per[lang]["accuracy"] for lang in langs]
        err = [
            [y - per[lang]["ci95"][0] for lang, y in zip(langs, ys, strict=True)],
            [per[lang]["ci95"][1] - y for lang, y in zip(langs, ys, strict=True)],
        ]
        label = f"{a} (non-en {R.pct(arms[a]['non_english_mean'])}%)"
        ax.bar(xs, ys, w, yerr=err, capsize=2, label=label, error_kw={"lw": 0.7})
    ax.set_xticks(range(len(langs)), langs)
    ax.set_ylabel("accuracy in the query language")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, ncol=min(3, len(names)))
    ax.set_title(str(report.get("title", "accuracy per language (95% Wilson CI)")))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(
    report: Mapping[str, Any],
    out_dir: str | Path,
    results: Mapping[str, ArmResult] | None = None,
) -> Path:
    """``report.json``, ``report.md``, ``accuracy.png`` and, given the ``results``, every reply
    in ``replies.jsonl`` into ``out_dir``."""
    figures = {"accuracy.png": lambda path: plot(report, path)}
    if results is not None:
        write_replies(Path(out_dir) / "replies.jsonl", all_replies(results))
    return R.write(out_dir, report, report_markdown(report), figures)


# --- the whole evaluation ----------------------------------------------------------------------


def evaluate(
    engine: Any,
    artifact: Any,
    records: Sequence[dict],
    arms: Sequence[str] | None = None,
    max_tokens: int = 8,
    keep_texts: bool = False,
    chunk: int = 256,
    on_chunk: Callable[[int, dict[str, ArmResult], dict[str, float]], None] | None = None,
) -> tuple[dict[str, ArmResult], dict[str, float]]:
    """Every arm on every record, chunk by chunk (later arms read the first's prefix cache;
    ``on_chunk`` after each lets a stopped run leave a report); results and seconds per arm."""
    from tqdm import tqdm

    from steerserve.tune.records import dataset_form

    arms = arm_names(artifact) if arms is None else arms
    check_arms(arms, artifact)
    form = dataset_form(records)
    register_artifact(engine, artifact)
    entries = {arm: arm_entries(artifact, arm) or None for arm in arms}
    results = {arm: ArmResult() for arm in arms}
    times = dict.fromkeys(arms, 0.0)
    with tqdm(total=len(records) * len(arms), desc="eval", unit="prompt") as bar:
        for i in range(0, len(records), chunk):
            part = records[i : i + chunk]
            prompts = record_prompts(engine, part)
            for arm in arms:
                t0 = time.perf_counter()
                gens = generate(
                    engine, prompts, [entries[arm]] * len(prompts), max_tokens, form=form
                )
                res = score_all(part, [g.text for g in gens])
                res.replies = [judge(rec, arm, g) for rec, g in zip(part, gens, strict=True)]
                results[arm].extend(res, keep_texts)
                times[arm] = round(times[arm] + time.perf_counter() - t0, 1)
                bar.update(len(part))
            if on_chunk is not None:
                on_chunk(i + len(part), results, times)
    return results, times


def open_engine(
    model_dir: str | Path,
    dtype: str = "auto",
    max_num_seqs: int = 64,
    kv_cache_bytes: int = RESEARCH_KV_CACHE_MEMORY_BYTES,
    block_size: int | None = 32,
    max_model_len: int = 1024,
    cpu_threads: str | None = None,
) -> Any:
    """A SteerEngine for offline sweeps (in-process, prefix caching on, ``block_size`` 32 so
    ~100-token few-shot prompts share blocks); ``kv_cache_bytes=0`` lets vLLM size it on a GPU."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if cpu_threads:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads
    from steerserve.engine.api import EngineConfig, SteerEngine

    extra: dict[str, Any] = {}
    if block_size:
        extra["block_size"] = block_size
    cfg = EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes or None,
        gpu_memory_utilization=None if kv_cache_bytes else 0.85,
        max_num_seqs=max_num_seqs,
        extra=extra,
    )
    return SteerEngine(cfg)
