"""The request bodies the gateway reads and the error bodies it writes, per API.

    openai.py     OpenAI's shapes (chat, completions, responses, embeddings; error bodies,
                  rate-limit headers, JSON shape limits, the caller's deadline headers)
    anthropic.py  Anthropic's Messages API: request bodies and the error shape
    pooling.py    vLLM's pooling endpoints (rerank, score, classify), as far as they are read

Plain code: pydantic models and hand-written checks, no HTTP.
"""
