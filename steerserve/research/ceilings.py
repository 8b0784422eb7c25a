"""Headroom and oracle ceilings for residual-stream steering, before any vector sweep: the
command line of the research experiments.

Why ceilings first: a vector distilled from a prompt condition can at most recover that
condition's gain, and an edit of the last prompt token's state can at most do what patching in
the *right* state does. Every condition is scored by greedy accuracy (the one scorer,
``scorer.py``) *and* by the teacher-forced log-probability of the gold answer (``runner.py``).

The experiments live in ``experiments/`` (one module each, found by ``registry.EXPERIMENTS``);
this module parses the shared flags plus each experiment's own, runs the chosen ones in order
and merges their sections into the folder's report. Run
``python -m steerserve.research.ceilings --help``.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from steerserve.research.cache import spent
from steerserve.research.conditions import fact_index
from steerserve.research.experiments.base import Context
from steerserve.research.experiments.registry import EXPERIMENTS
from steerserve.research.experiments.report import load_report, write_report
from steerserve.research.facts import LANGS
from steerserve.research.runner import Runner

log = logging.getLogger("steerserve.ceilings")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The shared flags, then every registered experiment's own (each adder once)."""
    p = argparse.ArgumentParser(
        prog="python -m steerserve.research.ceilings",
        description="Headroom (prompt conditions) and oracle (last-token patching) ceilings "
        "for steering vectors; writes report.json and report.md to --out, merging experiments.",
    )
    p.add_argument("--model", required=True, help="local HF folder or an embedded model name")
    p.add_argument("--out", required=True, type=Path, help="report folder")
    p.add_argument(
        "--experiments",
        default="headroom,oracle",
        help="comma-separated: " + ", ".join(EXPERIMENTS),
    )
    p.add_argument("--split", default="calib", help="fact split of the evaluated items")
    p.add_argument(
        "--langs",
        default=None,
        help="query languages, comma-separated (English is always added: it supplies the twins); "
        "default all 12",
    )
    p.add_argument(
        "--form",
        default="auto",
        choices=("auto", "completion", "chat"),
        help="prompt form (auto: chat for an instruction-tuned model's folder name)",
    )
    p.add_argument(
        "--batch-size", type=int, default=64, help="items per forward (weights are read per call)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="model weights (bfloat16: ~5x faster matmuls on a CPU with AMX/AVX-512 BF16)",
    )
    p.add_argument("--seed", type=int, default=0, help="demonstration seed")
    for add in dict.fromkeys(f for e in EXPERIMENTS.values() for f in e.options):
        add(p)
    return p.parse_args(argv)


def context(args: argparse.Namespace) -> Context:
    """The model's runner and the run's facts, form and languages."""
    import torch

    from steerserve.models import load_hf_model, resolve_model
    from steerserve.research.records import default_form

    model, tok = load_hf_model(args.model, dtype=getattr(torch, args.dtype))
    form = default_form(resolve_model(args.model), args.form)
    langs = None if args.langs is None else sorted({"en", *args.langs.split(",")}, key=LANGS.index)
    runner = Runner(model, tok, args.batch_size)
    return Context(runner, fact_index(args.split), args, form, langs, args.out)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    unknown = [n for n in args.experiments.split(",") if n not in EXPERIMENTS]
    if unknown:
        raise SystemExit(f"unknown experiment {unknown[0]!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    ctx = context(args)
    command = "python -m steerserve.research.ceilings " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    report = load_report(args.out) or {"experiments": {}}
    for name in args.experiments.split(","):
        t0 = time.perf_counter()
        kind = EXPERIMENTS[name]
        plan = kind.plan(ctx)
        exp = kind.run(ctx, plan)
        exp["command"] = command
        took = spent(ctx.partial(plan.key)) or time.perf_counter() - t0
        exp["setup"] = plan.setup + f" Compute: {took / 60:.0f} min ({args.threads} thread(s))."
        # another run may have written its experiment meanwhile: merge, do not overwrite
        report = load_report(args.out) or report
        report |= {"model": args.model, "form": ctx.form}
        report.setdefault("experiments", {})[plan.key] = exp
        write_report(report, args.out)
        log.info("%s done in %.0f s -> %s", name, time.perf_counter() - t0, args.out)


if __name__ == "__main__":
    main()
