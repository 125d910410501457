"""Registering a service's generated handlers on a server, with requests that do not decode
answered INVALID_ARGUMENT.

gRPC hands a request's bytes to the generated deserializer; one that raises (bytes that are
not the message: a client of another version's protos, a broken proxy) reached the client as
UNKNOWN "Unexpected DecodeError" and left a traceback in the service's log, and on a
ProduceStream or FetchStream it ended the stream with the requests read before it unanswered
(review 32 #8: an acks=all batch was committed, its answer lost). Here such a request gets
INVALID_ARGUMENT naming the message type; a stream stops reading there, answers every
request it read before, then ends with that status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

# A handler as generated code registers it, by method name.
Handlers = dict[str, grpc.RpcMethodHandler]


class _Registration:
    """Stands in for the server while generated code registers a service's handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: Handlers = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: Handlers) -> None:
        self.service, self.handlers = service, handlers


def add_service(
    add_to_server: Callable[[Any, Any], None],
    servicer: object,
    server: grpc.aio.Server,
    adjust: Callable[[Handlers], None] = lambda handlers: None,
) -> None:
    """Register `servicer` as `add_to_server` (the generated add_..._to_server) would, its
    handlers first changed by `adjust` (in place), each checking that requests decode."""
    registration = _Registration()
    add_to_server(servicer, registration)
    handlers = registration.handlers
    adjust(handlers)
    checked = {method: _checked(handler) for method, handler in handlers.items()}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(registration.service, checked),)
    )
    server.add_registered_method_handlers(registration.service, checked)


class _Undecodable:
    """What the deserializer made of bytes that are not the message."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler

    def lenient(raw: bytes) -> object:
        try:
            return deserialize(raw)
        except Exception as e:  # protobuf's DecodeError, the lifter's: bytes, not a bug
            return _Undecodable(e)

    def refusal(request: _Undecodable) -> str:
        return f"the request does not decode as the method's message: {request.error}"

    # Generated handlers are namedtuples.
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: object, context: grpc.aio.ServicerContext) -> object:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
            return await unary(request, context)

        return handler._replace(request_deserializer=lenient, unary_unary=unary_unary)  # type: ignore[attr-defined,no-any-return]
    if handler.stream_stream is not None:
        stream = handler.stream_stream

        async def stream_stream(
            requests: AsyncIterator[object], context: grpc.aio.ServicerContext
        ) -> None:
            refused: list[_Undecodable] = []

            async def decoded() -> AsyncIterator[object]:
                async for request in requests:
                    if isinstance(request, _Undecodable):
                        refused.append(request)
                        return
                    yield request

            await stream(decoded(), context)
            if refused:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(refused[0]))

        return handler._replace(request_deserializer=lenient, stream_stream=stream_stream)  # type: ignore[attr-defined,no-any-return]
    return handler
