"""The options client commands share, and how they find the cluster.

Like Kafka's `--bootstrap-server`: the metadata service addresses come from `--bootstrap`,
else the TIDEWATER_BOOTSTRAP environment variable, else the `cluster.json` of the local
cluster (`tidewater cluster up`) in `--data-dir` or the default data dir. Admin commands reach
the active controller through the address the metadata service reports.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from tidewater.client.errors import ClientError, error_for
from tidewater.client.metadata import ClusterMetadata
from tidewater.errors import InvalidConfig
from tidewater.rpc.address import parse_addresses
from tidewater.v1.errors_pb2 import ErrorCode

BOOTSTRAP_ENV = "TIDEWATER_BOOTSTRAP"
DEFAULT_REQUEST_TIMEOUT_MS = 10_000
# The exit status of a command Ctrl-C stopped (the shells' 128 + SIGINT).
INTERRUPTED_EXIT = 130


class NoCluster(ClientError):
    """No bootstrap address was given and no local cluster is recorded."""


class UsageError(ClientError):
    """A flag value the command cannot take, found after parsing (a flag checked against
    another, an empty separator): a usage error, exit status 2, as argparse's own."""


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (and <= maximum), else a usage error naming
    the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            wanted = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"expected an integer {wanted}, got {text!r}")
        return value

    return parse


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap",
        "--bootstrap-server",
        type=bootstrap_arg,
        metavar="HOST:PORT[,...]",
        help=f"metadata service addresses (default: ${BOOTSTRAP_ENV}, else the local cluster)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="the local cluster whose cluster.json names the addresses (default: the user "
        "data dir of `tidewater cluster up`)",
    )
    parser.add_argument(
        "--request-timeout-ms",
        type=at_least(1),
        default=DEFAULT_REQUEST_TIMEOUT_MS,
        help=f"deadline of each request to the cluster (default {DEFAULT_REQUEST_TIMEOUT_MS})",
    )
    parser.add_argument(
        "--trace-file",
        type=Path,
        help="append this client's spans here as OTLP/JSON lines (see also the OTEL_* variables)",
    )


def bootstrap(args: argparse.Namespace) -> list[str]:
    """The metadata service addresses to use, by the rules in this module's docstring."""
    from tidewater.local.cluster import ClusterFile, default_data_dir, is_running

    if args.bootstrap:
        return args.bootstrap
    text = os.environ.get(BOOTSTRAP_ENV, "")
    if text.strip():
        return parse_addresses(text)
    data_dir = args.data_dir or default_data_dir()
    state = ClusterFile.read(data_dir)
    if state is None or not state.find("metadata"):
        raise NoCluster(
            f"no cluster to talk to: pass --bootstrap HOST:PORT, set {BOOTSTRAP_ENV}, or "
            f"start a local one with `tidewater cluster up` (none recorded in {data_dir})"
        )
    if not is_running(state):
        # A machine restarted, say: its addresses would only fail as unreachable (review 27
        # L8).
        raise NoCluster(
            f"the local cluster recorded in {data_dir} is not running: `tidewater cluster up "
            f"--data-dir {data_dir}` starts it again (or pass --bootstrap HOST:PORT)"
        )
    return [m.address for m in state.find("metadata")]


def bootstrap_arg(text: str) -> list[str]:
    """`--bootstrap`: checked as the command line is parsed (a usage error)."""
    try:
        return parse_addresses(text)
    except InvalidConfig as e:
        raise argparse.ArgumentTypeError(e.message) from None


async def partition_count(metadata: ClusterMetadata, topic: str) -> int:
    """The topic's partition count; its error (UNKNOWN_TOPIC_OR_PARTITION, INVALID_TOPIC)
    when the cluster does not have it."""
    await metadata.refresh([topic])
    info = metadata.topics.get(topic)
    if info is None or info.error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION:
        raise error_for(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"topic {topic!r} does not exist")
    if info.error_code != ErrorCode.NONE:
        # The metadata service's message names the topic where it helps (INVALID_TOPIC).
        raise error_for(info.error_code, info.error_message or f"topic {topic!r}")
    return info.num_partitions


def int_list(text: str, what: str) -> list[int]:
    """Comma-separated integers (maybe none); a usage error naming `what` otherwise."""
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def partitions_arg(text: str) -> list[int]:
    """`--partition 0,2`: a comma-separated list of partition indexes."""
    partitions = int_list(text, "partition numbers")
    if not partitions or min(partitions) < 0:
        raise argparse.ArgumentTypeError(f"expected partition numbers >= 0, got {text!r}")
    return partitions


def check_partitions(topic: str, wanted: list[int] | None, count: int) -> list[int]:
    if wanted is None:
        return list(range(count))
    missing = [p for p in wanted if p >= count]
    if missing:
        raise error_for(
            ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
            f"topic {topic!r} has {count} partitions, not partition {missing[0]}",
        )
    return wanted
