"""What ``steerserve tune`` reads, checked before any compute (a wrong language code found after
an hour's sweep wastes it), and the three disjoint parts it selects, confirms and tests on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from steerserve.tune.gate import GateSettings, wins_needed
from steerserve.tune.runs import ConfigError

#: The stages, in order; each writes its outputs into the work folder before the next starts.
STAGES: tuple[str, ...] = ("extract", "calibrate", "confirm", "gate", "test", "publish")


@dataclass
class TuneConfig:
    """Everything a tune reads (the CLI's options, parsed). ``model`` as given (a folder or an
    embedded model's name); ``out`` is ROOT/NAME/VERSION of the artifact to publish."""

    model: str
    out: Path
    work: Path | None = None  # default: out/tune/<name>-<version>
    device: str = "cpu"
    dtype: str = "auto"  # transformers dtype (auto: float32 on CPU, bfloat16 on a GPU)
    engine_dtype: str = "auto"
    form: str = "auto"
    languages: tuple[str, ...] = ()  # (): every language of the records
    dataset: Path | None = None  # records of one form; None: the built-in fact set
    candidates: Path | None = None  # given candidates skip extraction
    extract_per_lang: int = 16
    recall_sources: tuple[str, ...] = ("en", "native", "mixed")
    per_lang: int = 40  # built-in: selection and confirmation facts per language (each half)
    test_per_lang: int = 0  # built-in test split: first N per language (0: all)
    shots: int | None = None
    grid: dict[str, Any] = field(default_factory=dict)  # calibrate.Grid.for_layers keywords
    gate: GateSettings = field(default_factory=GateSettings)
    batch_size: int = 0  # 0: sized for the machine
    kv_cache_bytes: int = -1  # -1: sized for the machine; 0: vLLM's own (GPU)
    max_num_seqs: int = 64
    threads: int = 0
    stop_after: str = ""

    def fingerprint(self) -> dict[str, Any]:
        """The settings a work folder's results depend on (not where they go, nor when to stop):
        a resumed run must have the same ones."""
        d = asdict(self)
        for k in ("work", "stop_after", "batch_size", "kv_cache_bytes", "max_num_seqs", "threads"):
            d.pop(k)
        return json.loads(json.dumps(d, default=str))

    @property
    def name(self) -> str:
        return self.out.parent.name

    @property
    def version(self) -> str:
        return self.out.name

    def work_dir(self) -> Path:
        return self.work or Path("out/tune") / f"{self.name}-{self.version}"


def check(cfg: TuneConfig) -> None:
    """Refuse, naming the option, what cannot run (an existing version, a bad language, stage or
    dataset, a folder that is no causal LM); the model is only looked at here, not loaded."""
    import re

    from steerserve.artifacts import LANGUAGE_CODES, SLUG

    if (cfg.out / "manifest.json").exists():
        raise ConfigError(f"{cfg.out} exists already: a published version never changes", "--out")
    if not (re.fullmatch(SLUG, cfg.name) and re.fullmatch(SLUG, cfg.version)):
        raise ConfigError(f"{cfg.out}: want ROOT/NAME/VERSION with slug names", "--out")
    bad = sorted(set(cfg.languages) - LANGUAGE_CODES)
    if bad:
        raise ConfigError(f"{bad}: not ISO 639-1 codes the language detector knows", "--languages")
    if cfg.stop_after and cfg.stop_after not in STAGES:
        raise ConfigError(f"{cfg.stop_after!r}; known: {', '.join(STAGES)}", "--stop-after")
    if cfg.candidates is not None and not cfg.candidates.with_suffix(".json").is_file():
        raise ConfigError(f"{cfg.candidates}: no candidates (.safetensors + .json)", "--candidates")
    if not 0 < cfg.gate.alpha < 1 or not 0 < cfg.gate.min_effect <= 1:
        raise ConfigError("alpha in (0, 1) and min effect in (0, 1]", "--alpha/--min-effect")
    check_model(cfg.model)


def check_model(model: str) -> None:
    """A folder must hold a config a transformers causal LM reads; a name must be embedded."""
    from steerserve.models import EMBEDDED

    path = Path(model).expanduser()
    if not path.exists():
        if model in EMBEDDED or model == "default":
            return
        raise ConfigError(f"{model!r}: no such folder nor embedded model", "--model")
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        conf = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a transformers model folder ({e})", "--model") from None
    if conf.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"{path}: model type {conf.model_type!r} is not a causal LM transformers can load",
            "--model",
        )


@dataclass
class Parts:
    """Selection, confirmation and test records (no fact in two) and their one form."""

    select: list[dict]
    confirm: list[dict]
    test: list[dict]
    form: str
    source: str

    def ids(self) -> dict[str, list[Any]]:
        return {k: [r["id"] for r in getattr(self, k)] for k in ("select", "confirm", "test")}


def parts(cfg: TuneConfig, model_dir: Path, fallback_form: str = "auto") -> Parts:
    """The records of a run: a dataset's in thirds per language, else the calibration halves and the
    test split; ``ConfigError`` where a language has too few items to ever open its gate."""
    from steerserve.tune.calibrate import round_robin
    from steerserve.tune.facts import eval_records
    from steerserve.tune.records import load_records

    langs = list(cfg.languages)
    if langs and "en" not in langs:
        langs = ["en", *langs]  # English is the guard, always measured
    try:
        if cfg.dataset is not None:
            records, form = load_records(cfg.dataset, model_dir)
            if langs:
                records = [r for r in records if r["lang"] in langs]
            sel, con, test = round_robin(records, 3)
            source = str(cfg.dataset)
        else:
            kw: dict[str, Any] = dict(shots=cfg.shots, langs=langs or None)
            sel, form = load_records(
                None, model_dir, cfg.form, fallback_form, split="calib", part=(0, 2),
                limit_per_lang=cfg.per_lang, **kw,
            )  # fmt: skip
            con = eval_records(split="calib", part=(1, 2), limit_per_lang=cfg.per_lang,
                               form=form, **kw)  # fmt: skip
            test = eval_records(split="test", limit_per_lang=cfg.test_per_lang or None,
                                form=form, **kw)  # fmt: skip
            source = "built-in fact set (calibration split halves, test split)"
    except ValueError as e:
        raise ConfigError(str(e), "--dataset/--languages/--form") from None
    p = Parts(sel, con, test, form, source)
    _check_counts(p, cfg.gate.alpha)
    return p


def _check_counts(p: Parts, alpha: float) -> None:
    """Each language needs, on the selection and the confirmation half, at least the wins that
    could reject at alpha / k: with fewer, its gate could never open, whatever the vectors do."""
    langs = sorted({r["lang"] for r in p.select + p.confirm + p.test})
    if "en" not in langs:
        raise ConfigError(
            "no English records: English is the guard every tune measures", "--dataset"
        )
    non_en = [lang for lang in langs if lang != "en"]
    if not non_en:
        raise ConfigError("no non-English records: nothing to tune", "--dataset/--languages")
    from steerserve.artifacts import LANGUAGE_CODES

    unknown = sorted(set(langs) - LANGUAGE_CODES)
    if unknown:
        raise ConfigError(f"{unknown}: languages the detector does not know", "--dataset")
    floor = wins_needed(len(non_en), alpha)
    short = {}
    for lang in langs:
        n = min(sum(r["lang"] == lang for r in part) for part in (p.select, p.confirm))
        if n < floor:
            short[lang] = n
    if short:
        raise ConfigError(
            f"too few facts per language {short}: each half needs >= {floor} (the wins an exact "
            f"test at alpha {alpha:g}/{len(non_en)} needs); a dataset needs 3x that per language",
            "--dataset/--per-lang",
        )
