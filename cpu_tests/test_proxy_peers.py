"""`kvxfer proxy --peer-reads`: a session's next turn through P reads the conversation so far
from the D that answered the last one (`kvxfer.serve.sources`), against stand-in instances."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from test_proxy import FakeVllm, pd, run

from kvxfer.serve.sources import Held, Relayed, completion_tokens, usage_asked

ANSWER = 100


class Instance(FakeVllm):
    """A stand-in that also tokenizes (a text prompt: one token per character) and answers
    with its usage (`ANSWER` tokens); `lookup_fails` fails the one-token prefills of id
    prompts (a D's lookups)."""

    def __init__(self, name: str, lookup_fails: bool = False, answer: int = ANSWER,
                 tokenize: bytes | None = None, lookup_s: float = 0.0) -> None:
        super().__init__(name)
        self.lookup_fails, self.tokenized, self.answer = lookup_fails, [], answer
        self.tokenize, self.lookup_s = tokenize, lookup_s  # a raw /tokenize answer; a slow lookup

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        if self.tokenize is not None:
            return web.Response(body=self.tokenize, content_type="application/json")
        text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
        return web.json_response({"tokens": [ord(c) for c in text], "count": len(text)})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        answer = await super()._complete(request)
        body = self.seen[-1][1]
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") and isinstance(body["prompt"], list) and self.lookup_fails:
            return web.Response(status=500, text='{"error": "lookup"}', content_type="application/json")
        if params.get("do_remote_decode") and self.lookup_s:
            await asyncio.sleep(self.lookup_s)
        if not params.get("do_remote_decode") and not body.get("stream"):
            return web.json_response({"choices": [{"text": f"decoded by {self.name}"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": self.answer}})
        return answer

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """Three events, the usage one where asked (as vLLM: `"choices": []`), then `[DONE]`."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            await out.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
        if (self.seen[-1][1].get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": self.answer, "total_tokens": 2}
            await out.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out


def _turns(p, d, prompts, headers=None, **config):
    """Each prompt in turn through the proxy (every one through P), under `headers`; returns
    the statuses and the proxy's /metrics."""

    async def go():
        async with pd([p], [d], local_prefill_tokens=0, peer_reads=True, **config) as (s, url):
            statuses = []
            for prompt in prompts:
                async with s.post(url + "/v1/completions", headers=headers,
                                  json={"model": "tiny", "prompt": prompt, "max_tokens": 30}) as r:
                    statuses.append(r.status)
            async with s.get(url + "/metrics") as r:
                return statuses, await r.text()

    return run(go())


def _p_sources(p):
    return [body["kv_transfer_params"].get("kv_source") for _, body, _ in p.seen]


SESSION = {"X-Session-Id": "chat-1"}
FIRST = list(range(100, 200))  # 100 token ids
SECOND = FIRST + list(range(300, 300 + ANSWER)) + list(range(500, 550))


def test_the_next_turn_looks_up_the_conversation_on_ds_and_p_reads_it():
    p, d = Instance("P"), Instance("D")
    statuses, metrics = _turns(p, d, [FIRST, SECOND], SESSION)
    assert statuses == [200, 200]
    lookups = [(body, h) for _, body, h in d.seen if body["kv_transfer_params"].get("do_remote_decode")]
    [(lookup, headers)] = lookups
    assert lookup["prompt"] == SECOND[:100 + ANSWER - 1]  # the answer's last token: never computed
    assert lookup["max_tokens"] == 1 and lookup["stream"] is False
    assert headers["X-Request-Id"].endswith("-lookup")
    assert _p_sources(p) == [None, {"remote_host": "D", "remote_block_ids": [3, 4], "peer": "kv-D",
                                    "host": "10.0.0.5", "port": 5610}]
    assert 'kvxfer_proxy_peer_reads_total{outcome="looked_up"} 1' in metrics


def test_a_text_prompt_is_tokenized_once_a_turn_and_read_the_same_way():
    p, d = Instance("P"), Instance("D")
    first = "x" * 100
    second = first + "".join(chr(c) for c in SECOND[100:])
    _turns(p, d, [first, second], SESSION)
    assert len(p.tokenized) == 2 and all(t["prompt"] for t in p.tokenized)
    assert _p_sources(p)[1] is not None


def test_a_prompt_that_goes_another_way_or_is_too_short_is_not_looked_up():
    p, d = Instance("P"), Instance("D")
    statuses, metrics = _turns(p, d, [FIRST, list(range(1, 200)), list(range(1, 230))[:10]],
                               SESSION)
    assert statuses == [200] * 3 and _p_sources(p) == [None] * 3
    assert 'outcome="skipped"} 2' in metrics and 'outcome="looked_up"' not in metrics


def test_a_turn_whose_p_holds_all_but_a_short_answer_is_not_looked_up():
    """P keeps the prompts it prefilled: the last turn's answer of 20 tokens is all a lookup
    would spare it, less than a block; P computes it."""
    p, d = Instance("P"), Instance("D", answer=20)
    second = FIRST + list(range(300, 320)) + list(range(500, 550))
    statuses, metrics = _turns(p, d, [FIRST, second], SESSION)
    assert statuses == [200, 200] and _p_sources(p) == [None, None]
    assert 'outcome="skipped"} 1' in metrics


def test_without_a_session_or_under_another_tenant_nothing_is_tokenized_or_read():
    p, d = Instance("P"), Instance("D")
    _turns(p, d, [FIRST, SECOND])
    assert p.tokenized == [] and _p_sources(p) == [None, None]

    async def go():  # the same session id from another key: another session
        async with pd([p2], [d2], local_prefill_tokens=0, peer_reads=True) as (s, url):
            for prompt, key in ((FIRST, "a"), (SECOND, "b")):
                async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt},
                                  headers={**SESSION, "Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200

    p2, d2 = Instance("P"), Instance("D")
    run(go())
    assert _p_sources(p2) == [None, None]


def test_a_failed_lookup_leaves_p_to_compute_the_prompt_and_the_answer_stands():
    p, d = Instance("P"), Instance("D", lookup_fails=True)
    statuses, metrics = _turns(p, d, [FIRST, SECOND], SESSION)
    assert statuses == [200, 200] and _p_sources(p) == [None, None]
    assert 'outcome="failed"} 1' in metrics


def test_without_peer_reads_nothing_is_tokenized_or_looked_up():
    """Round robin over two P sends a conversation's next turn to the P that did not prefill
    the last one, which the other holds: without --peer-reads nothing is looked up there."""
    ps, d = [Instance("P0"), Instance("P1")], Instance("D")

    async def go():
        async with pd(ps, [d], local_prefill_tokens=0, route="round_robin") as (s, url):
            for prompt in (FIRST, SECOND, "text"):
                async with s.post(url + "/v1/completions", headers=SESSION,
                                  json={"model": "tiny", "prompt": prompt}) as r:
                    assert r.status == 200
            async with s.get(url + "/metrics") as r:
                return await r.text()

    metrics = run(go())
    assert [p.tokenized for p in ps] == [[], []]
    assert [len(p.seen) for p in ps] == [2, 1]
    assert _p_sources(ps[0]) + _p_sources(ps[1]) == [None] * 3
    assert "kvxfer_proxy_peer_reads_total{" not in metrics
    # no lookup: every request any instance saw is a client's prompt
    assert all(b["prompt"] in (FIRST, SECOND, "text") for _, b, _ in ps[0].seen + ps[1].seen + d.seen)


@pytest.mark.parametrize("tail, expected", [
    (b'{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 31}}', 31),
    (b'data: {"usage": {"completion_tokens": 1}}\n\ndata: {"usage": {"completion_tokens": 2}}\n\n'
     b'data: [DONE]\n\n', 2),
    (b'data: [DONE]\n\n', None), (None, None),
    (b'"completion_tokens": 99999999999999999999', None),  # no usage is that long: not read
])
def test_the_answers_length_is_the_last_usage_at_its_end(tail, expected):
    assert completion_tokens(tail) == expected


def test_a_turn_holds_its_prompt_and_its_answer_but_its_last_token():
    held = Held()
    held.remember("s", "d", [1, 2, 3, 4], 3)
    turn = held.get("s")
    assert turn.prefix([1, 2, 3, 4, 7, 8, 9, 10]) == 6
    assert turn.prefix([1, 2, 3, 4, 7]) == 4  # all but the new prompt's last token
    assert turn.prefix([1, 2, 3, 5, 7, 8]) == 0  # another way
    assert turn.prefix([1, 2, 3, 4]) == 0  # nothing new


def test_sessions_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr("kvxfer.serve.sources.MAX_SESSIONS", 2)
    held = Held()
    for s in "abc":
        held.remember(s, "d", [1, 2], 1)
    assert held.get("a") is None and held.get("c").tokens == 2


@pytest.mark.parametrize("answer", [b"not json", b'{"tokens": "abc"}', b"[" * 100000 + b"]" * 100000,
                                    b'{"tokens": [1, 2, "x"]}'])
def test_a_bad_tokenize_answer_leaves_the_turn_unremembered_and_the_answers_standing(answer):
    p, d = Instance("P", tokenize=answer), Instance("D")
    statuses, metrics = _turns(p, d, ["x" * 100, "x" * 300], SESSION)
    assert statuses == [200, 200] and _p_sources(p) == [None, None]
    assert "kvxfer_proxy_peer_reads_total{" not in metrics  # nothing remembered: no lookup


def test_a_huge_tokenize_answer_is_not_read_past_its_bound(monkeypatch):
    monkeypatch.setattr("kvxfer.serve.sources.MAX_TOKENIZE_BYTES", 1000)
    p, d = Instance("P", tokenize=b'{"tokens": [' + b"1, " * 2000 + b"1]}"), Instance("D")
    statuses, metrics = _turns(p, d, ["x" * 100, "x" * 300], SESSION)
    assert statuses == [200, 200] and _p_sources(p) == [None, None]
    assert "kvxfer_proxy_peer_reads_total{" not in metrics  # read past the bound, it would count


def test_a_slow_lookup_is_given_up_and_p_computes_the_prompt(monkeypatch):
    monkeypatch.setattr("kvxfer.serve.proxy.LOOKUP_TIMEOUT_S", 0.3)
    p, d = Instance("P"), Instance("D", lookup_s=2.0)
    statuses, metrics = _turns(p, d, [FIRST, SECOND], SESSION)
    assert statuses == [200, 200] and _p_sources(p) == [None, None]
    assert 'outcome="failed"} 1' in metrics


def test_an_answer_of_several_choices_is_not_counted_as_the_conversation():
    """With `n` > 1 the usage sums every choice, and the next turn continues one of them: the
    lookup covers the last prompt alone, which P holds (nothing worth reading)."""
    p, d = Instance("P"), Instance("D")

    async def go():
        async with pd([p], [d], local_prefill_tokens=0, peer_reads=True) as (s, url):
            for prompt in (FIRST, SECOND):
                async with s.post(url + "/v1/completions", headers=SESSION,
                                  json={"model": "tiny", "prompt": prompt, "n": 2}) as r:
                    assert r.status == 200

    run(go())
    assert _p_sources(p) == [None, None]


def test_a_p_that_holds_more_of_the_prompt_than_the_chosen_one_is_looked_up():
    """Where the router chose a P (by load, say) other than the one it expects to hold the
    most of the prompt, that other P is the holder, for as many tokens as it is expected to
    hold (the chosen P's own expected hit, 0 here, being a block or more less)."""
    from kvxfer.serve.proxy import _IDS, _holder
    from kvxfer.serve.routing import Prompt, Route
    from kvxfer.serve.upstreams import ProxyConfig, Upstreams

    upstreams = Upstreams(ProxyConfig(prefill=("http://p0", "http://p1"), decode=("http://d",),
                                      peer_reads=True))
    body = {"model": "tiny", "prompt": list(range(100, 300))}
    upstreams.router.prefill.remember("http://p0", Prompt.of("/v1/completions", body))
    longer = {"model": "tiny", "prompt": body["prompt"] + list(range(50))}

    class Request(dict):
        path, headers = "/v1/completions", {}

    request = Request({_IDS: longer["prompt"]})
    route = Route("http://p1", "http://d", 0, "turn")
    assert run(_holder(request, upstreams, route, longer, {})) == (
        "http://p0", longer["prompt"], 192)  # 12 spans of 16 ids: the 200-id prompt's whole ones
    chosen = Route("http://p0", "http://d", 192, "prefix")  # the holder itself: nothing to read
    assert run(_holder(request, upstreams, chosen, longer, {})) is None


def _streamed_turns(p, d, bodies):
    """Each body in turn, streamed, through the proxy under `SESSION`; returns what the client
    got of each."""

    async def go():
        async with pd([p], [d], local_prefill_tokens=0, peer_reads=True) as (s, url):
            got = []
            for body in bodies:
                async with s.post(url + "/v1/completions", headers=SESSION,
                                  json={"model": "tiny", "max_tokens": 30, "stream": True,
                                        **body}) as r:
                    assert r.status == 200
                    got.append(await r.read())
            return got

    return run(go())


def test_a_streamed_answer_the_client_asked_no_usage_of_is_still_read_on_the_next_turn():
    """A chat client streams without `include_usage` (the OpenAI client's default): the
    proxy asks D for the usage, takes its event out of what the client gets, and the next
    turn's lookup covers the answer as after a non-streamed one."""
    p, d = Instance("P"), Instance("D")
    got = _streamed_turns(p, d, [{"prompt": FIRST}, {"prompt": SECOND}])
    events = [b'data: {"choices": [{"text": "%d"}]}\n\n' % i for i in range(3)]
    assert got == [b"".join(events) + b"data: [DONE]\n\n"] * 2  # as D sends them, less the usage
    asked = [body for _, body, _ in d.seen if body.get("stream")]
    assert [b["stream_options"] for b in asked] == [{"include_usage": True,
                                                     "continuous_usage_stats": False}] * 2
    [lookup] = [b for _, b, _ in d.seen if b["kv_transfer_params"].get("do_remote_decode")]
    assert lookup["prompt"] == SECOND[:100 + ANSWER - 1]
    assert "stream_options" not in p.seen[0][1]


def test_a_client_that_asked_for_usage_gets_it_and_its_options_stand():
    p, d = Instance("P"), Instance("D")
    options = {"include_usage": True, "continuous_usage_stats": True}
    [got] = _streamed_turns(p, d, [{"prompt": FIRST, "stream_options": options}])
    assert b'"usage"' in got and got.endswith(b"data: [DONE]\n\n")
    assert [b.get("stream_options") for _, b, _ in d.seen] == [options]


@pytest.mark.parametrize("body, asked", [
    ({"stream": True}, {"include_usage": True, "continuous_usage_stats": False}),
    ({"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
     {"include_usage": True, "continuous_usage_stats": False}),
    ({"stream": True, "stream_options": {"include_usage": True}}, None),
    ({"stream": True, "stream_options": {"include_usage": None}},
     {"include_usage": True, "continuous_usage_stats": False}),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, None),  # vLLM's true
    ({"stream": True, "stream_options": {"include_usage": 1}}, None),
    ({"stream": True, "stream_options": "usage"}, None),  # D's to refuse, as the client sent it
    ({"stream": "yes"}, None), ({}, None), ({"stream": True, "n": 2}, None),
])
def test_usage_is_asked_for_only_where_a_stream_lacks_it(body, asked):
    out = usage_asked(body)
    assert (out and out["stream_options"]) == asked


class _Answer:
    status, content_length, content_type = 200, None, "text/event-stream"


def _relayed(chunks, drop=True, answer=_Answer):
    from kvxfer.serve.sources import DROP_USAGE
    relayed = Relayed({DROP_USAGE: drop}, answer)
    return b"".join(relayed.feed(c) for c in chunks) + relayed.rest(), relayed.tail


USAGE = b'data: {"choices": [], "usage": {"completion_tokens": 7}}\n\n'


@pytest.mark.parametrize("chunks", [
    [b'data: {"choices": [{"text": "a"}]}\n\n', USAGE, b"data: [DONE]\n\n"],
    [b'data: {"choices": [{"te', b'xt": "a"}]}\n', b"\n" + USAGE[:9], USAGE[9:] + b"data: [DONE]\n\n"],
    [b'data: {"choices": [{"text": "a"}]}\r\n\r\n' + USAGE.replace(b"\n", b"\r\n") + b"data: [DONE]\n\n"],
])
def test_the_usage_event_is_dropped_however_the_answer_is_cut_and_its_length_kept(chunks):
    sent, tail = _relayed(chunks)
    assert b'"usage"' not in sent and sent.startswith(b'data: {"choices": [{"text": "a"}]}')
    assert sent.endswith(b"data: [DONE]\n\n") and completion_tokens(tail) == 7


def test_a_usage_event_is_passed_on_where_not_dropped():
    beside = b'data: {"choices": [{"text": "a"}]}\n\n'
    assert _relayed([beside, USAGE])[0] == beside
    assert _relayed([beside, USAGE], drop=False)[0] == beside + USAGE

    class Json(_Answer):
        content_type = "application/json"

    assert _relayed([USAGE], answer=Json)[0] == USAGE


def test_an_event_over_the_bound_is_passed_on_as_it_comes_and_the_usage_after_it_dropped(
        monkeypatch):
    monkeypatch.setattr("kvxfer.serve.sources.MAX_EVENT_BYTES", 100)
    from kvxfer.serve.sources import DROP_USAGE
    relayed = Relayed({DROP_USAGE: True}, _Answer)
    assert relayed.feed(b"data: " + b"x" * 200) == b"data: " + b"x" * 200  # passed on at once
    assert relayed.feed(USAGE) == USAGE  # still that event's: passed on unread, until its end
    assert relayed.feed(b"x" * 50 + b"\n\n" + USAGE + b"data: [DONE]\n\n") == (
        b"x" * 50 + b"\n\ndata: [DONE]\n\n")
    assert relayed.rest() == b""


def test_a_long_event_trickled_in_small_chunks_is_searched_once(monkeypatch):
    """A D sending a 1 MiB event a few bytes at a time: each chunk is searched for an
    event's end once, not the whole event again (seconds of the proxy's event loop)."""
    from kvxfer.serve import sources
    searched = []

    class Counted:
        def search(self, data, start):
            searched.append(len(data) - start)
            return sources.re.compile(rb"(\r?\n\r?\n)").search(data, start)

        def split(self, data):
            searched.append(len(data))
            return sources.re.compile(rb"(\r?\n\r?\n)").split(data)

    monkeypatch.setattr(sources, "_EVENT_END", Counted())
    relayed = Relayed({sources.DROP_USAGE: True}, _Answer)
    event = b'data: {"choices": [{"text": "' + b"a" * (sources.MAX_EVENT_BYTES - 64) + b'"}]}\n\n'
    sent = b"".join(relayed.feed(event[i:i + 64]) for i in range(0, len(event), 64))
    assert sent + relayed.feed(USAGE) + relayed.rest() == event
    assert sum(searched) < 3 * len(event)  # each byte searched about twice: not quadratic


def test_the_fingerprint_of_the_dropped_usage_goes_to_the_event_that_ends_the_choice():
    """vLLM stamps `system_fingerprint` on the event with the `finish_reason` unless usage was
    asked for, and then on the usage event instead: the client gets it where it would have."""
    end = b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 2}, "system_fingerprint": "fp-1"}\n\n'
    sent, tail = _relayed([b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n', end,
                           usage, b"data: [DONE]\n\n"])
    events = [json.loads(e[len(b"data: "):]) for e in sent.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e.get("system_fingerprint") for e in events] == [None, "fp-1"]
    assert events[1]["choices"] == [{"text": "b", "finish_reason": "length"}]
    assert sent.endswith(b"data: [DONE]\n\n") and completion_tokens(tail) == 2
    # with no usage event after it, the event is passed on as it was
    assert _relayed([end, b"data: [DONE]\n\n"])[0] == end + b"data: [DONE]\n\n"
    assert _relayed([end])[0] == end


def test_a_lookup_is_in_flight_on_its_holder_while_it_runs():
    """The router weighs a D's load by its requests in flight: a lookup there is one."""
    p, d = Instance("P"), Instance("D", lookup_s=1.0)

    async def go():
        async with pd([p], [d], local_prefill_tokens=0, peer_reads=True) as (s, url):
            async with s.post(url + "/v1/completions", headers=SESSION,
                              json={"model": "tiny", "prompt": FIRST}) as r:
                assert r.status == 200
            asked = asyncio.ensure_future(s.post(url + "/v1/completions", headers=SESSION,
                                                 json={"model": "tiny", "prompt": SECOND}))
            await asyncio.sleep(0.5)  # within the lookup
            async with s.get(url + "/metrics") as r:
                during = await r.text()
            async with await asyncio.wait_for(asked, 10) as r:
                assert r.status == 200
            async with s.get(url + "/metrics") as r:
                return during, await r.text()

    during, after = run(go())
    flights = [[line.rsplit(" ", 1)[1] for line in m.splitlines()
                if line.startswith("kvxfer_proxy_in_flight{")] for m in (during, after)]
    assert flights == [["1", "2"], ["0", "0"]]  # the request on P and D; the lookup on D


def test_peer_reads_beside_stream_is_refused_by_name():
    """A streamed prompt reads no prefix from a peer: the two flags together would leave
    --peer-reads silently off."""
    from kvxfer.errors import InvalidInputError
    from kvxfer.serve.upstreams import ProxyConfig
    with pytest.raises(InvalidInputError, match="--stream and --peer-reads"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), stream=True, peer_reads=True)


def test_usage_a_server_forces_on_every_client_is_not_taken_out():
    """Under vLLM's --enable-force-include-usage every event carries usage and the usage
    event ends the answer whether or not the client asked: the client gets them all."""
    events = [b'data: {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}\n\n',
              b'data: {"choices": [{"text": "b", "finish_reason": "length"}], '
              b'"usage": {"completion_tokens": 2}}\n\n',
              b'data: {"choices": [], "usage": {"completion_tokens": 2}, "system_fingerprint": "f"}\n\n',
              b"data: [DONE]\n\n"]
    sent, tail = _relayed(events)
    assert sent == b"".join(events) and completion_tokens(tail) == 2


@pytest.mark.parametrize("url, by", [("http://elsewhere", 1), ("http://d", 2)])
def test_a_lookup_on_no_instance_of_the_proxys_or_by_a_bad_step_is_refused_by_name(url, by):
    from kvxfer.errors import InvalidInputError
    from kvxfer.serve.upstreams import ProxyConfig
    router = ProxyConfig(prefill=("http://p",), decode=("http://d",)).router()
    with pytest.raises(InvalidInputError, match="elsewhere|by 2"):
        router.looking_up(url, by)
    assert not router.prefill.in_flight and not router.decode.in_flight
