"""What the control guard checks besides the token: a browser's cross-site marks, the Host a request names, the launch proof.

A web page the user opens can send requests to ``127.0.0.1``: a simple cross-site POST needs no
CORS preflight (and vLLM reads a JSON body whatever its content type), and after a DNS rebinding
the page's own name resolves to ``127.0.0.1``, so it can read the answers too. Browsers mark such
requests: an ``Origin`` of another site, a ``Sec-Fetch-Site`` other than ``same-origin``/``none``,
and (after a rebinding) a ``Host`` that is the page's name instead of the address the server is
bound to. lmcollect's own client sends none of these marks and names the server by its address.

:func:`launch_proof` lets a launcher check that the server answering on its port is the process it
started: the launcher hands the server a per-launch secret (in its environment) and asks it to
answer a random challenge with an HMAC of it before it sends a token or a prompt there.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable

FETCH_SITES_ALLOWED = frozenset({"same-origin", "none"})
"""``Sec-Fetch-Site`` values a control request may carry (``none``: typed by the user, not sent by a page)."""
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
LAUNCH_PROOF_CONTEXT = b"lmcollect launch proof v1\x00"  # the secret signs nothing else
MIN_CHALLENGE_CHARS = 32
MAX_CHALLENGE_CHARS = 256


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine's loopback."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def header_value(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case bytes, as ASGI gives names) in ``headers``, else None."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def split_host(authority: str, scheme: str) -> tuple[str, int] | None:
    """``"name:port"`` / ``"[v6]:port"`` / ``"name"`` -> (lower-case name without brackets, port); None if malformed."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, bracket, rest = authority[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else ""
    else:
        name, colon, port_text = authority.rpartition(":") if ":" in authority else (authority, "", "")
        if colon and ":" in name:  # an IPv6 address without brackets is not a Host
            return None
    if not name:
        return None
    if not port_text:
        default = DEFAULT_PORTS.get(scheme)
        return None if default is None else (name, default)
    return (name, int(port_text)) if port_text.isdigit() and len(port_text) <= 5 else None


def same_address(name: str, address: str) -> bool:
    """Whether ``name`` is an address literal equal to ``address`` (a name that DNS resolves never is)."""
    try:
        return ipaddress.ip_address(name) == ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return False


def host_refusal(host: bytes | None, server: tuple[str, int] | None, scheme: str) -> str | None:
    """Why a request naming ``Host: host`` may not reach a server bound to ``server`` (address, port), or None.

    The Host must name the server by the address it is bound to (or by a loopback address or
    ``localhost`` when that address is loopback) and by its port: a page's own name, which DNS
    rebinding pointed at the server, is refused.
    """
    if server is None:
        return "the server's own address is unknown (not a TCP socket), so the Host header cannot be checked"
    if host is None:
        return "a control request must carry a Host header naming the server's address and port"
    parsed = split_host(host.decode("latin-1"), scheme)
    if parsed is None:
        return f"Host {host.decode('latin-1')!r} is not a host and port"
    name, port = parsed
    bound, bound_port = str(server[0]), int(server[1])
    named = same_address(name, bound) or (is_loopback_host(bound) and is_loopback_host(name))
    if not named or port != bound_port:
        return (
            f"Host {host.decode('latin-1')!r} does not name this server's address {bound}:{bound_port} "
            "(a page's own name resolved to this machine, as in DNS rebinding)"
        )
    return None


def browser_refusal(headers: Iterable[tuple[bytes, bytes]], scheme: str) -> str | None:
    """Why a request that a browser marked as sent by another site may not reach a control endpoint, or None.

    Refused: a ``Sec-Fetch-Site`` other than ``same-origin``/``none``, and an ``Origin`` (also
    ``null``) that is not the request's own ``scheme://Host``. Requests without these headers
    (lmcollect's client, curl) pass this check.
    """
    headers = list(headers)
    site = header_value(headers, b"sec-fetch-site")
    if site is not None and site.decode("latin-1").strip().lower() not in FETCH_SITES_ALLOWED:
        return f"Sec-Fetch-Site is {site.decode('latin-1')!r}: a web page of another site sent it"
    origin = header_value(headers, b"origin")
    if origin is None:
        return None
    own = _own_origin(header_value(headers, b"host"), scheme)
    given = _origin_key(origin.decode("latin-1"))
    if own is None or given is None or given != own:
        return (
            f"Origin {origin.decode('latin-1')!r} is not this server's own origin: a web page of another site sent it"
        )
    return None


def _own_origin(host: bytes | None, scheme: str) -> tuple[str, str, int] | None:
    if host is None:
        return None
    scheme = {"ws": "http", "wss": "https"}.get(scheme.lower(), scheme.lower())  # a websocket's page is http(s)
    parsed = split_host(host.decode("latin-1"), scheme)
    return None if parsed is None else (scheme, *parsed)


def _origin_key(origin: str) -> tuple[str, str, int] | None:
    """``"http://name:port"`` -> (scheme, name, port); None for ``null`` or anything else."""
    scheme, sep, authority = origin.strip().partition("://")
    if not sep or not authority or "/" in authority:
        return None
    parsed = split_host(authority, scheme.lower())
    return None if parsed is None else (scheme.lower(), *parsed)


def check_challenge(challenge: str) -> str:
    """``challenge`` if it can be a launch challenge (hex, 32 to 256 characters), else ValueError."""
    hex_digits = set("0123456789abcdef")
    if not MIN_CHALLENGE_CHARS <= len(challenge) <= MAX_CHALLENGE_CHARS or not set(challenge) <= hex_digits:
        raise ValueError(
            f"challenge must be {MIN_CHALLENGE_CHARS} to {MAX_CHALLENGE_CHARS} lower-case hex digits, got "
            f"{len(challenge)} characters; e.g. secrets.token_hex(32)."
        )
    return challenge


def launch_proof(secret: str, challenge: str) -> str:
    """The answer to ``challenge`` of the server that holds the launch ``secret`` (HMAC-SHA256, hex)."""
    message = LAUNCH_PROOF_CONTEXT + check_challenge(challenge).encode("ascii")
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()
