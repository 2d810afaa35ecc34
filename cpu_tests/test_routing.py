"""`kvxfer.serve.routing`: the proxy's choice of P and D, without a network."""

from __future__ import annotations

import dataclasses

import pytest

from kvxfer.errors import InvalidInputError
from kvxfer.serve import routing
from kvxfer.serve.routing import Prompt, Route, Router

PS, DS = ("http://p0", "http://p1"), ("http://d0", "http://d1")


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def completion(prompt) -> Prompt | None:
    return Prompt.of("/v1/completions", {"prompt": prompt})


def answered(router: Router, prompt, session: str | None = None):
    """Route `prompt` (ids or a Prompt), settle and finish it answered; return its route."""
    prompt = completion(prompt) if isinstance(prompt, list) else prompt
    route = router.choose(prompt, session)
    router.started(route)
    router.finished(route)
    router.settled(route)
    router.answered(route, prompt)
    return route


def test_unrelated_prompts_take_p_and_d_in_turn():
    router = Router(PS, DS, local_prefill_tokens=512)
    routes = [answered(router, ids(64, 10_000 * i)) for i in range(4)]
    assert [(r.prefill, r.decode, r.reason) for r in routes] == [
        ("http://p0", "http://d0", "turn"), ("http://p1", "http://d1", "turn")] * 2
    assert router.counts == {("pd", "turn"): 4}


def test_the_next_turn_goes_to_the_d_that_holds_its_history_and_d_prefills_a_short_suffix_alone():
    router = Router(PS, DS, local_prefill_tokens=256)
    first = answered(router, ids(512))
    answered(router, ids(64, 50_000))  # another conversation moves the turn on
    second = answered(router, ids(512) + ids(200, 7))
    assert first.choice == "pd" and second.choice == "local"
    assert second.decode == first.decode and second.prefill is None
    assert (second.expected_hit, second.reason) == (512, "prefix")
    third = answered(router, ids(512) + ids(200, 7) + ids(300, 9))
    assert third.choice == "pd" and third.decode == first.decode, "300 tokens to go: P prefills"
    assert third.prefill == first.prefill and third.expected_hit == 512, "P holds turn 1's prompt"
    assert "choice=pd" in third.header() and "expected_hit=512" in third.header()


def test_a_prompt_counts_as_held_only_once_its_request_was_answered():
    router = Router(PS, DS, local_prefill_tokens=512)
    system = ids(256)
    first = router.choose(completion(system + ids(96, 1)))
    router.started(first)
    second = router.choose(completion(system + ids(96, 2)))
    assert second.choice == "pd", "D holds nothing of the system prompt while the first runs"
    router.finished(first)  # failed: not answered
    assert router.choose(completion(system + ids(96, 3))).choice == "pd", "a failure holds nothing"
    answered(router, system + ids(96, 4))
    later = router.choose(completion(system + ids(96, 5)))
    assert later.choice == "local" and later.expected_hit == 256


def test_d_does_not_prefill_alone_when_a_p_is_expected_to_hold_more():
    router = Router(PS[:1], DS, local_prefill_tokens=512)
    answered(router, ids(512))  # P and D0 hold it
    router.holds("http://d0", 256)  # D0 keeps only what its cache holds: the last 16 spans
    answered(router, ids(256, 5))  # ... now its own
    route = router.choose(completion(ids(256, 5) + ids(600)[256:]))
    assert route.choice == "local", "D holds 256, P nothing of this one"
    route = router.choose(completion(ids(512) + ids(100, 9)))
    assert route.choice == "pd" and route.expected_hit == 512, "P holds all 512, D none"


def test_a_local_prefill_needs_a_hit_and_a_threshold():
    short = completion(ids(40))
    assert Router(PS, DS, local_prefill_tokens=512).choose(short).choice == "pd", (
        "a short prompt D never saw still goes through P")
    router = Router(PS, DS, local_prefill_tokens=0)
    answered(router, ids(512))
    assert router.choose(completion(ids(520))).choice == "pd"


def test_a_d_with_the_prefix_but_too_many_requests_in_flight_loses_to_the_least_loaded():
    router = Router(PS, DS, local_prefill_tokens=0, imbalance=2)
    held = answered(router, ids(512))
    busy = [router.choose(completion(ids(64, 90_000 + 100 * i))) for i in range(6)]
    for route in busy:
        if route.decode == held.decode:
            router.started(route)
    loaded = router.decode.in_flight[held.decode]
    assert loaded == 3
    moved = router.choose(completion(ids(600)))
    assert moved.decode != held.decode and moved.reason == "turn"
    router.finished(next(r for r in busy if r.decode == held.decode))
    again = router.choose(completion(ids(512) + ids(88, 70_000)))
    assert again.decode == held.decode and again.reason == "prefix"


def test_a_session_sticks_to_its_d_and_another_session_does_not():
    router = Router(PS, DS)
    first = answered(router, completion(ids(64, 1)), session="alice")
    assert [answered(router, completion(ids(64, 100 * i)), session="alice").decode
            for i in range(2, 5)] == [first.decode] * 3
    assert answered(router, completion(ids(64, 9999)), session="bob").decode != first.decode
    assert router.counts[("pd", "session")] == 3


def test_instances_marked_down_are_not_chosen_until_marked_up_and_all_down_means_all():
    router = Router(PS, DS)
    fresh = iter(range(0, 10**9, 1000))

    def four() -> set[str]:  # four prompts nobody was sent
        return {router.choose(completion(ids(64, next(fresh)))).decode for _ in range(4)}

    router.mark("http://d0", up=False)
    assert four() == {"http://d1"}
    router.mark("http://d1", up=False)
    assert four() == set(DS)
    router.mark("http://d0", up=True)
    router.mark("http://d1", up=True)
    assert four() == set(DS)


def test_each_instance_forgets_its_least_recently_sent_spans_beyond_its_bound_end_first():
    router = Router(PS[:1], DS[:1], local_prefill_tokens=0, index_spans=8)
    answered(router, ids(128))  # 8 spans of 16
    assert router.decode.hit("http://d0", completion(ids(128))) == 128
    answered(router, ids(64, 5000))  # 4 more: the last 4 of the first go, as vLLM evicts
    assert router.decode.hit("http://d0", completion(ids(128))) == 64
    assert len(router.decode.sent["http://d0"]) == 8


def test_chat_messages_match_as_a_conversation_grows_and_not_across_roles():
    turn1 = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "u" * 200}]
    turn2 = [*turn1, {"role": "assistant", "content": "a" * 100}, {"role": "user", "content": "v"}]
    router = Router(PS, DS, local_prefill_tokens=512)
    answered(router, Prompt.of("/v1/chat/completions", {"messages": turn1}))
    later = answered(router, Prompt.of("/v1/chat/completions", {"messages": turn2}))
    assert later.choice == "local" and later.expected_hit >= 100
    swapped = [{"role": "user", "content": "s" * 300}, *turn1[1:]]
    assert router.decode.hit(later.decode,
                             Prompt.of("/v1/chat/completions", {"messages": swapped})) == 0


@pytest.mark.parametrize("body", [{}, {"prompt": ["a", "b"]}, {"prompt": [[1, 2]]},
                                  {"prompt": [1, "x"]}, {"prompt": [1, True]}, {"prompt": 3},
                                  {"prompt": []}])
def test_prompts_the_router_does_not_read_route_in_turn_without_a_hit(body):
    assert Prompt.of("/v1/completions", body) is None
    router = Router(PS, DS)
    assert router.choose(None).reason == "turn"


def test_another_tenants_salt_or_another_model_never_matches():
    router = Router(PS, DS, local_prefill_tokens=512)
    base = {"model": "m", "prompt": ids(512)}
    answered(router, Prompt.of("/v1/completions", {**base, "cache_salt": "alice"}))
    for other in ({**base, "cache_salt": "bob"}, base, {**base, "cache_salt": "alice",
                                                         "model": "m-lora"}):
        route = router.choose(Prompt.of("/v1/completions", {**other, "prompt": ids(520)}))
        assert route.choice == "pd" and route.expected_hit == 0, other
    same = router.choose(Prompt.of("/v1/completions",
                                   {**base, "cache_salt": "alice", "prompt": ids(520)}))
    assert same.choice == "local" and same.expected_hit == 512


def test_a_chat_too_deep_to_write_again_is_not_read():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert Prompt.of("/v1/chat/completions", {"messages": [{"role": "user", "content": deep}]}) is None


def test_a_huge_prompt_is_read_up_to_its_span_bound(monkeypatch):
    monkeypatch.setattr(routing, "MAX_SPANS", 4)
    prompt = completion(ids(1000))
    assert len(prompt.chain) == 4 and prompt.tokens == 1000
    text = Prompt.of("/v1/completions", {"prompt": "x" * 10_000})
    assert len(text.chain) == 4 and text.tokens == 2500


def test_sessions_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(routing, "MAX_SESSIONS", 3)
    router = Router(PS, DS)
    for i in range(10):
        router.choose(None, session=f"s{i}")
    assert len(router.sessions) == 3


def test_a_request_is_counted_once_under_the_route_it_took_in_the_end():
    router = Router(PS, DS)
    route = router.choose(completion(ids(64)))
    assert router.counts == {}, "nothing counted before the route is final"
    other = router.other_decode(route)
    local = router.instead_of_p(other)
    router.settled(local)
    assert router.counts == {("local", "p_unreachable"): 1}


def test_round_robin_ignores_prefixes():
    router = Router(PS, DS, policy="round_robin", local_prefill_tokens=512)
    routes = [answered(router, ids(512) + ids(i)) for i in range(4)]
    assert [r.decode for r in routes] == list(DS) * 2 and all(r.choice == "pd" for r in routes)
    assert router.counts == {("pd", "round_robin"): 4}


@pytest.mark.parametrize("kwargs,flag", [({"policy": "nearest"}, "--route"),
                                         ({"local_prefill_tokens": -1}, "--local-prefill-tokens"),
                                         ({"local_prefill_tokens": 1.5}, "--local-prefill-tokens"),
                                         ({"imbalance": "2"}, "--route-imbalance"),
                                         ({"index_spans": 0}, "index_spans"),
                                         ({"decode_slots": -1}, "--decode-slots"),
                                         ({"whole_slots": True}, "--whole-slots"),
                                         ({"prefill_queue": -2}, "--prefill-queue")])
def test_bad_settings_are_refused_naming_them(kwargs, flag):
    with pytest.raises(InvalidInputError, match=flag):
        Router(PS, DS, **kwargs)


def test_an_instance_whose_cache_holds_fewer_tokens_is_believed_to_hold_no_more():
    router = Router(PS[:1], DS[:1], local_prefill_tokens=512)
    answered(router, ids(512))
    router.holds("http://d0", 128)  # 8 spans: the prompt's first 8 stay, its last 24 go
    assert len(router.decode.sent["http://d0"]) == 8
    assert router.decode.hit("http://d0", completion(ids(512) + ids(8, 1))) == 128
    answered(router, ids(64, 7000))
    assert len(router.decode.sent["http://d0"]) == 8
    with pytest.raises(InvalidInputError, match="positive number of tokens, got 0 for http://d0"):
        router.holds("http://d0", 0)


def test_an_instance_marked_down_forgets_what_it_held_so_a_restarted_d_does_not_prefill_alone():
    """A D that went down may come back restarted, its prefix cache empty: the conversation's
    next turn goes through P, not to D to be recomputed whole."""
    router = Router(PS[:1], DS[:1], local_prefill_tokens=512)
    first = answered(router, ids(512), session="alice")
    router.mark(first.decode, up=False)
    router.mark(first.decode, up=True)
    later = router.choose(completion(ids(512) + ids(64, 7)), session="alice")
    assert later.choice == "pd" and later.decode == first.decode, later
    assert later.expected_hit == 512, "P still holds it"
    router.mark(first.decode, up=True)  # marked up again while up: nothing is forgotten
    answered(router, ids(512))
    router.mark(first.decode, up=True)
    assert router.choose(completion(ids(520))).choice == "local"


def test_no_salt_and_the_salt_named_none_are_different_tenants():
    router = Router(PS, DS, local_prefill_tokens=512)
    answered(router, Prompt.of("/v1/completions", {"model": "m", "prompt": ids(512)}))
    for salt in ("None", ["x"], {"deep": [[[]]]}):
        route = router.choose(Prompt.of("/v1/completions",
                                        {"model": "m", "cache_salt": salt, "prompt": ids(520)}))
        assert route.choice == "pd" and route.expected_hit == 0, salt
    route = router.choose(Prompt.of("/v1/completions", {"model": "None", "prompt": ids(520)}))
    assert route.expected_hit == 0, "no model and the model named None differ too"


def test_an_empty_session_header_is_no_session():
    router = Router(PS, DS)
    first = router.choose(completion(ids(64, 1)), session="")
    assert router.choose(completion(ids(64, 500)), session="").decode != first.decode
    assert router.sessions == {} and router.counts[("pd", "session")] == 0


def test_a_local_prefill_whose_d_is_gone_goes_through_p_unless_the_next_d_holds_the_prompt():
    """D0 answered a 512-token prompt, so its next turn is D0's alone. D0 cannot be
    reached: D1, which holds none of it, would prefill it all alone, so the request goes
    through P (whose hit it names); had D1 held it too, it stays local there, naming D1's
    hit, not D0's."""
    router = Router(PS, DS, local_prefill_tokens=64)
    first, second = ids(512), ids(512) + ids(32, start=9)
    route = answered(router, first)
    local = router.choose(completion(second))
    assert local.prefill is None and local.decode == route.decode and local.expected_hit == 512
    other = router.other_decode(local, completion(second))
    assert other.decode != route.decode and other.prefill == route.prefill
    assert (other.expected_hit, other.reason) == (512, "d_unreachable")  # P's hit
    router.answered(Route(None, other.decode, 0, "turn"), completion(first))  # D1 holds it too
    again = router.other_decode(local, completion(second))
    assert (again.prefill, again.decode, again.expected_hit) == (None, other.decode, 512)
    router.mark(route.prefill, up=False)
    router.mark([u for u in PS if u != route.prefill][0], up=False)
    nowhere = router.other_decode(local, completion(ids(1024, start=5000)))
    assert nowhere.prefill is None, "no P up: D prefills it alone"


def _past_p(router: Router, route: Route) -> Route:
    """As the proxy does once P answered: what is in flight is on D alone."""
    router.finished(route)
    past = dataclasses.replace(route, prefill=None)
    router.started(past)
    return past


def test_a_request_whose_d_is_full_is_served_whole_by_a_p_with_room_and_else_waits_for_d():
    """D decodes 2 at once: a third request in flight for it goes whole to a P with fewer
    than 2 in flight; with every P as full it goes to D, which queues it."""
    router = Router(PS, DS[:1], local_prefill_tokens=512, decode_slots=2, whole_slots=2)
    routes, choices = [], []
    for i in range(7):
        route = router.choose(completion(ids(64, 10_000 * i)))
        router.started(route)
        router.settled(route)
        choices.append(route.choice)
        routes.append(_past_p(router, route) if route.choice == "pd" else route)
    assert choices == ["pd", "pd"] + ["whole"] * 4 + ["pd"]
    assert [r.decode for r in routes[2:6]] == ["http://p0", "http://p1"] * 2
    assert all(r.reason == "d_full" and r.prefill is None for r in routes[2:6])
    assert "choice=whole; prefill=-; decode=http://p0" in routes[2].header()
    assert router.counts == {("pd", "turn"): 3, ("whole", "d_full"): 4}
    router.finished(routes[2])  # p0 has room again; D is still full
    again = router.choose(completion(ids(64, 98_000)))
    assert again.whole and again.decode == "http://p0"
    for r in (routes[0], routes[1], routes[6]):
        router.finished(r)  # D has room: through P to D
    assert router.choose(completion(ids(64, 99_000))).choice == "pd"


def test_a_conversation_served_whole_stays_on_its_p_while_d_is_full_and_p_holds_it_after():
    router = Router(PS, DS[:1], local_prefill_tokens=512, decode_slots=1, whole_slots=4)
    busy = router.choose(completion(ids(64, 90_000)))
    router.started(busy)
    busy = _past_p(router, busy)  # D is full from now on
    first = answered(router, ids(300), session="s")
    assert first.whole and first.decode in PS
    answered(router, ids(64, 80_000))  # another conversation, served whole, moves the turn on
    second = answered(router, ids(300) + ids(50, 7), session="s")
    assert second.whole and second.decode == first.decode and second.expected_hit == 288
    router.finished(busy)  # D has room: through the P that holds the conversation
    third = router.choose(completion(ids(300) + ids(50, 7) + ids(40, 9)), "s")
    assert third.choice == "pd" and third.prefill == first.decode and third.expected_hit >= 288


def test_without_decode_slots_or_with_p_down_nothing_is_served_whole():
    plain = Router(PS, DS[:1], local_prefill_tokens=512)
    down = Router(PS, DS[:1], local_prefill_tokens=512, decode_slots=1, whole_slots=4)
    for p in PS:
        down.mark(p, up=False)
    for router in (plain, down):
        for i in range(3):
            route = router.choose(completion(ids(64, 10_000 * i)))
            router.started(route)
            assert not route.whole


def test_a_request_whose_p_has_a_queue_is_prefilled_by_its_d_while_d_has_a_slot():
    """`prefill_queue=1`: with one request in flight on P, the next is prefilled by D
    (`p_busy`); once D is full too, it goes through P (or whole, where P has room)."""
    router = Router(PS[:1], DS[:1], local_prefill_tokens=512, decode_slots=3, prefill_queue=1)
    first = router.choose(completion(ids(64, 1)))
    router.started(first)  # prefilling on P
    second = router.choose(completion(ids(64, 2)))
    assert (second.choice, second.reason, second.decode) == ("local", "p_busy", "http://d0")
    router.started(second)
    third = router.choose(completion(ids(64, 3)))
    router.started(third)
    assert third.choice == "local"  # D: 3 in flight now, its slots all taken
    fourth = router.choose(completion(ids(64, 4)))
    assert fourth.choice == "pd", "D is full: it queues there, through P"
    router.finished(first)
    assert router.choose(completion(ids(64, 5))).choice == "pd"  # P's queue is gone
