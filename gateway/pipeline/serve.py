"""`serve`: one request through its stages, in order, and its end in one place.

A variant is a choice of stages over the same context (SGLang's model gateway builds its
request paths the same way: routers/grpc/pipeline.rs): the proxy prepares, takes the quota,
admits and forwards; the preview (`/gateway/estimate`) prepares and asks admission what it
would decide, taking nothing. Whatever ends a served request (its answer, a refusal, the
caller leaving, an engine failing, a bug), what it took is released and it is observed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.errors import GatewayError, InternalError, ServerBusy
from gateway.pipeline.admit import admit, decide, quota
from gateway.pipeline.context import Gate, RequestContext, Shared, Stage
from gateway.pipeline.finish import observe, refuse, release
from gateway.pipeline.forward import forward
from gateway.pipeline.inbound import Client, Inbound
from gateway.pipeline.prepare import prepare
from gateway.runtime import Runtime
from gateway.upstream.forward import ClientGone

log = logging.getLogger("gateway.api")

PROXY: tuple[Stage, ...] = (prepare, quota, admit, forward)
PREVIEW: tuple[Stage, ...] = (prepare, decide)


class Pipeline:
    """The stages over one runtime (the policy in force and what it built)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.shared = Shared(rt)

    async def serve(self, inbound: Inbound, client: Client, watch: bool = False,
                    gate: Gate | None = None, stages: tuple[Stage, ...] = PROXY) -> None:
        """The whole request; the caller gets an answer in OpenAI's error shape for anything
        but a full answer. `gate`: counted in it while served, refused if it is full."""
        sh, ctx = self.shared, RequestContext(inbound, client, watch, timed=True)
        if gate is not None:
            gate.open += 1  # then at once into the `try` whose `finally` uncounts it
        try:
            if gate is not None and gate.open > gate.cap:
                raise ServerBusy("The gateway is handling as many requests as it is "
                                 "configured to; retry shortly.", retry_after_s=1.0)
            for stage in stages:
                await stage(sh, ctx)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not client.gone or task is None:
                raise
            task.uncancel()  # the caller left: handled here, not an error of ours
        except ClientGone:
            pass
        except GatewayError as err:
            await refuse(sh, ctx, err)
        except Exception:
            log.exception("unexpected error in request %s", inbound.request_id)
            await refuse(sh, ctx, InternalError(
                f"Internal gateway error (request id {inbound.request_id})."))
        finally:
            if gate is not None:
                gate.open -= 1
            client.detach()
            await release(sh, ctx)
        observe(sh, ctx)

    async def preview(self, inbound: Inbound, client: Client) -> dict[str, Any]:
        """What `serve` would do with this request now; its refusals raised as they are."""
        ctx = RequestContext(inbound, client)
        for stage in PREVIEW:
            await stage(self.shared, ctx)
        assert ctx.preview is not None
        return ctx.preview
