"""Who may change what a server serves at run time (``POST /v1/steering/vectors``), and what a
name sent there may be: admin endpoints are refused beyond loopback without an API key (anyone
who reaches the port could change every client's answers) unless opened on purpose, and a name is
an artifact name, optionally ``/version``, never a path."""

from __future__ import annotations

import ipaddress
import re

from steerserve.server.errors import ApiError

_ARTIFACT_REF = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99}(/[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99})?$"
)


def check_ref(ref: str) -> None:
    """A 400 unless ``ref`` is ``name`` or ``name/version`` (never a path)."""
    if not _ARTIFACT_REF.fullmatch(ref) or ".." in ref:  # fullmatch: "$" allows a "\n"
        raise ApiError(
            "name: must be an artifact name, optionally /version (never a path)", param="name"
        )


def admin_refusal(host: str, api_key: str | None, open_admin: bool) -> str | None:
    """Why admin endpoints are refused: served beyond loopback with no API key and no opt-in,
    anyone who reaches the port could change what every client gets."""
    if api_key or open_admin or loopback(host):
        return None
    return (
        f"the server listens on {host!r} without an API key: set --api-key "
        "(STEERSERVE_API_KEY), or allow open admin endpoints with --open-admin "
        "(STEERSERVE_OPEN_ADMIN=1)"
    )


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
