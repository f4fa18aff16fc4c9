"""Which engine endpoints a tenant may have the node dial, and when two endpoints are one.

With API keys, ``POST /v1/engines`` makes the node connect to an endpoint on a tenant's
behalf. By default a tenant may name only ``tcp://`` endpoints at an IP address off this host:
loopback, unspecified, link-local and multicast addresses, host names (they may resolve to
one of those), ``ipc://`` (a socket file of this host) and ``inproc://`` (the node's own
sockets) are refused. ``SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES`` replaces that rule with a
list of prefixes of the endpoint's canonical form; a host name is taken only by a prefix
that names it whole (up to the ``:`` of its port), so that ``tcp://10.0.0.`` admits no
``tcp://10.0.0.example.com``. The node without API keys follows any endpoint.

``canonical`` spells an endpoint one way (the IP address in its short form, the host name in
lower case, the port without leading zeros, the ``ipc://`` path normalised), so that no
spelling escapes a prefix (``..``; ZMQ's ``source;destination`` is no endpoint here) and one
engine is recognised under every spelling.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sessioncache.errors import Refused

SETTING = "SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES"

_TCP = re.compile(
    r"tcp://(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>[0-9]{1,5})"
)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class _Endpoint:
    text: str
    """The canonical form."""
    ip: IPAddress | None
    """The address of a ``tcp://`` endpoint given as one."""
    host_end: int = 0
    """Where the host of a ``tcp://`` endpoint ends in ``text`` (at the ``:`` of its port)."""


def _parse(endpoint: str) -> _Endpoint | None:
    """``tcp://<IP address or host name>:<port>``, ``ipc://<absolute path>`` or
    ``inproc://<name>``, spelled one way; None for anything else."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        m = _TCP.fullmatch(endpoint)
        if m is None or not 0 < int(m["port"]) < 65536:
            return None
        ip: IPAddress | None
        try:
            if m["v6"] is not None:
                ip = ipaddress.IPv6Address(m["v6"])
                host = f"[{ip.compressed}]"
            else:
                ip = ipaddress.IPv4Address(m["host"])
                host = ip.compressed
        except ValueError:
            if m["v6"] is not None:
                return None
            ip, host = None, m["host"].lower().rstrip(".")
        return _Endpoint(f"tcp://{host}:{int(m['port'])}", ip, len("tcp://") + len(host))
    if scheme == "ipc" and rest.startswith("/"):
        return _Endpoint("ipc:///" + posixpath.normpath(rest).lstrip("/"), None)
    if scheme == "inproc" and rest:
        return _Endpoint(endpoint, None)
    return None


def canonical(endpoint: str) -> str:
    """``endpoint`` spelled one way (as given when it is none of the forms above)."""
    parsed = _parse(endpoint)
    return endpoint if parsed is None else parsed.text


def _off_host(ip: IPAddress) -> bool:
    """An address that reaches another host (an IPv4 address inside an IPv6 one counts as
    itself)."""
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ip.ipv4_mapped or ip.sixtofour or ip
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast)


def allowed(endpoint: str, prefixes: Sequence[str] | None) -> str:
    """The canonical form of an endpoint a keyed tenant may register, under the setting's
    ``prefixes`` (None: the default rule); ``Refused``, naming the setting, for the rest."""
    parsed = _parse(endpoint)
    if prefixes is None:
        if parsed is not None and parsed.ip is not None and _off_host(parsed.ip):
            return parsed.text
        raise Refused(
            f"endpoint {endpoint!r} is refused: with API keys a tenant registers tcp:// "
            "endpoints at an IP address off this host (not loopback, unspecified, link-local "
            f"or multicast), unless {SETTING} lists others"
        )
    if parsed is not None and any(
        parsed.text.startswith(p) and (parsed.ip is not None or len(p) > parsed.host_end)
        for p in prefixes
    ):
        return parsed.text
    raise Refused(f"endpoint {endpoint!r} is not under {SETTING}")
