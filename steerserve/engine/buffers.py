"""The worker-side steering state: persistent buffers and the host bookkeeping that fills them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from steerserve.engine.degenerate import flag_rows
from steerserve.engine.ops import OPS
from steerserve.engine.spec import (
    DEFAULT_OPS_PER_LAYER,
    EXTRA_ARGS_KEY,
    PHASE_GENERATED,
    PHASE_LAST_PROMPT,
    PHASE_PROMPT,
    decode,
    plan_ops,
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
        ops_per_layer: int = DEFAULT_OPS_PER_LAYER,
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
        self._top = self._op_top = 0  # the most of _hw and _op_hw: 0, nothing to clear
        self.vectors: dict[str, torch.Tensor] = {}
        self.digests: dict[str, str] = {}
        self.hooked_layers: list[int] = []
        self._slot_of: dict[str, int] = {}
        self._slot_layers: dict[int, list[int]] = {}
        self._unsteered: set[str] = set()
        self._free = list(range(max_num_seqs, 0, -1))
        self._slot_rows = np.zeros((num_layers, max_num_seqs + 1, 3), np.int32)
        self._layer_users = np.zeros(num_layers, np.int64)  # running requests steering it
        # the non-additive ops: rows, their slots, their per-token index (see the module doc)
        self.ops_per_layer = k = ops_per_layer
        n_rows = 1 + max_num_seqs * rows_per_request
        self.op_rows = torch.zeros(n_rows, 2 * hidden_size + 2, device=self.device)
        self.op_rows[0, -2] = 1.0  # row 0: the identity (a = 1)
        self.op_index = torch.zeros(
            num_layers, k, max_num_tokens, dtype=torch.int32, device=self.device
        )
        self._op_host = (
            self.op_index.numpy()
            if self._shared
            else np.zeros((num_layers, k, max_num_tokens), np.int32)
        )
        self._op_hw = np.zeros(num_layers, np.int64)
        self._slot_ops = np.zeros((num_layers, k, max_num_seqs + 1, 3), np.int32)
        self._op_users = np.zeros(num_layers, np.int64)
        # per layer and slot, the op slots its request fills; per layer, the most any live one
        # does (eager forwards and gated ops run only those; a captured graph runs all K)
        self._slot_depth = np.zeros((num_layers, max_num_seqs + 1), np.int64)
        self._op_depth = np.zeros(num_layers, np.int64)
        self._slot_op_layers: dict[int, list[int]] = {}  # only slots whose request has ops
        # Eager forwards skip the op on a layer no running request steers (x + 0 is x), and
        # compiled ones pass the ops these counters as gates; off where a CUDA graph might be
        # captured (it would bake the skip in).
        self.skip_idle = skip_idle
        # the step's steered requests and their rows, until the sampled logits are checked
        # (``check_sampled``); then the check's flags, until the runner's output takes them
        self._armed: tuple[list[str], np.ndarray] | None = None
        self._checked: tuple[list[str], np.ndarray, torch.Tensor] | None = None

    # ---- model wiring -------------------------------------------------------------------------
    def attach(self, layers: Sequence[torch.nn.Module], layer_ids: Iterable[int]) -> None:
        """Give each owned decoder layer its buffers and the hook that calls the op."""
        from steerserve.engine import kernels as op

        users, depth, compiling = self._layer_users, self._op_depth, torch.compiler.is_compiling
        edits = self.ops_per_layer > 0  # static: 0 keeps steer_edit out of the graph
        # the counters as host tensors sharing their memory: the ops' gates (kernels.py), on a
        # CPU only (a GPU's compiled graph is captured: its ops always run, as before)
        users_t, depth_t = torch.from_numpy(users), torch.from_numpy(depth)
        gates = self._shared

        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
            hidden, residual = output  # vLLM keeps the stream split: add to hidden only
            if compiling():  # traced, the ops always stay in the graph: a branch would be baked in
                # skip_idle is read once, at trace time: gated ops only where no graph is captured
                gated = gates and self.skip_idle
                if edits:
                    hidden, residual = op.steer_edit(
                        hidden,
                        residual,
                        module.steer_op_index,
                        module.steer_op_rows,
                        module.steer_depth if gated else None,
                    )
                hidden = op.steer_add(
                    hidden,
                    module.steer_index,
                    module.steer_pool,
                    module.steer_users if gated else None,
                )
                return hidden, residual
            i, every = module.steer_layer, not self.skip_idle
            if not (every or users[i] or depth[i]):
                return output  # idle layer: what the stock layer returned, no op, no copy
            # Eager: the ops' kernels without the dispatcher's ~10 µs a call; same arithmetic.
            if edits and (every or depth[i]):
                index = module.steer_op_index if every else module.steer_op_index[: depth[i]]
                hidden, residual = op._steer_edit(hidden, residual, index, module.steer_op_rows)
            if every or users[i]:
                hidden = op._steer_add(hidden, module.steer_index, module.steer_pool)
            return hidden, residual

        for i in layer_ids:
            layer = layers[i]
            layer.steer_layer = i
            layer.register_buffer("steer_index", self.index[i], persistent=False)
            layer.register_buffer("steer_pool", self.pool, persistent=False)
            layer.register_buffer("steer_op_index", self.op_index[i], persistent=False)
            layer.register_buffer("steer_op_rows", self.op_rows, persistent=False)
            if gates:
                layer.register_buffer("steer_users", users_t[i : i + 1], persistent=False)
                layer.register_buffer("steer_depth", depth_t[i : i + 1], persistent=False)
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
        """Give a steered request a slot and materialise its delta rows and op rows."""
        entries = decode(spec)
        rows, ops = plan_rows(entries), plan_ops(entries)
        if len(rows) > self.rows_per_request or len(ops) > self.rows_per_request:
            raise RuntimeError(
                f"request {rid}: steering needs {len(rows)} delta rows and {len(ops)} op rows, "
                f"the engine holds {self.rows_per_request} of each; it should have been refused "
                "at admission"
            )
        k_max = max((k + 1 for p in ops for _, k in p.slots), default=0)
        if k_max > self.ops_per_layer:
            raise RuntimeError(
                f"request {rid}: {k_max} non-additive entries on one layer > "
                f"{self.ops_per_layer}; it should have been refused at admission"
            )
        missing = [e.vector for e in entries if e.vector not in self.vectors]
        if missing:
            raise RuntimeError(
                f"request {rid}: vector {missing[0]!r} is not registered in the worker"
            )
        if not self._free:
            raise RuntimeError("steering: no free slot (more running requests than max_num_seqs)")
        slot = self._free.pop()
        base = 1 + (slot - 1) * self.rows_per_request
        layers: list[int] = []
        for k, row in enumerate(rows):
            delta = torch.zeros(self.hidden_size, dtype=torch.float32, device=self.device)
            for name, scale, op_name in row.terms:
                delta += OPS[op_name].delta(self.vectors[name], scale)  # type: ignore[misc]
            self.pool[base + k].copy_(delta)
            self._slot_rows[row.layer, slot, list(row.phases)] = base + k
            if row.layer not in layers:
                layers.append(row.layer)
        op_layers: list[int] = []
        for j, p in enumerate(ops):
            affine = OPS[p.op].affine
            assert affine is not None  # plan_ops keeps non-additive ops only, each has one
            a, b, u, c = affine(self.vectors[p.vector], p.scale)
            self.op_rows[base + j].copy_(torch.cat([u, c, u.new_tensor([a, b])]))
            for phase, k in p.slots:
                self._slot_ops[p.layer, k, slot, phase] = base + j
                self._slot_depth[p.layer, slot] = max(self._slot_depth[p.layer, slot], k + 1)
            if p.layer not in op_layers:
                op_layers.append(p.layer)
        self._layer_users[layers] += 1
        self._op_users[op_layers] += 1
        if op_layers:
            self._op_depth[:] = self._slot_depth.max(1)
        self._slot_of[rid] = slot
        self._slot_layers[slot] = layers
        if op_layers:
            self._slot_op_layers[slot] = op_layers

    def release_if_present(self, rid: str) -> None:
        if rid in self._slot_of:
            self._release(rid)

    def _release(self, rid: str) -> None:
        slot = self._slot_of.pop(rid)
        layers = self._slot_layers.pop(slot)
        op_layers = self._slot_op_layers.pop(slot, [])
        self._slot_rows[:, slot, :] = 0
        self._layer_users[layers] -= 1
        if op_layers:
            self._slot_ops[:, :, slot, :] = 0
            self._slot_depth[:, slot] = 0
            self._op_depth[:] = self._slot_depth.max(1)
            self._op_users[op_layers] -= 1
        self._free.append(slot)

    # ---- per step -----------------------------------------------------------------------------
    def prepare_step(
        self,
        req_ids: Sequence[str],
        query_start_loc: np.ndarray,
        num_computed: np.ndarray,
        num_prompt: np.ndarray,
    ) -> None:
        """Fill the indexes for a batch whose request ``i`` owns tokens
        ``query_start_loc[i]:query_start_loc[i+1]`` (positions from ``num_computed[i]`` on)."""
        self._armed = None
        if not (self._slot_of or self._top or self._op_top):
            return  # idle: nothing steered now, nothing written last step
        n = len(req_ids)
        total = int(query_start_loc[n]) if n else 0
        if total > self.max_num_tokens:
            raise RuntimeError(
                f"steering: {total} tokens in a step > buffer of {self.max_num_tokens}"
            )
        tok_slot = phase = None
        if self._slot_of and total:
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
            tok_slot = slots[tok_req]
            rows = np.flatnonzero(slots)
            if rows.size:
                self._armed = (list(req_ids), rows)
        top = self._fill(self._host, self._hw, self._layer_users, self._slot_rows, tok_slot, phase)
        op_top = 0
        if self._op_top or self._slot_op_layers:
            op_top = self._fill(
                self._op_host, self._op_hw, self._op_users, self._slot_ops, tok_slot, phase
            )
        self._push(max(top, self._top), max(op_top, self._op_top))
        self._top, self._op_top = top, op_top

    def check_sampled(self, hidden: torch.Tensor) -> None:
        """Flag the step's steered rows whose final hidden state (``compute_logits``' input, one
        row per request) makes a degenerate distribution (``engine/degenerate.py``): reads
        ``[steered rows, H]``, no logits, no host sync. Other calls (dummy runs, prompt
        logprobs) find nothing armed or another row count."""
        armed, self._armed = self._armed, None
        if armed is None or hidden.shape[0] != len(armed[0]):
            return
        rids, rows = armed
        index = torch.from_numpy(rows).to(hidden.device, non_blocking=True)
        self._checked = (rids, rows, flag_rows(hidden.index_select(0, index)))

    def take_degenerate(self) -> list[str]:
        """The requests the last check flagged (once; on a GPU this reads the flags back)."""
        checked, self._checked = self._checked, None
        if checked is None:
            return []
        rids, rows, bad = checked
        return [rids[rows[i]] for i in torch.nonzero(bad.cpu()).flatten().tolist()]

    @staticmethod
    def _fill(
        host: np.ndarray,
        hw: np.ndarray,
        users: np.ndarray,
        table: np.ndarray,
        tok_slot: np.ndarray | None,
        phase: np.ndarray | None,
    ) -> int:
        """Write one index (``host[layer, ..., token]`` from ``table[layer, ..., slot, phase]``)
        on the layers some running request uses, zero what the last step left beyond it
        elsewhere, and keep ``hw``; returns how far this step wrote."""
        written = np.zeros(len(hw), np.int64)
        active = np.flatnonzero(users)
        if active.size and tok_slot is not None:
            total = len(tok_slot)
            host[active, ..., :total] = table[active][..., tok_slot, phase]
            written[active] = total
        for layer in np.flatnonzero(hw > written):
            host[layer, ..., written[layer] : hw[layer]] = 0
        hw[:] = written
        return int(written.max())

    def reset(self) -> None:
        """Zero the indexes (dummy, profile and capture runs see no steering)."""
        top, op_top = self._top, self._op_top
        self._armed = self._checked = None
        if top:
            self._host[:, :top] = 0
            self._hw[:] = 0
        if op_top:
            self._op_host[:, :, :op_top] = 0
            self._op_hw[:] = 0
        self._top = self._op_top = 0
        self._push(top, op_top)

    def _push(self, upto: int, op_upto: int = 0) -> None:
        if self._shared:
            return
        if upto:
            src = torch.from_numpy(np.ascontiguousarray(self._host[:, :upto])).pin_memory()
            self.index[:, :upto].copy_(src, non_blocking=True)
        if op_upto:
            src = torch.from_numpy(np.ascontiguousarray(self._op_host[:, :, :op_upto]))
            self.op_index[:, :, :op_upto].copy_(src.pin_memory(), non_blocking=True)

    def info(self) -> dict:
        return {
            "hooked_layers": list(self.hooked_layers),
            "vectors": dict(self.digests),
            "rows_per_request": self.rows_per_request,
            "ops_per_layer": self.ops_per_layer,
            "max_num_seqs": self.max_num_seqs,
            "max_num_tokens": self.max_num_tokens,
            "live_steered": len(self._slot_of),
        }
