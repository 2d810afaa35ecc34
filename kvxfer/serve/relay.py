"""`kvxfer proxy` relaying D's answer to the client (`decode_part`), as it comes.

Once the client has D's status, an answer that cannot be finished (D breaks off, is given up
on as hung, or runs over `--decode-timeout`) is `ended`: the client's connection is closed
before the answer's end, the only way left to say it is incomplete (the client sees its
stream break off, as when D breaks off). Only an answer relayed to its end keeps its `TAIL`
(`kvxfer.serve.sources`), which is what the proxy counts as answered.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kvxfer.serve.routing import Route
from kvxfer.serve.sources import TAIL, Relayed
from kvxfer.serve.upstreams import (
    NOT_CONNECTED,
    REQUEST_ID,
    ROUTE,
    TRANSFER,
    Unreached,
    Upstreams,
    connected,
    log,
    timed_out,
    unless_down,
    unreachable,
)

__all__ = ["decode_part", "drop", "ended"]


def ended(request: web.Request, out: web.StreamResponse) -> web.StreamResponse:
    """`out`, begun, ended before its end: the client's connection closed (aiohttp then fails
    to finish it quietly, where a handler's error would log a traceback)."""
    if request.transport is not None:
        request.transport.close()
    return out


async def _relay(request: web.Request, resp: aiohttp.ClientResponse, out: web.StreamResponse,
                 request_id: str, transfer: str) -> web.StreamResponse:
    """Send `resp` to the client through `out` as it arrives: status, content type and body,
    chunk by chunk."""
    out.set_status(resp.status, resp.reason)
    if "Content-Type" in resp.headers:
        out.headers["Content-Type"] = resp.headers["Content-Type"]
    out.headers[REQUEST_ID] = request_id
    out.headers[TRANSFER] = transfer
    if resp.content_length is not None and "Content-Encoding" not in resp.headers:
        out.content_length = resp.content_length
    await out.prepare(request)
    relayed = Relayed(request, resp)
    async for chunk in resp.content.iter_any():
        if sent := relayed.feed(chunk):
            await out.write(sent)
    if rest := relayed.rest():
        await out.write(rest)
    await out.write_eof()
    out[TAIL] = relayed.tail
    return out


def drop(sent: asyncio.Future) -> None:
    """Cancel the request `sent` to D, closing D's answer if it has come (D aborts the request)."""

    def close(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    sent.add_done_callback(close)
    sent.cancel()


async def decode_part(request: web.Request, upstreams: Upstreams, route: Route, sent: asyncio.Future,
                  headers: dict[str, str], transfer: str) -> web.StreamResponse:
    """Relay D's answer to the request `sent` to `route`'s D within `--decode-timeout`: a D over
    its time is a 504 or, once the client has D's status, an ended stream. Whatever way this
    ends, D's answer is closed."""
    url, timeout_s = route.decode, upstreams.config.decode_timeout_s
    out = web.StreamResponse(headers={ROUTE: route.header()})
    try:  # errors inside _relayed are its own: a timeout that comes out is this one
        return await unless_down(upstreams, "decode", url,
                                 _relayed(request, url, sent, out, headers, transfer), timeout_s)
    except Unreached as e:
        if not out.prepared:  # another D may take the request
            raise
        log.warning("request %s: decode instance %s stopped answering mid-answer (%s); ending "
                    "the stream", headers[REQUEST_ID], url, e.answer.text)
        return ended(request, out)
    except asyncio.TimeoutError:
        if not out.prepared:
            return timed_out("decode", url, "--decode-timeout", timeout_s, headers[REQUEST_ID])
        log.warning("request %s: decode instance %s did not finish within --decode-timeout %g s; "
                    "ending the stream", headers[REQUEST_ID], url, timeout_s)
        return ended(request, out)
    finally:
        drop(sent)


async def _relayed(request: web.Request, url: str, sent: asyncio.Future, out: web.StreamResponse,
                   headers: dict[str, str], transfer: str) -> web.StreamResponse:
    """D's answer to the request `sent` relayed through `out`, or the 502 when D fails; raises
    `Unreached` (with that 502) when no connection to D could be made."""
    try:
        resp = await sent
    except NOT_CONNECTED as e:  # no connection: nothing reached D
        raise Unreached(unreachable("decode", url, e), "decode") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return unreachable("decode", url, e)
    async with resp:
        try:
            return await _relay(request, resp, out, headers[REQUEST_ID], transfer)
        except (aiohttp.ClientError, ConnectionError) as e:
            if not connected(request):  # the client left, which _for_client logs
                raise
            log.warning("request %s: relaying decode instance %s broke off: %r",
                        headers[REQUEST_ID], url, e)
            return ended(request, out)
