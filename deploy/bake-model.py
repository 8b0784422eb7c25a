"""Build-time steps of the CPU image (deploy/Dockerfile.cpu runs them in its builder stage).

    python deploy/bake-model.py model --out /opt/steerserve/models [--name NAME] [--vectors DIR]
    python deploy/bake-model.py prune

``model`` makes the embedded model's checkpoint the image serves, in OUT/NAME. It runs
steerserve.models' own steps (the GGUF assembled from its chunk packages with size and sha256
checked; converted by transformers; the reloaded checkpoint's logits, tokenization and chat template
compared with the GGUF-loaded model's), but stores the weights in bfloat16, the dtype vLLM computes
in on a CPU with native bfloat16 (on one without, steerserve serves float32 and vLLM upcasts them at
load). One tensor stays float32: the token embedding, because the shipped vectors are bound to
their model by a sha256 of float32 embedding values (steerserve.artifacts' fingerprint) and
bfloat16 would change it, so that the server would refuse them. The build fails unless the
bfloat16 checkpoint passes the same logits check as ``steerserve serve``'s own bfloat16 conversions
(models.LOGIT_TOLERANCE), keeps the float32 checkpoint's fingerprint, and the shipped vectors of the
model bind to it. Its marker says ``"dtype": "bfloat16"``, so ``resolve_model("default")`` (which
wants its float32 conversion) never takes it for its own: the image serves the folder by path.

``prune`` removes from the venv what the image never imports: the GGUF chunk packages (the GGUF is
assembled and converted already) and triton (vLLM's CPU build disables a triton without a CPU
backend and uses its C++ kernels instead, the same path as without triton). Then it imports what
serving imports, in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEEP_FLOAT32 = ("embed_tokens.weight",)  # what steerserve.artifacts.fingerprint_model reads
SERVING_IMPORTS = """
import torch, transformers, vllm, xgrammar
from vllm import LLM
from vllm.triton_utils import HAS_TRITON
import vllm.v1.engine.async_llm, vllm.v1.engine.core, vllm.v1.worker.cpu_worker
import vllm.model_executor.models.qwen2, vllm.model_executor.models.gemma3
import steerserve.cli, steerserve.engine.plugin, steerserve.server.app
assert torch.__version__.endswith("+cpu"), torch.__version__
assert not HAS_TRITON
print("prune: serving imports ok without triton; torch", torch.__version__)
"""


def shrink(folder: Path) -> list[str]:
    """Rewrite ``folder``'s safetensors in bfloat16, but for the tensors named in KEEP_FLOAT32;
    returns the names kept. One tensor at a time in float32, so memory stays near the output."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    kept: list[str] = []
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(f), framework="pt") as s:
            meta = s.metadata() or {}
            for k in s.keys():
                t = s.get_tensor(k)
                if t.is_floating_point() and t.dtype != torch.bfloat16:
                    if k.endswith(KEEP_FLOAT32):
                        kept.append(k)
                    else:
                        t = t.to(torch.bfloat16)
                tensors[k] = t
                total += t.numel() * t.element_size()
        tmp = f.with_name(f.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt", **meta})
        del tensors
        os.replace(tmp, f)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index's total size must say what is stored now
        doc = json.loads(index.read_text())
        doc.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(doc, indent=2) + "\n")
    return kept


def bake(name: str, out_root: Path, vectors: Path | None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from steerserve import models as M
    from steerserve.artifacts import artifacts_for_model, fingerprint_model

    spec = M.EMBEDDED[name]
    as_float32 = dataclasses.replace(spec, dtype="float32")
    stored = dataclasses.replace(spec, dtype="bfloat16", tolerance=None)
    target = out_root / name
    out_root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out_root))
    try:
        gguf = M.assemble_gguf(spec, tmp / f"{name}.gguf")
        tok = M.fix_tokenizer(AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name), spec)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
        ref = M.reference_outputs(model.eval(), tok, spec)
        ckpt = tmp / "model"
        M.save_checkpoint(model, tok, ckpt, as_float32)
        del model
        gc.collect()
        gguf.unlink()
        before = fingerprint_model(ckpt)
        kept = shrink(ckpt)
        after = fingerprint_model(ckpt)
        if (before.config_sha256, before.embedding_sha256) != (
            after.config_sha256,
            after.embedding_sha256,
        ):
            raise SystemExit(f"bake: {name}: bfloat16 storage changed the fingerprint: {kept=}")
        check = M.verify_conversion(ckpt, ref, stored)
        print(f"bake: {name}: {json.dumps(check['check'])}", flush=True)
        if not check["check"]["passed"]:
            raise SystemExit(f"bake: {name}: the bfloat16 checkpoint fails the logits check")
        if vectors is not None and (vectors / name).is_dir():
            bound = artifacts_for_model(vectors, ckpt)
            if not bound:
                raise SystemExit(f"bake: {name}: no artifact under {vectors / name} binds")
            print(f"bake: vectors bound: {[a.key for a in bound]}", flush=True)
        marker = {
            "format": M.FORMAT_VERSION,
            "model": spec.name,
            "packages": {c.package: md.version(c.package) for c in spec.chunks},
            "gguf_sha256": spec.gguf_sha256,
            "gguf_size": spec.gguf_size,
            "dtype": "bfloat16",
            "float32_tensors": kept,
            "baked_by": "deploy/bake-model.py",
            **check,
            "seconds": round(time.time() - t0, 1),
        }
        (ckpt / M.MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        ckpt.chmod(0o755)
        for f in ckpt.iterdir():
            f.chmod(0o644)
        if target.exists():
            shutil.rmtree(target)
        os.rename(ckpt, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"bake: {target}: {size / 1e9:.2f} GB in {time.time() - t0:.0f} s", flush=True)
    return target


def prune() -> None:
    from steerserve.models import EMBEDDED

    names = ["triton"] + [c.package for m in EMBEDDED.values() for c in m.chunks]
    present = []
    for n in names:
        try:
            md.version(n)
        except md.PackageNotFoundError:
            continue
        present.append(n)
    if present:
        pip = [sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present]
        # A build arg that was not passed may arrive empty; pip would read it as a setting.
        env = {k: v for k, v in os.environ.items() if v or not k.startswith("PIP_")}
        subprocess.run(pip, check=True, env=env)
    print(f"prune: removed {len(present)} distributions: {' '.join(present)}", flush=True)
    subprocess.run([sys.executable, "-c", SERVING_IMPORTS], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model", help="convert, shrink and check the embedded model")
    m.add_argument("--out", type=Path, required=True, help="the folder of model folders")
    m.add_argument("--name", default=None, help="an embedded model (default: the default one)")
    m.add_argument("--vectors", type=Path, default=None, help="the shipped vectors to bind")
    sub.add_parser("prune", help="remove triton and the GGUF chunk packages, check imports")
    args = ap.parse_args()
    if args.cmd == "model":
        from steerserve.models import DEFAULT_MODEL, EMBEDDED

        name = args.name or DEFAULT_MODEL
        if name not in EMBEDDED:
            ap.error(f"unknown embedded model {name!r}: {', '.join(EMBEDDED)}")
        bake(name, args.out, args.vectors)
    else:
        prune()


if __name__ == "__main__":
    main()
