"""The cross-session tier's interface and in-process store (the Redis store: test_redis_tier.py)."""

from __future__ import annotations

from decoding.drafters.racer import CrossSessionConfig, InProcessSharedTier, open_shared_tier
from decoding.drafters.racer.cross_session import Namespace, ngram_items


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ngram_items_on_a_literal_list() -> None:
    items = ngram_items([1, 2, 3, 4, 2, 3, 4], start=2, context_len=2, continuation_len=2)
    assert items == {(1, 2): {(3, 4): 1.0}, (2, 3): {(4, 2): 1.0, (4,): 1.0}, (3, 4): {(2, 3): 1.0},
                     (4, 2): {(3, 4): 1.0}}


def test_in_process_learn_rank_and_isolate() -> None:
    tier = InProcessSharedTier(CrossSessionConfig(context_len=2, continuation_len=3))
    acme = tier.cache("m", "tok", "acme")
    acme.learn([1, 2, 3, 4, 5], start=0)
    acme.learn([1, 2, 3, 9, 9], start=0)
    acme.learn([1, 2, 3, 4, 6], start=0)
    assert acme.continuations([7, 1, 2]) == [((3, 4, 5), 1.0), ((3, 4, 6), 1.0), ((3, 9, 9), 1.0)]
    acme.learn([1, 2, 3, 4, 5], start=0)
    assert acme.continuations([1, 2])[0] == ((3, 4, 5), 2.0)
    others = (tier.cache("m", "tok", "globex"), tier.cache("m2", "tok", "acme"), tier.cache("m", "t2", "acme"))
    for other in others:
        assert other.continuations([1, 2]) == []
    assert acme.continuations([2]) == []  # shorter than the context


def test_in_process_ttl_decay_and_bounds() -> None:
    clock = Clock()
    cfg = CrossSessionConfig(context_len=1, continuation_len=2, ttl_s=100, half_life_s=10, max_contexts=3,
                             max_continuations=2, max_namespaces=2)
    tier = InProcessSharedTier(cfg, clock)
    cache = tier.cache("m", "t", "a")
    cache.learn([1, 2, 3], start=0)
    clock.now += 10  # one half-life
    cache.learn([1, 5, 6], start=0)
    assert dict(cache.continuations([1])) == {(2, 3): 0.5, (5, 6): 1.0}
    clock.now += 10
    cache.learn([1, 7, 7], start=0)  # full: the weakest old continuation goes, the new one gets in
    assert dict(cache.continuations([1])) == {(5, 6): 0.5, (7, 7): 1.0}
    for t in range(10, 20):
        cache.learn([t, t + 1], start=0)
    assert tier.contexts(cache.namespace) == 3  # max_contexts (oldest updates dropped)
    assert cache.continuations([19]) == [((20,), 1.0)]
    clock.now += 101
    assert cache.continuations([19]) == []  # TTL
    tier.cache("m", "t", "b").learn([1, 2], 0)
    tier.cache("m", "t", "c").learn([1, 2], 0)
    assert tier.contexts(cache.namespace) == 0  # namespace "a" was the least recently used of three


def test_open_shared_tier_picks_the_backend() -> None:
    assert isinstance(open_shared_tier(CrossSessionConfig()), InProcessSharedTier)


def test_namespace_tag_hides_the_tenant() -> None:
    ns = Namespace("a:b{c}", "x" * 40, "tenant-key")
    assert "tenant-key" not in ns.tag and ns.tag.count("{") == 1 and ns.tag.count("}") == 1


def test_tier_draft_kinds_carry_its_streak_of_right_guesses() -> None:
    """The tier's nodes say how many steps in a row its best next token was the one the text went on with
    (verified or not), so a repeated answer is told apart from a short context's wrong continuations."""
    from decoding.drafters.racer.tier_drafter import TierDraft

    tier = InProcessSharedTier(CrossSessionConfig(context_len=2, continuation_len=3))
    cache = tier.cache("m", "tok", "acme")
    prompt, answer = [50, 51, 52], [10, 11, 12, 13, 14, 15]
    first = TierDraft(cache)
    first.begin(prompt)
    first.learn(answer)  # an earlier session's answer, twice: the tier's best guess where answers part
    first.learn(answer)

    draft = TierDraft(cache)
    draft.begin(prompt)
    kinds = []
    for n in range(1, 5):  # plain steps (nothing verified): the text goes on with the earlier answer
        tree = draft.paths(answer[:n], budget=4)
        assert tree.tokens[0] == answer[n]
        kinds.append(set(tree.kinds))
    assert kinds == [{"racer.cross_session/h0"}, {"racer.cross_session/h1"}, {"racer.cross_session/h2"},
                     {"racer.cross_session/h2"}]
    # another earlier answer parts from the first after 12; the text follows it where the tier guessed 13
    other = TierDraft(cache)
    other.begin(prompt)
    other.learn([10, 11, 12, 40, 41, 42])
    draft = TierDraft(cache)
    draft.begin(prompt)
    for n in (1, 2, 3):
        draft.paths(answer[:n], budget=4)
    tree = draft.paths([10, 11, 12, 40], budget=4)
    assert tree.tokens[0] == 41 and set(tree.kinds) == {"racer.cross_session/h0"}


def test_in_process_answers_newest_first_bounded_by_scope_and_tenant() -> None:
    clock = Clock()
    tier = InProcessSharedTier(CrossSessionConfig(max_answers=2, max_answer_tokens=3, ttl_s=100, max_scopes=2), clock)
    acme = tier.cache("m", "tok", "acme")
    acme.add_answer("doc-a", [1, 2, 3, 4, 5])
    acme.add_answer("doc-a", [6, 7])
    acme.add_answer("doc-a", [8])
    assert acme.answers("doc-a") == [(8,), (6, 7)]  # newest first, at most max_answers
    acme.add_answer("doc-b", [1, 2, 3, 4])
    assert acme.answers("doc-b") == [(1, 2, 3)]  # an answer's first max_answer_tokens
    assert tier.cache("m", "tok", "globex").answers("doc-a") == [] and acme.answers("doc-c") == []
    acme.add_answer("doc-c", [9])  # a third scope: the least recently used one goes
    assert acme.answers("doc-a") == [] and acme.answers("doc-c") == [(9,)]
    clock.now += 101
    assert acme.answers("doc-c") == []  # TTL
