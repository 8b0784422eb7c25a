"""Named steering vectors known to an engine (front-end side).

Names are immutable: registering a name again with different data is refused, so a request that
was validated against a name can never meet other data in the worker.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,199}$")


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a vector as contiguous little-endian float32 bytes."""
    return hashlib.sha256(
        t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    ).hexdigest()


@dataclass(frozen=True)
class RegisteredVector:
    name: str
    tensor: torch.Tensor  # float32, 1-D, CPU
    sha256: str
    source: str | None = None

    @functools.cached_property
    def norm(self) -> float:  # admission asks on every request that ablates it
        return float(self.tensor.norm())


class VectorRegistry:
    """name -> vector, checked against the model's hidden size."""

    def __init__(self, hidden_size: int | None = None) -> None:
        self.hidden_size = hidden_size
        self._vectors: dict[str, RegisteredVector] = {}

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        source: str | None = None,
        sha256: str | None = None,
    ) -> RegisteredVector:
        """Check and hash a vector and register it under ``name`` (the same data again: a no-op;
        other data: refused). ``sha256``: the data's digest when it was verified already (an
        artifact's, by ``load_artifact``), so that it is not hashed a second time."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"vector name {name!r}: use 1-200 letters, digits or _.:/@+-")
        t = torch.as_tensor(tensor).detach().to(torch.float32).cpu().contiguous()
        if t.dim() != 1:
            raise ValueError(f"vector {name!r}: expected a 1-D tensor, got shape {tuple(t.shape)}")
        if self.hidden_size is not None and t.numel() != self.hidden_size:
            raise ValueError(
                f"vector {name!r}: size {t.numel()} does not match the model's hidden size "
                f"{self.hidden_size}"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"vector {name!r}: contains NaN or Inf")
        digest = sha256 or tensor_sha256(t)
        old = self._vectors.get(name)
        if old is not None:
            if old.sha256 != digest:
                raise ValueError(f"vector {name!r} is already registered with different data")
            return old
        rv = RegisteredVector(name, t, digest, source)
        self._vectors[name] = rv
        return rv

    def admit(self, rv: RegisteredVector) -> RegisteredVector:
        """Add a vector another registry of the same hidden size already checked (and hashed):
        the server checks a vector aside, sends it to the workers, then admits it here, so its
        data is hashed once, not again. Same name, other data: refused as :meth:`add` does."""
        if self.hidden_size is not None and rv.tensor.numel() != self.hidden_size:
            raise ValueError(f"vector {rv.name!r}: checked for another hidden size")
        old = self._vectors.get(rv.name)
        if old is not None:
            if old.sha256 != rv.sha256:
                raise ValueError(f"vector {rv.name!r} is already registered with different data")
            return old
        self._vectors[rv.name] = rv
        return rv

    def __contains__(self, name: object) -> bool:
        return name in self._vectors

    def __getitem__(self, name: str) -> RegisteredVector:
        return self._vectors[name]

    def __iter__(self) -> Iterator[RegisteredVector]:
        return iter(self._vectors.values())

    def __len__(self) -> int:
        return len(self._vectors)

    def names(self) -> list[str]:
        return list(self._vectors)

    def digests(self) -> dict[str, str]:
        return {n: v.sha256 for n, v in self._vectors.items()}
