"""The engine's defaults that ``steerserve serve`` shares (server/settings.py takes them): one
place each, in a module that imports nothing heavy (the CLI prints its help without torch)."""

#: Longest prompt + completion, in tokens.
MAX_MODEL_LEN = 2048

#: Most sequences the engine batches at once.
MAX_NUM_SEQS = 64

#: The KV cache on a CPU, where vLLM cannot size it from free device memory: the embedded chat
#: model's 64 sequences of about 580 tokens in bfloat16. On a GPU none is set, so that
#: ``gpu_memory_utilization`` sizes it, as in vLLM.
CPU_KV_CACHE_MEMORY_BYTES = 1 << 30

#: The KV cache of a research engine on a CPU (tune, calibrate, evaluate): short fact prompts and
#: answers of a few tokens.
RESEARCH_KV_CACHE_MEMORY_BYTES = 512 << 20
