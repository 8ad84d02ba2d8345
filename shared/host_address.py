"""The address other machines reach this one at, when services bind every interface.

A node deployment binds ``cluster.ip = "0.0.0.0"`` (configs/node.toml). A bind address is not an
address to hand out: a replica that registered ``tcp://0.0.0.0:PORT`` as its Raft address would
have its peers on other hosts connect to themselves, and a connection file naming ``0.0.0.0``
reaches only the machine it was written on. ``advertised_ip`` names the interface instead:
``host.advertise_ip`` when set, else the bind address when it is a real one, else the source
address of this machine's route toward ``toward`` (the global scheduler: the cluster network).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


def is_wildcard(ip: str) -> bool:
    return ip.strip() in WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, bracketed or with a zone, or ``localhost``) names this
    machine's loopback, an IPv4-mapped IPv6 one included."""
    host = host.strip().strip("[]").split("%", 1)[0]
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def address_host(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); ValueError when it is not one."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address")
    return parts.hostname, parts.port


def route_source_ip(toward: str) -> str:
    """The local address this machine's routing table picks to reach ``toward`` (tcp://HOST:PORT).
    A UDP ``connect`` only resolves the name and looks the route up; nothing is sent."""
    host, port = address_host(toward)
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def advertised_ip(bind_ip: str, configured: str, toward: str) -> str:
    """What to hand out for a socket bound at ``bind_ip`` (see the module docstring)."""
    if configured.strip():
        return configured.strip()
    if not is_wildcard(bind_ip):
        return bind_ip
    return route_source_ip(toward)
