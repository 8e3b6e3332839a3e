"""A streamed reply as an ASGI response: its server-sent events one by one, and a cut told to the run if the client leaves."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the run is only told about a cut
    from lmcollect.agents.runs import AgentCall, AgentRun


def event_stream(events: list[bytes], run: AgentRun, call: AgentCall) -> Any:
    """The streamed reply (an ``EventStream``, a Starlette response: starlette comes with the
    ``agents`` extra, so it is imported here, when the endpoint answers, not with this module)."""
    return _event_stream_class()(events, run, call)


@functools.cache
def _event_stream_class() -> type:
    from starlette.responses import StreamingResponse

    class EventStream(StreamingResponse):
        """Sends ``events`` (the whole reply exists: it was generated before the first event) and tells
        ``run`` if the client left before the last one of ``call``'s reply was handed over
        (:meth:`AgentRun.cut_stream`).

        A client that leaves shows as a send that fails (the in-process transport raises ``OSError``
        once its reader closed the response) or as the task being cancelled.
        """

        def __init__(self, events: list[bytes], run: AgentRun, call: AgentCall) -> None:
            super().__init__(iter(()), media_type="text/event-stream", headers={"cache-control": "no-cache"})
            self.events = events
            self.run = run
            self.call = call

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            sent = 0
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    sent += 1
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # designed: the client closed the stream (the finally below records it)
                pass
            finally:
                if sent < len(self.events):
                    self.run.cut_stream(
                        self.call, f"the client left its streamed reply after {sent} of {len(self.events)} events"
                    )

    return EventStream
