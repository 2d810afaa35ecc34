"""`kvxfer proxy`: an OpenAI-compatible router in front of P and D `vllm serve` instances.

A completion (`POST /v1/completions`, `POST /v1/chat/completions`) is sent
first to a P instance as a one-token, non-streamed request carrying
`kv_transfer_params: {"do_remote_decode": true}`; P prefills, keeps the KV
for D and answers with the `kv_transfer_params` that say where it is. The
client's own request then goes to a D instance with those params added, and
D's answer (streamed or not) is relayed to the client as it arrives. P and
D share the request's `X-Request-Id` (the client's, or one made here) and the
client's `Authorization`. P instances and D instances are each taken in turn.

With `--stream` (`ProxyConfig.stream`), once the proxy knows a P instance's
kvxfer address (from the `kv_transfer_params` of its first answer), it sends
the request to P and D at once: P's carries a fresh stream id, D's the same
id and P's address, and D reads the prompt's KV chunk by chunk while P
prefills it (`kvxfer.nixl.streams`), so only the last chunk's read is left
when P finishes. D's answer is relayed once P's has come (D cannot answer
before P's prefill is done); if P fails, the client gets P's error and D's
request is dropped. Every answer says how its KV moved in
`X-Kvxfer-Transfer` (`stream` or `params`).

An upstream's error answer reaches the client with its own status and body;
an upstream that cannot be reached, or a P that returns no
`kv_transfer_params` (one not started as `kv_producer`), is a 502 that names
the URL. `GET /health` asks every upstream's `/health`; `GET /v1/models` is
answered by a D instance.

This module needs aiohttp (`pip install 'kvxfer[proxy]'`); nothing else in
kvxfer imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvxfer.errors import InvalidInputError, SetupError
from kvxfer.nixl.wire import new_stream_id
from kvxfer.plan.blocks import is_int

__all__ = ["ProxyConfig", "build_app", "check_listen", "parse_urls", "serve"]

log = logging.getLogger(__name__)

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""What P's request carries in `kv_transfer_params`: prefill here, decode elsewhere."""

_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields P must not see: `stream_options` needs `stream`, and a minimum above
P's one token would be refused (vLLM's NIXL proxy drops the same)."""

_FORWARDED_HEADERS = ("Authorization",)
_REQUEST_ID = "X-Request-Id"
_TRANSFER = "X-Kvxfer-Transfer"


def _check_url(flag: str, url: str) -> str:
    """Return `url` without a trailing slash; raise `InvalidInputError` unless it is a server's base URL."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError when out of range or not a number
    except ValueError as e:
        raise InvalidInputError(f"{flag} {url!r} is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInputError(
            f"{flag} {url!r} must be an http:// or https:// URL with a host, e.g. http://10.0.0.5:8100")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidInputError(
            f"{flag} {url!r} must be the server's base URL, without a path (the proxy adds /v1/...)")
    return url.rstrip("/")


def parse_urls(flag: str, text: str) -> tuple[str, ...]:
    """Split a comma-separated `--prefill` / `--decode` value into checked base URLs.

    **Arguments:** `flag`, the option's name (for messages); `text`, e.g.
    `"http://10.0.0.5:8100,http://10.0.0.6:8100"`.

    **Returns:** the URLs without trailing slashes, in the order given.
    Raises `InvalidInputError` naming the first bad value.
    """
    urls = tuple(_check_url(flag, u.strip()) for u in text.split(",") if u.strip())
    if not urls:
        raise InvalidInputError(f"{flag} needs at least one URL, got {text!r}")
    return urls


@dataclass(frozen=True)
class ProxyConfig:
    """Where the proxy listens and which P and D instances it routes to.

    `prefill` and `decode` are base URLs (`parse_urls`); `health_timeout_s`
    bounds each upstream's `/health` answer, `connect_timeout_s` each
    connection to an upstream. Generation itself has no time limit.
    `max_body_mb`: the largest request body taken (`--max-body-mb`); a larger one
    is a 413 in the OpenAI shape before P or D see it. The default, 64 MiB, takes a
    chat with a few base64 images or a 200k-token prompt as ids (about 1.4 MB).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    health_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    stream: bool = False
    max_body_mb: float = 64.0

    def __post_init__(self) -> None:
        for flag, urls in (("--prefill", self.prefill), ("--decode", self.decode)):
            if isinstance(urls, str) or not urls:
                raise InvalidInputError(f"{flag} needs a non-empty sequence of URLs, got {urls!r}")
            object.__setattr__(self, flag[2:], tuple(_check_url(flag, u) for u in urls))
        if not is_int(self.port) or not 1 <= self.port <= 65535:
            raise InvalidInputError(f"--port must be in 1-65535, got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidInputError(f"--host must be a host name or address, got {self.host!r}")
        if not isinstance(self.stream, bool):
            raise InvalidInputError(f"stream must be a bool, got {self.stream!r}")
        if (isinstance(self.max_body_mb, bool) or not isinstance(self.max_body_mb, (int, float))
                or not 0 < self.max_body_mb <= 4096):
            raise InvalidInputError(f"--max-body-mb must be a number in (0, 4096], got "
                                    f"{self.max_body_mb!r}")
        for name in ("health_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidInputError(f"{name} must be a positive number of seconds, got {value!r}")


class _Upstreams:
    """The session to the upstreams and the round-robin turn of each pool."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._next_prefill = itertools.cycle(config.prefill)
        self._next_decode = itertools.cycle(config.decode)
        self._session: aiohttp.ClientSession | None = None
        self.kv: dict[str, dict[str, Any]] = {}  # P url -> its kvxfer address, once known

    def learn(self, url: str, params: dict[str, Any]) -> None:
        """Keep P's kvxfer address from its `kv_transfer_params` (a P restarted elsewhere is
        learned again from its next answer)."""
        address = {key: params.get(key) for key in ("peer", "host", "port")}
        if isinstance(address["peer"], str) and isinstance(address["host"], str) and is_int(
                address["port"]):
            self.kv[url] = address

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise SetupError("the proxy's upstream session opens when its app starts "
                             "(serve, or an aiohttp.web.AppRunner)")
        return self._session

    def prefill(self) -> str:
        return next(self._next_prefill)

    def decode(self) -> str:
        return next(self._next_decode)

    async def open(self) -> None:
        # No limit on connections: each streamed answer holds one for its whole generation.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


_UPSTREAMS = web.AppKey("upstreams", _Upstreams)


def _error(status: int, message: str, kind: str, **extra: Any) -> web.Response:
    """An OpenAI-style error answer made by the proxy itself."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status, **extra}},
                             status=status)


def _unreachable(role: str, url: str, exc: BaseException) -> web.Response:
    reason = str(exc) or type(exc).__name__
    log.warning("%s instance %s failed: %s", role, url, reason)
    return _error(502, f"{role} instance {url} failed: {reason}", "upstream_unreachable", upstream=url)


def _upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    headers[_REQUEST_ID] = request_id
    headers["Accept-Encoding"] = "identity"  # bodies are relayed as they come, never re-encoded
    return headers


def _passed_through(status: int, body: bytes, content_type: str | None) -> web.Response:
    """An upstream's answer, status and body unchanged."""
    headers = {"Content-Type": content_type} if content_type else None
    return web.Response(status=status, body=body, headers=headers)


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """P's request for the client's `body`: one token, not streamed, KV kept for D."""
    sent = {k: v for k, v in body.items() if k not in _DROPPED_FOR_PREFILL}
    sent.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in body:
        sent["max_completion_tokens"] = 1
    return sent


async def _prefill(upstreams: _Upstreams, url: str, path: str, body: dict[str, Any],
                   headers: dict[str, str], stream: str | None = None
                   ) -> dict[str, Any] | web.Response:
    """Run P's part at `url` (streamed to D under `stream`, if given); return P's
    `kv_transfer_params`, or the answer the client gets instead."""
    sent = _prefill_body(body)
    if stream is not None:
        sent["kv_transfer_params"]["stream"] = stream
    try:
        async with upstreams.session.post(url + path, json=sent, headers=headers) as resp:
            data = await resp.read()
            status, content_type = resp.status, resp.headers.get("Content-Type")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _unreachable("prefill", url, e)
    if not 200 <= status < 300:
        log.debug("prefill instance %s answered %s for %s", url, status, headers[_REQUEST_ID])
        return _passed_through(status, data, content_type)
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return _error(502, f"prefill instance {url} answered {status} with a body that is not a "
                      f"JSON object", "bad_upstream_response", upstream=url)
    if not isinstance(params, dict) or not params:
        return _error(502, f"prefill instance {url} returned no kv_transfer_params: is it started "
                      f"with a kv_producer --kv-transfer-config?", "bad_upstream_response", upstream=url)
    upstreams.learn(url, params)
    return params


async def _relay(request: web.Request, resp: aiohttp.ClientResponse,
                 request_id: str, transfer: str) -> web.StreamResponse:
    """Send `resp` to the client as it arrives: status, content type and body, chunk by chunk."""
    out = web.StreamResponse(status=resp.status, reason=resp.reason)
    if "Content-Type" in resp.headers:
        out.headers["Content-Type"] = resp.headers["Content-Type"]
    out.headers[_REQUEST_ID] = request_id
    out.headers[_TRANSFER] = transfer
    if resp.content_length is not None and "Content-Encoding" not in resp.headers:
        out.content_length = resp.content_length
    await out.prepare(request)
    async for chunk in resp.content.iter_any():
        await out.write(chunk)
    await out.write_eof()
    return out


async def _decode(request: web.Request, url: str, sent: Awaitable[aiohttp.ClientResponse],
                  headers: dict[str, str], transfer: str) -> web.StreamResponse:
    """Relay D's answer to the request `sent` to D at `url`."""
    try:
        resp = await sent
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _unreachable("decode", url, e)
    async with resp:
        try:
            return await _relay(request, resp, headers[_REQUEST_ID], transfer)
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
            # The client already has D's status: dropping its connection is the
            # only way left to tell it that the answer is incomplete.
            log.warning("request %s: relaying decode instance %s broke off: %r",
                        headers[_REQUEST_ID], url, e)
            raise


async def _completions(request: web.Request) -> web.StreamResponse:
    """P prefills, D decodes, the client gets D's answer."""
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[_UPSTREAMS].config.max_body_mb
        return _error(413, f"request body is over --max-body-mb {limit:g} MiB",
                      "invalid_request_error")
    except ValueError as e:
        return _error(400, f"request body is not JSON: {e}", "invalid_request_error")
    except RecursionError:
        return _error(400, "request body is JSON nested too deeply to read",
                      "invalid_request_error")
    if not isinstance(body, dict):
        return _error(400, f"request body must be a JSON object, got {type(body).__name__}",
                      "invalid_request_error")
    request_id = request.headers.get(_REQUEST_ID) or uuid.uuid4().hex
    headers = _upstream_headers(request, request_id)
    upstreams = request.app[_UPSTREAMS]
    p_url, d_url = upstreams.prefill(), upstreams.decode()
    address = upstreams.kv.get(p_url) if upstreams.config.stream else None
    if address is not None:
        return await _streamed(request, upstreams, p_url, d_url, address, body, headers)
    params = await _prefill(upstreams, p_url, request.path, body, headers)
    if isinstance(params, web.Response):
        return params
    log.debug("request %s prefilled; params %s", request_id, params)
    sent = upstreams.session.post(d_url + request.path, headers=headers,
                                  json={**body, "kv_transfer_params": params})
    return await _decode(request, d_url, sent, headers, "params")


async def _streamed(request: web.Request, upstreams: _Upstreams, p_url: str, d_url: str,
                    address: dict[str, Any], body: dict[str, Any],
                    headers: dict[str, str]) -> web.StreamResponse:
    """P and D at once: D reads P's KV by the stream id both are given, while P prefills."""
    stream = new_stream_id()
    to_d = {"do_remote_prefill": True, "do_remote_decode": False, "stream": stream, **address}
    sent = asyncio.ensure_future(upstreams.session.post(
        d_url + request.path, headers=headers, json={**body, "kv_transfer_params": to_d}))
    params = await _prefill(upstreams, p_url, request.path, body, headers, stream)
    if isinstance(params, web.Response):  # D would wait for a stream P never fills
        sent.cancel()
        with contextlib.suppress(BaseException):
            (await sent).close()
        return params
    return await _decode(request, d_url, sent, headers, "stream")


async def _models(request: web.Request) -> web.Response:
    upstreams = request.app[_UPSTREAMS]
    url = upstreams.decode()
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    try:
        async with upstreams.session.get(url + "/v1/models", headers=headers) as resp:
            return _passed_through(resp.status, await resp.read(), resp.headers.get("Content-Type"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _unreachable("decode", url, e)


async def _down_reason(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """Why `url`'s `/health` does not answer 2xx, or None when it does."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return None if 200 <= resp.status < 300 else f"/health answered {resp.status}"
    except asyncio.TimeoutError:
        return f"/health did not answer within {timeout_s} s"
    except aiohttp.ClientError as e:
        return str(e) or type(e).__name__


async def _health(request: web.Request) -> web.Response:
    """200 when every P and D instance answers its `/health`, else 503 naming those down."""
    upstreams = request.app[_UPSTREAMS]
    config = upstreams.config
    roles = [("prefill", u) for u in config.prefill] + [("decode", u) for u in config.decode]
    reasons = await asyncio.gather(*(_down_reason(upstreams.session, url, config.health_timeout_s)
                                     for _, url in roles))
    down = [{"role": role, "url": url, "reason": reason}
            for (role, url), reason in zip(roles, reasons) if reason is not None]
    answer = {"status": "unhealthy" if down else "ok", "prefill": list(config.prefill),
              "decode": list(config.decode), "down": down}
    return web.json_response(answer, status=503 if down else 200)


def check_listen(host: str, port: int) -> None:
    """`InvalidInputError` naming `--host` or `--port` unless a socket can listen there now."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise InvalidInputError(f"--host {host!r} does not resolve: {e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp listens
        try:
            s.bind(address)
        except OSError as e:
            raise InvalidInputError(f"--port {port} on --host {host!r} cannot be listened on: "
                                    f"{e.strerror or e}") from None


def build_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (run it with `serve`, or an `aiohttp.web.AppRunner`)."""
    app = web.Application(client_max_size=int(config.max_body_mb * (1 << 20)))
    upstreams = _Upstreams(config)
    app[_UPSTREAMS] = upstreams

    async def session(_app: web.Application):  # aiohttp's cleanup context: open, then close
        await upstreams.open()
        yield
        await upstreams.close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


def serve(config: ProxyConfig) -> None:
    """Run the proxy until interrupted (SIGINT / SIGTERM). A `--host` that does not resolve, or
    a `--port` this process cannot listen on, is refused by name before the banner."""
    check_listen(config.host, config.port)
    print(f"kvxfer proxy on http://{config.host}:{config.port}: prefill "
             f"{', '.join(config.prefill)}; decode {', '.join(config.decode)}")
    web.run_app(build_app(config), host=config.host, port=config.port, print=None)

