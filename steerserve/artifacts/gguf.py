"""llama.cpp GGUF control vectors: export and import."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from steerserve.artifacts.fingerprint import binding_for_model, check_binding
from steerserve.artifacts.manifest import (
    LAYER_CONVENTION,
    Artifact,
    ArtifactError,
    Intervention,
    Manifest,
    ModelBinding,
)
from steerserve.artifacts.store import prepared
from steerserve.engine.ops import OPS

log = logging.getLogger(__name__)


# --- llama.cpp GGUF control vectors ------------------------------------------------------------
# llama.cpp adds tensor ``direction.N`` to the output of decoder block N (0-based il == N), so
# N == our L; direction.0 is rejected by llama.cpp. See vectors/README.md for the evidence.

GGUF_ARCH = "controlvector"


def export_gguf(
    artifact: Artifact, path: str | Path, *, names: Iterable[str] | None = None
) -> Path:
    """Write interventions as a llama.cpp control vector, each scale baked into its direction.

    llama.cpp has one strength per file and steers every token, so ``positions`` is not kept
    by llama.cpp; interventions sharing a layer are summed into one ``direction.N``. It only
    adds, so an intervention whose op cannot be carried (``engine/ops.py``: ``gguf``) is refused.
    """
    import gguf

    m = artifact.manifest
    ivs = m.interventions if names is None else [m.intervention(n) for n in names]
    by_layer: dict[int, torch.Tensor] = {}
    for iv in ivs:
        if not OPS[iv.op].gguf:
            raise ArtifactError(
                f"intervention {iv.name!r}: op {iv.op!r} cannot be exported (a llama.cpp control "
                "vector only adds its direction to every token)"
            )
        if iv.layer == 0:
            raise ArtifactError(
                f"intervention {iv.name!r}: layer 0 cannot be exported (llama.cpp rejects "
                "direction.0; direction.N is added to the output of block N)"
            )
        if iv.scale == 0:
            raise ArtifactError(f"intervention {iv.name!r}: scale 0 would export a zero vector")
        if iv.positions != "all":
            log.warning("%s: llama.cpp steers all tokens, not %r", iv.name, iv.positions)
        v = artifact.tensors[iv.tensor].to(torch.float32) * iv.scale
        by_layer[iv.layer] = by_layer[iv.layer] + v if iv.layer in by_layer else v
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch=GGUF_ARCH)
    w.add_string(f"{GGUF_ARCH}.model_hint", m.model.architecture)
    w.add_int32(f"{GGUF_ARCH}.layer_count", len(by_layer))
    w.add_string("steerserve.source", f"{m.name}/{m.version}")
    w.add_string("steerserve.layer_convention", LAYER_CONVENTION)
    w.add_string("steerserve.binding", m.model.model_dump_json())
    w.add_string("steerserve.interventions", json.dumps([iv.model_dump() for iv in ivs]))
    for layer in sorted(by_layer):
        w.add_tensor(f"direction.{layer}", by_layer[layer].contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def import_gguf(
    path: str | Path,
    *,
    name: str,
    version: str,
    model_dir: str | Path,
    intervention: str | None = None,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Read a llama.cpp control vector as a manifest bound to ``model_dir`` plus its tensors.

    A file exported by steerserve gets its interventions back (direction / scale); a foreign
    file becomes one intervention per direction at scale 1, positions ``all``.
    """
    import gguf
    import numpy as np

    path = Path(path)
    r = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        f = r.fields.get(key)
        return None if f is None else f.contents()

    if field("general.architecture") != GGUF_ARCH:
        raise ArtifactError(
            f"{path}: not a control vector (general.architecture {field('general.architecture')!r})"
        )
    binding = binding_for_model(model_dir)
    if field("steerserve.binding"):
        check_binding(
            binding, ModelBinding.model_validate_json(field("steerserve.binding")), str(path)
        )
    dirs: dict[int, torch.Tensor] = {}
    for t in r.tensors:
        mt = re.fullmatch(r"direction\.(\d+)", t.name)
        if mt is None or int(mt.group(1)) == 0:
            raise ArtifactError(f"{path}: tensor {t.name!r} is not direction.N with N >= 1")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ArtifactError(f"{path}: {t.name} is {t.tensor_type.name}, expected F32")
        n = int(mt.group(1))
        if n >= binding.num_layers:
            raise ArtifactError(
                f"{path}: {t.name}: layer {n} is out of range 0..{binding.num_layers - 1}"
            )
        dirs[n] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    if not dirs:
        raise ArtifactError(f"{path}: no direction tensors")
    origin = {"imported_from": path.name, "format": "llama.cpp control vector"}
    records = json.loads(field("steerserve.interventions") or "[]")
    ivs: list[Intervention] = []
    tensors: dict[str, torch.Tensor] = {}
    for layer, v in sorted(dirs.items()):
        here = [rec for rec in records if rec.get("layer") == layer]
        if len(here) == 1:
            rec = {**here[0], "sha256": "", "norm": None, "tensor": here[0]["name"]}
            rec["provenance"] = {**rec.get("provenance", {}), **origin}
            iv = Intervention.model_validate(rec)
            v = v / iv.scale
        else:
            base = "+".join(rec["name"] for rec in here) if here else (intervention or "control")
            nm = base if (here or len(dirs) == 1) else f"{base}.L{layer}"
            hint = field(f"{GGUF_ARCH}.model_hint")
            iv = Intervention(
                name=nm,
                tensor=nm,
                layer=layer,
                scale=1.0,
                positions="all",
                provenance={**origin, "model_hint": hint},
            )
        ivs.append(iv)
        tensors[iv.tensor] = v
    manifest = Manifest(
        name=name,
        version=version,
        model=binding,
        interventions=ivs,
        description=f"imported from {path.name}",
    )
    return prepared(manifest, tensors)
