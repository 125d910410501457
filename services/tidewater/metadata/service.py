"""gRPC servicers of the metadata service: MetadataService (clients) and MetadataControl
(the active controller)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from tidewater.errors import TidewaterError
from tidewater.metadata.cache import MetadataCache
from tidewater.v1 import cluster_pb2, metadata_pb2, metadata_pb2_grpc

log = logging.getLogger(__name__)


class MetadataService(metadata_pb2_grpc.MetadataServiceServicer):
    def __init__(self, cache: MetadataCache) -> None:
        self._cache = cache

    async def GetMetadata(
        self, request: metadata_pb2.GetMetadataRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.GetMetadataResponse:
        if not self._cache.ready:
            # An empty answer would read as "no brokers, no topics"; send the client elsewhere.
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "this metadata service has no cluster view from the controller yet; "
                "ask another metadata address",
            )
        return self._cache.describe(request.topics, no_topics=request.no_topics)


class MetadataControl(metadata_pb2_grpc.MetadataControlServicer):
    """Applies the controller's pushes; calls `on_first_view` once the first FULL view is in."""

    def __init__(self, cache: MetadataCache, on_first_view: Callable[[], Awaitable[None]]) -> None:
        self._cache = cache
        self._on_first_view = on_first_view

    async def UpdateMetadata(
        self, request: cluster_pb2.UpdateMetadataRequest, context: grpc.aio.ServicerContext
    ) -> cluster_pb2.UpdateMetadataResponse:
        had_view = self._cache.ready
        try:
            self._cache.apply(request)
        except TidewaterError as e:
            log.info("refused UpdateMetadata: %s", e)
            return cluster_pb2.UpdateMetadataResponse(error_code=e.code, error_message=e.message)
        if not had_view:
            log.info(
                "first cluster view applied (controller %d, epoch %d)",
                request.controller_id,
                request.controller_epoch,
            )
            await self._on_first_view()
        return cluster_pb2.UpdateMetadataResponse()
