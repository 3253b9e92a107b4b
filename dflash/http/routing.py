"""Method + path -> handler, CORS on every response, API-key auth and the Host check. Generic: no
LLM knowledge.

The query string never takes part in routing: `/v1/messages?beta=true` (Claude Code) is
`/v1/messages`, and `/v1/models?client_version=…` (Codex) is `/v1/models`.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Collection, Mapping, Sequence

import attrs

from dflash.http.server import ErrorResponder, Handler, Request, Response, ResponseWriter


@attrs.frozen
class CORSPolicy:
    """`("*",)` allows every origin; otherwise the request's Origin is echoed when listed."""

    allowed_origins: tuple[str, ...] = ("*",)

    def headers(self, request: Request | None) -> list[tuple[str, str]]:
        if not self.allowed_origins:
            return []
        if "*" in self.allowed_origins:
            return [("access-control-allow-origin", "*")]
        origin = request.header("origin") if request else None
        if origin in self.allowed_origins:
            return [("access-control-allow-origin", origin), ("vary", "Origin")]
        return [("vary", "Origin")]

    def allows(self, origin: str | None) -> bool:
        return "*" in self.allowed_origins or (origin is not None and origin in self.allowed_origins)

    def preflight(self, request: Request) -> Response:
        if not self.allows(request.header("origin")):
            return Response(204, headers=(("vary", "Origin"),))  # no allow headers: the browser refuses
        # Echo the requested headers: a bare `*` does not cover Authorization in browsers.
        requested = request.header("access-control-request-headers") or "*"
        return Response(204, headers=(
            ("access-control-allow-methods", "GET, HEAD, POST, OPTIONS"),
            ("access-control-allow-headers", requested),
            ("access-control-max-age", "600"),
        ))


def is_loopback_host(host: str) -> bool:
    """A listen address or Host name that only this machine reaches: a loopback IP address (an
    IPv6 one with or without brackets), `localhost` or a name under it (RFC 6761)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port (`[::1]:8000` -> `[::1]`)."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


@attrs.frozen
class HostPolicy:
    """Against DNS rebinding: a page the user visits can make its own name resolve to 127.0.0.1
    and then talk to a local server as a same-origin site. Such requests carry the page's name in
    Host, so a server on a loopback address answers only Hosts that are loopback names or listed."""

    enforced: bool = False
    allowed_hosts: tuple[str, ...] = ()

    def allows(self, request: Request) -> bool:
        header = request.header("host")
        if not self.enforced or header is None:  # HTTP/1.0 clients may send none; browsers always do
            return True
        name = host_name(header.strip()).lower()
        return is_loopback_host(name) or name in (host.lower() for host in self.allowed_hosts)


class APIKeys:
    """Accepts `Authorization: Bearer KEY` or `x-api-key: KEY` (Claude Code sends the latter)."""

    def __init__(self, keys: Sequence[str]):
        self._keys = [key.encode() for key in keys]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def accepts(self, request: Request) -> bool:
        offered = offered_key(request)
        if offered is None:
            return False
        offered_bytes = offered.encode()
        # Compare against every key, without stopping at a match, so timing says nothing.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(offered_bytes, key)
        return matched


def offered_key(request: Request) -> str | None:
    """The API key a request offers: `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    authorization = request.header("authorization") or ""
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip()
    return request.header("x-api-key")


class Router:
    def __init__(self, routes: Mapping[tuple[str, str], Handler], *, error_response: ErrorResponder,
                 api_keys: Sequence[str] = (), cors: CORSPolicy = CORSPolicy(), hosts: HostPolicy = HostPolicy(),
                 open_paths: Collection[str] = ("/health",),
                 is_open: Callable[[Request], bool] = lambda request: False):
        self._routes = dict(routes)
        self._error_response = error_response
        self._keys = APIKeys(api_keys)
        self._hosts = hosts
        self._cors = cors
        self._open_paths = frozenset(open_paths)
        self._is_open = is_open  # other requests answered without a key (decided per request, not by path)

    def common_headers(self, request: Request | None) -> list[tuple[str, str]]:
        return self._cors.headers(request)

    async def __call__(self, request: Request, writer: ResponseWriter) -> Response | None:
        if not self._hosts.allows(request):
            return self._error_response(request.path, 403, f"Host {request.header('host')!r} is not served here: "
                                                           "this server answers loopback names and "
                                                           "[server] allowed_hosts only")
        if request.method == "OPTIONS":
            return self._cors.preflight(request)
        if self._keys.required and not self._open(request) and not self._keys.accepts(request):
            response = self._error_response(request.path, 401, "invalid or missing API key")
            return attrs.evolve(response, headers=(*response.headers, ("www-authenticate", "Bearer")))
        handler = self._find(request)
        if handler is None:
            return self._not_routed(request)
        return await handler(request, writer)

    def _open(self, request: Request) -> bool:
        return request.path in self._open_paths or self._is_open(request)

    def _find(self, request: Request) -> Handler | None:
        handler = self._routes.get((request.method, request.path))
        if handler is None and request.method == "HEAD":
            handler = self._routes.get(("GET", request.path))
        return handler

    def _not_routed(self, request: Request) -> Response:
        allowed = sorted(method for method, path in self._routes if path == request.path)
        if not allowed:
            return self._error_response(request.path, 404, f"unknown endpoint {request.method} {request.path}")
        if "GET" in allowed:
            allowed.append("HEAD")
        response = self._error_response(
            request.path, 405, f"method {request.method} is not allowed on {request.path}; use {', '.join(allowed)}")
        return attrs.evolve(response, headers=(*response.headers, ("allow", ", ".join([*allowed, "OPTIONS"]))))
