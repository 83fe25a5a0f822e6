"""uvicorn's HTTP/1.1 protocol with a deadline on each request's headers (slowloris).

uvicorn times out idle keep-alive connections only, and any byte received disarms that
timer: a client that opens a connection and sends its request line and headers a byte
now and then holds the connection (and its memory) forever. The request *body* has its
own deadline in the middleware (``PLANNER_BODY_TIMEOUT_S``); this module closes a
connection whose next request's headers are not complete ``header_timeout_s`` after the
connection opened or the previous response ended (``PLANNER_HEADER_TIMEOUT_S``).

There is no answer to send: the request line may not even have arrived. The connection is
closed, as nginx's ``client_header_timeout`` does for an incomplete request line.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineH11(H11Protocol):
    """``H11Protocol`` that closes a connection whose request headers are late.

    The subclass made by ``protocol_with_header_timeout`` sets ``header_timeout_s``.
    """

    header_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A new request cycle starts when h11 has parsed the request line and headers.
        if self._header_timer is not None and self.cycle is not self._waiting_cycle:
            self._header_timer.cancel()
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's headers, on a kept-alive connection (unless a pipelined
        # request already started a new cycle).
        if not self.transport.is_closing() and self._header_timer is None and self._between_requests():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._waiting_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_cycle and self._between_requests() \
                and not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_timeout(header_timeout_s: float) -> type[HeaderDeadlineH11]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this header deadline."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})
