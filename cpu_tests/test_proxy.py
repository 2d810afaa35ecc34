"""`kvxfer proxy` against fake P and D `vllm serve` instances on ephemeral ports.

Each fake is an aiohttp app that records what it received and answers as a
vLLM instance would (P: one token plus `kv_transfer_params`; D: the
completion, streamed as server-sent events when asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import subprocess
import sys
from typing import Any

import aiohttp  # the `test` extra installs it, as the `proxy` extra does for users
import pytest
from aiohttp import web

from kvxfer import cli
from kvxfer.errors import InvalidInputError
from kvxfer.serve.proxy import ProxyConfig, build_app, parse_urls, tenant_salt

WAIT_S = 10  # bounds a wait that only a broken proxy would exhaust; nothing asserts on time


class FakeVllm:
    """A stand-in `vllm serve`: records `(path, body, headers)` of each request; answers as set.

    `fail` is `(status, body)` to answer every completion with; `params`
    False makes a P that returns `kv_transfer_params: null` (not a kv_producer).
    `hold` makes each completion wait for `release` (set `holding` meanwhile), as a
    P prefilling or a D decoding a long time. Served by `pd`, a request whose
    connection closes while it waits is cancelled, as vLLM aborts it, and noted in
    `aborted`.
    """

    def __init__(self, name: str, fail: tuple[int, str] | None = None, params: bool = True,
                 health: int = 200, break_after: int | None = None, hold: bool = False) -> None:
        self.name, self.fail, self.params, self.health = name, fail, params, health
        self.break_after = break_after  # streamed chunks sent before D drops the connection
        self.seen: list[tuple[str, dict, Any]] = []
        self.events: list[str] = []
        self.chunk_seen: list[asyncio.Event] = []
        self.hold = hold
        self.release, self.holding, self.aborted = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.health_checks = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)  # vLLM's server sets no limit
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, _request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.health is None:  # hung: stopped, or its host gone, no connection breaks
            await asyncio.sleep(WAIT_S)
        return web.Response(status=self.health or 200)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-on-{self.name}"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body, request.headers.copy()))  # case-insensitive
        if self.hold:
            self.holding.set()
            await self._wait(self.release)
        if self.fail:
            return web.Response(status=self.fail[0], text=self.fail[1], content_type="application/json")
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):  # P's part
            params = {"remote_host": self.name, "remote_block_ids": [3, 4], "peer": f"kv-{self.name}",
                      "host": "10.0.0.5", "port": 5610} if self.params else None
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": f"decoded by {self.name}"}]})
        return await self._stream(request)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """Three SSE chunks; before each next one, wait (bounded) until the client has the last."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        self.chunk_seen = [asyncio.Event() for _ in range(3)]
        for i in range(3):
            await out.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
            self.events.append(f"D sent {i}")
            if i + 1 == self.break_after:
                request.transport.close()
                return out
            await self._wait(self.chunk_seen[i])
        await out.write(b"data: [DONE]\n\n")
        return out

    async def _wait(self, event: asyncio.Event) -> None:
        """Wait (bounded) for `event`; note in `aborted` a request cancelled meanwhile."""
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), WAIT_S)
        except asyncio.CancelledError:
            self.aborted.set()
            raise


@contextlib.asynccontextmanager
async def serving(app: web.Application, **options):
    """Serve `app` on an ephemeral port of 127.0.0.1 (`options` go to its `AppRunner`); yield its
    base URL."""
    runner = web.AppRunner(app, **options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def closed_port_url() -> str:
    """A URL on which nothing listens (a port just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.asynccontextmanager
async def pd(prefills: list[FakeVllm], decodes: list[FakeVllm], extra_prefill=(), extra_decode=(),
             stream=False, handler_cancellation=False, **config):
    """Start the fakes and a proxy in front of them; yield a client session and the proxy's URL.

    The fakes cancel a request whose connection closes, as vLLM does; the proxy's server does
    so only with `handler_cancellation` (aiohttp's default is not to).
    """
    async with contextlib.AsyncExitStack() as stack:
        p_urls = [await stack.enter_async_context(serving(f.app(), handler_cancellation=True))
                  for f in prefills]
        d_urls = [await stack.enter_async_context(serving(f.app(), handler_cancellation=True))
                  for f in decodes]
        config = ProxyConfig(prefill=tuple(p_urls) + tuple(extra_prefill),
                             decode=tuple(d_urls) + tuple(extra_decode), stream=stream, **config)
        url = await stack.enter_async_context(
            serving(build_app(config), handler_cancellation=handler_cancellation))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield session, url


def run(coro):
    return asyncio.run(coro)


BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 40, "min_tokens": 2,
        "temperature": 0.0, "stream_options": {"include_usage": True}}


def test_prefills_one_unstreamed_token_on_p_and_decodes_the_original_request_on_d():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                return resp.status, await resp.json()

    status, answer = run(go())
    assert (status, answer) == (200, {"choices": [{"text": "decoded by D"}]})
    [(p_path, p_body, _)] = p.seen
    assert p_path == "/v1/completions"
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "stream_options" not in p_body and "min_tokens" not in p_body
    assert p_body["prompt"] == BODY["prompt"] and p_body["temperature"] == 0.0
    [(d_path, d_body, _)] = d.seen
    assert d_path == "/v1/completions"
    assert d_body == {**BODY, "cache_salt": tenant_salt(""), "kv_transfer_params": {
        "remote_host": "P", "remote_block_ids": [3, 4], "peer": "kv-P", "host": "10.0.0.5",
        "port": 5610}}


def test_chat_prefill_caps_max_completion_tokens_too():
    p, d = FakeVllm("P"), FakeVllm("D")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/chat/completions", json=chat) as resp:
                return resp.status

    assert run(go()) == 200
    assert p.seen[0][0] == "/v1/chat/completions"
    assert p.seen[0][1]["max_completion_tokens"] == 1 and p.seen[0][1]["max_tokens"] == 1
    assert d.seen[0][0] == "/v1/chat/completions"
    assert d.seen[0][1]["max_completion_tokens"] == 9 and "max_tokens" not in d.seen[0][1]


@pytest.mark.parametrize("client_id", ["req-from-client", None])
def test_p_and_d_share_one_request_id_and_the_clients_authorization(client_id):
    p, d = FakeVllm("P"), FakeVllm("D")
    headers = {"Authorization": "Bearer sk-test"} | ({"X-Request-Id": client_id} if client_id else {})

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY, headers=headers) as resp:
                return resp.headers.get("X-Request-Id")

    returned = run(go())
    p_headers, d_headers = p.seen[0][2], d.seen[0][2]
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"] == returned
    assert returned == client_id if client_id else returned
    assert p_headers["Authorization"] == d_headers["Authorization"] == "Bearer sk-test"


def test_streamed_chunks_reach_the_client_in_order_as_d_sends_them():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json={**BODY, "stream": True}) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                buffer, texts = b"", []
                async for data in resp.content.iter_any():
                    buffer += data
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        payload = event.decode().removeprefix("data: ")
                        if payload == "[DONE]":
                            texts.append(payload)
                            continue
                        i = int(json.loads(payload)["choices"][0]["text"])
                        texts.append(str(i))
                        d.events.append(f"client got {i}")
                        d.chunk_seen[i].set()
                return texts

    assert run(go()) == ["0", "1", "2", "[DONE]"]
    # A buffering proxy would hold chunk 0 until D had sent them all.
    assert d.events == ["D sent 0", "client got 0", "D sent 1", "client got 1", "D sent 2",
                        "client got 2"]
    assert p.seen[0][1]["stream"] is False and d.seen[0][1]["stream"] is True


async def _stream_broken_off(session, url):
    """What a streamed request received before the proxy ended its answer not cleanly."""
    async with session.post(url + "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status == 200
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for data in resp.content.iter_any():
                received += data
    return received


def test_a_stream_d_breaks_off_is_not_ended_cleanly_for_the_client():
    p, d = FakeVllm("P"), FakeVllm("D", break_after=1)

    async def go():
        async with pd([p], [d]) as (session, url):
            return await _stream_broken_off(session, url)

    assert run(go()).startswith(b"data: ")


def test_takes_p_instances_and_d_instances_in_turn_independently():
    ps, ds = [FakeVllm("P0"), FakeVllm("P1")], [FakeVllm("D0"), FakeVllm("D1")]

    async def go():
        async with pd(ps, ds) as (session, url):
            answers = []
            for i in range(4):
                async with session.post(url + "/v1/completions", json={**BODY, "prompt": f"q{i}"}) as r:
                    answers.append((await r.json())["choices"][0]["text"])
            return answers

    assert run(go()) == ["decoded by D0", "decoded by D1", "decoded by D0", "decoded by D1"]
    assert [[b["prompt"] for _, b, _ in f.seen] for f in ps + ds] == [["q0", "q2"], ["q1", "q3"]] * 2
    assert [b["kv_transfer_params"]["remote_host"] for _, b, _ in ds[0].seen] == ["P0", "P0"]


@pytest.mark.parametrize("status", [400, 503])
def test_p_error_reaches_the_client_with_its_status_and_body_and_d_is_not_asked(status):
    body = json.dumps({"error": {"message": f"P says {status}"}})
    p, d = FakeVllm("P", fail=(status, body)), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                return resp.status, await resp.text()

    assert run(go()) == (status, body)
    assert d.seen == []


@pytest.mark.parametrize("status", [400, 500])
@pytest.mark.parametrize("stream", [False, True])
def test_d_error_reaches_the_client_with_its_status_and_body(status, stream):
    body = json.dumps({"error": {"message": f"D says {status}"}})
    p, d = FakeVllm("P"), FakeVllm("D", fail=(status, body))

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json={**BODY, "stream": stream}) as resp:
                return resp.status, await resp.text()

    assert run(go()) == (status, body)


@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_an_unreachable_upstream_is_a_502_naming_its_url_without_local_prefill(dead):
    gone = closed_port_url()
    alive = [FakeVllm("P")] if dead == "decode" else []
    decodes = [FakeVllm("D")] if dead == "prefill" else []

    async def go():
        extra = {"extra_prefill": [gone]} if dead == "prefill" else {"extra_decode": [gone]}
        async with pd(alive, decodes, local_prefill_tokens=0, **extra) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                return resp.status, await resp.json()

    status, answer = run(go())
    assert status == 502
    assert gone in answer["error"]["message"] and dead in answer["error"]["message"]
    assert answer["error"]["upstream"] == gone


def test_a_p_that_returns_no_kv_transfer_params_is_a_502_saying_so():
    p, d = FakeVllm("P", params=False), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                return resp.status, await resp.json()

    status, answer = run(go())
    assert status == 502 and "kv_transfer_params" in answer["error"]["message"]
    assert "kv_producer" in answer["error"]["message"]
    assert d.seen == []


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]"])
def test_a_body_that_is_not_a_json_object_is_a_400(raw):
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", data=raw,
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json()

    status, answer = run(go())
    assert status == 400 and "JSON" in answer["error"]["message"]
    assert p.seen == [] and d.seen == []


def test_a_json_body_nested_too_deeply_to_read_is_a_400_not_a_500():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", data=b"[" * 100_000 + b"]" * 100_000,
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json()

    status, answer = run(go())
    assert status == 400 and "nested too deeply" in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    assert p.seen == [] and d.seen == []


def test_a_real_prompt_over_a_mib_is_taken_and_a_body_over_the_limit_is_a_413_in_openai_shape():
    """A 200k-token prompt as ids is about 1.4 MB (aiohttp's default limit, 1 MiB, refused it
    with a plain-text 413); over --max-body-mb the proxy answers 413 itself."""
    p, d = FakeVllm("P"), FakeVllm("D")
    prompt = list(range(100_000, 300_000))

    async def go(limit_mb, body):
        async with pd([p], [d], max_body_mb=limit_mb) as (session, url):
            async with session.post(url + "/v1/completions", json=body) as resp:
                return resp.status, await resp.json()

    status, _ = run(go(64, {"model": "m", "prompt": prompt, "max_tokens": 4}))
    assert status == 200 and p.seen and p.seen[0][1]["prompt"] == prompt
    seen = len(p.seen)
    status, answer = run(go(1, {"model": "m", "prompt": prompt, "max_tokens": 4}))
    assert status == 413 and answer["error"]["type"] == "invalid_request_error"
    assert "--max-body-mb 1 MiB" in answer["error"]["message"] and len(p.seen) == seen


@pytest.mark.parametrize("limit", [0, -1, True, "64", 1e9])
def test_a_body_limit_that_is_not_a_size_is_refused(limit):
    with pytest.raises(InvalidInputError, match="--max-body-mb"):
        ProxyConfig(prefill=("http://p:8100",), decode=("http://d:8200",), max_body_mb=limit)


def test_health_is_200_when_every_upstream_answers():
    async def go():
        async with pd([FakeVllm("P")], [FakeVllm("D")]) as (session, url):
            async with session.get(url + "/health") as resp:
                return resp.status, await resp.json()

    status, answer = run(go())
    assert status == 200 and answer["status"] == "ok" and answer["down"] == []


class _CountedHealth(FakeVllm):
    asked = 0

    async def _health(self, request: web.Request) -> web.Response:
        self.asked += 1
        await asyncio.sleep(0.05)
        return await super()._health(request)


def test_clients_polling_health_at_once_share_one_check_of_the_instances():
    """Fifty clients ask the proxy's /health at once: P and D are asked once for them all
    (beside the check at start), not fifty times."""
    p, d = _CountedHealth("P"), _CountedHealth("D")

    async def go():
        async with pd([p], [d], health_interval_s=3600) as (session, url):
            await _until(lambda: p.asked and d.asked, "the check at start")

            async def one():
                async with session.get(url + "/health") as resp:
                    return resp.status

            return await asyncio.gather(*(one() for _ in range(50)))

    assert run(go()) == [200] * 50
    assert p.asked <= 3 and d.asked <= 3, (p.asked, d.asked)


def test_health_is_503_naming_the_upstreams_down():
    gone = closed_port_url()

    async def go():
        async with pd([FakeVllm("P", health=500)], [FakeVllm("D")], extra_decode=[gone]) as (session, url):
            async with session.get(url + "/health") as resp:
                return resp.status, await resp.json()

    status, answer = run(go())
    assert status == 503 and answer["status"] == "unhealthy"
    assert [(x["role"], x["url"] == gone) for x in answer["down"]] == [("prefill", False),
                                                                        ("decode", True)]
    assert "500" in answer["down"][0]["reason"]


class _SilentModels(FakeVllm):
    async def _models(self, _request: web.Request) -> web.Response:
        await asyncio.sleep(WAIT_S)
        return web.json_response({})


def test_models_from_a_d_that_never_answers_is_a_502_within_the_health_timeout():
    app = _SilentModels("D").app()

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            p_url = await stack.enter_async_context(serving(FakeVllm("P").app()))
            d_url = await stack.enter_async_context(serving(app))
            config = ProxyConfig(prefill=(p_url,), decode=(d_url,), health_interval_s=3600,
                                 health_timeout_s=0.3)
            url = await stack.enter_async_context(serving(build_app(config)))
            session = await stack.enter_async_context(aiohttp.ClientSession())
            async with session.get(url + "/v1/models",
                                   timeout=aiohttp.ClientTimeout(total=WAIT_S / 2)) as resp:
                return resp.status, await resp.json(), d_url

    status, answer, d_url = run(go())
    assert status == 502 and d_url in answer["error"]["message"]


def test_p_s_answer_nested_too_deeply_to_read_is_a_502_naming_p():
    p, d = FakeVllm("P", fail=(200, "[" * 100_000 + "]" * 100_000)), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                return resp.status, await resp.json(), resp.headers

    status, answer, headers = run(go())
    assert status == 502 and "not a JSON object" in answer["error"]["message"]
    assert d.seen == []
    assert headers["X-Kvxfer-Route"].startswith("choice=pd; prefill=http")


def test_an_error_answer_names_its_route_and_request_id_as_d_s_answers_do():
    p, d = FakeVllm("P", fail=(400, '{"error": "bad"}')), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY,
                                    headers={"X-Request-Id": "mine-1"}) as resp:
                return resp.status, resp.headers

    status, headers = run(go())
    assert status == 400 and headers["X-Request-Id"] == "mine-1"
    assert headers["X-Kvxfer-Route"].startswith("choice=pd; prefill=http")


def test_models_is_answered_by_a_d_instance():
    async def go():
        async with pd([FakeVllm("P")], [FakeVllm("D")]) as (session, url):
            async with session.get(url + "/v1/models") as resp:
                return resp.status, await resp.json()

    assert run(go()) == (200, {"object": "list", "data": [{"id": "model-on-D"}]})


@pytest.mark.parametrize("url", ["ftp://h:8100", "http://", "localhost:8100", "http://h:99999",
                                 "http://h:8100/v1", "http://h:8100?x=1", "h"])
def test_bad_urls_are_refused_naming_them(url):
    with pytest.raises(InvalidInputError, match="--prefill") as e:
        parse_urls("--prefill", f"http://ok:8100,{url}")
    assert repr(url) in str(e.value)
    with pytest.raises(InvalidInputError, match="--decode"):
        ProxyConfig(prefill=("http://ok:8100",), decode=(url,))


def test_urls_lose_their_trailing_slash_and_empty_lists_are_refused():
    assert parse_urls("--decode", "http://a:1/, https://b:2") == ("http://a:1", "https://b:2")
    with pytest.raises(InvalidInputError, match="at least one URL"):
        parse_urls("--decode", " , ")


@pytest.mark.parametrize("port", [0, 65536, -1, "8000"])
def test_a_port_out_of_range_is_refused(port):
    with pytest.raises(InvalidInputError, match="--port"):
        ProxyConfig(prefill=("http://p:8100",), decode=("http://d:8200",), port=port)


def test_cli_refuses_a_bad_url_or_port_before_listening(capsys):
    assert cli.main(["proxy", "--prefill", "ftp://p:1", "--decode", "http://d:2", "--port", "8000"]) == 2
    assert "'ftp://p:1'" in capsys.readouterr().err
    assert cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_cli_refuses_a_port_in_use_or_a_host_that_does_not_resolve_by_flag_before_its_banner(
        capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2",
                         "--port", str(port)]) == 2
        out = capsys.readouterr()
        assert f"kvxfer: error: --port {port} on --host '127.0.0.1' cannot be listened on" in out.err
        assert "kvxfer proxy on" not in out.out
    assert cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", "--port", "8000",
                     "--host", "no-such-host.invalid"]) == 2
    assert "kvxfer: error: --host 'no-such-host.invalid' does not resolve" in capsys.readouterr().err


def test_cli_without_aiohttp_says_how_to_install_it():
    probe = ("import sys; sys.modules['aiohttp'] = None; from kvxfer import cli; sys.exit(cli.main("
             "['proxy', '--prefill', 'http://p:1', '--decode', 'http://d:2', '--port', '8000']))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "pip install 'kvxfer[proxy]'" in out.stderr


def test_the_cli_serves_until_terminated():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with serving(p.app()) as p_url, serving(d.app()) as d_url:
            port = closed_port_url().rsplit(":", 1)[1]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvxfer.cli", "proxy", "--prefill", p_url, "--decode", d_url,
                "--port", port, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                async with aiohttp.ClientSession() as session:
                    url = f"http://127.0.0.1:{port}"
                    await _until_healthy(session, url, proc)
                    async with session.post(url + "/v1/completions", json=BODY) as resp:
                        answer = await resp.json()
            finally:
                proc.terminate()
                out, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
            return answer, proc.returncode, out.decode(), port

    answer, returncode, out, port = run(go())
    assert answer == {"choices": [{"text": "decoded by D"}]}
    assert returncode == 0 and f"kvxfer proxy on http://127.0.0.1:{port}" in out


async def _until_healthy(session, url: str, proc) -> None:
    """Poll the proxy's `/health` until it answers 200 (bounded: the child may be slow to import)."""
    for _ in range(600):
        assert proc.returncode is None, "the proxy exited before it was healthy"
        with contextlib.suppress(aiohttp.ClientConnectionError):
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url}/health did not answer 200")


def test_kvxfer_and_its_cli_do_not_import_aiohttp():
    probe = "import kvxfer, kvxfer.cli, sys; print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_stream_mode_sends_p_and_d_one_stream_id_once_it_knows_p_s_kvxfer_address():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d], stream=True) as (session, url):
            answers = []
            for _ in range(2):
                async with session.post(url + "/v1/completions", json=BODY) as resp:
                    answers.append((resp.status, resp.headers.get("X-Kvxfer-Transfer"),
                                    await resp.json()))
            return answers

    first, second = run(go())
    # The first request learns P's address from P's params; the next is streamed.
    assert first[:2] == (200, "params") and second[:2] == (200, "stream")
    assert second[2] == {"choices": [{"text": "decoded by D"}]}
    p_params, d_params = p.seen[1][1]["kv_transfer_params"], d.seen[1][1]["kv_transfer_params"]
    stream = p_params["stream"]
    assert len(stream) == 32 and int(stream, 16) >= 0
    assert p_params["do_remote_decode"] is True and p.seen[1][1]["max_tokens"] == 1
    assert d_params == {"do_remote_prefill": True, "do_remote_decode": False, "stream": stream,
                        "peer": "kv-P", "host": "10.0.0.5", "port": 5610}
    assert d.seen[1][1]["max_tokens"] == BODY["max_tokens"]


def test_stream_mode_p_error_reaches_the_client_and_not_d_s_answer():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d], stream=True) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                await resp.read()
            p.fail = (503, '{"error": "P is overloaded"}')
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                return resp.status, await resp.text()

    assert run(go()) == (503, '{"error": "P is overloaded"}')


def test_without_stream_mode_every_request_goes_by_params():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d]) as (session, url):
            kinds = []
            for _ in range(2):
                async with session.post(url + "/v1/completions", json=BODY) as resp:
                    kinds.append(resp.headers.get("X-Kvxfer-Transfer"))
            return kinds

    assert run(go()) == ["params", "params"]
    assert all("stream" not in body["kv_transfer_params"] for _, body, _ in p.seen)



async def _until(condition, what: str) -> None:
    """Wait (bounded) until `condition()` holds."""
    for _ in range(WAIT_S * 20):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {WAIT_S} s")


async def _learn_p_address(session, url: str, *held: FakeVllm) -> None:
    """Have a stream-mode proxy learn P's kvxfer address from a first request; then hold `held`."""
    async with session.post(url + "/v1/completions", json=BODY) as resp:
        assert (resp.status, resp.headers["X-Kvxfer-Transfer"]) == (200, "params")
    for fake in held:
        fake.hold = True


@pytest.mark.parametrize("handler_cancellation", [False, True])
def test_a_client_that_goes_away_while_p_prefills_has_p_s_request_closed_and_d_never_asked(
        handler_cancellation, caplog):
    """aiohttp by default goes on with the handler of a client that left, so the proxy must see
    it itself; where the server cancels the handler, the cancellation closes P's request too."""
    caplog.set_level(logging.INFO, logger="kvxfer.serve.proxy")
    p, d = FakeVllm("P", hold=True), FakeVllm("D")

    async def go():
        async with pd([p], [d], handler_cancellation=handler_cancellation) as (session, url):
            asked = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY,
                                                       headers={"X-Request-Id": "gone-1"}))
            await asyncio.wait_for(p.holding.wait(), WAIT_S)
            asked.cancel()  # the client goes away: its connection to the proxy closes
            await asyncio.wait((asked,))
            await asyncio.wait_for(p.aborted.wait(), WAIT_S)  # P's request closed: vLLM aborts it
            await _until(lambda: "gone-1" in caplog.text, "the log line naming the request")
            p.release.set()  # too late: nobody is waiting for P's answer

    run(go())
    assert d.seen == [] and len(p.seen) == 1
    [line] = [r.getMessage() for r in caplog.records if "gone-1" in r.getMessage()]
    assert "the client went away" in line


def test_a_client_that_goes_away_in_stream_mode_has_p_s_and_d_s_requests_closed():
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d], stream=True) as (session, url):
            await _learn_p_address(session, url, p, d)
            asked = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(p.holding.wait(), WAIT_S)
            await asyncio.wait_for(d.holding.wait(), WAIT_S)
            asked.cancel()
            await asyncio.wait((asked,))
            await asyncio.wait_for(p.aborted.wait(), WAIT_S)
            await asyncio.wait_for(d.aborted.wait(), WAIT_S)

    run(go())
    assert d.seen[1][1]["kv_transfer_params"]["stream"] == p.seen[1][1]["kv_transfer_params"]["stream"]


def test_a_client_that_goes_away_while_d_streams_has_d_s_request_closed():
    p, d = FakeVllm("P"), FakeVllm("D")  # D sends one chunk, then waits for the client's word

    async def go():
        async with pd([p], [d]) as (session, url):
            async with session.post(url + "/v1/completions", json={**BODY, "stream": True}) as resp:
                assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
                resp.close()  # the client goes away mid-answer
            await asyncio.wait_for(d.aborted.wait(), WAIT_S)

    run(go())
    assert d.events == ["D sent 0"]  # D did not go on decoding for nobody


@pytest.mark.parametrize("stream", [False, True])
def test_a_p_slower_than_prefill_timeout_is_a_504_naming_the_flag_and_d_is_not_left_waiting(stream):
    p, d = FakeVllm("P", hold=not stream), FakeVllm("D")

    async def go():
        async with pd([p], [d], stream=stream, prefill_timeout_s=0.3) as (session, url):
            if stream:  # D is asked at once, and waits for P's stream
                await _learn_p_address(session, url, p, d)
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                status, answer = resp.status, await resp.json()
            await asyncio.wait_for(p.aborted.wait(), WAIT_S)  # P's request is closed, not left
            if stream:
                await asyncio.wait_for(d.aborted.wait(), WAIT_S)
            return status, answer

    status, answer = run(go())
    assert status == 504
    error = answer["error"]
    assert error["type"] == "upstream_timeout" and error["code"] == 504
    assert "--prefill-timeout 0.3 s" in error["message"] and "prefill" in error["message"]
    assert error["upstream"].startswith("http://127.0.0.1:") and error["upstream"] in error["message"]
    assert len(d.seen) == (2 if stream else 0)  # stream mode asks D at once; it was closed (above)


def test_a_d_slower_than_decode_timeout_is_a_504_naming_the_flag():
    p, d = FakeVllm("P"), FakeVllm("D", hold=True)

    async def go():
        async with pd([p], [d], decode_timeout_s=0.3) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                status, answer = resp.status, await resp.json()
            await asyncio.wait_for(d.aborted.wait(), WAIT_S)  # D's request is closed, not left
            return status, answer

    status, answer = run(go())
    assert status == 504 and answer["error"]["type"] == "upstream_timeout"
    assert "decode" in answer["error"]["message"]
    assert "--decode-timeout 0.3 s" in answer["error"]["message"]
    assert answer["error"]["upstream"] in answer["error"]["message"]


def test_a_stream_d_stalls_past_decode_timeout_is_ended_not_cleanly_for_the_client():
    p, d = FakeVllm("P"), FakeVllm("D")  # D sends one chunk, then waits for the client's word

    async def go():
        async with pd([p], [d], decode_timeout_s=2) as (session, url):
            received = await _stream_broken_off(session, url)
            await asyncio.wait_for(d.aborted.wait(), WAIT_S)
            return received

    assert run(go()).startswith(b"data: ")
    assert d.events == ["D sent 0"]


@pytest.mark.parametrize("field, flag", [("prefill_timeout_s", "--prefill-timeout"),
                                         ("decode_timeout_s", "--decode-timeout")])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "600"])
def test_a_timeout_that_is_not_a_positive_finite_number_of_seconds_is_refused_naming_its_flag(
        field, flag, value):
    with pytest.raises(InvalidInputError, match=flag):
        ProxyConfig(prefill=("http://p:8100",), decode=("http://d:8200",), **{field: value})


def test_cli_takes_the_timeouts_with_their_defaults_and_refuses_a_bad_one_by_flag(monkeypatch, capsys):
    from kvxfer.serve import proxy

    configs = []
    monkeypatch.setattr(proxy, "serve", configs.append)
    args = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", "--port", "8000"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--prefill-timeout", "30", "--decode-timeout", "90.5"]) == 0
    assert [(c.prefill_timeout_s, c.decode_timeout_s) for c in configs] == [(600, 3600), (30, 90.5)]
    assert cli.main([*args, "--decode-timeout", "0"]) == 2
    assert "kvxfer: error: --decode-timeout must be a positive" in capsys.readouterr().err


P_PARAMS = {"remote_host": "P", "remote_block_ids": [3], "peer": "kv-P", "host": "10.0.0.5",
            "port": 5610}


def _p_answering(body: bytes, chunked: bool) -> web.Application:
    """A P that answers every completion with `body`: with its length, or chunked in 100-byte
    pieces (no length said, as a streaming server sends)."""

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not chunked:
            return web.Response(body=body, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        out.enable_chunked_encoding()
        await out.prepare(request)
        for i in range(0, len(body), 100):
            await out.write(body[i:i + 100])
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    return app


def _p_streaming_without_end(closed: asyncio.Event, answered: list[int]) -> web.Application:
    """A P that answers each completion after the first `answered[0]` with server-sent events
    that do not end (1 kB each 10 ms, for minutes), though asked for no stream; `closed` is set
    once such a request is closed. The first ones get a one-token answer with P's params."""

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        if answered[0] > 0:
            answered[0] -= 1
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await out.prepare(request)
            for _ in range(WAIT_S * 6000):
                await out.write(b"data: " + b"x" * 1000 + b"\n\n")
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionError):
            closed.set()
            raise
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    return app


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("over", [0, 1])
def test_p_s_answer_is_read_up_to_prefill_max_bytes_and_one_byte_more_is_a_502_naming_it(
        chunked, over):
    d = FakeVllm("D")
    answer = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS,
                         "pad": "y" * 1000}).encode()
    limit = len(answer) - over

    async def go():
        async with serving(_p_answering(answer, chunked)) as p_url:
            async with pd([], [d], extra_prefill=[p_url], prefill_max_bytes=limit) as (session, url):
                async with session.post(url + "/v1/completions", json=BODY) as resp:
                    return resp.status, await resp.json(), p_url

    status, got, p_url = run(go())
    if not over:
        assert status == 200 and d.seen[0][1]["kv_transfer_params"] == P_PARAMS
        return
    assert status == 502 and got["error"]["type"] == "bad_upstream_response"
    assert f"--prefill-max-bytes {limit} bytes" in got["error"]["message"]
    assert got["error"]["upstream"] == p_url and p_url in got["error"]["message"]
    assert d.seen == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_p_streaming_without_end_is_a_502_once_over_prefill_max_bytes_and_its_request_closed(
        stream):
    """The proxy stops reading at the limit: the client's request ends (long before
    --prefill-timeout), P's request is closed, and D is not left waiting (stream mode)."""
    closed, d = asyncio.Event(), FakeVllm("D")

    async def go():
        # In stream mode, P's first answer gives the proxy its address, to stream the next one.
        app = _p_streaming_without_end(closed, [1 if stream else 0])
        async with serving(app, handler_cancellation=True) as p_url:
            async with pd([], [d], extra_prefill=[p_url], stream=stream,
                          prefill_max_bytes=4096) as (session, url):
                if stream:
                    await _learn_p_address(session, url, d)
                asked = session.post(url + "/v1/completions", json=BODY)
                async with await asyncio.wait_for(asked, WAIT_S) as resp:
                    status, answer = resp.status, await resp.json()
                await asyncio.wait_for(closed.wait(), WAIT_S)
                if stream:
                    await asyncio.wait_for(d.aborted.wait(), WAIT_S)
                return status, answer, p_url

    status, answer, p_url = run(go())
    assert status == 502 and "--prefill-max-bytes 4096 bytes" in answer["error"]["message"]
    assert answer["error"]["upstream"] == p_url
    assert len(d.seen) == (2 if stream else 0)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "4096", None])
def test_a_prefill_max_bytes_that_is_not_a_positive_int_is_refused_naming_its_flag(value):
    with pytest.raises(InvalidInputError, match="--prefill-max-bytes") as e:
        ProxyConfig(prefill=("http://p:8100",), decode=("http://d:8200",), prefill_max_bytes=value)
    assert repr(value) in str(e.value)


def test_cli_takes_prefill_max_bytes_with_its_default_and_refuses_a_bad_one(monkeypatch, capsys):
    from kvxfer.serve import proxy

    configs = []
    monkeypatch.setattr(proxy, "serve", configs.append)
    args = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", "--port", "8000"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--prefill-max-bytes", "65536"]) == 0
    assert [c.prefill_max_bytes for c in configs] == [4 << 20, 65536]
    assert cli.main([*args, "--prefill-max-bytes", "0"]) == 2
    assert "kvxfer: error: --prefill-max-bytes must be a positive int, got 0" in capsys.readouterr().err


def _p_answering_raw(head: bytes, body: bytes) -> web.Application:
    """A P that writes `head` (its status line and headers, as it pleases) and `body` to the
    socket itself, then closes it: a Content-Length or encoding that lies."""

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        request.transport.write(head + b"\r\n" + body)
        request.transport.close()
        return web.Response()  # never sent: the connection is gone

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    return app


def test_a_compressed_answer_is_held_to_prefill_max_bytes_as_it_decompresses():
    """A gzip bomb: 16 MiB of answer in a few kB on the wire, its Content-Length small. The
    limit is on what the proxy reads out (aiohttp decompresses as it reads), not on the wire."""
    import gzip

    bomb = gzip.compress(json.dumps({"kv_transfer_params": P_PARAMS, "pad": "y" * (16 << 20)})
                         .encode())
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: %d\r\n" % len(bomb))

    async def go():
        async with serving(_p_answering_raw(head, bomb)) as p_url:
            async with pd([], [FakeVllm("D")], extra_prefill=[p_url],
                          prefill_max_bytes=1 << 20) as (session, url):
                async with session.post(url + "/v1/completions", json=BODY) as resp:
                    return resp.status, await resp.json()

    assert len(bomb) < 64 << 10  # well under the limit on the wire
    status, answer = run(go())
    assert status == 502 and "--prefill-max-bytes 1048576 bytes" in answer["error"]["message"]


@pytest.mark.parametrize("said", ["longer", "shorter"])
def test_a_content_length_that_lies_is_a_502_naming_p_never_a_hang_or_a_500(said):
    """Longer than the body, P closing after it: the body ends early. Shorter: the proxy reads
    what it said, which cuts the JSON (no params)."""
    body = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS}).encode()
    length = len(body) + 1000 if said == "longer" else len(body) // 2
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            % length)
    d = FakeVllm("D")

    async def go():
        async with serving(_p_answering_raw(head, body)) as p_url:
            async with pd([], [d], extra_prefill=[p_url]) as (session, url):
                asked = session.post(url + "/v1/completions", json=BODY)
                async with await asyncio.wait_for(asked, WAIT_S) as resp:
                    return resp.status, await resp.json(), p_url

    status, answer, p_url = run(go())
    assert status == 502 and answer["error"]["upstream"] == p_url and d.seen == []


def test_a_later_turn_d_holds_all_but_a_short_suffix_of_skips_p_and_the_route_says_so():
    ps, ds = [FakeVllm("P0"), FakeVllm("P1")], [FakeVllm("D0"), FakeVllm("D1")]
    turn1 = list(range(1000, 1512))
    prompts = [turn1, list(range(5000, 5600)), turn1 + list(range(7, 207)),
               turn1 + list(range(7, 207)) + list(range(9, 609))]

    async def go():
        async with pd(ps, ds, local_prefill_tokens=256) as (session, url):
            routes = []
            for prompt in prompts:
                async with session.post(url + "/v1/completions", json={**BODY, "prompt": prompt}) as r:
                    routes.append((r.headers["X-Kvxfer-Route"], r.headers["X-Kvxfer-Transfer"],
                                   (await r.json())["choices"][0]["text"]))
            async with session.get(url + "/metrics") as r:
                return routes, await r.text()

    routes, metrics = run(go())
    assert [t for _, t, _ in routes] == ["params", "params", "local", "params"]
    assert [a for _, _, a in routes] == ["decoded by D0", "decoded by D1", "decoded by D0",
                                         "decoded by D0"]
    assert routes[2][0].startswith("choice=local; prefill=-; decode=http://127.0.0.1:")
    assert "expected_hit=512; reason=prefix" in routes[2][0]
    assert "choice=pd" in routes[3][0] and "expected_hit=512" in routes[3][0]
    assert [len(b["prompt"]) for f in ps for _, b, _ in f.seen] == [512, 1312, 600]
    local = ds[0].seen[1][1]
    assert local["kv_transfer_params"] == {"do_remote_decode": False, "do_remote_prefill": False,
                                           "local_prefill": True}
    assert local["prompt"] == prompts[2]
    assert 'kvxfer_proxy_routes_total{choice="local",reason="prefix"} 1' in metrics
    assert 'kvxfer_proxy_routes_total{choice="pd",reason="prefix"} 1' in metrics
    assert 'kvxfer_proxy_routes_total{choice="pd",reason="turn"} 2' in metrics
    assert metrics.count("kvxfer_proxy_in_flight{") == 4 and "} 0\n" in metrics


def test_a_session_header_keeps_a_client_on_one_d():
    ps, ds = [FakeVllm("P0")], [FakeVllm("D0"), FakeVllm("D1"), FakeVllm("D2")]

    async def go():
        async with pd(ps, ds) as (session, url):
            answers = []
            for i in range(4):
                async with session.post(url + "/v1/completions", json={**BODY, "prompt": f"q{i}"},
                                        headers={"X-Session-Id": "s" * 4000}) as r:
                    answers.append((await r.json())["choices"][0]["text"])
            return answers

    assert run(go()) == ["decoded by D0"] * 4


def test_another_tenant_sending_the_same_session_id_has_a_session_of_its_own():
    """Tenant A's session goes to D0, which is then busy (A's request held there): tenant B
    sends the same `X-Session-Id` under another `Authorization` and goes to D1, the least
    loaded; A's next turn still goes to D0 (B did not move A's session). The same id under
    A's key with another `cache_salt` of the client's is A's session still: the proxy sets
    the salt from the tenant."""
    ps, ds = [FakeVllm("P0")], [FakeVllm("D0"), FakeVllm("D1")]

    async def ask(session, url, key, salt="s1"):
        headers = {"X-Session-Id": "1", "Authorization": f"Bearer {key}"}
        async with session.post(url + "/v1/completions", headers=headers,
                                json={**BODY, "prompt": "q", "cache_salt": salt}) as r:
            return r.headers["X-Kvxfer-Route"].split("decode=")[1].split(";")[0]

    async def go():
        async with pd(ps, ds, route_imbalance=0) as (session, url):
            a = await ask(session, url, "A")
            ds[0].hold = True
            held = asyncio.ensure_future(ask(session, url, "A"))
            await asyncio.wait_for(ds[0].holding.wait(), WAIT_S)
            b = await ask(session, url, "B")
            ds[0].hold = False
            ds[0].release.set()
            await held
            other_salt = await ask(session, url, "A", salt="s2")
            return a, b, other_salt, await ask(session, url, "A")

    a, b, other_salt, again = run(go())
    assert a == again and b != a and other_salt == a


def test_a_clients_own_cache_salt_and_kv_transfer_params_change_nothing_another_tenant_reads():
    """Tenant B sends A's prompt with A's salt (learnt somehow) and made-up params naming a
    peer to read from: P and D get B's own salt, derived from B's key, and the proxy's params
    only; the router counts B's prompt as no hit on A's (B goes to the least loaded D, not
    the one holding A's prompt). Behind a gateway (`tenant_header` its header), the salt is
    derived from that header; with none, the client's passes through."""
    ps, ds = [FakeVllm("P0")], [FakeVllm("D0"), FakeVllm("D1")]
    forged = {"kv_source": {"peer": "kv-D0", "num_prompt_tokens": 3}, "do_remote_prefill": True,
              "peer": "attacker", "host": "10.9.9.9", "port": 1}
    prompt = {**BODY, "prompt": list(range(40)), "max_tokens": 2}

    async def ask(session, url, key, body, **headers):
        async with session.post(url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}", **headers}) as r:
            assert r.status == 200
            return r.headers["X-Kvxfer-Route"].split("decode=")[1].split(";")[0]

    async def go(**config):
        async with pd(ps, ds, route_imbalance=0, **config) as (session, url):
            a = await ask(session, url, "A", prompt)
            b = await ask(session, url, "B", {**prompt, "cache_salt": tenant_salt("Bearer A"),
                                               "kv_transfer_params": forged})
            return a, b

    a, b = run(go())
    assert a != b  # A's prompt under B's salt is no hit on the D that holds A's
    (_, p_a, _), (_, p_b, _) = ps[0].seen
    (_, d_a, _), (_, d_b, _) = ds[0].seen + ds[1].seen
    assert p_a["cache_salt"] == d_a["cache_salt"] == tenant_salt("Bearer A")
    assert p_b["cache_salt"] == d_b["cache_salt"] == tenant_salt("Bearer B")
    assert p_b["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "kv_source" not in d_b["kv_transfer_params"]
    assert d_b["kv_transfer_params"]["peer"] == "kv-P0"
    for fake in (*ps, *ds):
        fake.seen.clear()
    def salts():
        seen = {b.get("cache_salt") for fake in (*ps, *ds) for _, b, _ in fake.seen}
        for fake in (*ps, *ds):
            fake.seen.clear()
        return seen

    run(go(tenant_header="X-Tenant"))
    assert salts() == {tenant_salt("")}  # neither sent X-Tenant: one tenant
    run(go(tenant_header=None))
    assert salts() == {None, tenant_salt("Bearer A")}  # each client's own


def test_an_instance_failing_its_health_check_is_not_routed_to_within_one_interval():
    ps, ds = [FakeVllm("P0")], [FakeVllm("D0", health=503), FakeVllm("D1")]

    async def go():
        async with pd(ps, ds, health_interval_s=0.05) as (session, url):
            await asyncio.sleep(0.5)
            answers = []
            for i in range(4):
                async with session.post(url + "/v1/completions", json={**BODY, "prompt": f"q{i}"}) as r:
                    answers.append((await r.json())["choices"][0]["text"])
            ds[0].health = 200
            await asyncio.sleep(0.5)
            for i in range(4, 6):
                async with session.post(url + "/v1/completions", json={**BODY, "prompt": f"q{i}"}) as r:
                    answers.append((await r.json())["choices"][0]["text"])
            async with session.get(url + "/metrics") as r:
                return answers, await r.text()

    answers, metrics = run(go())
    assert answers[:4] == ["decoded by D1"] * 4 and set(answers[4:]) == {"decoded by D0",
                                                                         "decoded by D1"}
    assert metrics.count('kvxfer_proxy_up{') == 3 and '} 0\n' not in metrics.split("up{")[-1]


def test_cli_takes_the_routing_flags_with_their_defaults_and_refuses_bad_ones(monkeypatch, capsys):
    from kvxfer.serve import proxy

    configs = []
    monkeypatch.setattr(proxy, "serve", configs.append)
    args = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", "--port", "8000"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--route", "round_robin", "--local-prefill-tokens", "0",
                     "--route-imbalance", "9", "--health-interval", "0.5"]) == 0
    assert [(c.route, c.local_prefill_tokens, c.route_imbalance, c.health_interval_s)
            for c in configs] == [("prefix", 512, 4, 5.0), ("round_robin", 0, 9, 0.5)]
    assert cli.main([*args, "--local-prefill-tokens", "-3"]) == 2
    assert "--local-prefill-tokens must be an int of at least 0, got -3" in capsys.readouterr().err
    assert cli.main([*args, "--health-interval", "nan"]) == 2
    assert "--health-interval must be a positive, finite" in capsys.readouterr().err


def test_with_local_prefill_on_a_p_that_cannot_be_reached_has_d_prefill_alone_and_is_marked_down():
    gone, d = closed_port_url(), FakeVllm("D")

    async def go():
        async with pd([], [d], extra_prefill=[gone], health_interval_s=3600) as (session, url):
            answers = []
            for _ in range(2):
                async with session.post(url + "/v1/completions", json=BODY) as r:
                    answers.append((r.status, r.headers["X-Kvxfer-Route"],
                                    r.headers["X-Kvxfer-Transfer"], await r.json()))
            async with session.get(url + "/metrics") as r:
                return answers, await r.text()

    answers, metrics = run(go())
    for status, route, how, answer in answers:
        assert (status, how, answer) == (200, "local", {"choices": [{"text": "decoded by D"}]})
        assert route.startswith("choice=local; prefill=-;") and "reason=p_unreachable" in route
    assert [b["kv_transfer_params"] for _, b, _ in d.seen] == [
        {"do_remote_decode": False, "do_remote_prefill": False, "local_prefill": True}] * 2
    assert 'kvxfer_proxy_routes_total{choice="local",reason="p_unreachable"} 2' in metrics
    assert f'kvxfer_proxy_up{{role="prefill",url="{gone}"}} 0' in metrics


def _vllm_metrics(blocks: int, block_size: int, pool_tokens: str = "",
                  pool_once_stepped: bool = False, padding: int = 0, before: str = "",
                  first_late_s: float = 0.0) -> web.Application:
    """A D whose /metrics says its KV cache is `blocks` blocks of `block_size` tokens, and
    with `pool_tokens` (the gauge's value as prometheus_client writes it: `384.0`, and from
    a million on `1.048576e+06`), that its kvxfer host pool holds that many more; with
    `pool_once_stepped`, only once D has answered a request (vLLM's engine steps, and
    kvxfer's gauges exist, only once it has one). `padding`: bytes of histogram lines first,
    sent in 16 KiB chunks as a busy vLLM's are (it writes its cache config late); `before`:
    lines before the cache config; `first_late_s`: its first answer comes that late."""
    d = FakeVllm("D")
    app = d.app()
    pool = (f'vllm:kvxfer_pool_capacity_tokens{{engine="0",model_name="m",role="D"}} '
            f'{pool_tokens}\n') if pool_tokens else ""
    line = 'vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="m"} 3.0\n'
    asked = []

    async def metrics(request: web.Request) -> web.StreamResponse:
        asked.append(1)
        if len(asked) == 1 and first_late_s:
            await asyncio.sleep(first_late_s)
        text = (line * (padding // len(line)) + before
                + '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
                f'vllm:cache_config_info{{block_size="{block_size}",engine="0",'
                f'num_gpu_blocks="{blocks}",prefix_caching_hash_algo="sha256"}} 1.0\n'
                + (pool if d.seen or not pool_once_stepped else "")).encode()
        out = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await out.prepare(request)
        for i in range(0, len(text), 16 << 10):
            await out.write(text[i:i + (16 << 10)])
            await asyncio.sleep(0.001)
        await out.write_eof()
        return out

    app.router.add_get("/metrics", metrics)
    return app


@pytest.mark.parametrize("pool_tokens, second", [("", "pd"), ("384.0", "pd"), ("640.0", "local"),
                                                  ("1.048576e+06", "local")])
def test_what_d_is_believed_to_hold_is_bounded_by_its_kv_cache_and_pool_from_its_metrics(
        pool_tokens, second):
    """D's cache holds 8 blocks of 16 tokens (128 tokens, 8 spans): of a 512-token prompt D
    answered, only the last 8 spans are remembered, so the prompt's next turn finds no run
    from its start and goes through P. D's host pool keeps what its cache drops, much of it
    also still in the cache: D holds the larger of the two, not their sum. A pool of 384
    tokens still drops the prompt's start; one of 640 keeps all of it, and the next turn is
    D's alone; as does one of a million tokens, a gauge /metrics writes as 1.048576e+06."""
    p = FakeVllm("P")

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            d_url = await stack.enter_async_context(serving(_vllm_metrics(8, 16, pool_tokens)))
            proxy, session = await _proxy_over(stack, p, d_url)
            return await _two_turn_choices(session, proxy)

    assert run(go()) == ["choice=pd", f"choice={second}"]


@pytest.mark.parametrize("options", [{"padding": 300_000}, {"first_late_s": 1.0}])
def test_d_s_kv_cache_size_is_read_from_the_whole_of_its_metrics_and_asked_again_if_unread(
        options):
    """vLLM writes its cache config after its histograms, and a busy D's /metrics arrives in
    pieces: the proxy reads it whole (a first piece lacks the size, and D would be believed
    to hold every prompt it answered). A /metrics that does not come within the health
    timeout is asked again at the next check. Either way, D's 128 tokens are learned: a
    512-token prompt's next turn goes through P."""
    p = FakeVllm("P")

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            d_url = await stack.enter_async_context(serving(_vllm_metrics(8, 16, **options)))
            proxy, session = await _proxy_over(stack, p, d_url, health_interval_s=0.05,
                                               health_timeout_s=0.5)
            return await _two_turn_choices(session, proxy)

    assert run(go()) == ["choice=pd", "choice=pd"]


def test_a_pool_gauge_cut_off_in_d_s_metrics_is_not_read_across_lines():
    """A line that opens the pool gauge's labels and never closes them, then a line that
    ends as the gauge would: no pool is credited (the match stays on one line)."""
    p = FakeVllm("P")
    broken = ('vllm:kvxfer_pool_capacity_tokens{engine="0"\n'
              'x{role="D"} 1.048576e+06\n')

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            d_url = await stack.enter_async_context(serving(_vllm_metrics(8, 16, before=broken)))
            proxy, session = await _proxy_over(stack, p, d_url)
            return await _two_turn_choices(session, proxy)

    assert run(go()) == ["choice=pd", "choice=pd"]


def test_a_d_pool_its_metrics_name_only_once_d_has_stepped_is_counted_from_then_on():
    """A freshly started D has no kvxfer gauges until its engine has stepped (its first
    request): the pool its /metrics names after that first answer still counts, so a
    conversation D answered later is D's alone on its next turn."""
    p = FakeVllm("P")

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            d_url = await stack.enter_async_context(
                serving(_vllm_metrics(8, 16, "640.0", pool_once_stepped=True)))
            proxy, session = await _proxy_over(stack, p, d_url, health_interval_s=0.05)
            async with session.post(proxy + "/v1/completions", json=BODY) as r:
                assert r.status == 200  # D has stepped: its pool's gauge is there
            await asyncio.sleep(0.3)  # the health checks since
            return await _two_turn_choices(session, proxy)

    assert run(go()) == ["choice=pd", "choice=local"]


async def _two_turn_choices(session: aiohttp.ClientSession, proxy: str) -> list[str]:
    """The route choices of a 512-token prompt and its next turn (40 tokens more)."""
    choices = []
    for prompt in (list(range(512)), list(range(512)) + [7] * 40):
        async with session.post(proxy + "/v1/completions", json={**BODY, "prompt": prompt}) as r:
            choices.append(r.headers["X-Kvxfer-Route"].split(";")[0])
    return choices


async def _proxy_over(stack, p: FakeVllm, d_url: str, **options: Any):
    """A proxy over fake P `p` and the D at `d_url` (`options`: more `ProxyConfig` fields),
    once its first health check has run."""
    p_url = await stack.enter_async_context(serving(p.app()))
    config = ProxyConfig(prefill=(p_url,), decode=(d_url,), **options)
    app = build_app(config)
    proxy = await stack.enter_async_context(serving(app))
    session = await stack.enter_async_context(aiohttp.ClientSession())
    await _until_checked(session, proxy, d_url)  # the check at start asks D's /metrics once
    return proxy, session


@pytest.mark.parametrize("local", [0, 512])
def test_a_d_that_stops_answering_is_marked_down_and_the_next_d_gets_the_request(local):
    """D2 passes the proxy's first health check, then goes away: the request the proxy sends
    it reaches nobody, so the next D gets it, P's params and all; D2 is then out of routing."""
    p, d1 = FakeVllm("P"), FakeVllm("D1")

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            url, session, _, _, d2_url = await _d2_gone(stack, p, d1, local_prefill_tokens=local)
            answers = []
            for i in range(3):  # Ds in turn: D1, D2 (gone: D1 instead), D1
                async with session.post(url + "/v1/completions",
                                        json={**BODY, "prompt": f"q{i}"}) as r:
                    answers.append((r.status, r.headers["X-Kvxfer-Route"],
                                    (await r.json())["choices"][0]["text"]))
            async with session.get(url + "/metrics") as r:
                return answers, await r.text(), d2_url

    answers, metrics, gone = run(go())
    assert [(s, a) for s, _, a in answers] == [(200, "decoded by D1")] * 3
    assert ["d_unreachable" in route for _, route, _ in answers] == [False, True, False]
    assert "choice=pd" in answers[1][1]
    assert [b["kv_transfer_params"]["remote_host"] for _, b, _ in d1.seen] == ["P"] * 3
    assert f'kvxfer_proxy_up{{role="decode",url="{gone}"}} 0' in metrics
    assert 'kvxfer_proxy_routes_total{choice="pd",reason="d_unreachable"} 1' in metrics


def test_a_d_that_cannot_be_reached_at_all_is_a_502_naming_it_when_no_other_d_is_up():
    p, gone = FakeVllm("P"), closed_port_url()

    async def go():
        async with pd([p], [], extra_decode=[gone]) as (session, url):
            async with session.post(url + "/v1/completions", json=BODY) as r:
                return r.status, await r.json()

    status, answer = run(go())
    assert status == 502 and gone in answer["error"]["message"]


async def _d2_gone(stack: contextlib.AsyncExitStack, p: FakeVllm, d1: FakeVllm,
                   d2_first: bool = False, **config):
    """P, D1 and a D2 that passed the proxy's first health check, then went away (its port
    closed: nothing reaches it), with a proxy over them (`config`, D2 first in turn when
    `d2_first`). Returns the proxy's URL, a client session, and P's, D1's and D2's URLs."""
    p_url = await stack.enter_async_context(serving(p.app()))
    d1_url = await stack.enter_async_context(serving(d1.app()))
    d2 = contextlib.AsyncExitStack()
    d2_url = await d2.enter_async_context(serving(_vllm_metrics(8, 16)))
    decode = (d2_url, d1_url) if d2_first else (d1_url, d2_url)
    app = build_app(ProxyConfig(prefill=(p_url,), decode=decode, health_interval_s=3600, **config))
    url = await stack.enter_async_context(serving(app))
    session = await stack.enter_async_context(aiohttp.ClientSession())
    await _until_checked(session, url, d2_url)
    await d2.aclose()
    return url, session, p_url, d1_url, d2_url


def test_a_local_prefill_whose_d_is_gone_goes_through_p_to_a_d_that_holds_none_of_it():
    """Turn 1 goes through P to D2; its next turn would be D2's alone, but D2 is gone: D1,
    which holds none of it, gets P's params instead of prefilling the whole prompt alone."""
    p, d1 = FakeVllm("P"), FakeVllm("D1")
    first = list(range(1000, 1512))

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            p_url = await stack.enter_async_context(serving(p.app()))
            d1_url = await stack.enter_async_context(serving(d1.app()))
            d2 = contextlib.AsyncExitStack()
            d2_url = await d2.enter_async_context(serving(_vllm_metrics(64, 16)))
            app = build_app(ProxyConfig(prefill=(p_url,), decode=(d2_url, d1_url),
                                        local_prefill_tokens=256, health_interval_s=3600))
            url = await stack.enter_async_context(serving(app))
            session = await stack.enter_async_context(aiohttp.ClientSession())
            await _until_checked(session, url, d2_url)
            async with session.post(url + "/v1/completions", json={**BODY, "prompt": first}) as r:
                assert f"decode={d2_url}" in r.headers["X-Kvxfer-Route"]
            await d2.aclose()
            async with session.post(url + "/v1/completions",
                                    json={**BODY, "prompt": first + [7] * 100}) as r:
                return r.status, r.headers["X-Kvxfer-Route"], await r.json(), p_url, d1_url

    status, route, answer, p_url, d1_url = run(go())
    assert (status, answer) == (200, {"choices": [{"text": "decoded by D1"}]})
    assert route == (f"choice=pd; prefill={p_url}; decode={d1_url}; expected_hit=512; "
                     f"reason=d_unreachable")
    assert d1.seen[-1][1]["kv_transfer_params"]["peer"] == "kv-P"  # P's params, not local
    assert len(p.seen) == 2


async def _until_checked(session, url: str, d_url: str) -> None:
    """Wait until the proxy at `url` has read D's KV cache size (its first health check)."""
    for _ in range(100):
        async with session.get(url + "/metrics") as r:
            if f'kvxfer_proxy_cache_tokens{{role="decode",url="{d_url}"}}' in await r.text():
                return
        await asyncio.sleep(0.05)
    raise AssertionError("the proxy never checked D")


def _metric(text: str, name: str, role: str, url: str) -> str:
    return next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                if line.startswith(f'kvxfer_proxy_{name}{{role="{role}",url="{url}"}}'))


def test_a_request_the_next_d_takes_over_is_in_flight_on_that_d_not_on_the_one_gone():
    p, d1 = FakeVllm("P"), FakeVllm("D1", hold=True)

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            url, session, p_url, d1_url, d2_url = await _d2_gone(stack, p, d1, d2_first=True)
            asked = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(d1.holding.wait(), WAIT_S)
            async with session.get(url + "/metrics") as r:
                during = await r.text()
            d1.release.set()
            async with await asyncio.wait_for(asked, WAIT_S) as r:
                assert r.status == 200 and "d_unreachable" in r.headers["X-Kvxfer-Route"]
            async with session.get(url + "/metrics") as r:
                return during, await r.text(), p_url, d1_url, d2_url

    during, after, p_url, d1_url, d2_url = run(go())
    assert [_metric(during, "in_flight", role, u) for role, u in (
        ("prefill", p_url), ("decode", d1_url), ("decode", d2_url))] == ["0", "1", "0"]
    assert [_metric(after, "in_flight", role, u) for role, u in (
        ("prefill", p_url), ("decode", d1_url), ("decode", d2_url))] == ["0", "0", "0"]


def _blackhole(port: int) -> list[socket.socket]:
    """A socket listening on 127.0.0.1:`port` whose backlog is full: a connection to it is never
    made (its SYNs are dropped), as to a host switched off. Close the sockets returned."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(0)
    held = [s]
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        held.append(c)
    return held


def test_a_d_whose_connection_times_out_is_marked_down_and_the_next_d_gets_the_request():
    """Nothing reached a D whose TCP connection was never made (a host switched off): as one
    that refuses it, the next D gets the request."""
    p, d1 = FakeVllm("P"), FakeVllm("D1")

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            url, session, _, _, d2_url = await _d2_gone(stack, p, d1, d2_first=True,
                                                        connect_timeout_s=0.3)
            for s in _blackhole(int(d2_url.rsplit(":", 1)[1])):
                stack.callback(s.close)
            async with session.post(url + "/v1/completions", json=BODY) as r:
                return r.status, r.headers["X-Kvxfer-Route"], await r.json()

    status, route, answer = run(go())
    assert (status, answer) == (200, {"choices": [{"text": "decoded by D1"}]}), answer
    assert "reason=d_unreachable" in route


def _d_with_metrics(d: FakeVllm, text: str) -> web.Application:
    app = d.app()

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=text)

    app.router.add_get("/metrics", metrics)
    return app


@pytest.mark.parametrize("blocks", ["\u00b2", "9" * 5000])
def test_a_d_whose_metrics_say_nonsense_does_not_stop_the_health_checks(blocks):
    ds = [FakeVllm("D0"), FakeVllm("D1")]
    metrics = f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1.0\n'

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            p_url = await stack.enter_async_context(serving(FakeVllm("P").app()))
            d_urls = [await stack.enter_async_context(serving(_d_with_metrics(d, metrics)))
                      for d in ds]
            config = ProxyConfig(prefill=(p_url,), decode=tuple(d_urls), health_interval_s=0.05)
            url = await stack.enter_async_context(serving(build_app(config)))
            session = await stack.enter_async_context(aiohttp.ClientSession())
            await asyncio.sleep(0.3)
            ds[0].health = 503
            await asyncio.sleep(0.5)
            answers = []
            for i in range(4):
                async with session.post(url + "/v1/completions", json={**BODY, "prompt": f"q{i}"}) as r:
                    answers.append((await r.json())["choices"][0]["text"])
            return answers

    assert run(go()) == ["decoded by D1"] * 4


def test_in_stream_mode_a_d_that_cannot_be_reached_is_a_502_and_marked_down():
    p = FakeVllm("P")

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            p_url = await stack.enter_async_context(serving(p.app()))
            d = contextlib.AsyncExitStack()
            d_url = await d.enter_async_context(serving(_vllm_metrics(8, 16)))
            config = ProxyConfig(prefill=(p_url,), decode=(d_url,), stream=True,
                                 health_interval_s=3600)
            url = await stack.enter_async_context(serving(build_app(config)))
            session = await stack.enter_async_context(aiohttp.ClientSession())
            await _until_checked(session, url, d_url)
            async with session.post(url + "/v1/completions", json=BODY) as r:
                assert r.status == 200  # the proxy knows P's kvxfer address now
            await d.aclose()
            async with session.post(url + "/v1/completions", json=BODY) as r:
                status, answer = r.status, await r.json()
            async with session.get(url + "/metrics") as r:
                return status, answer, await r.text(), d_url

    status, answer, metrics, d_url = run(go())
    assert status == 502 and d_url in answer["error"]["message"]
    assert _metric(metrics, "up", "decode", d_url) == "0"


def test_metrics_escape_a_url_s_quotes_and_backslashes():
    config = ProxyConfig(prefill=("http://p\\x:1",), decode=('http://d"x:1',), health_interval_s=3600)

    async def go():
        async with serving(build_app(config)) as url, aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as r:
                return await r.text()

    metrics = run(go())
    assert 'kvxfer_proxy_up{role="prefill",url="http://p\\\\x:1"} ' in metrics
    assert 'kvxfer_proxy_up{role="decode",url="http://d\\"x:1"} ' in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_in_flight_on_p_only_until_p_has_answered(stream):
    """P's work ends with its answer: a long generation on D does not make P look loaded."""
    p, d = FakeVllm("P"), FakeVllm("D")

    async def go():
        async with pd([p], [d], stream=stream) as (session, url):
            if stream:
                await _learn_p_address(session, url, d)
            d.hold = True
            asked = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(d.holding.wait(), WAIT_S)
            await _until(lambda: len(p.seen) == 1 + stream, "P answered")
            await asyncio.sleep(0.1)
            async with session.get(url + "/metrics") as r:
                during = await r.text()
            d.release.set()
            async with await asyncio.wait_for(asked, WAIT_S) as r:
                assert r.status == 200
            async with session.get(url + "/metrics") as r:
                return during, await r.text()

    during, after = run(go())
    assert [line.rsplit(" ", 1)[1] for line in during.splitlines()
            if line.startswith("kvxfer_proxy_in_flight{")] == ["0", "1"]
    assert [line.rsplit(" ", 1)[1] for line in after.splitlines()
            if line.startswith("kvxfer_proxy_in_flight{")] == ["0", "0"]


def test_a_p_that_hangs_mid_prefill_is_given_up_on_once_its_health_check_fails_and_d_prefills():
    """P takes the request, then hangs (its /health with it): the proxy gives P's request up at
    the next health check, not at --prefill-timeout, and D prefills the prompt alone."""
    p, d = FakeVllm("P", hold=True), FakeVllm("D")

    async def go():
        async with pd([p], [d], health_interval_s=0.05, health_timeout_s=0.2) as (session, url):
            ask = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(p.holding.wait(), WAIT_S)
            p.health = None
            async with await ask as r:
                answer = (r.status, r.headers["X-Kvxfer-Route"], await r.json())
            await asyncio.wait_for(p.aborted.wait(), WAIT_S)  # P's request was closed
            return answer, p.release.is_set()

    (status, route, body), released = run(go())
    assert (status, body) == (200, {"choices": [{"text": "decoded by D"}]}) and not released
    assert route.startswith("choice=local; prefill=-;") and "reason=p_unreachable" in route
    assert d.seen[0][1]["kv_transfer_params"] == {
        "do_remote_decode": False, "do_remote_prefill": False, "local_prefill": True}


def test_without_local_prefill_a_p_that_hangs_is_a_502_naming_it_once_its_health_check_fails():
    p, d = FakeVllm("P", hold=True), FakeVllm("D")

    async def go():
        async with pd([p], [d], health_interval_s=0.05, health_timeout_s=0.2,
                      local_prefill_tokens=0) as (session, url):
            ask = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(p.holding.wait(), WAIT_S)
            p.health = None
            async with await ask as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 502 and not d.seen
    assert body["error"]["type"] == "upstream_unreachable"
    assert ("stopped answering before it answered the request: /health did not answer within "
            "0.2 s, 2 health checks in a row") in body["error"]["message"]


def test_a_p_whose_health_answers_503_while_draining_keeps_its_requests_in_flight():
    """vLLM answers 503 to /health while it drains (SIGTERM, scaling) yet finishes what it
    has: an answer is no hang. P is taken out of routing, its request is not given up."""
    p, d = FakeVllm("P", hold=True), FakeVllm("D")

    async def go():
        async with pd([p], [d], health_interval_s=0.05) as (session, url):
            ask = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(p.holding.wait(), WAIT_S)
            p.health, checks = 503, p.health_checks
            while p.health_checks < checks + 4:
                await asyncio.sleep(0.01)
            p.release.set()
            async with await ask as r:
                return r.status, r.headers["X-Kvxfer-Route"], await r.json()

    status, route, body = run(go())
    assert (status, body) == (200, {"choices": [{"text": "decoded by D"}]})
    assert route.startswith("choice=pd;") and not p.aborted.is_set()


def test_an_instance_is_given_up_on_after_hung_checks_unanswered_in_a_row_and_back_once_it_answers():
    from kvxfer.serve.upstreams import HUNG_CHECKS, Upstreams

    async def go():
        upstreams = Upstreams(ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",)))
        signal, seen = upstreams.hung_signal("http://p:1"), []
        for answered in [False] * (HUNG_CHECKS - 1) + [True] + [False] * HUNG_CHECKS:
            seen.append(signal.done())
            upstreams.heard("http://p:1", "/health did not answer", answered)
        return seen, signal.result()

    seen, reason = run(go())
    assert HUNG_CHECKS == 2 and not any(seen)  # one answer in between starts the count again
    assert reason == "/health did not answer, 2 health checks in a row"


def test_a_d_that_hangs_before_answering_is_given_up_on_and_the_request_goes_through_p_to_the_next():
    """D1 may have read P's KV (P then freed it) before it hung: the next D gets the request
    through P again, with P's fresh params, not with the ones D1 had."""
    p, d1, d2 = FakeVllm("P"), FakeVllm("D1", hold=True), FakeVllm("D2")

    async def go():
        async with pd([p], [d1, d2], health_interval_s=0.05, health_timeout_s=0.2,
                      route="round_robin") as (session, url):
            ask = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(d1.holding.wait(), WAIT_S)
            d1.health = None
            async with await ask as r:
                answer = (r.status, r.headers["X-Kvxfer-Route"], await r.json())
            await asyncio.wait_for(d1.aborted.wait(), WAIT_S)
            return answer

    status, route, body = run(go())
    assert (status, body) == (200, {"choices": [{"text": "decoded by D2"}]})
    assert "reason=d_unreachable" in route and route.startswith("choice=pd;")
    assert len(p.seen) == 2  # P prefilled it again for D2
    assert d2.seen[0][1]["kv_transfer_params"]["remote_host"] == "P"


def test_a_d_that_goes_down_mid_stream_ends_the_stream_not_cleanly_and_its_request_is_closed():
    p, d = FakeVllm("P"), FakeVllm("D")  # D sends one chunk, then waits for the client's word

    async def go():
        async with pd([p], [d], health_interval_s=0.05, health_timeout_s=0.2) as (session, url):
            async def down_once_streaming():
                while not d.events:
                    await asyncio.sleep(0.01)
                d.health = None

            turn = asyncio.ensure_future(down_once_streaming())
            received = await _stream_broken_off(session, url)
            await turn
            await asyncio.wait_for(d.aborted.wait(), WAIT_S)
            return received

    assert run(go()).startswith(b"data: ")
    assert d.events == ["D sent 0"]


def test_an_instance_given_up_on_is_asked_again_once_back_not_left_out_until_the_next_check():
    """P left its /health unanswered at two checks in a row, then came back (restarted): a
    request before the next check still goes through P, as it did before P was given up."""
    from kvxfer.serve.upstreams import HEALTH_REUSE_S

    p, d = FakeVllm("P", health=None), FakeVllm("D")

    async def go():
        async with pd([p], [d], health_interval_s=3600, health_timeout_s=0.1) as (session, url):
            while p.health_checks < 1:  # the start-up check
                await asyncio.sleep(0.01)
            await asyncio.sleep(HEALTH_REUSE_S + 0.1)
            async with session.get(url + "/health") as r:  # the second check: given up on
                assert r.status == 503
            p.health = 200
            async with session.post(url + "/v1/completions", json=BODY) as r:
                return r.status, r.headers["X-Kvxfer-Route"], await r.json()

    status, route, body = run(go())
    assert (status, body) == (200, {"choices": [{"text": "decoded by D"}]})
    assert route.startswith("choice=pd;") and len(p.seen) == 1


def test_cli_takes_the_tenant_header_with_its_default_and_refuses_a_bad_one_by_flag(monkeypatch,
                                                                                     capsys):
    from kvxfer.serve import proxy

    configs = []
    monkeypatch.setattr(proxy, "serve", configs.append)
    args = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", "--port", "8000"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--tenant-header", "X-Tenant-Id"]) == 0
    assert cli.main([*args, "--tenant-header", "none"]) == 0
    assert [c.tenant_header for c in configs] == ["Authorization", "X-Tenant-Id", None]
    assert cli.main([*args, "--tenant-header", "X Tenant: 1"]) == 2
    assert "--tenant-header must be an HTTP header name" in capsys.readouterr().err


def test_a_request_whose_d_is_full_is_served_whole_by_p_as_the_client_sent_it():
    """`--decode-slots 1 --whole-slots 2`: while D decodes one request, the next is sent to P
    whole (no `kv_transfer_params`, every token P's) and P's answer reaches the client."""
    p, d = FakeVllm("P"), FakeVllm("D", hold=True)

    async def go():
        async with pd([p], [d], decode_slots=1, whole_slots=2) as (session, url):
            first = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
            await asyncio.wait_for(d.holding.wait(), WAIT_S)
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                second = resp.status, await resp.json(), dict(resp.headers)
            d.release.set()
            async with await first as resp:
                return second, (resp.status, await resp.json())

    (status, answer, headers), first = run(go())
    assert first == (200, {"choices": [{"text": "decoded by D"}]})
    assert (status, answer) == (200, {"choices": [{"text": "decoded by P"}]})
    assert headers["X-Kvxfer-Transfer"] == "whole" and "choice=whole" in headers["X-Kvxfer-Route"]
    assert [body.get("kv_transfer_params") for _, body, _ in p.seen] == [
        {"do_remote_decode": True, "do_remote_prefill": False}, None]
    assert p.seen[1][1]["max_tokens"] == BODY["max_tokens"] and len(d.seen) == 1


def test_a_p_gone_when_a_request_is_sent_to_it_whole_costs_the_client_nothing():
    """D is full, so the next request goes whole to P, which is gone by then (it stopped
    after prefilling the first): P is marked down and D serves the request after all (it
    prefills the short prompt itself)."""
    p, d = FakeVllm("P"), FakeVllm("D", hold=True)

    async def go():
        async with contextlib.AsyncExitStack() as p_up:
            p_url = await p_up.enter_async_context(serving(p.app()))
            async with pd([], [d], extra_prefill=[p_url], health_interval_s=3600,
                          decode_slots=1, whole_slots=2) as (session, url):
                first = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
                await asyncio.wait_for(d.holding.wait(), WAIT_S)
                await p_up.aclose()  # P stops: nothing listens at its port any more
                second = asyncio.ensure_future(session.post(url + "/v1/completions", json=BODY))
                await _until(lambda: len(d.seen) == 2, "D being sent the second request")
                d.release.set()
                out = []
                for sent in (first, second):
                    async with await sent as resp:
                        out.append((resp.status, await resp.json(),
                                    resp.headers["X-Kvxfer-Route"]))
                async with session.get(url + "/metrics") as r:
                    return out, await r.text(), p_url

    [(s1, a1, _), (s2, a2, route)], metrics, p_url = run(go())
    assert (s1, a1) == (s2, a2) == (200, {"choices": [{"text": "decoded by D"}]})
    assert route.startswith("choice=local; prefill=-;") and "reason=p_unreachable" in route
    assert 'kvxfer_proxy_routes_total{choice="whole"' not in metrics  # it never served whole
    assert f'kvxfer_proxy_up{{role="prefill",url="{p_url}"}} 0' in metrics
    assert len(p.seen) == 1  # P's part of the first request only

