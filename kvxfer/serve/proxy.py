"""`kvxfer proxy`: an OpenAI-compatible router in front of P and D `vllm serve` instances.

A completion (`POST /v1/completions`, `POST /v1/chat/completions`) is sent
first to a P instance as a one-token, non-streamed request carrying
`kv_transfer_params: {"do_remote_decode": true}`; P prefills, keeps the KV
for D and answers with the `kv_transfer_params` that say where it is. The
client's own request then goes to a D instance with those params added, and
D's answer (streamed or not) is relayed to the client as it arrives. P and
D share the request's `X-Request-Id` (the client's, or one made here) and the
client's `Authorization`. Which P and which D is `kvxfer.serve.routing`'s choice (by the
prompts each instance answered, the requests in flight, and `X-Session-Id`); when D holds
all but `--local-prefill-tokens` of the prompt, P is skipped and D's request carries
`kv_transfer_params: {"local_prefill": true, ...}` (`X-Kvxfer-Transfer: local`). Every answer
names its route in `X-Kvxfer-Route`; `GET /metrics` counts the choices.

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
the URL. A P that does not answer within `--prefill-timeout`, or a D within
`--decode-timeout`, is a 504 naming the URL and the flag (after P's, D is not
asked); a D that runs over once its answer has begun ends the stream. Of P's
answer the proxy reads at most `--prefill-max-bytes` (it needs only the
`kv_transfer_params`): a longer one, or one streamed without end, is a 502
naming the limit, and P's request is closed.

A client that goes away (its connection closes) stops its request: the
proxy closes its requests to P and D, which is how vLLM learns to abort
them, and never asks D after P. aiohttp (since 3.9, by default) does not
cancel a handler whose client left, so the proxy looks at the client's
connection itself while it waits; a handler that is cancelled (an app run
with `handler_cancellation=True`, or shutting down) closes them too.

`GET /health` asks every upstream's `/health`; `GET /v1/models` is
answered by a D instance.

This module needs aiohttp (`pip install 'kvxfer[proxy]'`); nothing else in
kvxfer imports it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvxfer.errors import InvalidInputError, SetupError
from kvxfer.nixl.wire import new_stream_id
from kvxfer.plan.blocks import is_int
from kvxfer.serve.routing import Prompt, Route, Router

__all__ = ["ProxyConfig", "build_app", "check_listen", "parse_urls", "serve"]

log = logging.getLogger(__name__)

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""What P's request carries in `kv_transfer_params`: prefill here, decode elsewhere."""

LOCAL_PARAMS = {"do_remote_decode": False, "do_remote_prefill": False, "local_prefill": True}
"""What D's request carries when D prefills alone: a local prefill, which kvxfer's D counts as
such, not as a fallback."""

_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields P must not see: `stream_options` needs `stream`, and a minimum above
P's one token would be refused (vLLM's NIXL proxy drops the same)."""

_CLIENT_CHECK_S = 0.5
"""How often a waiting request looks whether its client is still connected: P and D learn
that a request is abandoned at most this late (and every look is a timer, cheap)."""

_CLIENT_GONE = 499
"""The status logged for a request whose client went away (nginx's "client closed request");
nothing reaches the client."""

_FORWARDED_HEADERS = ("Authorization",)
_REQUEST_ID = "X-Request-Id"
_SESSION = "X-Session-Id"
_TRANSFER = "X-Kvxfer-Transfer"
_ROUTE = "X-Kvxfer-Route"


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
    connection to an upstream.
    `prefill_timeout_s` (`--prefill-timeout`) bounds P's whole answer: its queue, the
    prompt's prefill and the transfer's start. The default, 600 s, leaves a busy P many
    minutes for a prompt of hundreds of thousands of tokens, yet frees a hung one.
    `decode_timeout_s` (`--decode-timeout`) bounds D's answer, from P's answer to D's last
    byte. The default, 3600 s, lets a long generation finish (30k tokens at 10 tokens/s
    under load), yet frees a D that stalls. A P over its time is a 504 and D is not asked;
    a D over its time is a 504 or, once its answer has begun, an ended stream.
    `max_body_mb`: the largest request body taken (`--max-body-mb`); a larger one
    is a 413 in the OpenAI shape before P or D see it. The default, 64 MiB, takes a
    chat with a few base64 images or a 200k-token prompt as ids (about 1.4 MB).
    `prefill_max_bytes` (`--prefill-max-bytes`): the most of P's answer read, so that a P
    answering without end (streaming, say) cannot grow the proxy; more is a 502. The
    default, 4 MiB, is thousands of times a one-token answer with its `kv_transfer_params`.
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    health_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    stream: bool = False
    max_body_mb: float = 64.0
    prefill_timeout_s: float = 600.0
    decode_timeout_s: float = 3600.0
    prefill_max_bytes: int = 4 << 20
    route: str = "prefix"
    local_prefill_tokens: int = 512
    route_imbalance: int = 4
    health_interval_s: float = 5.0

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
        for flag, value in (("--prefill-timeout", self.prefill_timeout_s),
                            ("--decode-timeout", self.decode_timeout_s)):
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                    or not math.isfinite(value)):
                raise InvalidInputError(f"{flag} must be a positive, finite number of seconds, "
                                        f"got {value!r}")
        if not is_int(self.prefill_max_bytes) or not self.prefill_max_bytes > 0:
            raise InvalidInputError(f"--prefill-max-bytes must be a positive int, got "
                                    f"{self.prefill_max_bytes!r}")
        value = self.health_interval_s
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                or not math.isfinite(value)):
            raise InvalidInputError(f"--health-interval must be a positive, finite number of "
                                    f"seconds, got {value!r}")
        self.router()  # refuses a bad --route, --local-prefill-tokens or --route-imbalance

    def router(self) -> Router:
        """A fresh `Router` over these instances with these settings."""
        return Router(self.prefill, self.decode, self.route, self.local_prefill_tokens,
                      self.route_imbalance)


class _Upstreams:
    """The session to the upstreams and the router that picks among them."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.router = config.router()
        self.sized: set[str] = set()  # upstreams whose KV cache size was asked for
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


class _Unreached(Exception):
    """P could not be connected to: the request never reached it. `answer` is its 502."""

    def __init__(self, answer: web.Response) -> None:
        super().__init__(answer.text)
        self.answer = answer


def _timed_out(role: str, url: str, flag: str, timeout_s: float, request_id: str) -> web.Response:
    """The 504 for an upstream that did not answer within `flag`'s `timeout_s`."""
    log.warning("request %s: %s instance %s did not answer within %s %g s", request_id, role, url,
                flag, timeout_s)
    return _error(504, f"{role} instance {url} did not answer within {flag} {timeout_s:g} s",
                  "upstream_timeout", upstream=url)


def _connected(request: web.Request) -> bool:
    """Whether the client's connection is still open."""
    transport = request.transport
    return transport is not None and not transport.is_closing()


async def _disconnected(request: web.Request) -> None:
    """Return once the client's connection has closed (looked at every `_CLIENT_CHECK_S`: aiohttp
    has no event for it, and by default does not cancel the handler)."""
    while _connected(request):
        await asyncio.sleep(_CLIENT_CHECK_S)


async def _cancel(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended, its `async with`s having closed what it opened
    (again, should a `wait_for` in it have swallowed the cancellation, as on Python < 3.12)."""
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=_CLIENT_CHECK_S)


async def _for_client(request: web.Request, request_id: str,
                      work: Coroutine[Any, Any, web.StreamResponse]) -> web.StreamResponse:
    """`work`'s answer while the client is connected. Once it has gone away, `work` is cancelled:
    its requests to P and D are closed (vLLM aborts a request whose connection closes) and D is
    not asked after P. So is it when this handler is cancelled, and the cancellation goes on."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # aiohttp's handler_cancellation, or the proxy stopping
        await _cancel(task)
        log.info("request %s: cancelled (%s); its requests to P and D are closed", request_id,
                 "the proxy is stopping" if _connected(request) else "the client went away")
        raise
    finally:
        watch.cancel()
    if not task.done():
        await _cancel(task)
    if task.cancelled() or (task.exception() is not None and not _connected(request)):
        log.info("request %s: the client went away; its requests to P and D are closed", request_id)
        return _error(_CLIENT_GONE, "the client closed the request", "client_closed_request")
    return task.result()


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


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """`resp`'s body, or None (not reading on) once it is over `limit` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    data = bytearray()
    while chunk := await resp.content.read(limit + 1 - len(data)):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


async def _ask_prefill(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                       headers: dict[str, str], limit: int
                       ) -> tuple[int, bytes, str | None] | web.Response:
    """P's status, body and content type for `body`, or the 502 when P at `url` fails or
    answers more than `limit` bytes (its request is then closed: P aborts it); raises
    `_Unreached` (with that 502) when no connection to P could be made."""
    try:
        async with session.post(url + path, json=body, headers=headers) as resp:
            data = await _read_at_most(resp, limit)
            if data is None:
                resp.close()
                log.warning("prefill instance %s answered over --prefill-max-bytes %d for %s", url,
                            limit, headers[_REQUEST_ID])
                return _error(502, f"prefill instance {url} answered more than --prefill-max-bytes "
                              f"{limit} bytes", "bad_upstream_response", upstream=url)
            return resp.status, data, resp.headers.get("Content-Type")
    except aiohttp.ClientConnectorError as e:  # no connection: nothing reached P
        raise _Unreached(_unreachable("prefill", url, e)) from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _unreachable("prefill", url, e)


async def _prefill(upstreams: _Upstreams, url: str, path: str, body: dict[str, Any],
                   headers: dict[str, str], stream: str | None = None
                   ) -> dict[str, Any] | web.Response:
    """Run P's part at `url` (streamed to D under `stream`, if given) within `--prefill-timeout`;
    return P's `kv_transfer_params`, or the answer the client gets instead."""
    sent = _prefill_body(body)
    if stream is not None:
        sent["kv_transfer_params"]["stream"] = stream
    timeout_s, limit = upstreams.config.prefill_timeout_s, upstreams.config.prefill_max_bytes
    try:  # a timeout inside _ask_prefill is its 502: one that comes out is this one
        answer = await asyncio.wait_for(
            _ask_prefill(upstreams.session, url, path, sent, headers, limit), timeout_s)
    except asyncio.TimeoutError:
        return _timed_out("prefill", url, "--prefill-timeout", timeout_s, headers[_REQUEST_ID])
    if isinstance(answer, web.Response):
        return answer
    status, data, content_type = answer
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


async def _relay(request: web.Request, resp: aiohttp.ClientResponse, out: web.StreamResponse,
                 request_id: str, transfer: str) -> web.StreamResponse:
    """Send `resp` to the client through `out` as it arrives: status, content type and body,
    chunk by chunk."""
    out.set_status(resp.status, resp.reason)
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


def _drop(sent: asyncio.Future) -> None:
    """Cancel the request `sent` to D, closing D's answer if it has come (D aborts the request)."""

    def close(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    sent.add_done_callback(close)
    sent.cancel()


async def _decode(request: web.Request, upstreams: _Upstreams, route: Route, sent: asyncio.Future,
                  headers: dict[str, str], transfer: str) -> web.StreamResponse:
    """Relay D's answer to the request `sent` to `route`'s D within `--decode-timeout`: a D over
    its time is a 504 or, once the client has D's status, an ended stream. Whatever way this
    ends, D's answer is closed."""
    url, timeout_s = route.decode, upstreams.config.decode_timeout_s
    out = web.StreamResponse(headers={_ROUTE: route.header()})
    try:  # errors inside _relayed are its own: a timeout that comes out is this one
        return await asyncio.wait_for(_relayed(request, url, sent, out, headers, transfer), timeout_s)
    except asyncio.TimeoutError:
        if not out.prepared:
            return _timed_out("decode", url, "--decode-timeout", timeout_s, headers[_REQUEST_ID])
        # As when D breaks off: dropping the client's connection says the answer is incomplete.
        log.warning("request %s: decode instance %s did not finish within --decode-timeout %g s; "
                    "ending the stream", headers[_REQUEST_ID], url, timeout_s)
        raise
    finally:
        _drop(sent)


async def _relayed(request: web.Request, url: str, sent: asyncio.Future, out: web.StreamResponse,
                   headers: dict[str, str], transfer: str) -> web.StreamResponse:
    """D's answer to the request `sent` relayed through `out`, or the 502 when D cannot be had."""
    try:
        resp = await sent
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _unreachable("decode", url, e)
    async with resp:
        try:
            return await _relay(request, resp, out, headers[_REQUEST_ID], transfer)
        except (aiohttp.ClientError, ConnectionError) as e:
            if _connected(request):  # else the client left, which _for_client logs
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
    return await _for_client(request, request_id, _route(request, body, headers))


async def _route(request: web.Request, body: dict[str, Any], headers: dict[str, str]
                 ) -> web.StreamResponse:
    """The router's choice, then P's part and D's with P's `kv_transfer_params` (or both at once:
    `_streamed`), or D's alone when it prefills the prompt itself."""
    upstreams = request.app[_UPSTREAMS]
    prompt = Prompt.of(request.path, body)
    route = upstreams.router.choose(prompt, request.headers.get(_SESSION))
    log.debug("request %s: %s", headers[_REQUEST_ID], route.header())
    upstreams.router.started(route)
    answer, used = None, route
    try:
        answer, used = await _routed(request, upstreams, route, body, headers)
        return answer
    finally:
        upstreams.router.finished(route)
        if answer is not None and 200 <= answer.status < 300:
            upstreams.router.answered(used, prompt)


async def _routed(request: web.Request, upstreams: _Upstreams, route: Route, body: dict[str, Any],
                  headers: dict[str, str]) -> tuple[web.StreamResponse, Route]:
    """The client's answer by `route`, and the route it took: with local prefill on, a P that
    cannot be connected to is marked down and D prefills the prompt alone instead."""
    if route.prefill is None:
        return await _local(request, upstreams, route, body, headers), route
    try:
        return await _through_p(request, upstreams, route, body, headers), route
    except _Unreached as e:
        if not upstreams.config.local_prefill_tokens:
            return e.answer, route
    upstreams.router.mark(route.prefill, up=False)
    local = upstreams.router.instead_of_p(route)
    log.warning("request %s: prefill instance %s cannot be reached; decode instance %s "
                "prefills it alone", headers[_REQUEST_ID], route.prefill, route.decode)
    return await _local(request, upstreams, local, body, headers), local


async def _through_p(request: web.Request, upstreams: _Upstreams, route: Route,
                     body: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
    """P's part, then D's with P's `kv_transfer_params` (or both at once: `_streamed`); raises
    `_Unreached` when P cannot be connected to."""
    address = upstreams.kv.get(route.prefill) if upstreams.config.stream else None
    if address is not None:
        return await _streamed(request, upstreams, route, address, body, headers)
    params = await _prefill(upstreams, route.prefill, request.path, body, headers)
    if isinstance(params, web.Response):
        return params
    log.debug("request %s prefilled; params %s", headers[_REQUEST_ID], params)
    sent = asyncio.ensure_future(upstreams.session.post(
        route.decode + request.path, headers=headers, json={**body, "kv_transfer_params": params}))
    return await _decode(request, upstreams, route, sent, headers, "params")


async def _local(request: web.Request, upstreams: _Upstreams, route: Route, body: dict[str, Any],
                 headers: dict[str, str]) -> web.StreamResponse:
    """D's answer for a prompt it prefills alone (`route` has no P)."""
    sent = asyncio.ensure_future(upstreams.session.post(
        route.decode + request.path, headers=headers, json={**body, "kv_transfer_params": LOCAL_PARAMS}))
    return await _decode(request, upstreams, route, sent, headers, "local")


async def _streamed(request: web.Request, upstreams: _Upstreams, route: Route,
                    address: dict[str, Any], body: dict[str, Any],
                    headers: dict[str, str]) -> web.StreamResponse:
    """P and D at once: D reads P's KV by the stream id both are given, while P prefills."""
    stream = new_stream_id()
    to_d = {"do_remote_prefill": True, "do_remote_decode": False, "stream": stream, **address}
    sent = asyncio.ensure_future(upstreams.session.post(
        route.decode + request.path, headers=headers, json={**body, "kv_transfer_params": to_d}))
    try:
        params = await _prefill(upstreams, route.prefill, request.path, body, headers, stream)
    except BaseException:  # cancelled, the client gone: D would wait for a stream P never fills
        _drop(sent)
        raise
    if isinstance(params, web.Response):  # D would wait for a stream P never fills
        _drop(sent)
        return params
    return await _decode(request, upstreams, route, sent, headers, "stream")


async def _models(request: web.Request) -> web.Response:
    upstreams = request.app[_UPSTREAMS]
    url = upstreams.router.any_decode()
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


async def _check(upstreams: _Upstreams) -> list[dict[str, str]]:
    """Ask every P and D instance's `/health`; mark each up or down for the router; return those
    down (role, url, reason)."""
    config = upstreams.config
    roles = [("prefill", u) for u in config.prefill] + [("decode", u) for u in config.decode]
    reasons = await asyncio.gather(*(_down_reason(upstreams.session, url, config.health_timeout_s)
                                     for _, url in roles))
    for (role, url), reason in zip(roles, reasons):
        upstreams.router.mark(url, reason is None)
        # D's device cache bounds what it holds; P's host pool may hold more than its cache.
        if role == "decode" and reason is None and url not in upstreams.sized:
            upstreams.sized.add(url)
            tokens = await _cache_tokens(upstreams.session, url, config.health_timeout_s)
            if tokens is not None:
                upstreams.router.holds(url, tokens)
    return [{"role": role, "url": url, "reason": reason}
            for (role, url), reason in zip(roles, reasons) if reason is not None]


async def _cache_tokens(session: aiohttp.ClientSession, url: str, timeout_s: float) -> int | None:
    """The tokens `url`'s KV cache holds, from its `/metrics`' `vllm:cache_config_info`
    (`num_gpu_blocks` times `block_size`); None when it does not say."""
    try:
        async with session.get(url + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = (await resp.content.read(1 << 22)).decode(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    info = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.MULTILINE)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1))) if info else {}
    blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if not (blocks.isdigit() and size.isdigit()) or not int(blocks) * int(size):
        return None
    return int(blocks) * int(size)


async def _watch(upstreams: _Upstreams) -> None:
    """At start and then every `--health-interval`, take instances that stopped answering out
    of routing and put back those that answer again."""
    while True:
        down = await _check(upstreams)
        if down:
            log.warning("instances down, not routed to: %s",
                        "; ".join(f"{d['role']} {d['url']} ({d['reason']})" for d in down))
        await asyncio.sleep(upstreams.config.health_interval_s)


async def _health(request: web.Request) -> web.Response:
    """200 when every P and D instance answers its `/health`, else 503 naming those down."""
    upstreams = request.app[_UPSTREAMS]
    down = await _check(upstreams)
    answer = {"status": "unhealthy" if down else "ok", "prefill": list(upstreams.config.prefill),
              "decode": list(upstreams.config.decode), "down": down}
    return web.json_response(answer, status=503 if down else 200)


async def _metrics(request: web.Request) -> web.Response:
    """The router's counters in Prometheus' text format."""
    router = request.app[_UPSTREAMS].router
    lines = ["# HELP kvxfer_proxy_routes_total Requests routed, by choice (pd: P then D; local: "
             "D prefilled alone) and the reason D was chosen.",
             "# TYPE kvxfer_proxy_routes_total counter"]
    lines += [f'kvxfer_proxy_routes_total{{choice="{c}",reason="{r}"}} {n}'
              for (c, r), n in sorted(router.counts.items())]
    for name, kind, text in (("in_flight", "gauge", "Requests in flight per instance."),
                             ("up", "gauge", "1 while the instance is routed to.")):
        lines += [f"# HELP kvxfer_proxy_{name} {text}", f"# TYPE kvxfer_proxy_{name} {kind}"]
        for role, instances in (("prefill", router.prefill), ("decode", router.decode)):
            for url in instances.urls:
                value = instances.in_flight[url] if name == "in_flight" else int(
                    url not in instances.down)
                lines.append(f'kvxfer_proxy_{name}{{role="{role}",url="{url}"}} {value}')
    lines += ["# HELP kvxfer_proxy_cache_tokens Tokens the instance's KV cache holds (from its "
              "vllm:cache_config_info): the most the proxy believes it holds.",
              "# TYPE kvxfer_proxy_cache_tokens gauge"]
    lines += [f'kvxfer_proxy_cache_tokens{{role="decode",url="{url}"}} {tokens}'
              for url, tokens in router.decode.capacity.items()]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


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
        watch = asyncio.ensure_future(_watch(upstreams))
        yield
        watch.cancel()
        await upstreams.close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def serve(config: ProxyConfig) -> None:
    """Run the proxy until interrupted (SIGINT / SIGTERM). A `--host` that does not resolve, or
    a `--port` this process cannot listen on, is refused by name before the banner."""
    check_listen(config.host, config.port)
    print(f"kvxfer proxy on http://{config.host}:{config.port}: prefill "
             f"{', '.join(config.prefill)}; decode {', '.join(config.decode)}")
    web.run_app(build_app(config), host=config.host, port=config.port, print=None)

