"""Ports for processes started on this machine, kept from other processes while they change
hands: between one process's exit and its successor's bind (a restart at the same address),
or between choosing a port and binding it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def held(address: str) -> Iterator[str]:
    """Hold `address` (host:port; port 0: a fresh one) for the block, yielding it: a socket
    bound to it, not listening (dialling it is refused; it takes no connection), with
    SO_REUSEPORT and SO_REUSEADDR as gRPC's servers bind. Bound while the serving process
    still has the port, it keeps the port through that process's exit; a Tidewater process
    (or an in-process gRPC server) started at the address within the block binds beside it,
    and any other process is refused."""
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, int(port)))
        yield f"{host}:{s.getsockname()[1]}"
