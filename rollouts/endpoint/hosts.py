"""Which `Host` headers a local server answers: its guard against DNS rebinding.

A page on another site can make a browser send requests to 127.0.0.1 under a name it controls
(`evil.example` resolving to 127.0.0.1); the browser then sends `Host: evil.example`. A server
bound to loopback answers only the loopback names (localhost, 127.0.0.1, [::1]) and the host it was
bound to; one bound to all interfaces (0.0.0.0, ::) was opened to other machines on purpose and
answers any name. The endpoint (rollouts/endpoint/server.py) and the viewer (`toolgym view`) use it.
"""

from __future__ import annotations

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_ALL_INTERFACES = frozenset({"0.0.0.0", "::", ""})


def host_name(header: str) -> str:
    """The name in a Host header, without its port and brackets, lowercased."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str | None, bind_host: str) -> bool:
    """Whether a request with this Host header (None: absent, as HTTP/1.0 allows) is answered by a
    server bound to `bind_host`."""
    if bind_host.strip("[]") in _ALL_INTERFACES or header is None:
        return True
    name = host_name(header)
    return name in _LOOPBACK or name == bind_host.strip("[]").lower()
