"""The generation path: one request from its parsed body to its answer (``pipeline``), through
the endpoint's checks (``endpoints``), what it may cost (``capacity``, ``grammar``), its
steering (``policy``) and A/B place (``enrolment``), vLLM's own serving classes (``hosted``),
its bookkeeping (``flight``) and its stream (``streaming``)."""
