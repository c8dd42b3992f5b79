"""TLS for both gRPC servers and for the clients of a core (a frontend, ``splitserve health``, the stack launcher):
PEM files on disk turned into grpcio credentials. Imports grpc only.

A server with ``--ssl-keyfile`` / ``--ssl-certfile`` speaks TLS only (a plaintext client fails its handshake);
with ``--ssl-ca-certs`` as well it requires every client to present a certificate signed by that CA (mTLS), as a
core does for its frontends. vLLM's ``--ssl-ca-certs`` alone does not require one (that takes its
``--ssl-cert-reqs``); grpcio can only require a client certificate or not ask for one, so here the CA is the switch.
Files are read once, at startup: a renewed certificate takes a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

# The gRPC channel argument that sets the name a server's certificate is checked against (its SAN), instead of the
# target's host: cores reached by IP (a ``dns:///`` name's addresses) are checked against the name.
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of a PEM file given by ``flag``.

    Raises:
        ValueError: the file cannot be read, or holds no PEM block (the message names the flag and the path).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror or e}") from e
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key, and the CA its clients' certificates must be signed by (None: clients
    present none).

    Raises:
        ValueError: from ``from_flags``, when only one of the key and certificate is given, or a CA without them.
    """

    certfile: str
    keyfile: str
    ca_certs: str | None = None

    @property
    def requires_client_certificates(self) -> bool:
        return self.ca_certs is not None

    @classmethod
    def from_flags(cls, keyfile: str | None, certfile: str | None, ca_certs: str | None) -> ServerTLS | None:
        """From ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``; None (plaintext) when none is given."""
        if keyfile is None and certfile is None:
            if ca_certs is not None:
                raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile (the server's own TLS)")
            return None
        if keyfile is None or certfile is None:
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        return cls(certfile, keyfile, ca_certs)

    def credentials(self) -> grpc.ServerCredentials:
        """grpcio's server credentials, read from the files now.

        Raises:
            ValueError: a file cannot be read or is not PEM.
        """
        pair = (read_pem(self.keyfile, "--ssl-keyfile"), read_pem(self.certfile, "--ssl-certfile"))
        roots = read_pem(self.ca_certs, "--ssl-ca-certs") if self.ca_certs is not None else None
        return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=roots is not None)

    def describe(self) -> str:
        return "TLS, client certificates required" if self.requires_client_certificates else "TLS"


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks a server and proves itself: the CA the server's certificate must be signed by (None:
    the system's roots), the client's own certificate and key (for a server that requires one), and the name the
    server's certificate must carry when it is not the target's host (None: the host; a ``dns:///`` core target
    uses its name).

    Raises:
        ValueError: from the constructor, when only one of the key and certificate is given.
    """

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("a client certificate needs both its certificate file and its key file")

    def credentials(self) -> grpc.ChannelCredentials:
        """grpcio's channel credentials, read from the files now.

        Raises:
            ValueError: a file cannot be read or is not PEM.
        """
        roots = read_pem(self.ca_certs, "CA certificates") if self.ca_certs is not None else None
        key = read_pem(self.keyfile, "client key") if self.keyfile is not None else None
        chain = read_pem(self.certfile, "client certificate") if self.certfile is not None else None
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)

    def options(self, default_server_name: str | None = None) -> list[tuple[str, str]]:
        """Channel options: the name the server's certificate is checked against, when it is not the target's
        host (``server_name``, else ``default_server_name``)."""
        name = self.server_name or default_server_name
        return [(TARGET_NAME_OVERRIDE, name)] if name else []


def secure_or_insecure_channel(
    target: str, tls: ClientTLS | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A blocking channel to ``target``: TLS per ``tls``, plaintext when it is None."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=[*(options or []), *tls.options()])


def secure_or_insecure_aio_channel(
    target: str, tls: ClientTLS | None, options: list[tuple[str, object]] | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to ``target``: TLS per ``tls``, plaintext when it is None."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.credentials(), options=[*(options or []), *tls.options()])


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries an API key (``authorization: Bearer <key>``); none without a key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
