"""Start and stop the split stack as processes (a core, then frontends), the way the deployment files do.

Used by ``splitserve stack`` / ``splitserve demo`` and by the tests, so all three start processes alike.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.base.tls import ClientTLS, secure_or_insecure_channel

ENGINE_CORE_GRPC_SERVICE = "splitserve.engine.v1.EngineCore"
GENERATION_GRPC_SERVICE = "splitserve.frontend.v1.Generation"


_HANDED_OUT: set[int] = set()  # every port free_port returned in this process
_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000  # below: ports services commonly take


def free_port() -> int:
    """A TCP port free on loopback right now, and not one this process was handed before: a caller often takes
    several before any is bound (a frontend's HTTP port, then its gRPC port). Drawn at random below the kernel's
    ephemeral range (``ip_local_port_range``), from which every outgoing connection and every bind to port 0 on the
    machine takes its port, so that none of those takes it between now and the caller's bind; the kernel's choice
    (port 0) where that range leaves no room or no port there is free."""
    ephemeral_low = _ephemeral_low()
    candidates = (
        [random.randrange(_LOWEST_PORT, ephemeral_low) for _ in range(64)] if ephemeral_low > _LOWEST_PORT else []
    )
    for port in [*candidates, *[0] * 64]:
        if port in _HANDED_OUT:
            continue
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1")


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        return int(_PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass(frozen=True)
class StackTLS:
    """One CA and one certificate for a whole stack (``splitserve stack --ssl-*``): the core serves with it and
    requires a client certificate signed by the CA (mTLS), the frontend serves with it (TLS) and presents it to the
    core, and clients check both against the CA. The certificate must name the host the processes are reached at
    (localhost or 127.0.0.1) and allow both server and client authentication."""

    certfile: str
    keyfile: str
    ca_certs: str

    @classmethod
    def from_flags(cls, keyfile: str | None, certfile: str | None, ca_certs: str | None) -> StackTLS | None:
        """None (plaintext) when no flag is given.

        Raises:
            ValueError: some of the three are given, not all.
        """
        if keyfile is None and certfile is None and ca_certs is None:
            return None
        if keyfile is None or certfile is None or ca_certs is None:
            raise ValueError("a TLS stack needs --ssl-keyfile, --ssl-certfile and --ssl-ca-certs")
        return cls(certfile, keyfile, ca_certs)

    def core_args(self) -> list[str]:
        return ["--ssl-keyfile", self.keyfile, "--ssl-certfile", self.certfile, "--ssl-ca-certs", self.ca_certs]

    def frontend_args(self) -> list[str]:
        server = ["--ssl-keyfile", self.keyfile, "--ssl-certfile", self.certfile]
        to_core = ["--core-ssl-keyfile", self.keyfile, "--core-ssl-certfile", self.certfile]
        return [*server, *to_core, "--core-ssl-ca-certs", self.ca_certs]

    def client(self) -> ClientTLS:
        """A client of either server: checks it against the CA, presents the certificate (the core requires one)."""
        return ClientTLS(self.ca_certs, self.certfile, self.keyfile)


@dataclass
class ServiceProcess:
    """One ``splitserve core`` or ``splitserve frontend`` process."""

    name: str
    address: str  # host:port it serves on
    process: subprocess.Popen[bytes]
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    service: str = GENERATION_GRPC_SERVICE  # the gRPC service whose health is this process's readiness
    tls: ClientTLS | None = None  # how to reach it: None, plaintext

    def channel(self) -> grpc.Channel:
        """A blocking channel to the process (TLS when it serves TLS)."""
        return secure_or_insecure_channel(self.address, self.tls)

    def health(self, timeout_s: float = 1.0) -> int:
        """The grpc.health.v1 readiness status (health_pb2.HealthCheckResponse.ServingStatus) of the process's
        service; 0 (UNKNOWN) when it does not answer."""
        try:
            with self.channel() as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return stub.Check(health_pb2.HealthCheckRequest(service=self.service), timeout=timeout_s).status
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN

    def wait_serving(self, timeout_s: float = 300.0) -> None:
        """Block until health says SERVING.

        Raises:
            RuntimeError: the process exited or the timeout passed (with the log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}{self._log_tail()}")
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not become SERVING within {timeout_s:.0f} s{self._log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait for the drain; SIGKILL after ``timeout_s``. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-20:]
        return "\n  " + "\n  ".join(lines)


def start_service(
    name: str,
    args: list[str],
    port: int,
    log_dir: Path | None,
    service: str = GENERATION_GRPC_SERVICE,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = (),
    tls: ClientTLS | None = None,
) -> ServiceProcess:
    """``splitserve <args...> --host <host> --port <port>`` as a child process, logging to ``log_dir``;
    ``service``: the gRPC service whose health tells its readiness; ``env``: added to this environment;
    ``launcher``: the command that runs ``splitserve`` (default: this Python's ``-m splitserve.entrypoints.cli``);
    ``tls``: how to reach it when it serves TLS (its own ``--ssl-*`` flags are in ``args``)."""
    launcher = launcher or [sys.executable, "-m", "splitserve.entrypoints.cli"]
    argv = [*launcher, *args, "--host", host, "--port", str(port)]
    log_path = None
    stdout: int | IO[bytes] = subprocess.DEVNULL
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        stdout = log_path.open("wb")
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT, env=child_env)
    return ServiceProcess(name, f"{host}:{port}", process, log_path, argv, service, tls)


def start_core(
    model: str,
    log_dir: Path | None,
    extra_args: Sequence[str] = (),
    port: int | None = None,
    tls: StackTLS | None = None,
) -> ServiceProcess:
    """A core on loopback; with ``tls``, serving TLS and requiring the frontend's certificate."""
    port = port or free_port()
    args = ["core", "--model", model, *(tls.core_args() if tls else []), *extra_args]
    return start_service(
        f"core-{port}", args, port, log_dir, ENGINE_CORE_GRPC_SERVICE, tls=tls.client() if tls else None
    )


def start_frontend(
    model: str,
    core_addresses: list[str],
    log_dir: Path | None,
    extra_args: Sequence[str] = (),
    port: int | None = None,
    tls: StackTLS | None = None,
) -> ServiceProcess:
    """A frontend on loopback over ``core_addresses``; with ``tls``, serving TLS and presenting the stack's
    certificate to the cores."""
    port = port or free_port()
    args = ["frontend", "--model", model, "--core", ",".join(core_addresses), *(tls.frontend_args() if tls else [])]
    return start_service(f"frontend-{port}", [*args, *extra_args], port, log_dir, tls=tls.client() if tls else None)
