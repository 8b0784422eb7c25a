"""Candidate vectors for the two interventions from any transformers causal LM, at the last
prompt token of every block (what the engine steers), deterministically.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from steerserve import __version__
from steerserve.tune.facts import (
    LANGS,
    RELATIONS,
    Fact,
    load_facts,
    prompt,
    query,
    shot,
    shots_for,
)
from steerserve.tune.hf import decoder_layers, device_of, last_token_outputs, left_padded
from steerserve.tune.records import Prompt, encode

#: English names of the fact-set languages, for translation prompts.
LANG_NAMES: dict[str, str] = {
    "en": "English", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "fr": "French",
    "es": "Spanish", "de": "German", "it": "Italian", "ru": "Russian", "pt": "Portuguese",
    "nl": "Dutch", "ar": "Arabic",
}  # fmt: skip
RECALL_SOURCES: tuple[str, ...] = ("en", "native", "mixed")
NORM_KEY = "resid_norm"  # [num_layers]: mean |h| at the last token of zero-shot queries


@dataclass
class ExtractConfig:
    """What to extract from; the defaults fit a 2-core CPU in a few minutes for a 270M model."""

    per_lang: int = 48  # train facts per language (relations interleaved)
    recall_shots: int = 5  # demonstrations in the task-vector prompts
    translation_shots: int = 3
    seed: int = 0
    batch_size: int = 16
    langs: tuple[str, ...] = LANGS
    relations: tuple[str, ...] = RELATIONS
    form: str = "completion"  # or "chat" (instruction-tuned models)
    # which recall variants to compute (fewer: fewer prompt groups, for a large model on a CPU)
    recall_sources: tuple[str, ...] = RECALL_SOURCES


@dataclass
class Candidates:
    """Per-layer candidate vectors ``[num_layers, hidden]`` plus how they were made."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def vector(self, name: str, layer: int) -> torch.Tensor:
        return self.tensors[name][layer]

    @property
    def names(self) -> list[str]:
        return [k for k in self.tensors if k != NORM_KEY]

    def save(self, path: str | Path) -> Path:
        """``path`` (.safetensors) and ``path.json`` (provenance)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path))
        path.with_suffix(".json").write_text(json.dumps(self.meta, indent=2, ensure_ascii=False))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Candidates:
        from safetensors.torch import load_file

        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        return cls(dict(load_file(str(path))), meta)


# --- prompts ----------------------------------------------------------------------------------


def _interleave(facts: Sequence[Fact], relations: Sequence[str]) -> list[Fact]:
    by = {r: [f for f in facts if f.relation == r] for r in relations}
    out: list[Fact] = []
    for i in range(max((len(v) for v in by.values()), default=0)):
        out += [v[i] for v in by.values() if i < len(v)]
    return out


def train_facts(cfg: ExtractConfig) -> dict[str, list[Fact]]:
    """Up to ``per_lang`` train facts per language, relations interleaved, file order."""
    facts = load_facts("train", cfg.langs, cfg.relations)
    return {
        lang: _interleave([f for f in facts if f.lang == lang], cfg.relations)[: cfg.per_lang]
        for lang in cfg.langs
    }


def _english_twin(fact: Fact) -> Fact | None:
    for f in load_facts(fact.split, ["en"], [fact.relation]):
        if f.fact_id == fact.fact_id:
            return f
    return None


def mixed_prompt(fact: Fact, k: int, seed: int) -> str:
    """English demonstrations, then the query in ``fact.lang`` (the "mixed" recall variant)."""
    demos = []
    for s in shots_for(fact, k, seed):
        twin = _english_twin(s)
        demos.append(shot(twin) if twin is not None else shot(s))
    return "".join(demos) + query(fact)


def translation_prompt(word_en: str, lang: str, demos: Sequence[tuple[str, str]]) -> str:
    """``English: Paris → French: Paris`` lines, then the query line without its answer."""
    name = LANG_NAMES[lang]
    lines = [f"English: {e} → {name}: {t}\n" for e, t in demos]
    return "".join(lines) + f"English: {word_en} → {name}:"


def translation_prompts(facts: Sequence[Fact], k: int, seed: int) -> list[str]:
    """Translate each fact's English answer into its language, ``k`` other answers as shots."""
    out = []
    for f in facts:
        demos = [(s.answers_en[0], s.answers[0]) for s in shots_for(f, k, seed)]
        out.append(translation_prompt(f.answers_en[0], f.lang, demos))
    return out


def translation_chat(fact: Fact, k: int, seed: int) -> list[dict[str, str]]:
    """The chat form of :func:`translation_prompts`: the query language's instruction as system
    message, ``k`` "Translate into <language>: X" turns answered, then the fact's."""
    from steerserve.tune.facts.chat import INSTRUCTION

    def ask(word: str) -> dict[str, str]:
        return {"role": "user", "content": f"Translate into {LANG_NAMES[fact.lang]}: {word}"}

    out = [{"role": "system", "content": INSTRUCTION[fact.lang]}]
    for s in shots_for(fact, k, seed):
        out += [ask(s.answers_en[0]), {"role": "assistant", "content": s.answers[0]}]
    return out + [ask(fact.answers_en[0])]


def _chat_groups(cfg: ExtractConfig, tf: dict[str, list[Fact]]) -> dict[str, list[Prompt]]:
    from steerserve.tune.facts.chat import messages

    non_en = [f for lang in cfg.langs if lang != "en" for f in tf[lang]]
    every = [f for lang in cfg.langs for f in tf[lang]]
    en = tf.get("en", [])
    k, s = cfg.recall_shots, cfg.seed

    def mixed(f: Fact) -> list[dict[str, str]]:
        twins = {d.fact_id: _english_twin(d) or d for d in shots_for(f, k, s)}
        return messages(f, k, s, demos_from=twins)

    return {
        "zero.native": [messages(f) for f in every],
        "fewshot.native": [messages(f, k, s) for f in every],
        "zero.en": [messages(f) for f in en],
        "fewshot.en": [messages(f, k, s) for f in en],
        "fewshot.mixed": [mixed(f) for f in non_en],
        "zero.non_en": [messages(f) for f in non_en],
        "translation": [translation_chat(f, cfg.translation_shots, s) for f in non_en],
        "recall.non_en": [messages(f, cfg.translation_shots, s) for f in non_en],
    }


#: The prompt groups each recall variant needs (the translation vector always needs its two).
_SOURCE_GROUPS: dict[str, tuple[str, ...]] = {
    "native": ("zero.native", "fewshot.native"),
    "en": ("zero.en", "fewshot.en"),
    "mixed": ("fewshot.mixed", "zero.non_en"),
}


def prompt_groups(cfg: ExtractConfig) -> dict[str, list[Prompt]]:
    """Every prompt group whose mean is needed; names are stable keys of the sidecar."""
    unknown = set(cfg.recall_sources) - set(RECALL_SOURCES)
    if unknown:
        raise ValueError(f"unknown recall sources {sorted(unknown)}; known: {RECALL_SOURCES}")
    # zero.native always: its norms are the scale unit
    needed = {"zero.native", "translation", "recall.non_en"}
    needed |= {g for src in cfg.recall_sources for g in _SOURCE_GROUPS[src]}
    return {k: v for k, v in _all_groups(cfg).items() if v and k in needed}


def _all_groups(cfg: ExtractConfig) -> dict[str, list[Prompt]]:
    tf = train_facts(cfg)
    if cfg.form == "chat":
        return _chat_groups(cfg, tf)
    if cfg.form != "completion":
        raise ValueError(f"unknown form {cfg.form!r}; known: completion, chat")
    non_en = [f for lang in cfg.langs if lang != "en" for f in tf[lang]]
    every = [f for lang in cfg.langs for f in tf[lang]]
    en = tf.get("en", [])
    k, s = cfg.recall_shots, cfg.seed
    groups: dict[str, list[Prompt]] = {
        "zero.native": [query(f) for f in every],
        "fewshot.native": [prompt(f, k, s) for f in every],
        "zero.en": [query(f) for f in en],
        "fewshot.en": [prompt(f, k, s) for f in en],
        "fewshot.mixed": [mixed_prompt(f, k, s) for f in non_en],
        "zero.non_en": [query(f) for f in non_en],
        "translation": list(translation_prompts(non_en, cfg.translation_shots, s)),
        "recall.non_en": [prompt(f, cfg.translation_shots, s) for f in non_en],
    }
    return groups


# --- residual means ---------------------------------------------------------------------------


@torch.no_grad()
def last_token_means(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    batch_size: int = 16,
    desc: str = "extract",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean last-prompt-token output of every block ``[L, H]`` and mean norm ``[L]``; prompts are
    left-padded with explicit positions, so results do not depend on the batch."""
    from tqdm import tqdm

    layers = decoder_layers(model)
    dev = device_of(model)
    enc = [encode(tokenizer, p) for p in prompts]
    order = sorted(range(len(enc)), key=lambda i: (len(enc[i]), i))
    hidden = model.config.get_text_config().hidden_size
    total = torch.zeros(len(layers), hidden, dtype=torch.float64)
    norms = torch.zeros(len(layers), dtype=torch.float64)
    with last_token_outputs(layers) as captured:
        for b in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch", leave=False):
            batch = left_padded([enc[i] for i in order[b : b + batch_size]], tokenizer.pad_token_id)
            # logits_to_keep=1: the LM head over every position dominates a small model
            model(**batch.inputs(dev), use_cache=False, logits_to_keep=1)
            for li, h in enumerate(captured):
                assert h is not None
                total[li] += h.double().sum(0).cpu()
                norms[li] += h.double().norm(dim=-1).sum().cpu()
    n = max(len(prompts), 1)
    return (total / n).float(), (norms / n).float()


def extract(model: Any, tokenizer: Any, cfg: ExtractConfig | None = None) -> Candidates:
    """All candidate vectors for all layers (see the module docstring for the variants)."""
    cfg = cfg or ExtractConfig()
    t0 = time.perf_counter()
    groups = prompt_groups(cfg)
    means: dict[str, torch.Tensor] = {}
    norm: torch.Tensor | None = None
    for name, ps in groups.items():
        means[name], nrm = last_token_means(model, tokenizer, ps, cfg.batch_size, desc=name)
        if name == "zero.native":
            norm = nrm
    t: dict[str, torch.Tensor] = {}
    zero = {"native": "zero.native", "en": "zero.en", "mixed": "zero.non_en"}
    for src in cfg.recall_sources:
        few = f"fewshot.{src}"
        if few in means:
            t[f"recall.{src}.raw"] = means[few]
            t[f"recall.{src}.diff"] = means[few] - means[zero[src]]
    if "translation" in means:
        t["translation"] = means["translation"] - means["recall.non_en"]
    assert norm is not None
    t[NORM_KEY] = norm
    meta = {
        "config": {**asdict(cfg), "langs": list(cfg.langs), "relations": list(cfg.relations)},
        "groups": {k: len(v) for k, v in groups.items()},
        "examples": {k: v[0] for k, v in groups.items()},
        "form": cfg.form,
        "num_layers": int(norm.numel()),
        "hidden_size": int(next(iter(means.values())).shape[-1]),
        "layer_convention": "output of decoder block L (0-based) = hidden_states[L+1]",
        "position": "last prompt token",
        "fact_split": "train",
        "steerserve_version": __version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "definitions": {
            "recall.<src>.raw": "mean(fewshot.<src>)",
            "recall.<src>.diff": "mean(fewshot.<src>) - mean(zero-shot queries of the same facts)",
            "translation": f"mean(translation) - mean(recall.non_en) ({cfg.translation_shots}-shot, "
            "non-English)",
        },
    }
    return Candidates(t, meta)


def unit_scaled(c: Candidates, name: str, layer: int) -> torch.Tensor:
    """The unit direction times the layer's mean residual norm: scales are then comparable across
    layers and models."""
    v = c.vector(name, layer).float()
    return v / v.norm().clamp_min(1e-12) * float(c.tensors[NORM_KEY][layer])


def summary(c: Candidates) -> list[dict[str, Any]]:
    """Per-layer |v| / mean |h| for each candidate (how big the raw vectors are)."""
    nrm = c.tensors[NORM_KEY]
    rows = []
    for li in range(int(nrm.numel())):
        row: dict[str, Any] = {"layer": li, "resid_norm": round(float(nrm[li]), 3)}
        for n in c.names:
            row[n] = round(float(c.vector(n, li).norm() / nrm[li]), 4)
        rows.append(row)
    return rows


@dataclass
class ExtractRun:
    """``steerserve extract``'s settings: the model, where the candidates go, and the
    extraction (``extract.form`` ``auto``: chat for an instruction-tuned model's name)."""

    model: str  # as given: a checkpoint folder or an embedded model's name
    model_dir: Path  # the folder it resolves to
    out: Path = Path("out/candidates.safetensors")
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # torch threads; 0: torch's own
    extract: ExtractConfig = field(default_factory=ExtractConfig)


def run(cfg: ExtractRun, log: Callable[[str], None] = print) -> Candidates:
    """Extract every candidate, save it (.safetensors + .json sidecar) and log one summary row
    per layer; the candidates. An unknown form is a ``runs.ConfigError``."""
    from dataclasses import replace

    from steerserve.tune.hf import load_model
    from steerserve.tune.records import default_form
    from steerserve.tune.runs import ConfigError

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    try:
        ext = replace(cfg.extract, form=default_form(cfg.model_dir, cfg.extract.form))
    except ValueError as e:
        raise ConfigError(str(e), "--form") from None
    mdl, tok = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    cands = extract(mdl, tok, ext)
    cands.meta.update(
        model=cfg.model, device=cfg.device, dtype=cfg.dtype, total_seconds=time.perf_counter() - t0
    )
    cands.save(cfg.out)
    log(
        f"wrote {cfg.out} ({len(cands.names)} {ext.form}-form candidates, {cands.meta['seconds']} s)"
    )
    for row in summary(cands):
        log(json.dumps(row))
    return cands


__all__ = [
    "Candidates",
    "ExtractConfig",
    "ExtractRun",
    "extract",
    "last_token_means",
    "prompt_groups",
    "run",
    "summary",
    "translation_chat",
    "unit_scaled",
]
