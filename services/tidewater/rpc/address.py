"""The address a service binds and the one it tells others to dial (Kafka's `listeners` and
`advertised.listeners`).

A broker registers its advertised address with the controller, which hands it to followers
(LeaderAndIsr) and the metadata service (clients); the active controller writes its own to
etcd, from where standbys and the metadata service pass it on. Without an advertised address
the bound one is published, so a wildcard bind (0.0.0.0, ::) needs one: as Kafka refuses to
advertise the non-routable meta-address, a service that would publish it does not start.
(Kafka's empty host, `PLAINTEXT://:9092`, binds everything and advertises the machine's
canonical host name; here a host is always written out.)
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from tidewater.errors import InvalidConfig

# Kafka's listener form SECURITY_PROTOCOL://HOST:PORT; every Tidewater service is plaintext gRPC.
PLAINTEXT = "PLAINTEXT"
# The exit status of a service that cannot bind its address (1: any other error, 2: usage), so
# a supervisor or a test harness can tell "taken by another process" from a failure of its own.
LISTEN_FAILED_EXIT = 3


class ListenFailed(OSError):
    """A server could not bind its address: most often another process listens there. Such a
    process stops at once (as Kafka's "Socket server failed to bind ... Address already in
    use") rather than share the port with the one serving it."""


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_listener(text: str, setting: str) -> HostPort:
    """HOST:PORT or Kafka's PLAINTEXT://HOST:PORT, one listener (port 0: any free one)."""
    value = text.strip()
    form = f"{setting} must be HOST:PORT or PLAINTEXT://HOST:PORT"
    if "," in value:
        raise InvalidConfig(f"{form}, one listener (a service serves one port), got {text!r}")
    protocol, sep, rest = value.partition("://")
    if sep:
        if protocol.upper() != PLAINTEXT:
            raise InvalidConfig(
                f"{form}: every service is plaintext gRPC, no {protocol} listener, got {text!r}"
            )
        value = rest
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidConfig(f"{form}, got {text!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # Unbracketed, HOST:PORT is ambiguous to whoever dials it (as in Kafka and gRPC).
        raise InvalidConfig(f"{form}, an IPv6 host in brackets ([::1]:9092), got {text!r}")
    return HostPort(host, int(port))


def parse_addresses(text: str, what: str = "bootstrap address") -> list[str]:
    """Comma-separated HOST:PORT entries, addresses to dial; InvalidConfig names `what` a bad
    one is."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidConfig(f"{what} must be HOST:PORT, got {address!r}")
    return addresses


def listen_and_advertised(
    listen: str, advertised: str, listen_setting: str, advertised_setting: str
) -> tuple[HostPort, HostPort | None]:
    """The bind address and the advertised one (None when `advertised` is empty: the bound
    address is published). What is advertised is what others dial, so it takes neither a
    wildcard host nor port 0 (Kafka puts the bound port in for 0; here what is advertised is
    what is written), and a wildcard bind needs one."""
    bind = parse_listener(listen, listen_setting)
    if not advertised.strip():
        if _is_wildcard(bind.host):
            raise InvalidConfig(
                f"{listen_setting} binds the wildcard address {bind.host}, which nobody can "
                f"dial: set {advertised_setting} to the HOST:PORT clients and the other "
                "services reach this one at"
            )
        return bind, None
    address = parse_listener(advertised, advertised_setting)
    if _is_wildcard(address.host):
        raise InvalidConfig(
            f"{advertised_setting} cannot be the wildcard address {address.host}, which nobody "
            f"can dial: name this host as clients and the other services reach it, got "
            f"{advertised!r}"
        )
    if address.port == 0:
        raise InvalidConfig(
            f"{advertised_setting} needs the port others dial, not 0, got {advertised!r}"
        )
    return bind, address


def published(bind: HostPort, bound_port: int, advertised: HostPort | None) -> HostPort:
    """What others are told: the advertised address, else the bound one."""
    return advertised or HostPort(bind.host, bound_port)


def bind_error(host: str, port: int) -> OSError | None:
    """Why nothing could bind host:port now (None: it could), binding as gRPC's servers and
    the metrics endpoint do (SO_REUSEADDR: a port left only in TIME_WAIT by a process that
    exited is free). A server that failed to bind names the cause with this: gRPC tells none."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
    except OSError as e:
        return e
    return None


def _is_wildcard(host: str) -> bool:
    """0.0.0.0, ::, [::] (any spelling of the unspecified address)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False
