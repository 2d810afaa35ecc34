"""`kvxfer proxy`'s side toward P and D: its settings (`ProxyConfig`), the session and router it
holds (`Upstreams`), P's part of a request (`prefill_part`), and the health checks that take
instances in and out of routing (`check`, `watch`). D's answer is relayed by `relay.py`; the
handlers that use them, and what the client sees, are in `proxy.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvxfer.errors import InvalidInputError, SetupError
from kvxfer.plan.blocks import is_int
from kvxfer.serve.routing import Router
from kvxfer.serve.sources import Held

__all__ = ["HEALTH_REUSE_S", "HUNG_CHECKS", "LOCAL_PARAMS", "METRICS_MAX_BYTES",
           "PREFILL_PARAMS", "REQUEST_ID", "ROUTE", "TRANSFER", "ProxyConfig", "Unread", "Unreached",
           "Upstreams", "cancel", "check", "check_url", "connected", "error",
           "parse_urls", "passed_through", "prefill_part", "read_at_most", "timed_out",
           "unless_down", "unreachable", "watch"]

log = logging.getLogger("kvxfer.serve.proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""What P's request carries in `kv_transfer_params`: prefill here, decode elsewhere."""

LOCAL_PARAMS = {"do_remote_decode": False, "do_remote_prefill": False, "local_prefill": True}
"""What D's request carries when D prefills alone: a local prefill, which kvxfer's D counts as
such, not as a fallback."""

_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields P must not see: `stream_options` needs `stream`, and a minimum above
P's one token would be refused (vLLM's NIXL proxy drops the same)."""

NOT_CONNECTED = (aiohttp.ClientConnectorError,
                 getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ServerTimeoutError))
"""What a request to an upstream raises when no connection was made, refused or timed out (the
session's only timeout is `sock_connect`): nothing reached the upstream."""

REQUEST_ID, TRANSFER, ROUTE = "X-Request-Id", "X-Kvxfer-Transfer", "X-Kvxfer-Route"
"""The headers P and D share the request's id in, and that say how the KV moved and the route."""


def check_url(flag: str, url: str) -> str:
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
    urls = tuple(check_url(flag, u.strip()) for u in text.split(",") if u.strip())
    if not urls:
        raise InvalidInputError(f"{flag} needs at least one URL, got {text!r}")
    return urls


@dataclass(frozen=True)
class ProxyConfig:
    """Where the proxy listens and which P and D instances it routes to.

    `prefill` and `decode` are base URLs (`parse_urls`); `health_timeout_s`
    bounds each upstream's `/health` and `/metrics` answer and D's to `/v1/models`,
    `connect_timeout_s` each connection to an upstream.
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
    `tenant_header` (`--tenant-header`): the header naming a request's tenant, from which the
    proxy sets its `cache_salt` (`tenant_salt`), replacing any the client sent: prefix caches,
    host pools, routes, sessions and lookups are then one tenant's, whatever a client says.
    The default, `Authorization`, is the client's API key; a trusted gateway in front may
    set another header. None passes the client's own salt through (a gateway sets it).
    `decode_slots` (`--decode-slots`, each D's `--max-num-seqs`) and `whole_slots`
    (`--whole-slots`, each P's): a request whose D has `decode_slots` requests in flight is
    served whole by a P with fewer than `whole_slots` (`kvxfer.serve.routing`); 0 (the
    default) for either: never. `prefill_queue` (`--prefill-queue`): a request whose P has
    that many in flight is prefilled by its D while D has a slot; 0 (the default): never.
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
    peer_reads: bool = False
    tenant_header: str | None = "Authorization"
    decode_slots: int = 0
    whole_slots: int = 0
    prefill_queue: int = 0

    def __post_init__(self) -> None:
        for flag, urls in (("--prefill", self.prefill), ("--decode", self.decode)):
            if isinstance(urls, str) or not urls:
                raise InvalidInputError(f"{flag} needs a non-empty sequence of URLs, got {urls!r}")
            object.__setattr__(self, flag[2:], tuple(check_url(flag, u) for u in urls))
        if not is_int(self.port) or not 1 <= self.port <= 65535:
            raise InvalidInputError(f"--port must be in 1-65535, got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidInputError(f"--host must be a host name or address, got {self.host!r}")
        for name in ("stream", "peer_reads"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.tenant_header is not None and not (
                isinstance(self.tenant_header, str) and self.tenant_header.isascii()
                and self.tenant_header.replace("-", "").replace("_", "").isalnum()):
            raise InvalidInputError(f"--tenant-header must be an HTTP header name (or none), "
                                    f"got {self.tenant_header!r:.60}")
        if self.stream and self.peer_reads:
            raise InvalidInputError("--stream and --peer-reads do not go together: a prompt "
                                    "streamed from P to D reads no prefix from a peer; give one")
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
        self.router()  # refuses a bad --route, --local-prefill-tokens, --route-imbalance, ...

    def router(self) -> Router:
        """A fresh `Router` over these instances with these settings."""
        return Router(self.prefill, self.decode, self.route, self.local_prefill_tokens,
                      self.route_imbalance, decode_slots=self.decode_slots,
                      whole_slots=self.whole_slots, prefill_queue=self.prefill_queue)



HEALTH_REUSE_S = 1.0
"""How long `GET /health` answers from the last check (`Upstreams.checked`)."""
HUNG_CHECKS = 2
"""Health checks in a row an instance leaves its `/health` unanswered before the requests in
flight to it are given up (one slow answer under load is not a hang)."""


class Upstreams:
    """The session to the upstreams and the router that picks among them."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.router = config.router()
        self.sized: set[str] = set()  # upstreams whose KV cache size was asked for
        self._session: aiohttp.ClientSession | None = None
        self.kv: dict[str, dict[str, Any]] = {}  # P url -> its kvxfer address, once known
        self.held = Held()  # --peer-reads: what each session's D holds
        self.reads: Counter[str] = Counter()  # --peer-reads: lookups by outcome
        self._check: asyncio.Future | None = None  # GET /health's check, under way or done
        self._checked_at = -math.inf
        self._hung: dict[str, asyncio.Future] = {}  # url -> resolved once it is given up on
        self._unanswered: dict[str, int] = {}  # url -> health checks in a row it left unanswered

    def hung_signal(self, url: str) -> asyncio.Future:
        """A future resolved, with why, once `url` is given up on as hung (`heard`): what a
        request in flight to it waits on beside its answer (`unless_down`)."""
        future = self._hung.get(url)
        if future is None or future.done():
            future = self._hung[url] = asyncio.get_running_loop().create_future()
        return future

    def heard(self, url: str, reason: str | None, answered: bool) -> None:
        """What a health check heard from `url`: whether its `/health` answered (any status:
        a server that answers is alive, as one draining its requests on a 503 is). Left
        unanswered at `HUNG_CHECKS` checks in a row, it is given up on: the requests in
        flight to it stop waiting (`unless_down`); the router keeps new ones away from it as
        from any instance down (`Router.mark`)."""
        if answered:
            self._unanswered.pop(url, None)
            return
        self._unanswered[url] = self._unanswered.get(url, 0) + 1
        if self._unanswered[url] < HUNG_CHECKS:
            return
        future = self._hung.pop(url, None)
        if future is not None and not future.done():
            future.set_result(f"{reason}, {self._unanswered[url]} health checks in a row")

    async def checked(self) -> list[dict[str, str]]:
        """`check`'s answer for `GET /health`: one under way is shared and one younger than
        `HEALTH_REUSE_S` reused, so clients polling `/health` do not multiply the proxy's
        requests to its instances (nor does one that leaves cut a check short)."""
        task = self._check
        if task is None or (task.done() and asyncio.get_running_loop().time() - self._checked_at
                            > HEALTH_REUSE_S):
            self._check = task = asyncio.ensure_future(check(self))
            task.add_done_callback(lambda _: setattr(
                self, "_checked_at", asyncio.get_running_loop().time()))
        return await asyncio.shield(task)

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


def error(status: int, message: str, kind: str, **extra: Any) -> web.Response:
    """An OpenAI-style error answer made by the proxy itself."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status, **extra}},
                             status=status)


def unreachable(role: str, url: str, exc: BaseException) -> web.Response:
    reason = str(exc) or type(exc).__name__
    log.warning("%s instance %s failed: %s", role, url, reason)
    return error(502, f"{role} instance {url} failed: {reason}", "upstream_unreachable", upstream=url)


class Unreached(Exception):
    """An upstream (`role` prefill or decode) could not be connected to (the request never
    reached it), or was given up on as hung before it answered (`unless_down`; `reached`:
    the request had reached it, which may have done part of it, as a D that read P's KV
    and let P free it): another instance may take the request. `answer` is its 502."""

    def __init__(self, answer: web.Response, role: str, reached: bool = False) -> None:
        super().__init__(answer.text)
        self.answer, self.role, self.reached = answer, role, reached


def timed_out(role: str, url: str, flag: str, timeout_s: float, request_id: str) -> web.Response:
    """The 504 for an upstream that did not answer within `flag`'s `timeout_s`."""
    log.warning("request %s: %s instance %s did not answer within %s %g s", request_id, role, url,
                flag, timeout_s)
    return error(504, f"{role} instance {url} did not answer within {flag} {timeout_s:g} s",
                  "upstream_timeout", upstream=url)


def connected(request: web.Request) -> bool:
    """Whether the client's connection is still open."""
    transport = request.transport
    return transport is not None and not transport.is_closing()


def passed_through(status: int, body: bytes, content_type: str | None) -> web.Response:
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


async def read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
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
    `Unreached` (with that 502) when no connection to P could be made."""
    try:
        async with session.post(url + path, json=body, headers=headers) as resp:
            data = await read_at_most(resp, limit)
            if data is None:
                resp.close()
                log.warning("prefill instance %s answered over --prefill-max-bytes %d for %s", url,
                            limit, headers[REQUEST_ID])
                return error(502, f"prefill instance {url} answered more than --prefill-max-bytes "
                              f"{limit} bytes", "bad_upstream_response", upstream=url)
            return resp.status, data, resp.headers.get("Content-Type")
    except NOT_CONNECTED as e:  # no connection: nothing reached P
        raise Unreached(unreachable("prefill", url, e), "prefill") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return unreachable("prefill", url, e)


async def cancel(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended, its `async with`s having closed what it opened
    (again, should a `wait_for` in it have swallowed the cancellation, as on Python < 3.12)."""
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=_CANCEL_CHECK_S)


_CANCEL_CHECK_S = 0.5
_T = TypeVar("_T")


async def unless_down(upstreams: Upstreams, role: str, url: str, work: Awaitable[_T],
                      timeout_s: float) -> _T:
    """`work`'s result within `timeout_s` (else `asyncio.TimeoutError`), unless `url` is given
    up on as hung first (`Upstreams.heard`: an instance stopped, or its host gone, where no
    connection breaks), within a few health intervals rather than a timeout of many minutes:
    `work` is cancelled (its request closed) and `Unreached` raised, whose 502 says why. One
    given up on already is asked all the same (it may be back since the last check), and
    given up on again at the next check it leaves unanswered. Cancelled itself, it cancels
    `work` too."""
    task = asyncio.ensure_future(work)
    hung = upstreams.hung_signal(url)
    try:
        await asyncio.wait((task, hung), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
    finally:
        await cancel(task)
    if not hung.done():
        raise asyncio.TimeoutError
    reason = hung.result()
    log.warning("%s instance %s is given up on with a request in flight: %s", role, url, reason)
    raise Unreached(error(502, f"{role} instance {url} stopped answering before it answered "
                               f"the request: {reason}", "upstream_unreachable", upstream=url),
                    role, reached=True)


async def prefill_part(upstreams: Upstreams, url: str, path: str, body: dict[str, Any],
                   headers: dict[str, str], stream: str | None = None,
                   source: dict[str, Any] | None = None,
                   timeout: tuple[str, float] | None = None) -> dict[str, Any] | web.Response:
    """Run P's part at `url` (streamed to D under `stream`, if given; reading a prefix from the
    peer `source` names, if given) within `--prefill-timeout` (or `timeout`: its name and
    seconds); return P's `kv_transfer_params`, or the answer the client gets instead."""
    sent = _prefill_body(body)
    if stream is not None:
        sent["kv_transfer_params"]["stream"] = stream
    if source is not None:
        sent["kv_transfer_params"]["kv_source"] = source
    flag, timeout_s = timeout or ("--prefill-timeout", upstreams.config.prefill_timeout_s)
    limit = upstreams.config.prefill_max_bytes
    try:  # a timeout inside _ask_prefill is its 502: one that comes out is this one
        answer = await unless_down(upstreams, "prefill", url, _ask_prefill(
            upstreams.session, url, path, sent, headers, limit), timeout_s)
    except asyncio.TimeoutError:
        return timed_out("prefill", url, flag, timeout_s, headers[REQUEST_ID])
    if isinstance(answer, web.Response):
        return answer
    status, data, content_type = answer
    if not 200 <= status < 300:
        log.debug("prefill instance %s answered %s for %s", url, status, headers[REQUEST_ID])
        return passed_through(status, data, content_type)
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):  # nested too deep: no params either
        return error(502, f"prefill instance {url} answered {status} with a body that is not a "
                      f"JSON object", "bad_upstream_response", upstream=url)
    if not isinstance(params, dict) or not params:
        return error(502, f"prefill instance {url} returned no kv_transfer_params: is it started "
                      f"with a kv_producer --kv-transfer-config?", "bad_upstream_response", upstream=url)
    upstreams.learn(url, params)
    return params


async def _down_reason(session: aiohttp.ClientSession, url: str, timeout_s: float
                       ) -> tuple[str | None, bool]:
    """Why `url`'s `/health` does not answer 2xx (None when it does), and whether it answered
    at all."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return (None if 200 <= resp.status < 300 else f"/health answered {resp.status}"), True
    except asyncio.TimeoutError:
        return f"/health did not answer within {timeout_s} s", False
    except aiohttp.ClientError as e:
        return str(e) or type(e).__name__, False


async def check(upstreams: Upstreams) -> list[dict[str, str]]:
    """Ask every P and D instance's `/health`; mark each up or down for the router; return those
    down (role, url, reason)."""
    config = upstreams.config
    roles = [("prefill", u) for u in config.prefill] + [("decode", u) for u in config.decode]
    heard = await asyncio.gather(*(_down_reason(upstreams.session, url, config.health_timeout_s)
                                   for _, url in roles))
    reasons = [reason for reason, _ in heard]
    for (_, url), (reason, answered) in zip(roles, heard):  # all of them before any /metrics
        upstreams.router.mark(url, reason is None)
        upstreams.heard(url, reason, answered)
        if reason is not None:  # it may come back restarted, its KV cache another size
            upstreams.sized.discard(url)
            upstreams.kv.pop(url, None)  # and its kvxfer address another (learned again)
    for (role, url), reason in zip(roles, reasons):
        # D's device cache or host pool bounds what it holds; P's pool may hold more than both.
        if role == "decode" and reason is None and url not in upstreams.sized:
            # kvxfer's gauges exist once D's engine has stepped (its first request): until D
            # has answered one, a pool its /metrics does not name yet may still come
            stepped = bool(upstreams.router.decode.sent.get(url))
            try:
                size = await _cache_tokens(upstreams.session, url, config.health_timeout_s)
            except Unread:  # asked again at the next check
                continue
            if size is None or size[1] or stepped:
                upstreams.sized.add(url)
            if size is not None:
                upstreams.router.holds(url, size[0])
    return [{"role": role, "url": url, "reason": reason}
            for (role, url), reason in zip(roles, reasons) if reason is not None]


METRICS_MAX_BYTES = 1 << 22
"""The most of a decode instance's `/metrics` the health check reads for its cache size."""


class Unread(Exception):
    """A decode instance's `/metrics` could not be read whole."""


async def _cache_tokens(session: aiohttp.ClientSession, url: str, timeout_s: float
                       ) -> tuple[int, bool] | None:
    """The tokens `url`'s KV cache holds, from its `/metrics`' `vllm:cache_config_info`
    (`num_gpu_blocks` times `block_size`), or its kvxfer host pool where that holds more (it
    keeps what the device cache drops: `vllm:kvxfer_pool_capacity_tokens`), with whether it
    named a pool; None when it does not say. Raises `Unread` when its `/metrics` could not be
    read whole (no answer in time, or over `METRICS_MAX_BYTES`): a part of it may lack
    `vllm:cache_config_info`, which vLLM writes late."""
    try:
        async with session.get(url + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            data = await read_at_most(resp, METRICS_MAX_BYTES)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Unread(f"{url}/metrics: {e!r:.200}") from None
    if data is None:
        raise Unread(f"{url}/metrics is over {METRICS_MAX_BYTES} bytes")
    text = data.decode(errors="replace")
    info = re.search(r"^vllm:cache_config_info\{([^}\n]*)\}", text, re.MULTILINE)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1))) if info else {}
    blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    digits = re.compile(r"[0-9]{1,15}")  # not str.isdigit: "²" is a digit int() refuses
    if not (digits.fullmatch(blocks) and digits.fullmatch(size)) or not int(blocks) * int(size):
        return None
    # prometheus_client writes a gauge of a million or more as 1.048576e+06
    pool = re.search(r'^vllm:kvxfer_pool_capacity_tokens\{[^}\n]*role="D"[^}\n]*\} '
                     r'([0-9]{1,15}(\.[0-9]{1,15})?(e\+[0-9]{2})?)$', text, re.MULTILINE)
    # the pool holds what D finished, much of it also in the device cache: the larger of the
    # two, not their sum, which would credit D with tokens it may not hold
    return max(int(blocks) * int(size), int(float(pool.group(1))) if pool else 0), pool is not None


async def watch(upstreams: Upstreams) -> None:
    """At start and then every `--health-interval`, take instances that stopped answering out
    of routing and put back those that answer again."""
    while True:
        try:
            down = await check(upstreams)
        except Exception:  # an upstream's odd answer must not end the checks for good
            log.exception("health check failed; trying again in %g s",
                          upstreams.config.health_interval_s)
            down = None
        if down:
            log.warning("instances down, not routed to: %s",
                        "; ".join(f"{d['role']} {d['url']} ({d['reason']})" for d in down))
        await asyncio.sleep(upstreams.config.health_interval_s)
