"""One request, top to bottom: the gateway's stages over one request context.

    prepare.py   identify, read, parse, count, route, estimate: nothing taken yet
    admit.py     quota, admit (and the preview's decide)
    forward.py   forward to the engine and relay its answer; learn from it
    finish.py    refuse, release, observe: however the request ended
    context.py   the request's context, and what every request reads of the runtime
    serve.py     `Pipeline.serve`: the stages in order, the end in one place; the variants

Nothing here speaks ASGI: the transport (gateway/api/openai.py) hands in an `Inbound` and a
`Client` (gateway/pipeline/inbound.py), and the forwarder writes the engine's answer through the
client's `send`. Refusals are the domain errors of gateway/errors.py; the client turns them
into HTTP.
"""

from gateway.pipeline.context import Gate, RequestContext
from gateway.pipeline.serve import PREVIEW, PROXY, Pipeline

__all__ = ["PREVIEW", "PROXY", "Gate", "Pipeline", "RequestContext"]
