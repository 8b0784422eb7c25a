"""steerserve: inference-time multilingual factual-recall steering for vLLM."""

__version__ = "0.1.0"
