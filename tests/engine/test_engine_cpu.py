"""CPU serving defaults of ``steerserve serve``: float32 without native bfloat16, every core bound."""

from __future__ import annotations

import pytest

from steerserve.engine.cpu import (
    BIND,
    bind_all_cores,
    core_list,
    cores_of,
    cpu_flags,
    serve_dtype,
)

ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nbogomips\t: 4000\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_dtype_auto_is_float32_without_native_bfloat16() -> None:
    assert cpu_flags(ZEN3) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert serve_dtype("auto", on_gpu=False, flags=cpu_flags(ZEN3)) == "float32"
    assert serve_dtype("auto", on_gpu=False, flags=cpu_flags(SAPPHIRE)) == "auto"
    assert serve_dtype("auto", on_gpu=True, flags=set()) == "auto"
    assert serve_dtype("bfloat16", on_gpu=False, flags=set()) == "bfloat16"  # asked for: kept
    assert cpu_flags("") == set()


@pytest.mark.parametrize(
    "cores,expected",
    [([0, 1], "0-1"), ([3], "3"), ([0, 2, 3, 4, 7, 9, 10], "0,2-4,7,9-10"), ({5, 1, 2}, "1-2,5")],
)
def test_core_list(cores: list[int], expected: str) -> None:
    assert core_list(cores) == expected
    assert cores_of(expected) == sorted(set(cores))  # the parser reads back what it wrote


@pytest.mark.parametrize("spec", ["", "x", "3-1", "0,a-2"])
def test_cores_of_refuses_what_is_not_a_core_list(spec: str) -> None:
    with pytest.raises(ValueError):
        cores_of(spec)


def test_bind_all_cores_only_for_one_cpu_worker_without_a_choice() -> None:
    env: dict[str, str] = {}
    assert bind_all_cores(env, on_gpu=False, ranks=1, cores=[0, 1, 2]) == "0-2"
    assert env == {BIND: "0-2"}
    mine = {BIND: "1"}
    assert bind_all_cores(mine, on_gpu=False, ranks=1, cores=[0, 1]) is None
    assert mine == {BIND: "1"}  # the user's binding wins
    for on_gpu, ranks in ((True, 1), (False, 2)):
        env = {}
        assert bind_all_cores(env, on_gpu=on_gpu, ranks=ranks, cores=[0, 1]) is None
        assert env == {}
