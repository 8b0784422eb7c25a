"""Answers of the embedded chat model at 4 bits vs full precision on the project's fact set.

Runs ``steerserve eval`` (arm ``unsteered``, every reply kept) once on the converted
checkpoint and once on its 4-bit sibling, on the same records, then pairs the replies item by
item: per-language and language-mean accuracy of each, and the paired bootstrap difference
(4-bit − full) with its 95 % interval (steerserve.tune.scoring, resampling items within
languages). The plan is declared in ``docs/results/w4-quality/plan.md`` before the run.

    .venv/bin/python docs/results/w4-quality/w4_quality.py --out docs/results/w4-quality \
        --limit-per-lang 40
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))  # w4.py: the kernel and CPU facts of the speed run

from w4 import cpu_kind, kernel  # noqa: E402

W4_DTYPE = "bfloat16"  # what the 4-bit arm computes in (its kernel depends on it)


def run_eval(model: Path, dtype: str, out: Path, args: argparse.Namespace) -> None:
    if (out / "replies.jsonl").is_file() and json.loads((out / "report.json").read_text()).get(
        "finished"
    ):
        print(f"kept: {out}", flush=True)  # a finished arm is not run twice
        return
    cmd = [sys.executable, "-m", "steerserve", "eval", "--model", str(model)]
    cmd += ["--arms", "unsteered", "--split", args.split, "--form", "chat", "--dtype", dtype]
    cmd += ["--limit-per-lang", str(args.limit_per_lang), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT)


def correct_by_lang(out: Path) -> dict[str, dict[str, float]]:
    """lang -> item id -> 1.0 / 0.0, from the run's replies.jsonl."""
    by: dict[str, dict[str, float]] = defaultdict(dict)
    for line in (out / "replies.jsonl").read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        by[r["lang"]][r["id"]] = float(r["verdict"] == "correct")
    return by


def main() -> None:
    from steerserve.models import resolve_model, w4_dir
    from steerserve.tune.scoring import bootstrap_mean, lang_mean, paired_bootstrap

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/w4-quality")
    ap.add_argument("--split", default="calib", help="built-in split (not the test split)")
    ap.add_argument("--limit-per-lang", type=int, default=40)
    ap.add_argument("--full-dtype", default="float32", help="the full checkpoint's compute dtype")
    args = ap.parse_args()

    full = Path(resolve_model("default"))
    w4 = w4_dir(full)
    if w4 is None:
        raise SystemExit(f"{full} has no 4-bit checkpoint")
    run_eval(full, args.full_dtype, args.out / "full", args)
    run_eval(w4, W4_DTYPE, args.out / "w4", args)

    a, b = correct_by_lang(args.out / "w4"), correct_by_lang(args.out / "full")
    if {k: sorted(v) for k, v in a.items()} != {k: sorted(v) for k, v in b.items()}:
        raise SystemExit("the two runs did not score the same items")
    langs = sorted(a)
    wa = {k: [a[k][i] for i in sorted(a[k])] for k in langs}
    fb = {k: [b[k][i] for i in sorted(b[k])] for k in langs}
    non_en = [k for k in langs if k != "en"]
    result = {
        "full_dtype": args.full_dtype,
        "w4_kernel": kernel("w4", W4_DTYPE),  # the eval child ran with this same environment
        "cpu": cpu_kind(),
        "items": sum(len(v) for v in wa.values()),
        "per_lang": {
            k: {"full": lang_mean({k: fb[k]}), "w4": lang_mean({k: wa[k]})} for k in langs
        },
        "mean_all": {"full": lang_mean(fb), "w4": lang_mean(wa)},
        "ci_all": {"full": bootstrap_mean(fb), "w4": bootstrap_mean(wa)},
        "paired_all": paired_bootstrap(wa, fb),
        "paired_non_english": paired_bootstrap(
            {k: wa[k] for k in non_en}, {k: fb[k] for k in non_en}
        ),
        "changed_items": sum(x != y for k in langs for x, y in zip(wa[k], fb[k], strict=True)),
    }
    (args.out / "comparison.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        f"`full` computed in {args.full_dtype}; 4-bit kernel: {result['w4_kernel']}; "
        f"CPU: {result['cpu']}.",
        "",
        "| language | full | 4-bit |",
        "|---|---|---|",
        *(
            f"| {k} | {100 * v['full']:.1f} % | {100 * v['w4']:.1f} % |"
            for k, v in result["per_lang"].items()
        ),
    ]
    p = result["paired_all"]
    q = result["paired_non_english"]
    summary = (
        f"{result['items']} items; mean over languages: full {100 * result['mean_all']['full']:.1f} "
        f"%, 4-bit {100 * result['mean_all']['w4']:.1f} %; paired 4-bit − full "
        f"{100 * p['diff']:+.1f} points [{100 * p['ci95'][0]:+.1f}, {100 * p['ci95'][1]:+.1f}] "
        f"(non-English {100 * q['diff']:+.1f} [{100 * q['ci95'][0]:+.1f}, "
        f"{100 * q['ci95'][1]:+.1f}]); {result['changed_items']} items changed verdict."
    )
    (args.out / "comparison.md").write_text(summary + "\n\n" + "\n".join(rows) + "\n")
    print(summary)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
