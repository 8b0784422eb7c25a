"""Serving defaults shared by the CLI and ``ServerSettings``: one place for each, in a module
that imports nothing heavy (the CLI must not load the server or vLLM to print its help)."""

#: On SIGTERM/SIGINT: how long requests in flight may finish before the server stops.
DRAIN_SECONDS = 300

#: Idle HTTP connections are kept this long: longer than a proxy's idle timeout (60 s is common)
#: and a busy client's lag, so the server never closes a connection a client is reusing
#: (uvicorn's 5 s: 298 client ReadErrors in 3 min of bench/load.py at load 10; 75 s: 0).
KEEP_ALIVE_SECONDS = 75

#: A request must arrive in full (head and body) this soon after its first byte (or after the
#: connection opens): a client that sends half a request is cut off with 408, not kept forever.
REQUEST_TIMEOUT_SECONDS = 30


def seqs_per_request(max_num_seqs: int, setting: int | None = None) -> int:
    """The most sequences one request may run (prompts x n, the A/B endpoint's two arms counted
    twice): ``setting``, else half the engine's seats (at least one). Below ``max_num_seqs``, one
    request never holds every seat, so vLLM's continuous batching (first come, first served)
    admits a later request at its next step, not after the whole large one."""
    return setting if setting is not None else max(1, max_num_seqs // 2)
