"""LLM admission-control gateway: an OpenAI-compatible proxy that admits, queues or rejects
requests by their KV-cache cost so that vLLM/SGLang pools stay at the load where SLOs hold."""

__version__ = "0.1.0"
