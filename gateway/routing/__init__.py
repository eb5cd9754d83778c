"""Request -> pool -> backend: where a request goes. Plain code; no HTTP.

    router.py    model + prompt tokens -> pool; the backend orders within a pool; context length
    backends.py  each engine replica's runtime state: outstanding requests, ejection, probes
    affinity.py  which backend stored a Responses API response, so the calls naming it reach it
"""
