"""The model fingerprint an artifact is bound to: the config's shape keys and a slice of the
embedding, read without loading the model (a vector made for another model must be refused)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from steerserve.artifacts.manifest import (
    EMBED_COLS,
    EMBED_ROWS,
    SHAPE_KEYS,
    ArtifactError,
    Fingerprint,
    ModelBinding,
    ModelMismatch,
)
from steerserve.engine.registry import tensor_sha256

# --- model fingerprint -------------------------------------------------------------------------


def _config_sha256(cfg: Mapping[str, Any]) -> str:
    """Hash the keys that shape the network, normalised so config.json and a live config agree."""
    text = cfg.get("text_config") or cfg
    desc: dict[str, Any] = {
        "architectures": list(cfg.get("architectures") or []),
        "model_type": cfg.get("model_type"),
        "text_model_type": text.get("model_type") if text is not cfg else None,
    }
    for k in SHAPE_KEYS:
        desc[k] = text.get(k)
    if desc["num_key_value_heads"] is None:
        desc["num_key_value_heads"] = desc["num_attention_heads"]
    if desc["head_dim"] is None and desc["hidden_size"] and desc["num_attention_heads"]:
        desc["head_dim"] = desc["hidden_size"] // desc["num_attention_heads"]
    canon = json.dumps(desc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _embedding_rows(vocab: int) -> list[int]:
    """Rows spread over the vocabulary: low ids are often unused tokens a fine-tune never moves."""
    return sorted({i * vocab // EMBED_ROWS for i in range(EMBED_ROWS)})


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ArtifactError(f"model {str(model_dir)!r}: no config.json")
    return json.loads(path.read_text())


def fingerprint_model(model_dir: str | Path) -> Fingerprint:
    """Fingerprint a local HF checkpoint, reading only a small embedding slice from disk."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = _read_config(model_dir)
    found: list[tuple[str, Path]] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            found += [(k, f) for k in s.keys() if k.endswith("embed_tokens.weight")]
    if not found:
        raise ArtifactError(f"model {str(model_dir)!r}: no *embed_tokens.weight in *.safetensors")
    name, f = min(found, key=lambda kf: (kf[0] != "model.embed_tokens.weight", len(kf[0]), kf[0]))
    with safe_open(str(f), framework="pt") as s:
        sl = s.get_slice(name)
        rows = [sl[r : r + 1, :EMBED_COLS] for r in _embedding_rows(sl.get_shape()[0])]
    return Fingerprint(
        config_sha256=_config_sha256(cfg), embedding_sha256=tensor_sha256(torch.cat(rows))
    )


def embedding_norm(model_dir: str | Path) -> float:
    """The typical norm of the residual stream's input: the median norm of the same spread rows
    of the token embeddings the fingerprint reads (all columns), times Gemma's sqrt(hidden_size)
    (its models scale embeddings by it). Read from disk once per scan: no forward pass."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = _read_config(model_dir)
    text = cfg.get("text_config") or cfg
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            names = [k for k in s.keys() if k.endswith("embed_tokens.weight")]
            if names:
                sl = s.get_slice(min(names, key=lambda k: (k != "model.embed_tokens.weight", k)))
                rows = torch.cat([sl[r : r + 1, :] for r in _embedding_rows(sl.get_shape()[0])])
                break
    else:
        raise ArtifactError(f"model {str(model_dir)!r}: no *embed_tokens.weight in *.safetensors")
    norm = float(rows.float().norm(dim=1).median())
    gemma = str(text.get("model_type") or cfg.get("model_type") or "").startswith("gemma")
    return norm * math.sqrt(int(text["hidden_size"])) if gemma else norm


def fingerprint_hf_model(model: Any) -> Fingerprint:
    """Same fingerprint for an in-memory transformers model (bind before saving anything)."""
    cfg = model.config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    weight = model.get_input_embeddings().weight.detach()
    sl = weight[_embedding_rows(weight.shape[0]), :EMBED_COLS].cpu()
    return Fingerprint(config_sha256=_config_sha256(cfg), embedding_sha256=tensor_sha256(sl))


def _binding(cfg: Mapping[str, Any], fp: Fingerprint, source: str) -> ModelBinding:
    text = cfg.get("text_config") or cfg
    archs = cfg.get("architectures") or ["?"]
    return ModelBinding(
        architecture=archs[0],
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        fingerprint=fp,
        source=source,
    )


def binding_for_model(model_dir: str | Path) -> ModelBinding:
    model_dir = Path(model_dir)
    return _binding(_read_config(model_dir), fingerprint_model(model_dir), model_dir.name)


def binding_for_hf_model(model: Any, source: str = "") -> ModelBinding:
    cfg = model.config.to_dict()
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]
    return _binding(cfg, fingerprint_hf_model(model), source)


def check_binding(expected: ModelBinding, got: ModelBinding, what: str) -> None:
    """Refuse ``got`` (the artifact's binding) unless it names the ``expected`` model."""
    diffs = [
        f"{k}: expected {getattr(expected, k)!r}, got {getattr(got, k)!r}"
        for k in ("architecture", "num_layers", "hidden_size")
        if getattr(expected, k) != getattr(got, k)
    ]
    e, g = expected.fingerprint, got.fingerprint
    if e.method != g.method:
        diffs.append(f"fingerprint method: expected {e.method!r}, got {g.method!r}")
    else:
        diffs += [
            f"fingerprint {k}: expected {getattr(e, k)[:16]}…, got {getattr(g, k)[:16]}…"
            for k in ("config_sha256", "embedding_sha256")
            if getattr(e, k) != getattr(g, k)
        ]
    if diffs:
        raise ModelMismatch(f"{what} was made for a different model: " + "; ".join(diffs))
