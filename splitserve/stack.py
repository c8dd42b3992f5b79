"""Start and stop the split stack as processes (a core, then frontends), the way the deployment files do.

Used by ``splitserve stack`` / ``splitserve demo`` and by the tests, so all three start processes alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

CORE_SERVICE = "splitserve.engine.v1.EngineCore"
FRONTEND_SERVICE = "splitserve.frontend.v1.Generation"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServiceProcess:
    """One ``splitserve core`` or ``splitserve frontend`` process."""

    name: str
    address: str  # host:port it serves on
    process: subprocess.Popen[bytes]
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    service: str = FRONTEND_SERVICE  # the gRPC service whose health is this process's readiness

    def health(self, timeout_s: float = 1.0) -> int:
        """The grpc.health.v1 readiness status (health_pb2.HealthCheckResponse.ServingStatus) of the process's
        service; 0 (UNKNOWN) when it does not answer."""
        try:
            with grpc.insecure_channel(self.address) as channel:
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
    service: str = FRONTEND_SERVICE,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> ServiceProcess:
    """``splitserve <args...> --host <host> --port <port>`` as a child process, logging to ``log_dir``;
    ``service``: the gRPC service whose health tells its readiness; ``env``: added to this environment;
    ``launcher``: the command that runs ``splitserve`` (default: this Python's ``-m splitserve.cli``)."""
    argv = [*(launcher or [sys.executable, "-m", "splitserve.cli"]), *args, "--host", host, "--port", str(port)]
    log_path = None
    stdout: int | object = subprocess.DEVNULL
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        stdout = log_path.open("wb")
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT, env=child_env)  # type: ignore[arg-type]
    return ServiceProcess(name, f"{host}:{port}", process, log_path, argv, service)


def start_core(
    model: str, log_dir: Path | None, extra_args: Sequence[str] = (), port: int | None = None
) -> ServiceProcess:
    port = port or free_port()
    return start_service(f"core-{port}", ["core", "--model", model, *extra_args], port, log_dir, CORE_SERVICE)


def start_frontend(
    model: str, core_addresses: list[str], log_dir: Path | None, extra_args: Sequence[str] = (), port: int | None = None
) -> ServiceProcess:
    port = port or free_port()
    return start_service(
        f"frontend-{port}",
        ["frontend", "--model", model, "--core", ",".join(core_addresses), *extra_args],
        port,
        log_dir,
    )
