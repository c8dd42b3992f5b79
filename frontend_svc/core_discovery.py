"""Where the engine cores are. A ``--core`` entry is either a fixed ``host:port`` or ``dns:///name:port``: the
name is resolved again every few seconds to all its addresses, so a Kubernetes headless Service (one address
per ready core pod) gives the frontend every core, and the list follows pods as they come and go.

Names are looked up in ``SPLITSERVE_HOSTS_FILE`` first (a hosts(5) file, read at every refresh), then in the
system's resolver (``getaddrinfo``: /etc/hosts, then DNS).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from splitserve.base import envs

DNS_SCHEME = "dns:///"


@dataclass(frozen=True)
class CoreTarget:
    """One ``--core`` entry."""

    host: str
    port: int
    dns: bool  # resolved again and again to every address of ``host``

    @classmethod
    def parse(cls, text: str) -> CoreTarget:
        """``host:port``, ``[v6]:port`` or ``dns:///name:port``.

        Raises:
            ValueError: the entry has no port or a bad one (the message names the entry).
        """
        dns = text.startswith(DNS_SCHEME)
        rest = text[len(DNS_SCHEME) :] if dns else text
        host, sep, port = rest.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"core address {text!r}: expected host:port or dns:///name:port")
        return cls(host, int(port), dns)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (what gRPC targets take)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def hosts_file_addresses(path: Path, name: str) -> list[str]:
    """The addresses a hosts(5) file gives ``name``, in file order; [] when it has none (or cannot be read)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    addresses = []
    for line in lines:
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and name in fields[1:]:
            addresses.append(fields[0])
    return addresses


async def resolve(target: CoreTarget) -> list[str]:
    """Every ``ip:port`` of ``target`` (sorted, without repeats).

    Raises:
        OSError: the name does not resolve (socket.gaierror).
    """
    hosts_file = envs.hosts_file()
    ips = hosts_file_addresses(hosts_file, target.host) if hosts_file is not None else []
    if not ips:
        infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        ips = [str(info[4][0]) for info in infos]
    return sorted({format_address(ip, target.port) for ip in ips})
