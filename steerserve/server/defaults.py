"""Serving limits that are not ``steerserve serve`` settings (those: settings.py), in a module that
imports nothing heavy."""

#: A request must arrive in full (head and body) this soon after its first byte (or after the
#: connection opens): a client that sends half a request is cut off with 408, not kept forever.
REQUEST_TIMEOUT_SECONDS = 30


def seqs_per_request(max_num_seqs: int, setting: int | None = None) -> int:
    """The most sequences one request may run (prompts x n, the A/B endpoint's two arms counted
    twice): ``setting``, else half the engine's seats (at least one). Below ``max_num_seqs``, one
    request never holds every seat, so vLLM's continuous batching (first come, first served)
    admits a later request at its next step, not after the whole large one."""
    return setting if setting is not None else max(1, max_num_seqs // 2)
