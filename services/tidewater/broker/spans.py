"""The broker's spans of the data path (README, Tracing). Callers make them only while
`tracing.ENABLED`; with tracing off none of this runs. Each `start()` returns None for a
request that is sampled out: the handler then runs as with tracing off.

Stages that are plain stretches of a handler (log.append, log.read, fetch.wait,
replication.wait) are recorded afterwards from two timestamps (`tracing.record_child`) rather
than entered as context managers, so the handlers keep one shape whether they trace or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
)

from tidewater.broker.fetch_answer import FetchAnswer
from tidewater.errors import NO_ERROR
from tidewater.records.header import read_header
from tidewater.telemetry import tracing
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

TopicPartition = tuple[str, int]
CONSUMER_REPLICA_ID = -1
# The leader's own new traces: a batch or fetch that carries no context on a stream that
# declared none (a client that does not trace) starts one, which this broker's sampler decides
# on. With the SDK's ratio sampler and ids, one sampled out then costs 64 random bits: no
# attributes, ids or Context (tracing.NewTraces; its constant is never sent from here).
_NEW_TRACES = tracing.NewTraces()


def messaging_attributes(topic: str, partition: int, operation: str) -> dict[str, Any]:
    """The OTel messaging semantic conventions' attributes of a partition; `operation`:
    produce or fetch."""
    return {
        **tracing.operation_attributes(operation),
        "messaging.destination.name": topic,
        "messaging.destination.partition.id": str(partition),
    }


def outcome(code: int, message: str) -> tuple[dict[str, Any], Status]:
    """A span's attributes and status for a response's error code (none for NONE)."""
    if code == NO_ERROR:
        return {}, tracing.UNSET
    return {"tidewater.error_code": ErrorCode.Name(code)}, Status(StatusCode.ERROR, message)


def end_with_error(span: tracing.DeferredSpan, code: int, message: str) -> None:
    attributes, status = outcome(code, message)
    if attributes:
        span.set_attributes(attributes)
        span.set_status(status)
    span.end()


class _Traced:
    """A recorded span in progress, the parent of the stretches recorded in it."""

    __slots__ = ("span",)

    def __init__(self, span: tracing.DeferredSpan) -> None:
        self.span = span

    def __enter__(self) -> _Traced:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: Any
    ) -> None:
        """Ends the span, whatever ended the stretch it times (a cancellation too)."""
        if error is not None:
            self.abandon(error)
        else:
            self.span.end()

    def failed(self, error: BaseException) -> None:
        self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

    def abandon(self, error: BaseException) -> None:
        """End for a handler that raised (cancelled at shutdown, say): the span still counts."""
        self.failed(error)
        self.span.end()


class ProduceTrace(_Traced):
    """One partition batch of a Produce on the leader: the `Produce` SERVER span, child of the
    producer's `send` span through the batch's trace_context."""

    __slots__ = ()

    @classmethod
    def start(
        cls,
        data: pb.PartitionProduceData,
        acks: int,
        metadata: Any,
        declared: SpanContext | None = None,
    ) -> ProduceTrace | None:
        """`metadata`: a unary call's; `declared`: its stream's sampled-out parent (see
        tracing.extract)."""
        parent = tracing.extract(data.trace_context, metadata, declared)
        if parent is None:
            return None

        def attributes() -> dict[str, Any]:
            made = messaging_attributes(data.topic, data.partition, "produce")
            made["tidewater.acks"] = acks
            return made

        span = tracing.start_span(
            "Produce", SpanKind.SERVER, parent, attributes, new_traces=_NEW_TRACES
        )
        return None if span is None else cls(span)

    def appended(
        self, batch: bytearray, base_offset: int, leader_epoch: int, start_ns: int
    ) -> None:
        tracing.record_child(self.span, "log.append", start_ns)
        header = read_header(batch)
        self.span.set_attributes(
            {
                "messaging.batch.message_count": header.record_count,
                "tidewater.batch.bytes": len(batch),
                "tidewater.base_offset": base_offset,
                "tidewater.leader_epoch": leader_epoch,
            }
        )

    @classmethod
    def start_all(
        cls, request: pb.ProduceRequest, metadata: Any, declared: SpanContext | None
    ) -> list[ProduceTrace | None] | None:
        """The traces of a produce's partition batches, in order; None, and nothing made, when
        none is traced. On a stream that declared its sampled-out parent, a batch that carries
        no context is looked at no further: at a low ratio that is nearly every batch."""
        traces: list[ProduceTrace | None] | None = None
        skips_bare = tracing.skips_bare(declared)
        for i, data in enumerate(request.partitions):
            if skips_bare and not data.trace_context:
                continue
            produce = cls.start(data, request.acks, metadata, declared)
            if produce is not None:
                if traces is None:
                    traces = [None] * len(request.partitions)
                traces[i] = produce
        return traces

    def end(self, result: pb.PartitionProduceResponse) -> None:
        end_with_error(self.span, result.error_code, result.error_message)


class ReplicationWait:
    """`replication.wait` of one acks=all batch: from after its append until the HW covers it.
    Each follower's first fetch that shows it holds the batch becomes a link, in order, until
    one moves the HW past it: that one is the follower the ack waited for. When something
    else moved the HW (the ISR shrank without a lagging follower), none is named (review 25
    M5: the last follower linked was named, though the ack waited for the one dropped)."""

    __slots__ = (
        "_completed_by",
        "_followers",
        "_links",
        "_produce",
        "_start_ns",
        "required_offset",
    )

    def __init__(self, produce: ProduceTrace, required_offset: int) -> None:
        self._produce = produce
        self.required_offset = required_offset
        self._start_ns = time.time_ns()
        self._links: list[Link] = []
        self._followers: list[int] = []
        self._completed_by: int | None = None

    def follower_fetched(
        self,
        follower_id: int,
        fetch_offset: int,
        high_watermark: int,
        fetch: Callable[[], SpanContext],
    ) -> None:
        """`high_watermark`: the partition's after the fetch."""
        if self._completed_by is not None:
            return  # the ack waits no more: later fetches are none of its story
        if fetch_offset >= self.required_offset and follower_id not in self._followers:
            self._followers.append(follower_id)
            if high_watermark >= self.required_offset:
                self._completed_by = follower_id
            context = fetch()
            if context.is_valid:  # a follower that does not trace sends no context
                self._links.append(
                    Link(
                        context,
                        {
                            "tidewater.follower_id": follower_id,
                            "tidewater.fetch_offset": fetch_offset,
                        },
                    )
                )

    def end(self, high_watermark: int, code: int, message: str) -> None:
        attributes, status = outcome(code, message)
        attributes["tidewater.hw"] = high_watermark
        if self._completed_by is not None:
            attributes["tidewater.last_follower_id"] = self._completed_by
        tracing.record_child(
            self._produce.span,
            "replication.wait",
            self._start_ns,
            attributes,
            links=self._links,
            status=status,
        )


class ReplicationWaits:
    """The acks=all batches of a leader still waiting, per partition, to link the follower
    fetches that complete them."""

    def __init__(self) -> None:
        self._waiting: dict[TopicPartition, list[ReplicationWait]] = {}

    def __bool__(self) -> bool:
        """Whether any batch waits: only then is a follower's fetch looked at for a link."""
        return bool(self._waiting)

    def start(
        self,
        partitions: Iterable[pb.PartitionProduceData],
        traces: Iterable[ProduceTrace | None],
        waiting: dict[TopicPartition, int],
    ) -> dict[TopicPartition, ReplicationWait]:
        """The waits of a produce's traced batches that acks=all holds (`waiting`: the offset
        each must reach), from now on."""
        waits = {}
        for data, produce in zip(partitions, traces, strict=True):
            tp = (data.topic, data.partition)
            if produce is not None and tp in waiting:
                waits[tp] = ReplicationWait(produce, waiting[tp])
                self._waiting.setdefault(tp, []).append(waits[tp])
        return waits

    def finish(
        self,
        waits: dict[TopicPartition, ReplicationWait],
        response: pb.ProduceResponse,
        high_watermark: Callable[[TopicPartition], int],
    ) -> None:
        """Stop linking fetches to `waits`, and end them with the produce's outcome."""
        for tp, wait in waits.items():
            pending = self._waiting[tp]
            pending.remove(wait)
            if not pending:
                del self._waiting[tp]
        for result in response.partitions:
            tp = (result.topic, result.partition)
            if tp in waits:
                waits[tp].end(high_watermark(tp), result.error_code, result.error_message)

    def follower_fetched(
        self,
        tp: TopicPartition,
        follower_id: int,
        fetch_offset: int,
        high_watermark: int,
        fetch: Callable[[], SpanContext],
    ) -> None:
        """`fetch`: the fetch's context to link (fetch_link), asked only for a link;
        `high_watermark`: the partition's after the fetch."""
        for wait in self._waiting.get(tp, ()):
            wait.follower_fetched(follower_id, fetch_offset, high_watermark, fetch)


def fetch_link(
    request: pb.FetchRequest,
    fetch_trace: FetchTrace | None,
    declared: SpanContext | None = None,
) -> Callable[[], SpanContext]:
    """What replication.wait links for a follower's fetch: the leader's `Fetch` span when the
    fetch is traced; else the sampled-out context the fetch carries or, carrying none, the
    one its stream `declared`: mostly its fetcher's constant (tracing.NewTraces). No span of
    it is exported, but the link's attributes still name the follower and the fetch's
    offset, at any sampling ratio. Read only when a traced produce waits on the fetch's
    partition."""
    if fetch_trace is not None:
        return lambda: fetch_trace.span_context
    return lambda: tracing.carried_span_context(request.trace_context, declared)


class FetchTrace(_Traced):
    """The leader's `Fetch` SERVER span of one fetch request, with `log.read` and `fetch.wait`."""

    __slots__ = ()

    @classmethod
    def start(
        cls, request: pb.FetchRequest, metadata: Any, declared: SpanContext | None = None
    ) -> FetchTrace | None:
        """`metadata`: a unary call's; `declared`: its stream's sampled-out parent (see
        tracing.extract, which answers a fetch carrying no context on such a stream at
        once)."""
        parent = tracing.extract(request.trace_context, metadata, declared)
        if parent is None:
            return None

        def attributes() -> dict[str, Any]:
            made: dict[str, Any] = {
                **tracing.operation_attributes("fetch"),
                "tidewater.partitions": len(request.partitions),
            }
            if request.replica_id != CONSUMER_REPLICA_ID:
                made["tidewater.follower_id"] = request.replica_id
            elif len(request.partitions) == 1:
                fp = request.partitions[0]
                made.update(messaging_attributes(fp.topic, fp.partition, "fetch"))
            return made

        span = tracing.start_span(
            "Fetch", SpanKind.SERVER, parent, attributes, new_traces=_NEW_TRACES
        )
        return None if span is None else cls(span)

    @property
    def span_context(self) -> SpanContext:
        return self.span.get_span_context()

    def read(self, start_ns: int, size: int) -> None:
        tracing.record_child(self.span, "log.read", start_ns, {"tidewater.bytes": size})

    def waited(self, start_ns: int) -> None:
        tracing.record_child(self.span, "fetch.wait", start_ns)

    def answered(self, size: int) -> None:
        """The bytes of the read answered (counted by the read: reading the response's bytes
        fields again would copy them)."""
        self.span.set_attribute("tidewater.bytes", size)

    def end(self, response: FetchAnswer) -> None:
        end_with_error(self.span, response.error_code, response.error_message)


class ReplicaFetchTrace(_Traced):
    """A follower's `replica.fetch` CLIENT span of one fetch request to its leader, carried to
    the leader in the request's trace_context; `log.append` per partition it appends."""

    __slots__ = ()

    @classmethod
    def start(
        cls, request: pb.FetchRequest, leader_id: int, new_traces: tracing.NewTraces
    ) -> ReplicaFetchTrace | None:
        """Sampled out, the request carries a not sampled context of its own to the leader;
        with the SDK's ratio or always-off sampler and ids, none: its stream declared the
        fetcher's constant (`new_traces`, see tracing.NewTraces)."""
        # A new trace: a fetch is nobody's child (the produce it serves links to it). The
        # invalid parent says so without a Context to look into (0.3 us per fetch).
        span = tracing.start_span(
            "replica.fetch",
            SpanKind.CLIENT,
            INVALID_SPAN_CONTEXT,
            lambda: {
                "messaging.system": tracing.MESSAGING_SYSTEM,
                "tidewater.follower_id": request.replica_id,
                "tidewater.leader_id": leader_id,
                "tidewater.partitions": len(request.partitions),
            },
            carrier=request.trace_context,
            new_traces=new_traces,
        )
        return None if span is None else cls(span)

    def appended(self, tp: TopicPartition, size: int, start_ns: int) -> None:
        attributes = messaging_attributes(tp[0], tp[1], "fetch")
        attributes["tidewater.bytes"] = size
        tracing.record_child(self.span, "log.append", start_ns, attributes)
