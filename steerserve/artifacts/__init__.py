"""Steering-vector artifacts: a manifest bound to one model, verified tensors, GGUF interop.

``manifest`` (the schema and its checks), ``fingerprint`` (what binds an artifact to a model),
``store`` (on disk: load, save, scan, find), ``gguf`` (llama.cpp control vectors); ``view`` and
``gate`` are the ``vectors`` commands. The names below are the package's API, one import away."""

from __future__ import annotations

from steerserve.artifacts.fingerprint import (
    binding_for_hf_model,
    binding_for_model,
    check_binding,
    embedding_norm,
    fingerprint_hf_model,
    fingerprint_model,
)
from steerserve.artifacts.gguf import GGUF_ARCH, export_gguf, import_gguf
from steerserve.artifacts.manifest import (
    EMBED_COLS,
    EMBED_ROWS,
    FINGERPRINT_METHOD,
    LANGUAGE_CODES,
    LAYER_CONVENTION,
    MANIFEST_FILE,
    MAX_LANGUAGE_MULTIPLIER,
    SCHEMA_VERSION,
    SHAPE_KEYS,
    SLUG,
    TENSORS_FILE,
    Artifact,
    ArtifactError,
    Fingerprint,
    Intervention,
    LanguageGate,
    Manifest,
    ModelBinding,
    ModelMismatch,
    parse_manifest,
    read_manifest,
)
from steerserve.artifacts.store import (
    Scanned,
    artifact_name_version,
    artifacts_for_model,
    default_vectors_dir,
    find_artifacts,
    load_artifact,
    named,
    newest_first,
    outside,
    preferred_artifact,
    prepared,
    resolve_artifact,
    save_artifact,
    scan_artifacts,
    version_key,
)
