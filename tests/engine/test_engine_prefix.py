"""Steered requests share the prompt's prefix cache up to the first steered token, nothing
steered is ever read by a request that is not steered the same way, and nothing is read across
client salts (``engine/prefix.py``).

A real engine on the tiny Llama with prefix caching on and 32-token blocks (the CPU backend's
smallest); a 300-token prompt has 9 full blocks (288 tokens) before the block that holds its
last token. Tokens are checked
against the transformers oracle or against the same request on an empty cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _engine_helpers import engine, load_hf, vectors

from steerserve.engine import prefix, spec
from steerserve.engine.spec import SteeringEntry
from steerserve.tune.reference import greedy

BLOCK = 32
SHARED = 288  # the full blocks before the one holding token 299, the last prompt token
TOKENS = 40  # 300 + 40 tokens fill block 9 (288-319): a steered block is cached
CHECKED = 12  # tokens held to the transformers oracle (full recomputation per token)


def lp(scale: float = 2.0, positions: str = "last_prompt_and_generated") -> list[dict]:
    return [{"vector": "alpha", "layer": 1, "scale": scale, "positions": positions}]


@pytest.fixture(scope="module")
def eng(tiny_llama: Path) -> Any:
    e = engine(tiny_llama, extra={"block_size": BLOCK})
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> Any:
    return load_hf(tiny_llama)


def prompt(seed: int, n: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(4, 250, (n - 1,), generator=g).tolist()


def gen(eng: Any, ids: list[int], steering: list[dict] | None) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens read from the prefix cache."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    [out] = eng.generate([ids], sp, steering=[steering])
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def solo(eng: Any, ids: list[int], steering: list[dict] | None) -> list[int]:
    """The same request on an empty prefix cache."""
    eng.llm.reset_prefix_cache()
    return gen(eng, ids, steering)[0]


def oracle(hf: Any, ids: list[int], steering: list[dict] | None) -> list[int]:
    entries = [SteeringEntry(**e) for e in steering or []]
    return greedy(hf, ids, CHECKED, entries, vectors(hf.config.hidden_size))[0]


def test_a_steered_after_unsteered_reuses_every_block_before_the_last_prompt_token(
    eng: Any, hf: Any
) -> None:
    ids = prompt(1)
    eng.llm.reset_prefix_cache()
    gen(eng, ids, None)
    toks, cached = gen(eng, ids, lp())
    assert cached == SHARED
    assert toks[:CHECKED] == oracle(hf, ids, lp())
    toks, cached = gen(eng, ids, lp(positions="generated"))
    assert cached == SHARED
    assert toks[:CHECKED] == oracle(hf, ids, lp(positions="generated"))


def test_b_nothing_steered_leaks_into_unsteered_requests(eng: Any) -> None:
    ids = prompt(2)
    eng.llm.reset_prefix_cache()
    steered, _ = gen(eng, ids, lp(scale=4.0))
    assert steered != solo(eng, ids, None)  # the steering changes the answer: the check bites
    eng.llm.reset_prefix_cache()
    gen(eng, ids, lp(scale=4.0))
    same, cached = gen(eng, ids, None)
    assert cached == SHARED and same == solo(eng, ids, None)
    # a next turn: the steered request's prompt and output, extended, asked unsteered
    eng.llm.reset_prefix_cache()
    steered, _ = gen(eng, ids, lp(scale=4.0))
    longer = ids + steered + prompt(3, 20)
    toks, cached = gen(eng, longer, None)
    assert cached == SHARED  # the steered request's blocks from token 288 on are not read
    assert toks == solo(eng, longer, None)


def test_c_two_steerings_never_share_a_block_at_or_after_the_first_steered_token(
    eng: Any,
) -> None:
    ids = prompt(4)
    eng.llm.reset_prefix_cache()
    first, _ = gen(eng, ids, lp(scale=4.0))
    longer = ids + first + prompt(5, 20)
    toks, cached = gen(eng, longer, lp(scale=-4.0))
    assert cached == SHARED
    assert toks == solo(eng, longer, lp(scale=-4.0))
    # Nor does the same steering in a next turn: its positions make the previous turn's tokens
    # prompt tokens, computed unsteered, while that turn's cached block 9 holds steered KV.
    eng.llm.reset_prefix_cache()
    first, _ = gen(eng, ids, lp(scale=4.0))
    longer = ids + first + prompt(5, 20)
    toks, cached = gen(eng, longer, lp(scale=4.0))
    assert cached == SHARED
    assert toks == solo(eng, longer, lp(scale=4.0))


def test_d_positions_all_shares_nothing(eng: Any, hf: Any) -> None:
    ids = prompt(6)
    eng.llm.reset_prefix_cache()
    gen(eng, ids, None)
    toks, cached = gen(eng, ids, lp(positions="all"))
    assert cached == 0
    assert toks[:CHECKED] == oracle(hf, ids, lp(positions="all"))


def salted(ids: list[int], salt: str | None) -> dict | list[int]:
    return ids if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}


def test_e_a_client_salt_isolates_steered_requests_too(eng: Any) -> None:
    """Every row of the probe's table: blocks are shared only within one client salt."""
    ids = prompt(7)
    rows = [  # (first, its salt, its steering), (second, ...), cached tokens the second reads
        (("alice", lp()), ("bob", lp()), 0),
        (("alice", lp()), (None, None), 0),
        (("alice", lp(positions="all")), ("bob", lp(positions="all")), 0),
        (("alice", lp(positions="generated")), ("bob", lp(positions="generated")), 0),
        (("alice", None), ("bob", None), 0),
        ((None, None), ("alice", lp()), 0),
        (("alice", None), ("alice", lp()), SHARED),  # one tenant still shares its prefix
        (("alice", lp()), ("alice", None), SHARED),
        (("alice", lp()), ("alice", lp()), SHARED),
    ]
    for (s1, st1), (s2, st2), want in rows:
        eng.llm.reset_prefix_cache()
        gen(eng, salted(ids, s1), st1)
        _, cached = gen(eng, salted(ids, s2), st2)
        assert cached == want, ((s1, st1), (s2, st2))


#: Salts a client may send (vLLM's validator allows them): ours in form once, hostile, long.
HOSTILE_SALTS = [
    "steer-x:boom",
    "steer-abc:-1",
    "steer-abc:-999999999999999999999",
    "steer-:",
    "steer-0123456789abcdef0123456789abcdef:last",
    "0123456789abcdef0123456789abcdef:gen",
    ":",
    "unshared:x",
    "s" * 128,
    "日本語:-1",
]


def test_f_no_client_salt_reaches_our_parser(eng: Any) -> None:
    """The probe's engine killer and a seeded fuzz of salts: each request fills a block (where
    the scheduler hashes), the engine answers every one, and a salt never reads unsalted KV."""
    import random

    rng = random.Random(0)
    alphabet = "steer-:0123456789abcdef-+ .@/\\x\u00e9"
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(20)]
    ids = prompt(8)
    for salt in HOSTILE_SALTS + fuzz:
        eng.llm.reset_prefix_cache()
        gen(eng, ids, None)
        toks, cached = gen(eng, salted(ids, salt), None)
        assert cached == 0, salt
        assert len(toks) == TOKENS, salt
    _, cached = gen(eng, ids, None)  # alive, and its unsalted blocks still shared
    assert cached >= SHARED


def test_the_key_names_the_first_steered_token_and_is_parsed_only_in_its_form() -> None:
    e = [SteeringEntry("a", 1, 2.0, "generated")]
    assert spec.first_steered(e) == 0 and prefix.key(e, {}).endswith(":gen")
    e.append(SteeringEntry("b", 2, 1.0, "last_prompt_and_generated"))
    assert spec.first_steered(e) == -1 and prefix.key(e, {}).endswith(":last")
    e.append(SteeringEntry("c", 3, 1.0, "all"))
    assert spec.first_steered(e) is None and prefix.key(e, {}).endswith(":all")
    k = prefix.key(e[:2], {})
    assert prefix.parse(k) == (k[:32], -1)
    well_formed = [s for s in HOSTILE_SALTS if prefix.parse(s)]  # harmless: salts are not keys
    assert well_formed == ["0123456789abcdef0123456789abcdef:gen"]
    for bad in [None, 3, b"x", k + " ", k.upper(), k[:-5] + ":-1", "steer-" + k]:
        assert prefix.parse(bad) is None, bad


def fake_request(extra: Any, n: int = 300) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        sampling_params=SimpleNamespace(extra_args=extra),
        num_prompt_tokens=n,
        request_id="r1",
        cache_salt=None,
    )


def test_the_scheduler_side_never_raises_and_shares_nothing_it_cannot_read() -> None:
    k = prefix.key([SteeringEntry("a", 1, 2.0, "last_prompt_and_generated")], {})
    assert prefix.steering_key(fake_request({prefix.KEY: k, spec.EXTRA_ARGS_KEY: "[]"})) == (
        k[:32],
        299,
    )
    assert prefix.steering_key(fake_request(None)) is None  # unsteered: vLLM's own rule
    assert prefix.steering_key(fake_request({"other": 1})) is None
    for bad in ["steer-x:boom", 7, None, "x" * 10_000]:  # steered, key unreadable: own key at 0
        got = prefix.steering_key(fake_request({spec.EXTRA_ARGS_KEY: "[]", prefix.KEY: bad}))
        assert got == ("unshared:r1", 0), bad
    assert prefix.steering_key(object()) is None  # a shape we do not know


def test_a_vllm_that_hashes_otherwise_is_refused() -> None:
    def no_salt(request: Any, start: int, end: int, mm: int) -> Any:
        return None, mm

    with pytest.raises(RuntimeError, match="block hashing differs"):
        prefix._probe(no_salt)
    with pytest.raises(RuntimeError, match="block hashing changed"):
        prefix._probe(lambda request, start, end: (None, 0))
    from vllm.v1.core import kv_cache_utils

    fn = kv_cache_utils.generate_block_hash_extra_keys
    prefix._probe(getattr(fn, "__wrapped__", fn))  # the installed vLLM's own passes
