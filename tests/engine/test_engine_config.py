"""``check_config``: engine features whose token layout the steering index cannot follow are
refused at start, on vLLM's own config objects."""

from __future__ import annotations

import pytest


def _config(**parallel: object):
    from vllm.config import ParallelConfig, VllmConfig

    cfg = VllmConfig()
    # The CPU platform turns micro-batching off while building a VllmConfig, so the parallel
    # settings a GPU engine would carry are set after construction.
    cfg.parallel_config = ParallelConfig(**parallel)
    return cfg


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        ({"ubatch_size": 2}, "ubatch_size=2"),  # micro-batching without enable_dbo
        ({"ubatch_size": 4}, "ubatch_size=4"),
        ({"enable_dbo": True}, "enable_dbo=True"),
    ],
)
def test_micro_batching_is_refused(parallel: dict, named: str) -> None:
    from steerserve.engine.runner import check_config

    cfg = _config(**parallel)
    assert cfg.parallel_config.use_ubatching  # what vLLM itself micro-batches on
    with pytest.raises(ValueError, match="micro-batching") as err:
        check_config(cfg)
    assert named in str(err.value)


@pytest.mark.parametrize("parallel", [{}, {"ubatch_size": 1}, {"ubatch_size": 0}])
def test_single_batch_is_accepted(parallel: dict) -> None:
    from steerserve.engine.runner import check_config

    cfg = _config(**parallel)
    assert not cfg.parallel_config.use_ubatching
    check_config(cfg)


def test_prefill_context_parallelism_is_refused() -> None:
    from steerserve.engine.runner import check_config

    with pytest.raises(ValueError, match="prefill context parallelism"):
        check_config(_config(prefill_context_parallel_size=2))
