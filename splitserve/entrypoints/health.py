"""``splitserve health``: a server's ``grpc.health.v1`` status, for container health checks (exit 0 when SERVING)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the server at ``--address`` says SERVING for ``--service``, else 1 (container health checks;
    Kubernetes probes speak grpc.health.v1 themselves, in plaintext only)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.base.tls import secure_or_insecure_channel

    try:
        with secure_or_insecure_channel(args.address, health_tls_from_args(args)) as channel:
            request = health_pb2.HealthCheckRequest(service=args.service)
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout).status
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name} {e.details()}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address} {args.service or '(server)'}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def health_tls_from_args(args: argparse.Namespace) -> Any:
    """``health``'s ``ClientTLS``: TLS with ``--tls`` or any ``--ssl-*`` flag, else None (plaintext)."""
    from splitserve.base.tls import ClientTLS

    flags = (args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile, args.ssl_server_name)
    if not args.tls and all(value is None for value in flags):
        return None
    return ClientTLS(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile, args.ssl_server_name)
