"""The diagnosis figures: median ranks by layer per language and per arm, failure shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from steerserve.tune import reporting as R
from steerserve.tune.analyze import CLASSES
from steerserve.tune.arms import base_arm


def figures(rep: Mapping[str, Any]) -> dict[str, Callable[[Path], None]]:
    """File name -> drawing function, for :func:`report.write`."""
    out: dict[str, Callable[[Path], None]] = {
        f"lens_{arm}.png": (lambda path, arm=arm: plot_lens(rep, arm, path)) for arm in rep["arms"]
    }
    out["lens_arms.png"] = lambda path: plot_arms(rep, path)
    out["failures.png"] = lambda path: plot_failures(rep, path)
    return out


def _xs(rep: Mapping[str, Any]) -> list[int]:
    return list(range(-1, rep["num_layers"]))  # -1: the embeddings


def plot_lens(rep: Mapping[str, Any], arm: str, path: Any) -> None:
    """Median rank by layer, one line per language: English answer (left), target (right)."""
    plt = R.pyplot()
    per = rep["arms"][arm]["per_language"]
    panels = [("median_rank_en", "English answer"), ("median_rank_target", "target answer")]
    if any(s.get("median_rank_zh") for s in per.values()):
        panels.append(("median_rank_zh", "Chinese answer"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), sharey=True)
    cmap = plt.get_cmap("tab20")
    for ax, (key, title) in zip(axes, panels, strict=True):
        for j, (g, s) in enumerate(per.items()):
            if not s.get(key):
                continue
            ys = [np.nan if v is None else v for v in s[key]]
            ax.plot(_xs(rep), ys, marker=".", lw=2.2 if g == "en" else 1.3, color=cmap(j), label=g)
        ax.set_yscale("log")
        ax.set_title(f"{title}: median rank of its first token")
        ax.set_xlabel("block (-1 = embeddings)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        lo, hi = rep["window"]
        ax.axvspan(lo - 0.5, hi + 0.5, color="0.92", zorder=0)
        ax.axhline(rep["threshold"], color="0.5", ls=":", lw=1)
        ax.grid(alpha=0.3, which="both", lw=0.4)
    axes[0].invert_yaxis()  # rank 1 at the top (shared y axis)
    axes[0].set_ylabel("median rank (log, 1 = top)")
    axes[-1].legend(fontsize=8, ncol=2, loc="lower left")
    fig.suptitle(f"logit lens at the last prompt token, arm '{arm}' (shaded: failure window)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_arms(rep: Mapping[str, Any], path: Any) -> None:
    """Non-English pooled median rank by layer per arm: English (solid) and target (dashed)."""
    plt = R.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for j, (arm, r) in enumerate(rep["arms"].items()):
        ne = r["non_english"]
        c = plt.get_cmap("tab10")(j)
        for key, ls, what in (("median_rank_en", "-", "en"), ("median_rank_target", "--", "tgt")):
            ys = [np.nan if v is None else v for v in ne[key]]
            ax.plot(_xs(rep), ys, ls=ls, color=c, marker=".", label=f"{arm}: {what}")
    ax.set_yscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("block (-1 = embeddings)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("median rank (log, 1 = top)")
    ax.set_title("non-English items: English answer (solid) vs target answer (dashed)")
    ax.grid(alpha=0.3, which="both", lw=0.4)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_failures(rep: Mapping[str, Any], path: Any) -> None:
    """Stacked shares correct / conversion / recall / unknown: per language (first arm) and
    pooled non-English per arm."""
    plt = R.pyplot()
    arms = rep["arms"]
    base = base_arm(arms)
    per = {g: s for g, s in arms[base]["per_language"].items() if g != "en"}
    groups = [
        (list(per), list(per.values())),
        (list(arms), [r["non_english"] for r in arms.values()]),
    ]
    fig, axes = plt.subplots(
        1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [max(len(per), 1), len(arms) + 1]}
    )
    colours = {"correct": "#4c9a2a", "conversion": "#f2a93b", "recall": "#c0392b", "unknown": "0.7"}
    for ax, (labels, sums) in zip(axes, groups, strict=True):
        bottom = np.zeros(len(labels))
        for c in CLASSES:
            ys = np.array([s["failures"][c] / max(s["n"], 1) for s in sums])
            ax.bar(labels, ys, bottom=bottom, color=colours[c], label=c)
            bottom += ys
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of items")
    axes[0].set_title(f"arm '{base}': per language")
    axes[1].set_title("non-English, per arm")
    axes[1].legend(fontsize=8, loc="upper right")
    fig.suptitle(
        f"wrong answers: conversion = English answer reached rank <= {rep['threshold']} in "
        f"blocks {rep['window'][0]}..{rep['window'][1]}, recall = it never did"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
