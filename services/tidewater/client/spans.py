"""The producer's spans of one batch (README, Tracing): `send <topic>` from the batch's first
record to its final ack or failure, and `batch.wait` for its time in the accumulator. Retries
send the same trace context, so every attempt's `Produce` on a leader is a child of `send`.

`send` is made as the brokers' data-path spans are (tracing.start_span): sampled by the
tracer's sampler on the caller's current span, handed to the provider's processors when it
ends. A batch sampled out makes no span object, only the context its requests carry; outside
any span of the application's, with the SDK's ratio sampler and ids, none: the producer's
streams declared its constant one (tracing.NewTraces), as a follower's fetcher does."""

from __future__ import annotations

from collections.abc import MutableMapping

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from tidewater.telemetry import tracing


class BatchTrace:
    __slots__ = ("carrier", "span", "tracer")

    def __init__(
        self, tracer: Tracer, new_traces: tracing.NewTraces, topic: str, partition: int, acks: int
    ) -> None:
        self.tracer = tracer
        # What each attempt's request carries in PartitionProduceData.trace_context.
        self.carrier: dict[str, str] = {}
        self.span = tracing.start_span(
            f"send {topic}",
            SpanKind.PRODUCER,
            otel_context.get_current(),
            # Made only for a span: most batches are sampled out at a low ratio.
            lambda: {
                **tracing.operation_attributes("send"),
                "messaging.destination.name": topic,
                "messaging.destination.partition.id": str(partition),
                "tidewater.acks": acks,
            },
            carrier=self.carrier,
            tracer=tracer,
            new_traces=new_traces,
        )

    def part(self) -> BatchTrace:
        """The trace of one part of this batch split after MESSAGE_TOO_LARGE: its attempts
        carry this batch's context (their Produce spans are children of this `send`), and it
        records nothing of its own; this batch's span ends once every part is done (review 25
        M2: the parts went in no trace, and `send` ended with no offset)."""
        part = BatchTrace.__new__(BatchTrace)
        part.tracer, part.carrier, part.span = self.tracer, self.carrier, None
        return part

    def carry(self, trace_context: MutableMapping[str, str]) -> None:
        """Writes the batch's context into an attempt's PartitionProduceData.trace_context.
        Key by key: a protobuf map's update() goes through Python's MutableMapping, twice
        the time (a sampled batch carries one key, its traceparent; most carry none)."""
        for key, value in self.carrier.items():
            trace_context[key] = value

    def drained(self) -> None:
        """The batch leaves the accumulator for its first attempt."""
        if self.span is not None:
            tracing.record_child(self.span, "batch.wait", self.span.start_time, tracer=self.tracer)

    def end(
        self, records: int, size: int, base_offset: int | None, error: BaseException | None
    ) -> None:
        span = self.span
        if span is None:
            return  # sampled out: nothing recorded
        span.set_attributes(
            {"messaging.batch.message_count": records, "tidewater.batch.bytes": size}
        )
        if base_offset is not None:
            span.set_attribute("tidewater.base_offset", base_offset)
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()
