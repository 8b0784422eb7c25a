"""Models: which checkpoint a name means and the embedded models made from packages
(``catalogue`` pins them, ``conversion`` converts and checks, ``embedded`` resolves and caches), their
4-bit sibling (``quantize``), tiny random models for tests (``tiny``) and the one chat rendering
(``chat``). The names below are the package's API."""

from __future__ import annotations

from steerserve.models.catalogue import (
    CHECK_CHATS,
    CHECK_PROMPTS,
    DEFAULT_MODEL,
    EMBEDDED,
    EXTRA,
    FORMAT_VERSION,
    GEMMA,
    GEMMA_CHAT_TEMPLATE,
    LOGIT_TOLERANCE,
    MARKER,
    QWEN_CODER,
    W4_DIR,
    W4_TOLERANCE,
    Chunk,
    EmbeddedModel,
    EmbeddedModelError,
    EmbeddedPackagesMissing,
    read_marker,
)
from steerserve.models.conversion import (
    Reference,
    assemble_gguf,
    check_tokenizer,
    compare_logits,
    convert,
    fix_tokenizer,
    reference_outputs,
    save_checkpoint,
    verify_conversion,
    verify_w4,
    write_w4,
)
from steerserve.models.embedded import (
    cache_dir,
    embedded_conversion,
    ensure_embedded,
    ensure_w4,
    is_valid,
    load_hf_model,
    missing_packages,
    model_dir,
    resolve_model,
    w4_dir,
)
