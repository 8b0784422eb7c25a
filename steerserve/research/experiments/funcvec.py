"""Step 3d: a head-based function vector (Todd et al. 2024, "Function Vectors in Large Language
Models"), tried on zero-shot multilingual factual recall.

Why heads rather than a block's whole state (step 3a's task vector): Todd et al. find that a few
attention heads carry "which task is this" from the demonstrations to the last token; their
summed mean outputs, added once, trigger the task zero-shot while the rest of the state is left
alone. Here the task is "answer the fact, in the query language".

1. Head inputs: block l's ``self_attn.o_proj`` input at the last token, reshaped ``[n_heads,
   head_dim]``, is z; head j's output is ``W_o[:, j*hd:(j+1)*hd] @ z_j`` (o_proj is linear, so
   the head outputs plus its bias add up to the attention output).
2. Mean z per head over 5-shot prompts in the query languages ("native5", languages pooled).
3. Average indirect effect (AIE): the same 5-shot prompts with the demonstrations' answers
   permuted among themselves (the task is unclear), each head's mean z patched in at the last
   token, one forward per head over a batch of prompts (prefix KV shared: a patch at the last
   token cannot change earlier tokens); effect = change in log P of the gold answer's first token.
4. FV = sum of the top-k heads' mean outputs ``W_o z̄``. Models with a post-attention norm
   (Gemma 3) normalise the attention output before the residual add, so the FV's raw scale is
   not the residual stream's: it is swept (``scales``), not trusted.
5. Added once at the last prompt token of the zero-shot form at a few blocks (about a quarter, a
   third and half of the depth); selected and confirmed like step 3a (``selection.select_confirm``).

Works for decoders whose attention has ``self_attn.o_proj`` (Gemma 3, Qwen2, Llama).
"""

from __future__ import annotations

import argparse
import copy
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from steerserve.research.cache import cached, cached_tensors
from steerserve.research.conditions import as_prompt, form_prompt, pooled_train_facts
from steerserve.research.experiments import selection
from steerserve.research.experiments.base import Context, Experiment, Plan, floats, ints
from steerserve.research.experiments.selection import select_confirm
from steerserve.research.experiments.taskvec import taskvec_md
from steerserve.research.extract import encode as encode_prompt
from steerserve.research.facts import ANSWER_SEP, Fact, query, shots_for
from steerserve.research.hf import decoder_layers, left_padded
from steerserve.research.runner import Edit, Runner, encode

log = logging.getLogger("steerserve.research.funcvec")

# --- heads -------------------------------------------------------------------------------------


def attn_shape(model: Any) -> tuple[int, int]:
    """``(n_heads, head_dim)`` of the decoder's attention (Gemma 3 sets head_dim explicitly;
    others derive it from the hidden size)."""
    cfg = model.config.get_text_config()
    n = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n
    return n, hd


def o_projs(model: Any) -> list[torch.nn.Linear]:
    """Every block's attention output projection, in block order."""
    return [ly.self_attn.o_proj for ly in decoder_layers(model)]


def head_outputs(o_proj: torch.nn.Linear, z: torch.Tensor) -> torch.Tensor:
    """Per-head outputs ``[..., H, D]`` of head inputs ``z`` ``[..., H, hd]``: head j's slice of
    W_o times z_j (no bias: o_proj adds it once, to the sum)."""
    n, hd = z.shape[-2:]
    w = o_proj.weight.detach().float().view(-1, n, hd)  # [D, H, hd]
    return torch.einsum("...hk,dhk->...hd", z.float(), w)


class HeadHooks:
    """Forward pre-hooks on every ``o_proj`` (registered while ``active``): ``capture`` takes the
    last token's head inputs ``[B, H, hd]`` per block; ``patch = (layer, head, value)`` replaces
    that head's input at the last token (``value`` ``[hd]`` or ``[B, hd]``)."""

    def __init__(self, model: Any) -> None:
        self.projs = o_projs(model)
        self.n_heads, self.head_dim = attn_shape(model)
        self.capture: list[torch.Tensor | None] | None = None
        self.patch: tuple[int, int, torch.Tensor] | None = None

    def _hook(self, i: int) -> Callable[..., Any]:
        def f(module: Any, args: Any) -> Any:  # noqa: ARG001
            x = args[0]
            if self.patch is not None and self.patch[0] == i:
                _, j, v = self.patch
                x = x.clone()
                hd = self.head_dim
                x[:, -1, j * hd : (j + 1) * hd] = v.to(x.dtype).to(x.device)
            if self.capture is not None:
                z = x[:, -1].detach().float()
                self.capture[i] = z.view(len(z), self.n_heads, self.head_dim).cpu()
            return (x, *args[1:])

        return f

    @contextmanager
    def active(self) -> Iterator[HeadHooks]:
        handles = [p.register_forward_pre_hook(self._hook(i)) for i, p in enumerate(self.projs)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.capture, self.patch = None, None


@torch.no_grad()
def mean_head_inputs(runner: Runner, prompts: Sequence[Any], batch_size: int = 16) -> torch.Tensor:
    """Mean last-token head inputs ``[L, H, hd]`` (float32) over ``prompts`` (text or chat),
    left-padded with explicit positions (a row sees what it would see alone)."""
    hooks = HeadHooks(runner.model)
    enc = [encode_prompt(runner.tok, p) for p in prompts]
    order = sorted(range(len(enc)), key=lambda i: (len(enc[i]), i))
    total = torch.zeros(len(hooks.projs), hooks.n_heads, hooks.head_dim, dtype=torch.float64)
    with hooks.active():
        for b0 in range(0, len(order), batch_size):
            b = left_padded([enc[i] for i in order[b0 : b0 + batch_size]], runner.pad)
            hooks.capture = [None] * len(hooks.projs)
            runner.decoder(**b.inputs(runner.dev), use_cache=False)
            total += torch.stack(hooks.capture, 1).double().sum(0)  # type: ignore[arg-type]
    return (total / max(len(prompts), 1)).float()


@torch.no_grad()
def head_effects(
    runner: Runner,
    records: Sequence[Mapping[str, Any]],
    values: torch.Tensor,
    batch_size: int = 32,
    heads: Sequence[tuple[int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """log P of the gold answer's first token (max over aliases) at the last prompt token of
    each record, unpatched (``base`` ``[N]``) and with each head's input replaced by ``values``
    (``[L, H, hd]`` for every item, or ``[N, L, H, hd]`` per item): ``patched`` ``[N, L, H]``
    (NaN for heads not in ``heads``). The prompt minus its last token runs once per batch; each
    head costs one one-token forward over the batch."""
    hooks = HeadHooks(runner.model)
    n_l, n_h = len(hooks.projs), hooks.n_heads
    heads = [(ly, j) for ly in range(n_l) for j in range(n_h)] if heads is None else heads
    enc = [encode(runner.tok, r) for r in records]
    firsts = [sorted({a[0] for a in al}) for _, al in enc]
    base = torch.zeros(len(records))
    patched = torch.full((len(records), n_l, n_h), float("nan"))
    with hooks.active():
        for b0 in range(0, len(records), batch_size):
            rows = list(range(b0, min(b0 + batch_size, len(records))))
            b = left_padded([enc[i][0] for i in rows], runner.pad)
            cache = runner.decoder(
                input_ids=b.ids[:, :-1].to(runner.dev),
                attention_mask=b.mask[:, :-1].to(runner.dev),
                position_ids=b.positions[:, :-1].to(runner.dev),
                use_cache=True,
            ).past_key_values

            def gold(rows: list[int] = rows, b: Any = b, cache: Any = cache) -> torch.Tensor:
                h = runner._hidden(b.ids[:, -1:], b.mask, b.positions[:, -1:], copy.deepcopy(cache))
                lp = torch.log_softmax(runner._logits(h[:, -1]), -1).cpu()
                return torch.stack([lp[r, firsts[i]].max() for r, i in enumerate(rows)])

            base[rows] = gold()
            for ly, j in heads:
                v = values[ly, j] if values.dim() == 3 else values[rows][:, ly, j]
                hooks.patch = (ly, j, v)
                patched[rows, ly, j] = gold()
            hooks.patch = None
    return {"base": base, "patched": patched}


def function_vector(model: Any, means: torch.Tensor, heads: Sequence[tuple[int, int]]):
    """Sum over ``heads`` ``(layer, head)`` of the head's mean output ``W_o z̄`` ``[D]``."""
    projs = o_projs(model)
    return sum(head_outputs(projs[ly], means[ly])[j] for ly, j in heads)


# --- corrupted prompts -------------------------------------------------------------------------


def derangement(n: int, rng: random.Random) -> list[int]:
    """A permutation of ``range(n)`` without a fixed point (identity for n < 2)."""
    if n < 2:
        return list(range(n))
    while True:
        p = list(range(n))
        rng.shuffle(p)
        if all(i != x for i, x in enumerate(p)):
            return p


def corrupted_prompt(fact: Fact, form: str, shots: int = 5, seed: int = 0) -> Any:
    """``form_prompt(fact, "native5")``'s demonstrations with their answers deranged among
    themselves (no demonstration keeps its own), the query unchanged: the prompt no longer says
    which relation is asked, while its tokens, languages and answer vocabulary stay the same."""
    demos = shots_for(fact, shots, seed)
    perm = derangement(len(demos), random.Random(f"corrupt|{seed}|{fact.fact_id}"))
    answers = [demos[p].answers[0] for p in perm]
    if form == "chat":
        from steerserve.research.facts.chat import messages

        msgs = messages(fact, shots, seed)
        for i, a in enumerate(answers):
            assert msgs[2 + 2 * i]["role"] == "assistant"
            msgs[2 + 2 * i] = {"role": "assistant", "content": a}
        return msgs
    lines = [f"{query(d)}{ANSWER_SEP[d.lang]}{a}\n" for d, a in zip(demos, answers, strict=True)]
    return "".join(lines) + query(fact)


# --- the experiment ----------------------------------------------------------------------------


def default_layers(num_layers: int) -> list[int]:
    """About a quarter, a third and half of the depth (Todd et al. add at about a third)."""
    return sorted({num_layers // 4, num_layers // 3, num_layers // 2})


def _spread(xs: Sequence[Any], n: int | None) -> list[Any]:
    """``n`` items evenly spaced over ``xs`` (the pool runs relation by relation: a prefix would
    hold one relation only)."""
    if n is None or n >= len(xs):
        return list(xs)
    return [xs[i * len(xs) // n] for i in range(n)]


def function_vectors(
    runner: Runner,
    sel: Sequence[dict],
    conf: Sequence[dict],
    facts: Mapping[str, Fact],
    layers: Sequence[int] | None = None,
    scales: Sequence[float] = (0.5, 1.0, 2.0, 4.0),
    heads: int = 10,
    n_prompts: int = 32,
    n_mean: int | None = None,
    top: int = 3,
    seed: int = 0,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Step 3d (see the module docstring): mean head inputs over ``n_mean`` pooled 5-shot
    train prompts (None: all ~200), AIE on ``n_prompts`` of them (corrupted), FV of the top
    ``heads`` heads, added x ``scales`` at ``layers`` (default :func:`default_layers`) to the
    zero-shot form; selected on ``sel``, the best ``top`` confirmed on ``conf``."""
    form = "chat" if "messages" in sel[0] else "completion"
    p = (lambda n: None) if partial is None else (lambda n: partial / n)  # noqa: E731
    layers = default_layers(runner.num_layers) if layers is None else list(layers)
    langs = sorted({r["lang"] for r in sel} - {"en"})
    pool = _spread(pooled_train_facts(langs), n_mean)
    t0 = time.perf_counter()
    means = cached_tensors(
        p("head_means.pt"),
        lambda: mean_head_inputs(runner, [form_prompt(f, "native5", form, seed) for f in pool]),
    )
    t1 = time.perf_counter()
    log.info("head means over %d prompts: %.0f s", len(pool), t1 - t0)
    probe = _spread(pool, n_prompts)

    def aie() -> dict[str, Any]:
        def recs(kind: str) -> list[dict[str, Any]]:
            return [
                {
                    "lang": f.lang,
                    "answers": list(f.answers),
                    **as_prompt(
                        corrupted_prompt(f, form, 5, seed)
                        if kind == "corrupt"
                        else form_prompt(f, "native5", form, seed)
                    ),
                }
                for f in probe
            ]

        clean = head_effects(runner, recs("clean"), means, heads=[])["base"]
        eff = head_effects(runner, recs("corrupt"), means)
        return {
            "clean": clean.tolist(),
            "corrupt": eff["base"].tolist(),
            "aie": (eff["patched"] - eff["base"][:, None, None]).mean(0).tolist(),
        }

    got = cached(p("aie.json"), aie)
    t2 = time.perf_counter()
    log.info("indirect effects of %d heads on %d prompts: %.0f s",
             means.shape[0] * means.shape[1], len(probe), t2 - t1)  # fmt: skip
    table = torch.tensor(got["aie"])
    flat = sorted(
        (
            (float(table[ly, j]), ly, j)
            for ly in range(table.shape[0])
            for j in range(table.shape[1])
        ),
        reverse=True,
    )
    chosen = [(ly, j) for _, ly, j in flat[:heads]]
    fv = function_vector(runner.model, means, chosen).float()
    edits = [Edit.of(f"fv{heads}x{s:g}@{ly}", ly, "add", fv, s) for ly in layers for s in scales]
    rs = [{**r, **as_prompt(form_prompt(facts[r["id"]], "zero", form, seed))} for r in sel]
    rc = [{**r, **as_prompt(form_prompt(facts[r["id"]], "zero", form, seed))} for r in conf]
    forms = {"zero": select_confirm(runner, rs, rc, edits, top, p("zero"))}
    t3 = time.perf_counter()
    log.info("function-vector edits: %.0f s", t3 - t2)
    n = len(got["clean"])
    return {
        "heads": [{"layer": ly, "head": j, "aie": round(a, 4)} for a, ly, j in flat[:heads]],
        "aie": [[round(x, 4) for x in row] for row in got["aie"]],
        "probe_logp": {
            "clean": sum(got["clean"]) / n,
            "corrupt": sum(got["corrupt"]) / n,
        },
        "fv_norm": round(float(fv.norm()), 2),
        "layers": layers,
        "scales": list(scales),
        "n_mean": len(pool),
        "n_prompts": len(probe),
        "forms": forms,
        "seconds": {
            "means": round(t1 - t0, 1),
            "aie": round(t2 - t1, 1),
            "edits": round(t3 - t2, 1),
        },
    }


# --- report ------------------------------------------------------------------------------------


def funcvec_md(t: Mapping[str, Any]) -> list[str]:
    """The chosen heads, then step 3a's selection and confirmation tables."""
    pl = t["probe_logp"]
    lines = [
        f"Head means over {t['n_mean']} pooled 5-shot train prompts; indirect effects on "
        f"{t['n_prompts']} of them with the demonstrations' answers deranged (mean log P of the "
        f"gold first token: clean {pl['clean']:.2f}, corrupted {pl['corrupt']:.2f}). FV = the "
        f"top {len(t['heads'])} heads' mean outputs, norm {t['fv_norm']:.1f} (raw W_o units), "
        f"added x {', '.join(f'{s:g}' for s in t['scales'])} at blocks "
        f"{', '.join(map(str, t['layers']))} at the last prompt token.",
        "",
        "| rank | block | head | AIE (nats, first token) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {i + 1} | {h['layer']} | {h['head']} | {h['aie']:+.3f} |"
        for i, h in enumerate(t["heads"])
    ]
    return [*lines, "", *taskvec_md(t)]


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fv-layers", default=None, help="function-vector blocks (default: ~L/4, L/3, L/2)"
    )
    p.add_argument("--fv-scales", default="0.5,1,2,4", help="function-vector scales (x raw FV)")
    p.add_argument("--fv-heads", type=int, default=10, help="heads summed into the function vector")
    p.add_argument(
        "--fv-prompts", type=int, default=32, help="corrupted prompts the indirect effects average"
    )


def _run(ctx: Context, plan: Plan) -> dict[str, Any]:
    a, i = ctx.args, plan.inputs
    layers = None if a.fv_layers is None else ints(a.fv_layers)
    return function_vectors(
        ctx.runner, i["sel"], i["conf"], ctx.facts, layers, floats(a.fv_scales),
        a.fv_heads, a.fv_prompts, top=a.top, seed=a.seed, partial=ctx.partial(plan.key),
    )  # fmt: skip


EXPERIMENT = Experiment(
    "funcvec",
    "Step 3d: function vector (Todd et al.), top heads by indirect effect",
    lambda ctx: selection.step3_plan("funcvec", ctx),
    _run,
    funcvec_md,
    (selection.options, _options),
)
