"""Who may change what a server serves at run time (``POST /v1/steering/vectors``) and read the
experiment's data, and what a name sent there may be: admin endpoints are refused beyond loopback
without an API key (anyone who reaches the port could change every client's answers) unless opened
on purpose, open on loopback to loopback Host names only (:class:`AdminGate`), and a name is an
artifact name, optionally ``/version``, never a path."""

from __future__ import annotations

import ipaddress
import re

from steerserve.engine.spec import short_repr
from steerserve.server.errors import ApiError

ARTIFACT_REF = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99}(/[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99})?$"
)


def check_ref(ref: str) -> None:
    """A 400 unless ``ref`` is ``name`` or ``name/version`` (never a path)."""
    if not ARTIFACT_REF.fullmatch(ref) or ".." in ref:  # fullmatch: "$" allows a "\n"
        raise ApiError(
            "name: must be an artifact name, optionally /version (never a path)", param="name"
        )


def admin_refusal(host: str, keyed: bool, open_admin: bool) -> str | None:
    """Why admin endpoints are refused: served beyond loopback with no API key and no opt-in,
    anyone who reaches the port could change what every client gets."""
    if keyed or open_admin or loopback(host):
        return None
    return (
        f"the server listens on {host!r} without an API key: set --api-key "
        "(STEERSERVE_API_KEY), or allow open admin endpoints with --open-admin "
        "(STEERSERVE_OPEN_ADMIN=1)"
    )


class AdminGate:
    """The one rule for admin endpoints: an API key decides alone; without one, loopback only
    (naming a loopback host) unless ``--open-admin``."""

    def __init__(self, host: str, keyed: bool, open_admin: bool) -> None:
        self.refusal = admin_refusal(host, keyed, open_admin)
        self.loopback_hosts_only = not keyed and not open_admin
        # Every other keyed route (generation, feedback, the vectors listing): a server on
        # loopback without a key is reachable only from this machine, where a rebound page is
        # the one caller that names another host; a server beyond loopback without a key is
        # open to its network on purpose, Host or not.
        self.api_loopback_hosts_only = self.loopback_hosts_only and loopback(host)

    def check(self, host_header: str | None) -> None:
        """A 403 in OpenAI's format when this request may not use the admin endpoints."""
        if self.refusal:
            raise ApiError(self.refusal, status=403, code="admin_disabled")
        if self.loopback_hosts_only:
            _loopback_host(host_header, "the admin endpoints")

    def check_api(self, host_header: str | None) -> None:
        """The same Host rule for every route behind the API key (generation could otherwise be
        sent, and A/B feedback scored, by any web page the operator opens)."""
        if self.api_loopback_hosts_only:
            _loopback_host(host_header, "this server")


def _loopback_host(host_header: str | None, what: str) -> None:
    if not loopback_name(host_header or ""):
        raise ApiError(
            f"the Host header names {short_repr(host_header)}: without an API key {what} "
            "answers loopback names only (localhost, 127.0.0.1, [::1]), so that a web page "
            "cannot reach it by DNS rebinding; set --api-key (STEERSERVE_API_KEY) to serve "
            "other names",
            status=403,
            code="untrusted_host",
        )


#: A ``Host`` header as RFC 9110 allows it (RFC 3986 ``host [":" port]``): an IP literal in
#: brackets, an IPv4 address or a DNS name, then an optional port of digits; nothing else.
HOST_HEADER = re.compile(
    r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?"
    r"(?:\.[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?)*\.?))(?::[0-9]{1,5})?"
)


def loopback_name(host_header: str) -> bool:
    """Whether a ``Host`` header (port optional) names loopback: ``localhost``, a name under
    ``.localhost`` (browsers resolve it to loopback themselves, RFC 6761), 127.0.0.0/8, ``[::1]``.
    Parsed strictly (:data:`HOST_HEADER`): ``[::1].attacker.example``, ``127.0.0.1:80@x`` or a
    list of hosts are no loopback name."""
    m = HOST_HEADER.fullmatch(host_header.strip().lower())
    if m is None:
        return False
    if m["v6"] is not None:
        return loopback(m["v6"]) and ":" in m["v6"]
    host = m["name"].removesuffix(".")
    return host.endswith(".localhost") or loopback(host)


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
