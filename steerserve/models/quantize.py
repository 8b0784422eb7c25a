"""4-bit weight-only checkpoints that vLLM's CPU backend serves (its ``CPUWNA16LinearKernel``)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

#: 4-bit values per int32 word.
PACK = 8
#: AWQ's order of the eight output columns inside a word: nibble i holds column ORDER[i].
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Clipping ratios tried per group (of its min and max); the least squared error wins.
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85)
#: Linear layers inside a decoder block: ``model.layers.N.<module>.<name>.weight``.
QUANTIZED = re.compile(
    r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$"
)
#: Kept in the dtype they come in (what steerserve.artifacts' fingerprint reads).
KEEP = ("embed_tokens.weight",)
#: The vLLM CPU kernel takes input and output sizes in multiples of this.
ALIGN = 32


def unsupported(shapes: Mapping[str, tuple[int, ...]], group_size: int) -> str | None:
    """Why the CPU 4-bit kernel cannot take these weights, or None when it can."""
    if group_size % 2 or group_size < PACK:
        return f"group size {group_size} is not an even number of at least {PACK}"
    names = [k for k in shapes if QUANTIZED.match(k)]
    if not names:
        return "no decoder-block linear layers named model.layers.N.*_proj"
    for k in names:
        out, inp = shapes[k]
        if out % ALIGN or inp % ALIGN:
            return f"{k} is {out}x{inp}; the CPU kernel needs multiples of {ALIGN}"
        if inp % group_size:
            return f"{k}: input size {inp} is not a multiple of the group size {group_size}"
    return None


def quantize_weight(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scales, zeros)`` of a ``[out, in]`` weight: q in 0..15 (``[out, in]``), scales and
    integer zeros ``[out, in // group_size]``, with ``w ≈ (q - zero) * scale``. Scales are
    rounded to bfloat16, which float16 holds exactly: vLLM loads them into the compute dtype."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // group_size, group_size)
    lo0 = g.amin(-1, keepdim=True).clamp(max=0)
    hi0 = g.amax(-1, keepdim=True).clamp(min=0)
    best = None
    for ratio in CLIP_RATIOS:
        lo, hi = lo0 * ratio, hi0 * ratio
        s = ((hi - lo) / 15).clamp_min(1e-5).bfloat16().float()
        z = torch.clamp(torch.round(-lo / s), 0, 15)
        q = torch.clamp(torch.round(g / s) + z, 0, 15)
        err = ((q - z) * s - g).square().sum(-1, keepdim=True)
        if best is None:
            best = [q, s, z, err]
        else:
            better = err < best[3]
            best = [
                torch.where(better, new, old) for new, old in zip((q, s, z, err), best, strict=True)
            ]
    q, s, z, _ = best
    n = inp // group_size
    return q.reshape(out, inp).to(torch.int32), s.reshape(out, n), z.reshape(out, n).int()


def pack(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values ``[rows, cols]`` along the columns, in AWQ's order, into int32 words
    ``[rows, cols // 8]``."""
    rows, cols = q.shape
    q = q.to(torch.int64).reshape(rows, cols // PACK, PACK)
    words = torch.zeros(rows, cols // PACK, dtype=torch.int64)
    for i, col in enumerate(ORDER):
        words |= q[:, :, col] << (4 * i)
    return words.to(torch.int32)  # two's complement keeps the high nibble


def unpack(words: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*words.shape, PACK, dtype=torch.int64)
    for i, col in enumerate(ORDER):
        out[:, :, col] = (w >> (4 * i)) & 0xF
    return out.reshape(words.shape[0], -1).to(torch.int32)


def quantized_tensors(name: str, w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The AWQ tensors that replace ``<module>.weight``: qweight ``[in, out // 8]``, qzeros
    ``[groups, out // 8]``, scales ``[groups, out]`` (float16)."""
    q, s, z = quantize_weight(w, group_size)
    base = name[: -len(".weight")]
    return {
        f"{base}.qweight": pack(q.t().contiguous()),
        f"{base}.qzeros": pack(z.t().contiguous()),
        f"{base}.scales": s.t().contiguous().half(),
    }


def dequantize(tensors: Mapping[str, torch.Tensor], base: str) -> torch.Tensor:
    """The float32 ``[out, in]`` weight the saved AWQ tensors of ``base`` stand for."""
    q = unpack(tensors[f"{base}.qweight"]).float()  # [in, out]
    z = unpack(tensors[f"{base}.qzeros"]).float()  # [groups, out]
    s = tensors[f"{base}.scales"].float()  # [groups, out]
    group = q.shape[0] // s.shape[0]
    w = (q - z.repeat_interleave(group, 0)) * s.repeat_interleave(group, 0)
    return w.t().contiguous()


def quantization_config(group_size: int) -> dict:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }


def quantize_state(
    state: Mapping[str, torch.Tensor],
    group_size: int,
    keep_dtype: torch.dtype = torch.bfloat16,
    embed_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The 4-bit checkpoint's tensors for a model's ``state``: block linears in AWQ form, the
    token embedding in ``embed_dtype`` (the full checkpoint's: steerserve.artifacts fingerprints
    its values, so vectors bound to the model bind to its 4-bit checkpoint too; a lookup reads
    only its rows; None: as it comes), everything else cast to ``keep_dtype``. Raises
    ValueError when the CPU kernel cannot take the shapes."""
    reason = unsupported({k: tuple(v.shape) for k, v in state.items()}, group_size)
    if reason:
        raise ValueError(f"no 4-bit checkpoint: {reason}")
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        w = w.detach()
        if QUANTIZED.match(name):
            out.update(quantized_tensors(name, w, group_size))
        elif name.endswith(KEEP):
            out[name] = w.to(embed_dtype or w.dtype, copy=True).contiguous()
        else:
            out[name] = w.to(keep_dtype).contiguous()
    return out


def write_checkpoint(
    tensors: Mapping[str, torch.Tensor], like: Path, out: Path, group_size: int
) -> None:
    """Write the 4-bit checkpoint ``tensors`` (from ``quantize_state``) to ``out``, with the
    config, tokenizer and generation config of the full-precision checkpoint folder ``like``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, out / f.name)
    save_file(dict(tensors), out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config(group_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_dequantized(folder: Path, dtype: torch.dtype = torch.float32):  # noqa: ANN201
    """A transformers model of the 4-bit checkpoint in ``folder`` with its weights unpacked
    to ``dtype`` (transformers cannot load AWQ without a GPU library; this is the reference the
    logits check and the kernel tests use)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    tensors = load_file(folder / "model.safetensors")
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            state[f"{base}.weight"] = dequantize(tensors, base).to(dtype)
        elif not name.endswith((".scales", ".qzeros")):
            state[name] = t.to(dtype)
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
