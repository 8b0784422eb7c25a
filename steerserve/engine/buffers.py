"""The worker-side steering state: persistent buffers and the host bookkeeping that fills them.

Device buffers (allocated once, before the first forward, updated in place only):

* ``pool``  float32 ``[1 + S*R, H]``: delta rows; row 0 is zeros. Batch slot ``s`` (1..S, one per
  running steered request) owns rows ``1 + (s-1)*R .. s*R``, so the pool can never overflow.
* ``index`` int32 ``[num_layers, max_tokens]``: for each layer, the pool row each token of the
  current step adds. 0 = untouched.

Per step the host computes ``index`` with numpy (no Python per token) and copies it in one go; the
op then does ``hidden + pool[index[layer, :T]]`` on every steerable layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from steerserve.engine.spec import (
    EXTRA_ARGS_KEY,
    PHASE_GENERATED,
    PHASE_LAST_PROMPT,
    PHASE_PROMPT,
    decode,
    plan_rows,
)

logger = logging.getLogger(__name__)


class SteeringState:
    """Owns the buffers of one model replica (one TP/PP rank) and the request→row bookkeeping.

    Every rank derives the same rows from the same scheduler output, so tensor-parallel ranks apply
    identical deltas with no collective in the hot path.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        hidden_size: int,
        max_num_seqs: int,
        max_num_tokens: int,
        rows_per_request: int,
        device: torch.device | str,
        skip_idle: bool = True,
    ) -> None:
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.rows_per_request = rows_per_request
        self.device = torch.device(device)
        self.pool = torch.zeros(
            1 + max_num_seqs * rows_per_request,
            hidden_size,
            dtype=torch.float32,
            device=self.device,
        )
        self.index = torch.zeros(num_layers, max_num_tokens, dtype=torch.int32, device=self.device)
        self._shared = self.device.type == "cpu"
        # On CPU the host mirror *is* the device buffer: writes need no copy.
        self._host = (
            self.index.numpy() if self._shared else np.zeros((num_layers, max_num_tokens), np.int32)
        )
        self._hw = np.zeros(num_layers, np.int64)  # per layer: entries [hw:] are known to be zero
        self.vectors: dict[str, torch.Tensor] = {}
        self.digests: dict[str, str] = {}
        self.hooked_layers: list[int] = []
        self._slot_of: dict[str, int] = {}
        self._slot_layers: dict[int, list[int]] = {}
        self._unsteered: set[str] = set()
        self._free = list(range(max_num_seqs, 0, -1))
        self._slot_rows = np.zeros((num_layers, max_num_seqs + 1, 3), np.int32)
        self._layer_users = np.zeros(num_layers, np.int64)  # running requests steering it
        # Eager forwards skip the op on a layer no running request steers (x + 0 is x); off
        # where a CUDA graph might be captured outside torch.compile (it would bake the skip in).
        self.skip_idle = skip_idle

    # ---- model wiring -------------------------------------------------------------------------
    def attach(self, layers: Sequence[torch.nn.Module], layer_ids: Iterable[int]) -> None:
        """Give each owned decoder layer its buffers and the hook that calls the op."""
        from steerserve.engine import op

        users, compiling = self._layer_users, torch.compiler.is_compiling

        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
            # Traced (compile), the op always stays in the graph: a branch would be baked in.
            traced = compiling()
            if not traced and self.skip_idle and not users[module.steer_layer]:
                return output  # idle layer: what the stock layer returned, no op, no copy
            hidden, residual = output  # vLLM keeps the stream split; add to hidden only
            # Eager: the op's kernel without the dispatcher's ~10 µs a call; same arithmetic.
            add = op.steer_add if traced else op._steer_add
            return add(hidden, module.steer_index, module.steer_pool), residual

        for i in layer_ids:
            layer = layers[i]
            layer.steer_layer = i
            layer.register_buffer("steer_index", self.index[i], persistent=False)
            layer.register_buffer("steer_pool", self.pool, persistent=False)
            layer.register_forward_hook(hook)
            self.hooked_layers.append(i)

    # ---- vectors ------------------------------------------------------------------------------
    def register_vector(self, name: str, data: torch.Tensor, digest: str) -> None:
        if data.shape != (self.hidden_size,):
            raise ValueError(f"vector {name!r}: shape {tuple(data.shape)} != ({self.hidden_size},)")
        old = self.digests.get(name)
        if old is not None and old != digest:
            raise ValueError(f"vector {name!r} is already registered with different data")
        self.vectors[name] = data.to(device=self.device, dtype=torch.float32)
        self.digests[name] = digest

    # ---- request lifecycle --------------------------------------------------------------------
    def sync(self, live: Sequence[str], extra_args_of: Callable[[str], dict | None]) -> None:
        """Match slots to the requests now in the persistent batch (after vLLM updated it)."""
        live_set = set(live)
        for rid in [r for r in self._slot_of if r not in live_set]:
            self._release(rid)
        self._unsteered &= live_set
        for rid in live:
            if rid in self._slot_of or rid in self._unsteered:
                continue
            extra = extra_args_of(rid)
            spec = extra.get(EXTRA_ARGS_KEY) if extra else None
            if spec:
                self.admit(rid, spec)
            else:
                self._unsteered.add(rid)

    def admit(self, rid: str, spec: object) -> None:
        """Give a steered request a slot and materialise its delta rows."""
        rows = plan_rows(decode(spec))
        if len(rows) > self.rows_per_request:
            raise RuntimeError(
                f"request {rid}: steering needs {len(rows)} rows > {self.rows_per_request}; "
                "it should have been refused at admission"
            )
        if not self._free:
            raise RuntimeError("steering: no free slot (more running requests than max_num_seqs)")
        slot = self._free.pop()
        base = 1 + (slot - 1) * self.rows_per_request
        layers: list[int] = []
        for k, row in enumerate(rows):
            missing = [n for n, _ in row.terms if n not in self.vectors]
            if missing:
                self._free.append(slot)
                raise RuntimeError(
                    f"request {rid}: vector {missing[0]!r} is not registered in the worker"
                )
            delta = torch.zeros(self.hidden_size, dtype=torch.float32, device=self.device)
            for name, scale in row.terms:
                delta += scale * self.vectors[name]
            self.pool[base + k].copy_(delta)
            self._slot_rows[row.layer, slot, list(row.phases)] = base + k
            if row.layer not in layers:
                layers.append(row.layer)
        self._layer_users[layers] += 1
        self._slot_of[rid] = slot
        self._slot_layers[slot] = layers

    def release_if_present(self, rid: str) -> None:
        if rid in self._slot_of:
            self._release(rid)

    def _release(self, rid: str) -> None:
        slot = self._slot_of.pop(rid)
        layers = self._slot_layers.pop(slot)
        self._slot_rows[:, slot, :] = 0
        self._layer_users[layers] -= 1
        self._free.append(slot)

    # ---- per step -----------------------------------------------------------------------------
    def prepare_step(
        self,
        req_ids: Sequence[str],
        query_start_loc: np.ndarray,
        num_computed: np.ndarray,
        num_prompt: np.ndarray,
    ) -> None:
        """Fill ``index`` for a batch whose request ``i`` owns tokens
        ``query_start_loc[i]:query_start_loc[i+1]`` (positions from ``num_computed[i]`` on)."""
        active = np.flatnonzero(self._layer_users)
        stale = np.flatnonzero(self._hw)
        if active.size == 0 and stale.size == 0:
            return
        n = len(req_ids)
        total = int(query_start_loc[n]) if n else 0
        if total > self.max_num_tokens:
            raise RuntimeError(
                f"steering: {total} tokens in a step > buffer of {self.max_num_tokens}"
            )
        written = np.zeros(self.num_layers, np.int64)
        if active.size and total:
            slots = np.fromiter((self._slot_of.get(r, 0) for r in req_ids), np.int64, n)
            counts = np.diff(query_start_loc[: n + 1])
            tok_req = np.repeat(np.arange(n), counts)
            pos = num_computed[:n][tok_req] + (np.arange(total) - query_start_loc[:n][tok_req])
            plen = num_prompt[:n][tok_req]
            phase = np.where(
                pos >= plen,
                PHASE_GENERATED,
                np.where(pos == plen - 1, PHASE_LAST_PROMPT, PHASE_PROMPT),
            )
            self._host[active, :total] = self._slot_rows[active][:, slots[tok_req], phase]
            written[active] = total
        for layer in np.flatnonzero(self._hw > written):
            self._host[layer, written[layer] : self._hw[layer]] = 0
        top = int(max(self._hw.max(), written.max()))
        self._hw = written
        self._push(top)

    def reset(self) -> None:
        """Zero the index (dummy, profile and capture runs see no steering)."""
        top = int(self._hw.max())
        if top:
            self._host[:, :top] = 0
            self._hw[:] = 0
            self._push(top)

    def _push(self, upto: int) -> None:
        if self._shared or upto == 0:
            return
        src = torch.from_numpy(np.ascontiguousarray(self._host[:, :upto])).pin_memory()
        self.index[:, :upto].copy_(src, non_blocking=True)

    def info(self) -> dict:
        return {
            "hooked_layers": list(self.hooked_layers),
            "vectors": dict(self.digests),
            "rows_per_request": self.rows_per_request,
            "max_num_seqs": self.max_num_seqs,
            "max_num_tokens": self.max_num_tokens,
            "live_steered": len(self._slot_of),
        }
