"""The runner seams: tell the steering state which request sits at which batch position, and when
requests come and go, before every forward."""

from __future__ import annotations

import functools
from typing import Any

from steerserve.engine import degenerate
from steerserve.engine.spec import EXTRA_ARGS_KEY


def check_config(vllm_config: Any) -> None:
    """Refuse engine features whose token layout the steering index cannot follow."""
    if vllm_config.speculative_config is not None:
        raise ValueError("steerserve: speculative decoding is not supported with steering")
    par = vllm_config.parallel_config
    # vLLM splits a step into micro-batches whenever ``use_ubatching`` holds (``enable_dbo`` or
    # ``ubatch_size > 1``); each micro-batch's forward would read the index from token 0.
    if par.use_ubatching:
        raise ValueError(
            "steerserve: micro-batching is not supported with steering "
            f"(enable_dbo={par.enable_dbo}, ubatch_size={par.ubatch_size}; "
            "use enable_dbo=False and ubatch_size<=1)"
        )
    if getattr(par, "prefill_context_parallel_size", 1) > 1:
        raise ValueError("steerserve: prefill context parallelism is not supported")


def _state(runner: Any) -> Any:
    return getattr(runner.get_model(), "steering", None)


def _extra_args(runner: Any, req_id: str) -> dict | None:
    sp = runner.requests[req_id].sampling_params
    return None if sp is None else sp.extra_args


def install_v1_seam() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R

    if getattr(R, "_steerserve_seam", False):
        return
    orig_update, orig_forward, orig_dummy = R._update_states, R._model_forward, R._dummy_run
    orig_sample = R.sample_tokens

    @functools.wraps(orig_update)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        out = orig_update(self, scheduler_output)  # returns a deferred-correction callable
        st = _state(self)
        if st is not None:
            st.sync(self.input_batch.req_ids, functools.partial(_extra_args, self))
        return out

    @functools.wraps(orig_forward)
    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state(self)
        if st is not None:
            b = self.input_batch
            n = b.num_reqs
            st.prepare_step(
                b.req_ids[:n],
                self.query_start_loc.np[: n + 1],
                b.num_computed_tokens_cpu[:n],
                b.num_prompt_tokens[:n],
            )
        return orig_forward(self, *args, **kwargs)

    @functools.wraps(orig_sample)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_sample(self, *args, **kwargs)
        st = _state(self)
        if st is not None and (bad := st.take_degenerate()):
            degenerate.merge(out, bad)  # vLLM's corrupted-logits field, to the front end
        return out

    @functools.wraps(orig_dummy)
    def _dummy_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _state(self)
        if st is not None:
            st.reset()
        return orig_dummy(self, *args, **kwargs)

    R._update_states = _update_states
    R._model_forward = _model_forward
    R._dummy_run = _dummy_run
    R.sample_tokens = sample_tokens
    R._steerserve_seam = True


@functools.cache
def steering_model_state_cls() -> type:
    """Model Runner V2 seam (GPU). Written from the 0.32/0.33 sources; confirmed only by
    ``bench/gpu_check.sh`` on a GPU."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    class SteeringModelState(DefaultModelState):
        def __init__(self, vllm_config: Any, model: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(vllm_config, model, *args, **kwargs)
            self._steer = model.steering

        def add_request(self, req_index: int, new_req_data: Any) -> None:
            super().add_request(req_index, new_req_data)
            sp = new_req_data.sampling_params
            extra = None if sp is None else sp.extra_args
            self._steer.release_if_present(new_req_data.req_id)
            if extra and extra.get(EXTRA_ARGS_KEY):
                self._steer.admit(new_req_data.req_id, extra[EXTRA_ARGS_KEY])

        def remove_request(self, req_id: str) -> None:
            super().remove_request(req_id)
            self._steer.release_if_present(req_id)

        def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict:
            out = super().prepare_inputs(input_batch, req_states)
            n = input_batch.num_reqs
            idx = input_batch.idx_mapping_np[:n]
            self._steer.prepare_step(
                input_batch.req_ids[:n],
                input_batch.query_start_loc_np[: n + 1],
                input_batch.num_computed_tokens_np[:n],
                req_states.prompt_len.np[idx],
            )
            return out

        def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict:
            self._steer.reset()
            return super().prepare_dummy_inputs(num_reqs, num_tokens)

    return SteeringModelState
