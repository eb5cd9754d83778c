"""The one seam to the engines: forwarding a request and relaying its answer.

    forward.py        Forwarder: picks the backend, sends, relays the answer (whole or as a
                      stream of SSE events); Upstream in (what to send), Relay out (what the
                      engine did)
    base.py           the client protocol (`Client`, `Answer`) both clients keep
    native.py         the gateway's own HTTP/1.1 client, for plain http:// engines
    aio.py            aiohttp's, for the rest, and the pass-through endpoints' whole answers
    errors.py         what an engine did, as the gateway's own exceptions
    sse.py            an answer read by whole events; usage from its JSON
    silence.py        one timer for every stream's silence
    engine_errors.py  engines' error bodies and events in OpenAI's shape

Nothing is re-exported here: the backends' probes use aio.py's helpers, and forward.py uses the
backends, so a package that imported forward.py would close that circle.
"""
