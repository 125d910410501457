"""OpenTelemetry tracing for every Tidewater process: the tracer provider, its exporters,
gRPC interceptors and W3C trace context in messages.

Tracing is on in a process once `setup()` found somewhere to send spans: `--trace-file PATH`
(OTLP/JSON lines) and/or an OTLP endpoint from the standard variables
(`OTEL_TRACES_EXPORTER=otlp`, `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; protocol from `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`,
grpc or http/protobuf). The SDK reads the sampler (`OTEL_TRACES_SAMPLER`, `_ARG`; default
parent-based always-on) and the batch processor's `OTEL_BSP_*` itself. Off, nothing is
installed: `ENABLED` stays False and the callers skip every span, so a request costs one
boolean test.

The SDK client does not call setup(): like any OTel-instrumented library it traces when the
application has installed a tracer provider (`client_tracer()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import re
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from random import getrandbits
from typing import Any, NamedTuple, TypeVar

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TraceState,
)

from tidewater.telemetry.otlp_file import (
    UNSET,
    OtlpJsonFileSpanExporter,
    OtlpJsonFileSpanProcessor,
    encode_fields,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# True once setup() installed a provider in this process.
ENABLED = False
SCOPE = "tidewater"
BROKER_ID = "tidewater.broker.id"
# Streams that carry many batches or fetches: their spans are made per message by the broker
# and the clients (trace_context in the messages), not per call by the interceptors. Unary
# Produce and Fetch are traced the same way, so every produce and fetch has one span shape.
# The streams must stay out of the server interceptor in any case: its stream wrapper takes
# an async generator, and their handlers (rpc.handlers' wrappers too) are coroutines.
DATA_PLANE_METHODS = frozenset({"Produce", "ProduceStream", "Fetch", "FetchStream"})
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")
MESSAGING_SYSTEM = "tidewater"
TRACEPARENT = "traceparent"
# The gRPC metadata with which a data-plane stream (ProduceStream, FetchStream) declares, once
# when it opens, the parent of each of its messages that carries no traceparent: a W3C
# traceparent whose sampled flag is clear (NewTraces.metadata). Its sampled-out batches and
# fetches then carry nothing, and a broker reads nothing of them (README, Tracing).
SAMPLED_OUT_PARENT = "tidewater-sampled-out-parent"
W3C_FIELDS = frozenset({TRACEPARENT, "tracestate", "baggage"})
_TRACE_ID_LOW_BITS = TraceIdRatioBased.TRACE_ID_LIMIT
_TRACEPARENT_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACE_FLAGS = {flags.to_bytes(1).hex(): TraceFlags(flags) for flags in range(256)}

_provider: TracerProvider | None = None
_FOLLOWS_SAMPLED_OUT_PARENTS = False
# The propagators last asked about, and whether they are the W3C ones alone.
_W3C_PROPAGATION: tuple[object, bool] = (None, False)
# The services' tracer; meaningful only while ENABLED.
TRACER: Tracer = trace.get_tracer(SCOPE)


def setup(
    service_name: str,
    trace_file: Path | None = None,
    attributes: Mapping[str, str | int] | None = None,
) -> bool:
    """Install the process's tracer provider when spans have somewhere to go; returns whether
    tracing is on. `service_name` yields to OTEL_SERVICE_NAME only for clients."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporters(trace_file)
    if not exporters:
        return False
    resource_attributes: dict[str, Any] = {
        "service.instance.id": str(uuid.uuid4()),
        **(attributes or {}),
    }
    if not (service_name == "tidewater-client" and os.environ.get("OTEL_SERVICE_NAME")):
        resource_attributes["service.name"] = service_name
    provider = TracerProvider(resource=Resource.create(resource_attributes))
    processors = [_processor(exporter) for exporter in exporters]
    for processor in processors:
        provider.add_span_processor(processor)
    # Global too, so that application code in a client process shares it.
    trace.set_tracer_provider(provider)
    install(provider)
    return True


def install(provider: TracerProvider) -> None:
    """Trace this process's services through `provider` (setup() does it; tests give one
    with an in-memory exporter)."""
    global ENABLED, TRACER, _provider, _FOLLOWS_SAMPLED_OUT_PARENTS
    _provider = provider
    TRACER = provider.get_tracer(SCOPE)
    _FOLLOWS_SAMPLED_OUT_PARENTS = _follows_sampled_out_parents(provider.sampler)
    ENABLED = True


def _follows_sampled_out_parents(sampler: Sampler) -> bool:
    """Whether `sampler` drops every span whose remote parent was sampled out, as the
    parent-based samplers (OTEL_TRACES_SAMPLER=parentbased_*, the default) do. Then such a
    message costs its receiver one look at its traceparent's flags (extract())."""
    remote = SpanContext(1, 1, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    return (
        isinstance(sampler, ParentBased)
        and not sampler.should_sample(parent, 1, "probe").decision.is_recording()
    )


def shutdown() -> None:
    """Export what is buffered; a process calls this on its way out."""
    global ENABLED, _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = None
    ENABLED = False


def _processor(exporter: SpanExporter) -> SpanProcessor:
    """The trace file's own processor (see OtlpJsonFileSpanProcessor), else the SDK's batch
    span processor."""
    if isinstance(exporter, OtlpJsonFileSpanExporter):
        return OtlpJsonFileSpanProcessor(exporter)
    return BatchSpanProcessor(exporter)


def _exporters(trace_file: Path | None) -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    if trace_file is not None:
        trace_file.parent.mkdir(parents=True, exist_ok=True)
        exporters.append(OtlpJsonFileSpanExporter(trace_file))
    names = {n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n}
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if "none" not in names and ("otlp" in names or endpoint):
        exporters.append(_otlp_exporter())
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters.append(ConsoleSpanExporter())
    return exporters


def _otlp_exporter() -> SpanExporter:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r}: use grpc or http/protobuf")


def client_tracer(provider: trace.TracerProvider | None = None) -> Tracer | None:
    """The SDK's tracer: from `provider` (the client's tracer_provider argument), else from
    the one the application (or setup()) installed, else None: without a provider the
    client makes no span at all."""
    provider = provider or _provider or trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        return provider.get_tracer("tidewater.client")
    return None


# -- spans of the services ----------------------------------------------------------------


# The operation type (OTel's messaging semantic conventions) of each operation name.
OPERATION_TYPES = {"produce": "send", "fetch": "receive", "send": "send", "poll": "receive"}


def operation_attributes(name: str) -> dict[str, Any]:
    """messaging.system and the operation's name and type (semantic conventions 1.27+, which
    require the name; review 25 L3)."""
    return {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.name": name,
        "messaging.operation.type": OPERATION_TYPES[name],
    }


def detached_task(coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """A long-lived task (a sender's, a fetcher's) outside the trace its creator is in: created
    in a span (the heartbeat that unfenced a broker, a LeaderAndIsr, the first send()), it
    would make every span of its later work that span's child, long after it ended (review 25
    M1). Its own spans start new traces, or follow what it carries in its requests."""
    return asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Span | None]:
    """A span around a block, current inside it (so the calls it makes are its children);
    yields None, and makes nothing, while tracing is off."""
    if not ENABLED:
        yield None
        return
    with TRACER.start_as_current_span(name, attributes=attributes) as current:
        yield current


def record(
    name: str,
    start_ns: int,
    parent: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A finished INTERNAL span from `start_ns` to now, for a stretch already timed."""
    done = TRACER.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    done.end()


def record_child(
    parent: Span | DeferredSpan,
    name: str,
    start_ns: int,
    attributes: dict[str, Any] | None = None,
    links: Sequence[Link] = (),
    status: Status = UNSET,
    tracer: Tracer | None = None,
) -> None:
    """A finished INTERNAL child of `parent` from `start_ns` to now, for a stretch already
    timed; nothing when `parent` is not recorded.

    Handed to the span processors as a finished ReadableSpan (or straight to the trace file,
    _hand_over) rather than started and ended through `tracer` (TRACER by default): that
    costs ~15 us of sampling, attribute limits and locks per span, this ~3, on a hot path
    that makes several such spans per batch. A child of a recorded span is recorded, as
    Tidewater's parent-based samplers decide anyway."""
    if not parent.is_recording():
        return
    sdk_tracer: Any = tracer or TRACER
    parent_context = parent.get_span_context()
    _hand_over(
        sdk_tracer,
        parent.resource,  # type: ignore[union-attr]
        parent.instrumentation_scope,  # type: ignore[union-attr]
        (
            parent_context.trace_id,
            _span_id(_facts(sdk_tracer), sdk_tracer),
            parent_context.trace_flags,
            parent_context.trace_state,
        ),
        None,
        parent_context,
        name,
        SpanKind.INTERNAL,
        start_ns,
        attributes,
        (),
        links,
        status,
    )


def _hand_over(
    tracer: Any,
    resource: Resource,
    scope: InstrumentationScope | None,
    ids: tuple[int, int, TraceFlags, TraceState | None],
    context: SpanContext | None,
    parent: SpanContext | None,
    name: str,
    kind: SpanKind,
    start_ns: int,
    attributes: dict[str, Any] | None,
    events: Sequence[Event],
    links: Sequence[Link],
    status: Status,
) -> None:
    """A span of `tracer`'s that ends now (`ids`: trace id, span id, flags, trace state;
    `context`: the same as a SpanContext, made from them when None) to the processors.

    While the trace file's processor is the tracer's provider's only one (setup()'s with
    --trace-file alone, or an application's provider for the SDK's spans), the span goes
    straight into it, encoded from these fields: no SpanContext, ReadableSpan and processor
    loop (about 5 of the 8 us of a child span, encoding included). Otherwise as a PlainSpan."""
    end_ns = time.time_ns()
    trace_id, span_id, flags, state = ids
    # The SDK's multi-span processor replaces its tuple when a processor is added: read
    # each time (the SDK keeps it private; another processor type has none, and is called).
    processors = getattr(tracer.span_processor, "_span_processors", ())
    if len(processors) == 1 and type(processors[0]) is OtlpJsonFileSpanProcessor:
        if not flags & TraceFlags.SAMPLED:
            return
        try:
            encoded = encode_fields(
                trace_id,
                span_id,
                state,
                parent,
                name,
                kind,
                start_ns,
                end_ns,
                attributes,
                events,
                links,
                status,
            )
        except Exception:  # as the processor does: a span must not fail its request
            log.exception("cannot encode span %s", name)
            return
        processors[0].add(resource, scope, encoded)
        return
    if context is None:
        context = SpanContext(
            trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=state
        )
    tracer.span_processor.on_end(
        PlainSpan(
            name,
            context,
            parent,
            resource,
            attributes,
            events=events,
            links=links,
            kind=kind,
            status=status,
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=scope,
        )
    )


class PlainSpan(ReadableSpan):
    """A finished span of Tidewater's own (record_child's, DeferredSpan's): its attributes,
    events and links are kept as given, never bounded, so none are dropped. Saying so spares
    each reader of the counts (the trace file's encoder, per span) the SDK's isinstance
    checks against ABCs."""

    dropped_attributes = 0  # type: ignore[assignment]
    dropped_events = 0  # type: ignore[assignment]
    dropped_links = 0  # type: ignore[assignment]


class _TracerFacts(NamedTuple):
    """What start_span() asks of an SDK tracer for every span, looked up once."""

    scope: InstrumentationScope
    # The sampler keeps a new trace when its id's low 64 bits are below this (the rule of
    # TraceIdRatioBased, OTEL_TRACES_SAMPLER=[parentbased_]traceidratio, ALWAYS_OFF's as 0
    # and ALWAYS_ON's, the default, as 2**64); None for other samplers, which are asked.
    new_trace_bound: int | None
    # new_trace_bound where the ids are the SDK's RandomIdGenerator's, whose trace ids
    # NewTraces may draw itself; None where the id generator is to make them.
    drawn_trace_bound: int | None
    # The sampler samples a span exactly when its parent is sampled (parent-based with its
    # default samplers for parents, as OTEL_TRACES_SAMPLER=parentbased_* makes it).
    follows_parents: bool
    random_trace_id: bool
    # The ids are the SDK's RandomIdGenerator's: span ids drawn here (_span_id).
    random_ids: bool


_TRACERS: weakref.WeakKeyDictionary[Any, _TracerFacts] = weakref.WeakKeyDictionary()


# The last tracer asked about and its facts: a process's data path asks of one tracer,
# and the weak dictionary's lookup (a weak reference made per call) took 0.5 us. Held weakly
# too (made once per tracer), so a tracer and its provider shut down are not kept alive.
_LAST_FACTS: tuple[Callable[[], Any], _TracerFacts | None] = (lambda: None, None)


def _facts(tracer: Any) -> _TracerFacts:
    """An SDK tracer's facts (its sampler, id generator and scope are fixed when it is made)."""
    global _LAST_FACTS
    last, facts = _LAST_FACTS
    if last() is tracer and facts is not None:
        return facts
    facts = _TRACERS.get(tracer)
    if facts is None:
        info = tracer.instrumentation_info
        bound = _new_trace_bound(tracer.sampler)
        random_ids = type(tracer.id_generator) is RandomIdGenerator
        facts = _TRACERS[tracer] = _TracerFacts(
            InstrumentationScope(info.name, info.version, info.schema_url),
            bound,
            bound if random_ids else None,
            _follows_parents(tracer.sampler),
            tracer.id_generator.is_trace_id_random(),
            random_ids,
        )
    _LAST_FACTS = (weakref.ref(tracer), facts)
    return facts


def _new_trace_bound(sampler: Sampler) -> int | None:
    """See _TracerFacts.new_trace_bound. A parent-based sampler decides a new trace by its
    root sampler, which the SDK keeps private; an SDK without it falls back to asking."""
    parent_based = type(sampler) in (ParentBased, ParentBasedTraceIdRatio)
    root = getattr(sampler, "_root", None) if parent_based else sampler
    if root is ALWAYS_OFF:
        return 0
    if root is ALWAYS_ON:  # the default: as TraceIdRatioBased(1.0), every id is below
        return 1 << 64
    return root.bound if type(root) is TraceIdRatioBased else None


def _follows_parents(sampler: Sampler) -> bool:
    """See _TracerFacts.follows_parents (the SDK keeps a parent-based sampler's own private;
    an SDK without them falls back to asking)."""
    if type(sampler) not in (ParentBased, ParentBasedTraceIdRatio):
        return False
    delegates = (
        (getattr(sampler, "_remote_parent_sampled", None), ALWAYS_ON),
        (getattr(sampler, "_local_parent_sampled", None), ALWAYS_ON),
        (getattr(sampler, "_remote_parent_not_sampled", None), ALWAYS_OFF),
        (getattr(sampler, "_local_parent_not_sampled", None), ALWAYS_OFF),
    )
    return all(delegate is default for delegate, default in delegates)


def _span_id(facts: _TracerFacts, tracer: Any) -> int:
    """A new span id from `tracer`'s generator; RandomIdGenerator's drawn as it draws them,
    without its method call (0.3 us per span)."""
    if facts.random_ids:
        span_id = getrandbits(64)
        if span_id:
            return span_id
    return tracer.id_generator.generate_span_id()


SpanAttributes = dict[str, Any] | Callable[[], dict[str, Any]]


def _made(attributes: SpanAttributes) -> dict[str, Any]:
    return attributes() if callable(attributes) else attributes


# A span's parent: a Context, or the remote SpanContext that extract() read alone from a
# traceparent (its Context made only for a sampler that asks).
Parent = Context | SpanContext


def context_of(parent: Parent) -> Context:
    """`parent` as a Context, as the propagators would have extracted a SpanContext alone."""
    if type(parent) is SpanContext:
        return trace.set_span_in_context(trace.NonRecordingSpan(parent), Context())
    return parent  # type: ignore[return-value]


def start_span(
    name: str,
    kind: SpanKind,
    parent: Parent,
    attributes: SpanAttributes,
    carrier: MutableMapping[str, str] | None = None,
    tracer: Tracer | None = None,
    new_traces: NewTraces | None = None,
) -> DeferredSpan | None:
    """A span of the data path (the brokers' `Produce`, `Fetch`, `replica.fetch`, the
    producer's `send`), sampled as Tracer.start_span samples: the tracer's sampler (TRACER's
    by default) decides on the span in `parent`, or on a new trace id without a valid one
    (from `new_traces`, the place's NewTraces, when given; else the tracer's).
    None when it is not recorded: a sampled-out request makes no span object at all.

    `carrier` (a message's trace_context), when given, gets the span's W3C context, sampled
    or not, so that the receiver follows this decision; but a new trace that `new_traces`
    drops leaves it empty (its stream declared the not sampled parent, NewTraces).
    `attributes` may be a function that makes them, called only for a span or a sampler
    that asks: a new trace sampled out at a low ratio (a producer's batch) then builds no
    attributes at all."""
    sdk_tracer: Any = tracer or TRACER
    facts = _facts(sdk_tracer)
    if type(parent) is SpanContext:
        parent_context = parent
    else:
        parent_context = trace.get_current_span(parent).get_span_context()  # type: ignore[arg-type]
    # Decided here where the sampler's rule is known (None: ask it): most spans are new
    # traces at a low ratio or children of a sampled parent, and asking cost a busy broker
    # ~10 us per span.
    sampled: bool | None = None
    if parent_context.is_valid:
        trace_id = parent_context.trace_id
        random_trace_id = parent_context.trace_flags.random_trace_id
        state = parent_context.trace_state
        if facts.follows_parents:
            sampled = parent_context.trace_flags.sampled
    else:
        if new_traces is not None and facts.drawn_trace_bound is not None:
            drawn = new_traces.next(facts.drawn_trace_bound)
            if drawn is None:
                return None  # sampled out: the stream declared the place's constant context
            trace_id = drawn
        else:
            trace_id = sdk_tracer.id_generator.generate_trace_id()
        random_trace_id = facts.random_trace_id
        state = None
        if facts.new_trace_bound is not None:
            sampled = trace_id & _TRACE_ID_LOW_BITS < facts.new_trace_bound
    if sampled is None:
        result = sdk_tracer.sampler.should_sample(
            context_of(parent), trace_id, name, kind, _made(attributes)
        )
        sampled, recorded = result.decision.is_sampled(), result.decision.is_recording()
        state, attributes = result.trace_state, dict(result.attributes)
    else:
        recorded = sampled
    flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
    if random_trace_id:
        flags |= TraceFlags.RANDOM_TRACE_ID
    span_id = _span_id(facts, sdk_tracer)
    if carrier is not None:
        _write_context(trace_id, span_id, flags, state, carrier)
    if not recorded:
        return None
    context = SpanContext(
        trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags), trace_state=state
    )
    return DeferredSpan(
        sdk_tracer,
        facts.scope,
        name,
        kind,
        context,
        parent_context if parent_context.is_valid else None,
        _made(attributes),
    )


# Not sampled; the trace id is random.
_SAMPLED_OUT_FLAGS = TraceFlags.RANDOM_TRACE_ID


class NewTraces:
    """New traces started one after another in one place, each sampled by its tracer's
    sampler: a follower's fetcher starts one per fetch, a producer one per batch sent outside
    any span of the application's, a leader one per batch or fetch of a client that does not
    trace. The fetcher and the producer send their requests on data-plane streams that open
    with `metadata`, their constant, not sampled context (made once, never exported).

    Where that sampler decides a new trace by the ratio rule and its ids come from the SDK's
    RandomIdGenerator (_TracerFacts.drawn_trace_bound), start_span() has next() draw only
    the low 64 bits of a trace id, which are all the rule reads, and the rest only for a
    trace it keeps. A trace it drops gets no ids of its own and its carrier stays empty: the
    stream declared the constant as the parent of every message that carries none, so a
    parent-based receiver records nothing, reads nothing of the message, and a link to it
    names the place, not the request. Per follower fetch, a sampled-out context of its own
    cost ~28 us of CPU in a busy broker, and one carried per message ~0.3 us per record over
    the brokers (README, Tracing, What it costs). Other samplers and id generators are asked
    for every trace, by start_span(), and their contexts carried."""

    __slots__ = ("metadata", "span_id", "trace_id", "traceparent")

    def __init__(self) -> None:
        ids = RandomIdGenerator()
        self.trace_id = ids.generate_trace_id()
        self.span_id = ids.generate_span_id()
        self.traceparent = _traceparent(self.trace_id, self.span_id, _SAMPLED_OUT_FLAGS)
        # What the streams of this place's requests open with.
        self.metadata = ((SAMPLED_OUT_PARENT, self.traceparent),)

    def next(self, bound: int) -> int | None:
        """The next trace, kept when its id's low 64 bits are below `bound` (the tracer's
        drawn_trace_bound): its id; else None, to carry nothing."""
        while True:
            low = getrandbits(64)
            if low >= bound:
                return None
            # As RandomIdGenerator draws it: 128 random bits, none of the invalid id.
            trace_id = getrandbits(64) << 64 | low
            if trace_id:
                return trace_id


class DeferredSpan:
    """A recorded span of the data path (made by start_span()), kept as plain
    fields while it runs and handed to the span processors as one finished ReadableSpan
    when it ends, like record_child's spans.

    What it leaves out is the SDK span's machinery that a span of a few microseconds pays
    for: attribute validation and limits (these attributes are Tidewater's own strs and
    ints), a lock per call, the processors' on_start (the batch processors do nothing there).
    In a broker at 100% sampling that was ~20 us per span of the ~25 it cost to make one."""

    __slots__ = (
        "_recording",
        "_tracer",
        "attributes",
        "context",
        "events",
        "instrumentation_scope",
        "kind",
        "name",
        "parent",
        "start_time",
        "status",
    )

    def __init__(
        self,
        tracer: Any,
        scope: InstrumentationScope,
        name: str,
        kind: SpanKind,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, Any],
    ) -> None:
        self._tracer = tracer
        self.name = name
        self.kind = kind
        self.context = context
        self.parent = parent
        self._recording = True
        self.attributes = attributes
        self.instrumentation_scope = scope
        self.status = UNSET
        self.events: list[Event] = []
        self.start_time = time.time_ns()

    @property
    def resource(self) -> Any:
        return self._tracer.resource

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self._recording

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def set_status(self, status: Status) -> None:
        if status.status_code is not StatusCode.UNSET:
            self.status = status

    def record_exception(self, error: BaseException) -> None:
        """An `exception` event, as the SDK's Span.record_exception (OTel's semantic
        conventions for exceptions)."""
        kind = type(error)
        module = kind.__module__
        self.events.append(
            Event(
                "exception",
                {
                    "exception.type": kind.__qualname__
                    if module in ("", "builtins")
                    else f"{module}.{kind.__qualname__}",
                    "exception.message": str(error),
                    "exception.stacktrace": "".join(traceback.format_exception(error)),
                    "exception.escaped": "False",
                },
            )
        )

    def end(self) -> None:
        """Hands the span to the processors (once: it records nothing after)."""
        if not self._recording:
            return
        self._recording = False
        context = self.context
        _hand_over(
            self._tracer,
            self._tracer.resource,
            self.instrumentation_scope,
            (context.trace_id, context.span_id, context.trace_flags, context.trace_state),
            context,
            self.parent,
            self.name,
            self.kind,
            self.start_time,
            self.attributes,
            self.events,
            (),
            self.status,
        )


# -- gRPC ------------------------------------------------------------------------------


def _traced(details: Any) -> bool:
    method: str = details.method
    if isinstance(method, bytes):
        method = method.decode()
    service, _, name = method.lstrip("/").rpartition("/")
    return name not in DATA_PLANE_METHODS and not service.startswith(UNTRACED_SERVICES)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """W3C trace context on every outgoing call but the data plane's (see DATA_PLANE_METHODS).

    No stream-stream interceptor: those calls are the data plane's streams alone, and grpc.aio
    passes every write of an intercepted stream through a queue and a new task, even when the
    interceptor lets the call through untraced (at 100% sampling that was most of a follower's
    tracing cost)."""
    if not ENABLED:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return [
        interceptor
        for interceptor in aio_client_interceptors(tracer_provider=_provider, filter_=_traced)
        if not isinstance(interceptor, grpc.aio.StreamStreamClientInterceptor)
    ]


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    if not ENABLED:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider, filter_=_traced)]


def insecure_channel(
    address: str, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """A grpc.aio channel that carries trace context when tracing is on."""
    return grpc.aio.insecure_channel(address, options=options, interceptors=client_interceptors())


# -- trace context in messages and metadata ----------------------------------------------


def _write_context(
    trace_id: int,
    span_id: int,
    flags: int,
    state: TraceState | None,
    carrier: MutableMapping[str, str],
) -> None:
    """A span's W3C trace context: with the W3C propagators alone (OTEL_PROPAGATORS'
    default), written as they would write it, without the SpanContext, span and Context that
    propagate.inject() reads it from; that took ~30 us per fetch or batch in a busy process,
    half the cost of a sampled-out one."""
    if not _w3c_propagation():
        context = SpanContext(trace_id, span_id, False, TraceFlags(flags), state)
        propagate.inject(carrier, trace.set_span_in_context(trace.NonRecordingSpan(context)))
        return
    carrier[TRACEPARENT] = _traceparent(trace_id, span_id, flags)
    if state:
        carrier["tracestate"] = state.to_header()


def _traceparent(trace_id: int, span_id: int, flags: int) -> str:
    # bytes.hex(): format specs ("032x") took 0.50 us for the three, this 0.21.
    return f"00-{trace_id.to_bytes(16).hex()}-{span_id.to_bytes(8).hex()}-{flags.to_bytes(1).hex()}"


def _w3c_propagation() -> bool:
    global _W3C_PROPAGATION
    textmap = propagate.get_global_textmap()
    known, w3c = _W3C_PROPAGATION
    if textmap is not known:
        w3c = textmap.fields <= W3C_FIELDS
        _W3C_PROPAGATION = (textmap, w3c)
    return w3c


def current_context_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata with the current span's W3C trace context, for a unary call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def stream_parent(metadata: Any) -> SpanContext | None:
    """The not sampled parent that a data-plane stream declared when it opened
    (SAMPLED_OUT_PARENT in its call's `metadata`) for its messages that carry no traceparent;
    None when it declared none, or anything but a valid version-00 traceparent whose sampled
    flag is clear: those messages are then read as any others (extract())."""
    for key, value in metadata or ():
        if key == SAMPLED_OUT_PARENT and isinstance(value, str):
            parent = _parent_of(value)
            return None if parent is None or parent.trace_flags.sampled else parent
    return None


def skips_bare(declared: SpanContext | None) -> bool:
    """Whether a message that carries no trace context, on a stream that `declared` its
    sampled-out parent (stream_parent()), is to make no span: this process's sampler follows
    that parent. Such a message is then looked at no further."""
    return declared is not None and _FOLLOWS_SAMPLED_OUT_PARENTS


def extract(
    carrier: Mapping[str, str], metadata: Any = None, declared: SpanContext | None = None
) -> Parent | None:
    """The parent of a span for a message (start_span's `parent`): its own trace_context,
    else the parent its stream `declared` (stream_parent()), else the gRPC call's metadata
    (unary calls from other clients), else none: the invalid span context, for a new trace
    (start_span reads it without a Context to look into). A traceparent alone is read as a
    remote SpanContext (_parent_of).

    None when there is to be no span: the parent was sampled out and this process's sampler
    follows its parent. That is read from the traceparent's flags alone: most requests are
    sampled out at a low ratio, and a busy broker took ~50 us per full extraction."""
    # `in`, then []: a protobuf map's get() goes through Python's Mapping (twice the time).
    if TRACEPARENT in carrier:
        headers: Mapping[str, str] = carrier
        traceparent: str | None = carrier[TRACEPARENT]
    elif declared is not None:
        return None if _FOLLOWS_SAMPLED_OUT_PARENTS else declared
    elif metadata:
        headers = {k: v for k, v in metadata if isinstance(v, str)}
        traceparent = headers.get(TRACEPARENT)
    else:
        return trace.INVALID_SPAN_CONTEXT
    if _FOLLOWS_SAMPLED_OUT_PARENTS and _sampled_out(traceparent):
        return None
    if len(headers) == 1 and _w3c_propagation():
        parent = _parent_of(traceparent)
        if parent is not None:
            return parent
    return propagate.extract(headers)


def _parent_of(traceparent: str | None) -> SpanContext | None:
    """The remote span context of a valid version-00 traceparent alone (no tracestate or
    baggage beside it), as the W3C propagator reads it in three times the time (it makes
    the span and Context around it too); None for anything else, the propagator's to read."""
    if not traceparent or _TRACEPARENT_00.fullmatch(traceparent) is None:
        return None
    # Sliced rather than the match's groups, flags looked up, the ids checked before the
    # SpanContext is made (any 32 and 16 hex digits are within range; 0 is invalid).
    trace_id, span_id = int(traceparent[3:35], 16), int(traceparent[36:52], 16)
    if not (trace_id and span_id):
        return None
    return SpanContext(trace_id, span_id, True, _TRACE_FLAGS[traceparent[53:]])


def carried_span_context(
    carrier: Mapping[str, str], declared: SpanContext | None = None
) -> SpanContext:
    """The span context a message carries, sampled or not; without a traceparent, the parent
    its stream `declared` (stream_parent()); invalid when none."""
    if declared is not None and TRACEPARENT not in carrier:
        return declared
    return trace.get_current_span(propagate.extract(carrier)).get_span_context()


def _sampled_out(traceparent: str | None) -> bool:
    """Whether `traceparent` is a version-00 W3C traceparent (`00-<trace id>-<parent id>-
    <flags>`) whose sampled flag, the low bit of <flags>, is clear. Anything else goes to the
    propagator, which knows every form (a sampled-out parent of another version included)."""
    return (
        traceparent is not None
        and len(traceparent) == 55
        and traceparent.startswith("00-")
        and traceparent[54] in "02468ace"
    )
