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
`kv_transfer_params: {"local_prefill": true, ...}` (`X-Kvxfer-Transfer: local`). With
`--decode-slots`, a request whose D is full is served whole by a P with room
(`--whole-slots`), as a colocated instance would serve it (`X-Kvxfer-Transfer: whole`). Every answer
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
a P that returns no `kv_transfer_params` (one not started as `kv_producer`)
is a 502 that names the URL. An upstream that cannot be connected to (nothing
reached it) is marked down: for a D, the next D that is up gets the request;
for a P, with local prefill on, D prefills the prompt alone; with neither,
it is a 502 that names the URL. So is one that hangs (stopped, or its host gone, where no
connection breaks): once its `/health` is left unanswered at two health checks in a row
(`HUNG_CHECKS`; a server that answers, even 503 while it drains, is alive) the requests in
flight to it are given up, as if it could not be reached, except that a D which has begun
its answer ends the stream, and the next D gets P's part again (the D given up on may have
read P's KV, which P then freed). A P that does not answer within `--prefill-timeout`, or a D within
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

`GET /health` asks every upstream's `/health` (as the proxy itself does at
start and every `--health-interval`, routing only to those that answer);
`GET /v1/models` is answered by a D instance.

This module needs aiohttp (`pip install 'kvxfer[proxy]'`); nothing else in
kvxfer imports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import socket
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvxfer.errors import InvalidInputError
from kvxfer.nixl.wire import new_stream_id
from kvxfer.serve.relay import decode_part, drop
from kvxfer.serve.routing import Prompt, Route
from kvxfer.serve.sources import (
    DROP_USAGE,
    LOOKUP_TIMEOUT_S,
    MIN_READ_TOKENS,
    TAIL,
    completion_tokens,
    token_ids,
    usage_asked,
)
from kvxfer.serve.upstreams import (
    LOCAL_PARAMS,
    PREFILL_PARAMS,
    REQUEST_ID,
    ROUTE,
    ProxyConfig,
    Unreached,
    Upstreams,
    cancel,
    connected,
    error,
    parse_urls,
    passed_through,
    prefill_part,
    read_at_most,
    unreachable,
    watch,
)

__all__ = ["LOCAL_PARAMS", "PREFILL_PARAMS", "ProxyConfig", "build_app", "check_listen",
           "parse_urls", "serve"]

log = logging.getLogger(__name__)

_CLIENT_CHECK_S = 0.5
"""How often a waiting request looks whether its client is still connected: P and D learn
that a request is abandoned at most this late (and every look is a timer, cheap)."""

_CLIENT_GONE = 499
"""The status logged for a request whose client went away (nginx's "client closed request");
nothing reaches the client."""

_FORWARDED_HEADERS = ("Authorization",)
_SESSION = "X-Session-Id"

_UPSTREAMS = web.AppKey("upstreams", Upstreams)
_IDS = web.RequestKey("ids", list) if hasattr(web, "RequestKey") else "kvxfer_ids"
"""A request's prompt in token ids, under --peer-reads with a session."""
_T = TypeVar("_T")


async def _disconnected(request: web.Request) -> None:
    """Return once the client's connection has closed (looked at every `_CLIENT_CHECK_S`: aiohttp
    has no event for it, and by default does not cancel the handler)."""
    while connected(request):
        await asyncio.sleep(_CLIENT_CHECK_S)


async def _for_client(request: web.Request, request_id: str,
                      work: Coroutine[Any, Any, web.StreamResponse]) -> web.StreamResponse:
    """`work`'s answer while the client is connected. Once it has gone away, `work` is cancelled:
    its requests to P and D are closed (vLLM aborts a request whose connection closes) and D is
    not asked after P. So is it when this handler is cancelled, and the cancellation goes on."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # aiohttp's handler_cancellation, or the proxy stopping
        await cancel(task)
        log.info("request %s: cancelled (%s); its requests to P and D are closed", request_id,
                 "the proxy is stopping" if connected(request) else "the client went away")
        raise
    finally:
        gone.cancel()
    if not task.done():
        await cancel(task)
    if task.cancelled() or (task.exception() is not None and not connected(request)):
        log.info("request %s: the client went away; its requests to P and D are closed", request_id)
        return error(_CLIENT_GONE, "the client closed the request", "client_closed_request")
    return task.result()


def _upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    headers[REQUEST_ID] = request_id
    headers["Accept-Encoding"] = "identity"  # bodies are relayed as they come, never re-encoded
    return headers


async def _completions(request: web.Request) -> web.StreamResponse:
    """P prefills, D decodes, the client gets D's answer."""
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[_UPSTREAMS].config.max_body_mb
        return error(413, f"request body is over --max-body-mb {limit:g} MiB",
                      "invalid_request_error")
    except ValueError as e:
        return error(400, f"request body is not JSON: {e}", "invalid_request_error")
    except RecursionError:
        return error(400, "request body is JSON nested too deeply to read",
                      "invalid_request_error")
    if not isinstance(body, dict):
        return error(400, f"request body must be a JSON object, got {type(body).__name__}",
                      "invalid_request_error")
    body.pop("kv_transfer_params", None)  # a client's never reach P or D: the proxy's do
    tenant = request.app[_UPSTREAMS].config.tenant_header
    if tenant is not None:  # the tenant's salt, never the client's own
        body["cache_salt"] = tenant_salt(request.headers.get(tenant, ""))
    request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
    headers = _upstream_headers(request, request_id)
    return await _for_client(request, request_id, _route(request, body, headers))


def tenant_salt(tenant: str) -> str:
    """The `cache_salt` of the tenant a request's `--tenant-header` names: a digest of the
    header's value (an API key never reaches an instance as a salt). Requests without the
    header share the salt of the empty tenant."""
    return hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"kvxfer-tenant").hexdigest()


async def _route(request: web.Request, body: dict[str, Any], headers: dict[str, str]
                 ) -> web.StreamResponse:
    """The router's choice, then P's part and D's with P's `kv_transfer_params` (or both at once:
    `_streamed`), or D's alone when it prefills the prompt itself."""
    upstreams = request.app[_UPSTREAMS]
    prompt = Prompt.of(request.path, body)
    session = _session(request, body)
    route = upstreams.router.choose(prompt, session)
    log.debug("request %s: %s", headers[REQUEST_ID], route.header())
    if upstreams.config.peer_reads and session is not None:
        request[_IDS] = await token_ids(upstreams.session, route.prefill or route.decode, body,
                                        headers, upstreams.config.health_timeout_s)
        if request[_IDS] is not None and (asked := usage_asked(body)) is not None:
            body, request[DROP_USAGE] = asked, True  # the answer's length: `Held`
    upstreams.router.started(route)  # moved to another route's instances by _instead
    answer, used = None, route
    try:
        answer, used = await _routed(request, upstreams, route, body, headers)
        if not answer.prepared:  # an error answer (P's, or the proxy's): named as D's are
            answer.headers.setdefault(ROUTE, used.header())
            answer.headers.setdefault(REQUEST_ID, headers[REQUEST_ID])
        return answer
    finally:
        upstreams.router.finished(route)
        upstreams.router.settled(used)
        if answer is not None and 200 <= answer.status < 300 and TAIL in answer:  # relayed whole
            upstreams.router.answered(used, prompt)
            if request.get(_IDS) is not None:  # an answer of one choice: its length is usage's
                one = body.get("n") in (None, 1)
                upstreams.held.remember(session, used.decode, request[_IDS],
                                        completion_tokens(answer[TAIL]) if one else None)


def _session(request: web.Request, body: dict[str, Any]) -> str | None:
    """The client's `X-Session-Id` (None without one), scoped to its `Authorization` and
    `cache_salt`: another tenant sending the same id neither steers nor moves its session."""
    session = request.headers.get(_SESSION)
    if not session:
        return None
    salt = body.get("cache_salt")
    return "\x1f".join((request.headers.get("Authorization", ""),
                         salt if isinstance(salt, str) else repr(type(salt)), session))


async def _routed(request: web.Request, upstreams: Upstreams, route: Route, body: dict[str, Any],
                  headers: dict[str, str]) -> tuple[web.StreamResponse, Route]:
    """The client's answer by `route`, and the route it took: with local prefill on, a P that
    cannot be connected to is marked down and D prefills the prompt alone instead."""
    if route.whole:  # D is full: a P serves it as a colocated instance would
        return await _to_d(request, upstreams, route, body, headers, "whole")
    if route.prefill is None:
        return await _to_d(request, upstreams, route, {**body, "kv_transfer_params": LOCAL_PARAMS},
                           headers, "local")
    try:
        return await _through_p(request, upstreams, route, body, headers)
    except Unreached as e:
        if e.role == "decode":  # streamed: P is already prefilling for this D
            upstreams.router.mark(route.decode, up=False)
        if e.role != "prefill" or not upstreams.config.local_prefill_tokens:
            return e.answer, route
        how = "stopped answering" if e.reached else "cannot be reached"
    upstreams.router.mark(route.prefill, up=False)
    upstreams.kv.pop(route.prefill, None)  # it may come back restarted, at another address
    local = upstreams.router.instead_of_p(route)
    log.warning("request %s: prefill instance %s %s; decode instance %s prefills it alone",
                headers[REQUEST_ID], route.prefill, how, route.decode)
    return await _instead(upstreams, route, local, _to_d(
        request, upstreams, local, {**body, "kv_transfer_params": LOCAL_PARAMS}, headers, "local"))


async def _instead(upstreams: Upstreams, route: Route, other: Route,
                   work: Coroutine[Any, Any, _T]) -> _T:
    """`work`'s answer, `route`'s request being in flight on `other`'s instances meanwhile (and on
    `route`'s again however it ends, for `_route` to finish)."""
    upstreams.router.finished(route)
    upstreams.router.started(other)
    try:
        return await work
    finally:
        upstreams.router.finished(other)
        upstreams.router.started(route)


async def _through_p(request: web.Request, upstreams: Upstreams, route: Route,
                     body: dict[str, Any], headers: dict[str, str]
                     ) -> tuple[web.StreamResponse, Route]:
    """P's part, then D's with P's `kv_transfer_params` (or both at once: `_streamed`); raises
    `Unreached` when P (or, streamed, D) cannot be connected to."""
    address = upstreams.kv.get(route.prefill) if upstreams.config.stream else None
    if address is not None:
        return await _streamed(request, upstreams, route, address, body, headers), route
    source = await _source(request, upstreams, route, body, headers)
    params = await prefill_part(upstreams, route.prefill, request.path, body, headers,
                                source=source)
    if isinstance(params, web.Response):
        return params, route
    log.debug("request %s prefilled; params %s", headers[REQUEST_ID], params)
    return await _instead(upstreams, route, _past_p(route), _to_d(
        request, upstreams, route, {**body, "kv_transfer_params": params}, headers, "params"))


async def _source(request: web.Request, upstreams: Upstreams, route: Route,
                  body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
    """`--peer-reads`: the `kv_transfer_params` of a peer for a prefix of the prompt, which P
    then reads (`kvxfer.serve.sources`): the D that answered the session's last turn, for the
    conversation so far; else another P the router expects to hold more of the prompt. None
    where nothing is worth reading or the lookup failed (P computes the prompt). Counted by
    outcome."""
    found = await _holder(request, upstreams, route, body, headers) if (
        upstreams.config.peer_reads) else None
    if found is None:
        return None
    url, ids, tokens = found
    if tokens - route.expected_hit < MIN_READ_TOKENS:  # spares P less than a block's prefill
        upstreams.reads["skipped"] += 1
        return None
    lookup = {"model": body.get("model"), "prompt": ids[:tokens],
              **{k: body[k] for k in ("cache_salt",) if k in body}}
    upstreams.router.looking_up(url, 1)
    try:  # within LOOKUP_TIMEOUT_S: a peer whose queue is full is not waited for (P computes)
        params = await prefill_part(upstreams, url, "/v1/completions", lookup,
                                    {**headers, REQUEST_ID: headers[REQUEST_ID] + "-lookup"},
                                    timeout=("the lookup's", LOOKUP_TIMEOUT_S))
    except Unreached:
        params = None
    finally:
        upstreams.router.looking_up(url, -1)
    if not isinstance(params, dict):
        upstreams.reads["failed"] += 1
        log.warning("request %s: the lookup of %d tokens on %s failed; P computes them",
                    headers[REQUEST_ID], tokens, url)
        return None
    upstreams.reads["looked_up"] += 1
    return params


async def _holder(request: web.Request, upstreams: Upstreams, route: Route,
                  body: dict[str, Any], headers: dict[str, str]
                  ) -> tuple[str, list[int], int] | None:
    """Who to look the prompt up on, its token ids and the tokens to look up: the session's
    last D (`Held`), or the P other than `route`'s the router expects to hold the most of
    the prompt, where that is a block more than `route`'s P (its estimate, in tokens: the
    lookup then computes what the other P lacks of it)."""
    router, ids = upstreams.router, request.get(_IDS)
    found: list[tuple[int, str]] = []
    turn = upstreams.held.get(_session(request, body)) if ids is not None else None
    if turn is not None and turn.url != route.prefill and turn.url not in router.decode.down:
        found.append((turn.prefix(ids), turn.url))
    prompt = Prompt.of(request.path, body)
    hit, url = max(((router.prefill.hit(u, prompt), u) for u in router.prefill.urls
                    if u != route.prefill and u not in router.prefill.down), default=(0, ""))
    if url and hit - route.expected_hit >= MIN_READ_TOKENS:
        if ids is None:
            ids = await token_ids(upstreams.session, route.prefill, body, headers,
                                  upstreams.config.health_timeout_s)
        if ids:
            found.append((min(hit, len(ids) - 1), url))
    if not found:
        return None
    tokens, url = max(found)
    return url, ids, tokens


def _past_p(route: Route) -> Route:
    """`route` once P has answered: what is in flight is on its D alone."""
    return dataclasses.replace(route, prefill=None)


async def _to_d(request: web.Request, upstreams: Upstreams, route: Route, d_body: dict[str, Any],
                headers: dict[str, str], transfer: str) -> tuple[web.StreamResponse, Route]:
    """D's answer to `d_body`, and the route it took: a D that cannot be connected to (nothing
    reached it) is marked down and the next D that is up gets the same request (P's params
    name P, whom any D can read from; a local prefill is then computed whole)."""
    sent = asyncio.ensure_future(upstreams.session.post(route.decode + request.path,
                                                        headers=headers, json=d_body))
    try:
        return await decode_part(request, upstreams, route, sent, headers, transfer), route
    except Unreached as e:
        upstreams.router.mark(route.decode, up=False)
        if route.whole:  # the P to serve it whole is gone: the choice again, without it
            other = upstreams.router.choose(Prompt.of(request.path, d_body))
            log.warning("request %s: prefill instance %s cannot serve it whole; %s instead",
                        headers[REQUEST_ID], route.decode, other.header())
            return await _instead(upstreams, route, other,
                                  _routed(request, upstreams, other, d_body, headers))
        other = upstreams.router.other_decode(route, Prompt.of(request.path, d_body))
        if other is None:  # each D tried is marked down: this ends
            return e.answer, route
        # Through P again where the next D holds too little to go alone, or where the D given
        # up on may have read P's KV already (P then freed it): P's params may name nothing.
        again = other.prefill is not None and (route.prefill is None or e.reached)
        how = "stopped answering" if e.reached else "cannot be reached"
    log.warning("request %s: decode instance %s %s; asking %s%s", headers[REQUEST_ID],
                route.decode, how, other.decode, f" through {other.prefill}" if again else "")
    if again:
        body = {k: v for k, v in d_body.items() if k != "kv_transfer_params"}
        return await _instead(upstreams, route, other,
                              _routed(request, upstreams, other, body, headers))
    return await _instead(upstreams, route, other,
                          _to_d(request, upstreams, other, d_body, headers, transfer))


async def _streamed(request: web.Request, upstreams: Upstreams, route: Route,
                    address: dict[str, Any], body: dict[str, Any],
                    headers: dict[str, str]) -> web.StreamResponse:
    """P and D at once: D reads P's KV by the stream id both are given, while P prefills."""
    stream = new_stream_id()
    to_d = {"do_remote_prefill": True, "do_remote_decode": False, "stream": stream, **address}
    sent = asyncio.ensure_future(upstreams.session.post(
        route.decode + request.path, headers=headers, json={**body, "kv_transfer_params": to_d}))
    try:
        params = await prefill_part(upstreams, route.prefill, request.path, body, headers, stream)
    except BaseException:  # cancelled, the client gone: D would wait for a stream P never fills
        drop(sent)
        raise
    if isinstance(params, web.Response):  # D would wait for a stream P never fills
        drop(sent)
        return params
    return await _instead(upstreams, route, _past_p(route),
                          decode_part(request, upstreams, route, sent, headers, "stream"))


async def _models(request: web.Request) -> web.Response:
    upstreams = request.app[_UPSTREAMS]
    url = upstreams.router.any_decode()
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    config = upstreams.config
    try:  # D's answer within the health timeout, at most --prefill-max-bytes of it
        async with upstreams.session.get(
                url + "/v1/models", headers=headers,
                timeout=aiohttp.ClientTimeout(total=config.health_timeout_s)) as resp:
            data = await read_at_most(resp, config.prefill_max_bytes)
            if data is None:
                return error(502, f"decode instance {url} answered /v1/models with more than "
                              f"--prefill-max-bytes {config.prefill_max_bytes} bytes",
                              "bad_upstream_response", upstream=url)
            return passed_through(resp.status, data, resp.headers.get("Content-Type"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return unreachable("decode", url, e)


async def _health(request: web.Request) -> web.Response:
    """200 when every P and D instance answers its `/health`, else 503 naming those down."""
    upstreams = request.app[_UPSTREAMS]
    down = await upstreams.checked()
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
                lines.append(f'kvxfer_proxy_{name}{{role="{role}",url="{_label(url)}"}} {value}')
    lines += ["# HELP kvxfer_proxy_cache_tokens Tokens the instance's KV cache holds (from its "
              "vllm:cache_config_info): the most the proxy believes it holds.",
              "# TYPE kvxfer_proxy_cache_tokens gauge"]
    lines += [f'kvxfer_proxy_cache_tokens{{role="decode",url="{_label(url)}"}} {tokens}'
              for url, tokens in router.decode.capacity.items()]
    lines += ["# HELP kvxfer_proxy_peer_reads_total --peer-reads' lookups of a session's "
              "conversation on its last D, by outcome (looked_up: P reads it; skipped; failed).",
              "# TYPE kvxfer_proxy_peer_reads_total counter"]
    lines += [f'kvxfer_proxy_peer_reads_total{{outcome="{o}"}} {n}'
              for o, n in sorted(request.app[_UPSTREAMS].reads.items())]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _label(value: str) -> str:
    """`value` as a Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
    upstreams = Upstreams(config)
    app[_UPSTREAMS] = upstreams

    async def session(_app: web.Application):  # aiohttp's cleanup context: open, then close
        await upstreams.open()
        watching = asyncio.ensure_future(watch(upstreams))
        yield
        watching.cancel()
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
