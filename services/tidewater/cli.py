"""The `tidewater` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import grpc

from tidewater.broker.config import BrokerConfig, load_properties
from tidewater.broker.topic_config import TopicConfig
from tidewater.client.errors import ClientError
from tidewater.errors import InvalidConfig, TidewaterError
from tidewater.rpc.address import LISTEN_FAILED_EXIT, ListenFailed, parse_addresses
from tidewater.telemetry import tracing
from tidewater.tools import bench, consume, produce, topics
from tidewater.tools.options import (
    INTERRUPTED_EXIT,
    UsageError,
    at_least,
    key_value,
)
from tidewater.tracereport import ReportError

# A usage error: a missing or unknown flag, or a flag value the command cannot take.
USAGE_EXIT = 2
# What a command can fail with that the user must see as one line, not a traceback.
USER_ERRORS = (TidewaterError, ClientError, ReportError, OSError)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (`tidewater: error: ...`), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message} (see --help)\n")


def min_insync_replicas(text: str) -> int:
    """The controller's --min-insync-replicas, checked as the brokers check the config."""
    try:
        return TopicConfig.from_properties({"min.insync.replicas": text}).min_insync_replicas
    except InvalidConfig as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def etcd_endpoints(text: str) -> str:
    """An argparse type: comma-separated host:port entries (review 27 L2: a traceback)."""
    try:
        endpoints = parse_addresses(text, "an etcd endpoint")
    except InvalidConfig as e:
        raise argparse.ArgumentTypeError(e.message) from None
    if not endpoints:
        raise argparse.ArgumentTypeError("expected at least one host:port")
    return text


def parser() -> argparse.ArgumentParser:
    """The whole command line (deploy/'s tests hold the systemd units' ExecStart to it)."""
    tidewater = _Parser(prog="tidewater", description=__doc__)
    tidewater.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        default="INFO",
        help="logging level (default INFO)",
    )
    commands = tidewater.add_subparsers(dest="command", required=True, parser_class=_Parser)

    # The services take their flags as written (allow_abbrev=False): a flag in a unit file or
    # script must not quietly stand for a longer one it happens to prefix.
    broker = commands.add_parser("broker", help="run a broker", allow_abbrev=False)
    broker.add_argument("--config", type=Path, help="TOML file with Kafka-named broker configs")
    broker.add_argument("--broker-id", help="broker.id")
    broker.add_argument(
        "--listen", help="listeners: HOST:PORT to bind (port 0 picks a free one; 0.0.0.0: all)"
    )
    broker.add_argument(
        "--advertised-address",
        help="advertised.listeners: the HOST:PORT the broker registers, which clients and "
        "followers dial (default: the --listen address; required when that is 0.0.0.0)",
    )
    broker.add_argument("--log-dirs", help="log.dirs: comma-separated directories")
    broker.add_argument(
        "--set",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other broker config, e.g. --set log.retention.ms=3600000",
    )
    broker.add_argument("--ready-file", type=Path, help="write the bound address here once serving")

    controller = commands.add_parser("controller", help="run a controller", allow_abbrev=False)
    controller.add_argument("--controller-id", type=int, required=True)
    controller.add_argument(
        "--listen", default="127.0.0.1:9093", help="HOST:PORT to bind (0: any port)"
    )
    controller.add_argument(
        "--advertised-address",
        default="",
        help="the HOST:PORT the active controller writes to etcd, where brokers, metadata "
        "services and admin clients are sent (default: the --listen address; required when "
        "that is 0.0.0.0)",
    )
    controller.add_argument(
        "--etcd",
        type=etcd_endpoints,
        default="127.0.0.1:2379",
        help="etcd endpoints, comma-separated host:port",
    )
    controller.add_argument("--cluster", default="default", help="cluster name (etcd prefix)")
    controller.add_argument(
        "--lease-ttl", type=at_least(1), default=5, help="election lease TTL, s"
    )
    controller.add_argument(
        "--broker-session-timeout-ms",
        type=at_least(1),
        default=6000,
        help="broker.session.timeout.ms",
    )
    controller.add_argument(
        "--leader-imbalance-check-interval-s",
        type=float,
        default=300,
        help="leader.imbalance.check.interval.seconds: the automatic preferred-leader rebalance",
    )
    controller.add_argument(
        "--metadata", default="", help="metadata services to keep up to date, host:port,..."
    )
    controller.add_argument(
        "--min-insync-replicas",
        type=min_insync_replicas,
        default=TopicConfig.min_insync_replicas,
        help="min.insync.replicas of topics without their own, for eligible leader replicas "
        "(default %(default)s, the brokers' default): set it to the brokers' value",
    )
    controller.add_argument(
        "--default-replication-factor",
        type=at_least(1),
        help="default.replication.factor of topics created without one (default: 3, or the "
        "number of brokers that ever registered where fewer)",
    )
    controller.add_argument("--ready-file", type=Path, help="write the bound address here")

    metadata = commands.add_parser("metadata", help="run a metadata service", allow_abbrev=False)
    metadata.add_argument(
        "--listen",
        default="127.0.0.1:9094",
        help="HOST:PORT to bind (0: any port; 0.0.0.0 will do: clients and controllers are "
        "given this service's address, it publishes none)",
    )
    metadata.add_argument("--ready-file", type=Path, help="write the bound address here")
    for service in (broker, controller, metadata):
        service.add_argument(
            "--metrics-port",
            type=at_least(0, 65535),
            help="serve Prometheus metrics on http://HOST:PORT/metrics, HOST as the service "
            "listens (0: any free port; default: no metrics)",
        )

    cluster = commands.add_parser("cluster", help="a local cluster: up, down, status")
    actions = cluster.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start etcd, 2 controllers, metadata and brokers")
    up.add_argument("--brokers", type=at_least(1), default=3, help="number of brokers (default 3)")
    up.add_argument("--detach", action="store_true", help="leave it running and return")
    # The detached supervisor tells `up --detach` it is ready through this file.
    up.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    down = actions.add_parser("down", help="stop the cluster cleanly")
    status = actions.add_parser("status", help="every process: role, id, address, pid, health")
    status.add_argument("--json", action="store_true", help="print JSON")
    for action in (up, down, status):
        action.add_argument(
            "--data-dir", type=Path, help="the cluster's data (default: the user data dir)"
        )

    for service in (broker, controller, metadata):
        service.add_argument(
            "--trace-file",
            type=Path,
            help="append spans here as OTLP/JSON lines (see also the OTEL_* variables)",
        )
    up.add_argument(
        "--trace",
        action="store_true",
        help="every process writes its spans to DATA_DIR/traces/<role>-<id>.jsonl",
    )

    demo = commands.add_parser(
        "demo",
        help="start a local cluster, produce records with acks=all, consume them, stop it",
    )
    demo.add_argument("--records", type=at_least(1), default=10_000)
    demo.add_argument("--data-dir", type=Path, help="keep data here (default: a temp dir)")

    trace = commands.add_parser("trace", help="read recorded trace files")
    trace_actions = trace.add_subparsers(dest="action", required=True)
    report = trace_actions.add_parser(
        "report", help="produce-to-ack latency per stage, and which follower acked last"
    )
    report.add_argument(
        "paths", nargs="+", type=Path, metavar="FILE", help="trace files or directories of *.jsonl"
    )
    report.add_argument("--html", type=Path, metavar="OUT", help="also write a page with charts")
    for client_command in (topics, produce, consume, bench):
        client_command.add_parser(commands)
    return tidewater


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        _setup_tracing(args)
        if hasattr(args, "run"):
            return asyncio.run(args.run(args))
        if args.command == "broker":
            return _broker(args)
        if args.command == "controller":
            from tidewater.controller.server import run_controller

            asyncio.run(
                run_controller(
                    args.controller_id,
                    args.listen,
                    [e.strip() for e in args.etcd.split(",") if e.strip()],
                    args.cluster,
                    args.lease_ttl,
                    args.broker_session_timeout_ms,
                    args.ready_file,
                    args.leader_imbalance_check_interval_s,
                    tuple(a.strip() for a in args.metadata.split(",") if a.strip()),
                    args.metrics_port,
                    args.advertised_address,
                    args.min_insync_replicas,
                    args.default_replication_factor,
                )
            )
            return 0
        if args.command == "metadata":
            from tidewater.metadata.server import run_metadata

            asyncio.run(run_metadata(args.listen, args.ready_file, args.metrics_port))
            return 0
        if args.command == "cluster":
            return _cluster(args)
        if args.command == "demo":
            from tidewater.local.demo import run_demo

            return asyncio.run(run_demo(args.records, args.data_dir))
        if args.command == "trace":
            return _trace_report(args.paths, args.html)
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except UsageError as e:
        print(f"tidewater: error: {e} (see --help)", file=sys.stderr)
        return USAGE_EXIT
    except ListenFailed as e:
        print(f"tidewater: {e}", file=sys.stderr)
        return LISTEN_FAILED_EXIT
    except USER_ERRORS as e:
        print(f"tidewater: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as e:
        print(f"tidewater: {e.code().name}: {_one_line(e.details() or '')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return INTERRUPTED_EXIT
    finally:
        tracing.shutdown()
    raise AssertionError(args.command)


def _setup_tracing(args: argparse.Namespace) -> None:
    """Brokers set theirs up in _broker(): their id may come from --config."""
    if hasattr(args, "run"):  # the client tools: topics, produce, consume, bench
        tracing.setup("tidewater-client", args.trace_file)
    elif args.command == "controller":
        tracing.setup(
            "tidewater-controller", args.trace_file, {"tidewater.controller.id": args.controller_id}
        )
    elif args.command == "metadata":
        tracing.setup("tidewater-metadata", args.trace_file)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cluster(args: argparse.Namespace) -> int:
    from tidewater.local import cluster

    data_dir = args.data_dir or cluster.default_data_dir()
    try:
        if args.action == "up":
            return cluster.cluster_up(
                data_dir, args.brokers, args.detach, args.ready_file, args.trace
            )
        if args.action == "down":
            return cluster.cluster_down(data_dir)
        return cluster.cluster_status(data_dir, args.json)
    except cluster.ClusterError as e:
        print(f"tidewater: {e}", file=sys.stderr)
        return 1


def broker_config(args: argparse.Namespace) -> BrokerConfig:
    """`tidewater broker`'s config: the --config file, then the flags and --set on top."""
    overrides = {
        "broker.id": args.broker_id,
        "listeners": args.listen,
        "advertised.listeners": args.advertised_address,
        "log.dirs": args.log_dirs,
        **dict(args.set),
    }
    return BrokerConfig.from_properties(load_properties(args.config, overrides))


def _broker(args: argparse.Namespace) -> int:
    import uvloop

    from tidewater.broker.server import run_broker

    config = broker_config(args)
    tracing.setup("tidewater-broker", args.trace_file, {tracing.BROKER_ID: config.broker_id})
    for log_dir in config.log_dirs:
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidConfig(f"log dir {log_dir} is not usable: {e}") from None
    # uvloop: each message costs the data path's event loop less CPU than asyncio's own loop.
    uvloop.run(run_broker(config, args.ready_file, args.metrics_port))
    return 0


def _trace_report(paths: list[Path], html_out: Path | None) -> int:
    from tidewater.tracereport.otlp_json import read_trace_files
    from tidewater.tracereport.page import render_html
    from tidewater.tracereport.stages import latency_report
    from tidewater.tracereport.text import render_text

    source = read_trace_files(paths)
    report = latency_report(source.spans)
    summary = render_text(report, source)
    print(summary)
    if not report.traces:
        print("tidewater: no complete produce trace in these files", file=sys.stderr)
        return 1
    if html_out is not None:
        html_out.write_text(render_html(report, summary), encoding="utf-8")
        print(f"wrote {html_out}")
    return 0
