"""The simulator's Belady reference (fast, memoised) against its former implementation,
and the LRU-to-Belady gap report."""

from array import array

import numpy as np
import pytest

from radixkv.cache import sim, traces
from radixkv.cache.traces import TraceRequest


class OracleBelady(sim.Belady):
    """Belady as it was before the memo: every victim builds every evictable leaf's path
    key and looks its next use up (cached per path bytes while ``now`` has not reached
    it), ranks all leaves, and binary-searches the victim's tail. Its ties went to
    ``id(leaf)`` (a memory address: replays could differ from run to run); here they go
    to the leaf created last, as in the new one."""

    def __init__(self, trace, page_size):
        super().__init__(trace, page_size)
        self._cache = {}

    def _cached_next_use(self, namespace, prefix):
        hit = self._cache.get((namespace, prefix))
        if hit is not None and hit > self.now:
            return hit
        value = self.index[namespace].first_after(prefix, self.now)
        self._cache[(namespace, prefix)] = value
        return value

    def choose(self, leaves, need):
        width = 4 * self.page_size
        ranked = []
        for leaf in leaves:
            path = leaf.path_key()
            ranked.append((self._cached_next_use(leaf.namespace, path), len(path), leaf.created, id(leaf), leaf, path))
        ranked.sort(reverse=True)
        _, _, _, _, victim, path = ranked[0]
        runner_up = ranked[1][0] if len(ranked) > 1 else -sim.NEVER
        lo, hi = 1, min(need, len(victim.pages))
        while lo < hi:
            k = (lo + hi + 1) // 2
            if self._cached_next_use(victim.namespace, path[: len(path) - (k - 1) * width]) >= runner_up:
                lo = k
            else:
                hi = k - 1
        return victim, lo


def branchy(seed: int, n: int = 80, namespaces: int = 1, timed: bool = False) -> list[TraceRequest]:
    """Requests that repeat an earlier prompt (a leaf used again stays the same leaf:
    its remembered next use must expire), or extend one cut at a random point (matches
    split edges mid-way, evicted tails come back), with a few outputs."""
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    out = []
    clock = 0.0
    for _ in range(n):
        u = rng.random()
        if prompts and u < 0.25:
            prompt = list(prompts[int(rng.integers(len(prompts)))])
        else:
            head = []
            if prompts and u < 0.8:
                base = prompts[int(rng.integers(len(prompts)))]
                head = base[: int(rng.integers(1, len(base) + 1))]
            prompt = head + rng.integers(0, 1000, size=int(rng.integers(2, 24))).tolist()
        prompts.append(prompt)
        clock += float(rng.exponential(0.05))
        out.append(TraceRequest(
            array("i", prompt), namespace=f"t{rng.integers(namespaces)}" if namespaces > 1 else None,
            output_tokens=int(rng.integers(0, 4)), arrival=clock if timed else None,
        ))  # fmt: skip
    return out


CASES = [
    ("branchy", lambda: branchy(0), 1, 1),
    ("branchy, pages of 4", lambda: branchy(1), 4, 1),
    ("branchy, 3 namespaces, 3 in flight", lambda: branchy(2, namespaces=3), 2, 3),
    ("branchy, timed", lambda: branchy(3, timed=True), 1, 4),
    ("multi_turn", lambda: traces.multi_turn(conversations=8, turns=5, min_new=3, max_new=20, seed=4), 4, 1),
    ("multi_turn, timed", lambda: traces.multi_turn(8, 5, 3, 20, seed=5, arrivals=True, conversation_rate=2,
                                                    think_median=1.0), 2, 8),  # fmt: skip
    ("branching", lambda: traces.branching(fanout=3, depth=3, step=5, seed=6), 1, 2),
]  # fmt: skip


@pytest.mark.parametrize("name, make, page_size, in_flight", CASES, ids=[c[0] for c in CASES])
def test_memoised_belady_decides_as_the_former_implementation(name, make, page_size, in_flight):
    trace = make()
    unique = sim.replay(trace, None, page_size, "lru", in_flight).cached_pages
    for fraction in (0.08, 0.2, 0.45):
        cap = max(2, round(fraction * unique))
        fast = sim.replay(trace, cap, page_size, "belady", in_flight, chunk_size=8)
        # a timed trace is replayed in arrival order: these already are (ties in file order)
        oracle = sim.replay(trace, cap, page_size, OracleBelady(trace, page_size), in_flight, chunk_size=8)
        assert fast.evicted_pages > 0
        assert fast == oracle, (name, cap)


def few_tokens(seed: int, n: int = 80) -> list[TraceRequest]:
    """Short prompts over 5 token ids, each extending a random earlier one cut at a
    random point: merges and tail evictions meet often."""
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    for _ in range(n):
        u = rng.random()
        if prompts and u < 0.85:
            base = prompts[int(rng.integers(len(prompts)))]
            head = base[: int(rng.integers(1, len(base) + 1))]
            tail = [int(rng.integers(0, 3))] if u < 0.2 else rng.integers(0, 5, size=int(rng.integers(1, 6))).tolist()
            prompts.append(head + tail)
        else:
            prompts.append(rng.integers(0, 5, size=int(rng.integers(2, 8))).tolist())
    return [TraceRequest(array("i", p)) for p in prompts]


@pytest.mark.parametrize("seed, capacity", [(18, 25), (159, 18), (188, 17)])
def test_a_leaf_whose_tail_went_and_whose_parent_merged_in_is_ranked_again(seed, capacity):
    # In these replays a leaf loses a tail page, then its one-page parent merges into it:
    # its key is as long as before but its path ends a page higher. A memo checked by
    # key length alone kept the old path's next use here and lost hits.
    trace = few_tokens(seed)
    fast = sim.replay(trace, capacity, 1, "belady", chunk_size=None)
    assert fast == sim.replay(trace, capacity, 1, OracleBelady(trace, 1), chunk_size=None)


def test_belady_memo_forgets_nodes_that_are_gone():
    trace = branchy(7, n=300)
    policy = sim.Belady(trace, 1)
    r = sim.replay(trace, 60, 1, policy)
    assert r.evicted_pages > 1000
    assert len(policy._memo) <= 2 * r.cached_pages + 1024


def test_a_mooncake_style_trace_replays_alike(tmp_path):
    rng = np.random.default_rng(8)
    lines, chats = [], [[int(h)] for h in range(6)]
    for i in range(50):
        chat = chats[int(rng.integers(len(chats)))]
        chat.append(100 + i)
        n = len(chat) * 4 - int(rng.integers(0, 4))
        lines.append(f'{{"timestamp": {i}, "input_length": {n}, "output_length": 2, "hash_ids": {chat}}}\n')
    path = tmp_path / "m.jsonl"
    path.write_text("".join(lines))
    trace = traces.load_mooncake(path, block_tokens=4)
    for cap in (6, 12, 25):
        fast = sim.replay(trace, cap, 4, "belady", arrivals=False)
        assert fast == sim.replay(trace, cap, 4, OracleBelady(trace, 4), arrivals=False)


# -- the gap report -----------------------------------------------------------------------


def test_gap_closed_and_share_of_belady():
    assert sim.gap_closed(0.3, 0.2, 0.4) == pytest.approx(0.5)
    assert sim.gap_closed(0.1, 0.2, 0.4) == pytest.approx(-0.5)  # worse than LRU
    assert sim.gap_closed(0.3, 0.4, 0.4) is None  # no gap
    assert sim.gap_closed(0.3, None, 0.4) is None  # no LRU run
    runs = [{"policy": p, "capacity_pages": c, "hit_rate": h}
            for p, c, h in [("lru", 10, 0.2), ("lfu", 10, 0.3), ("belady", 10, 0.4), ("lru", 20, 0.5),
                            ("lfu", 20, 0.45), ("belady", 20, 0.5), ("lru", 30, 0.6)]]  # fmt: skip
    sim.add_gap(runs)
    by = {(r["policy"], r["capacity_pages"]): r for r in runs}
    assert by["lfu", 10]["of_belady"] == pytest.approx(0.75) and by["lfu", 10]["gap_closed"] == pytest.approx(0.5)
    assert by["lru", 10]["gap_closed"] == 0 and by["belady", 10]["gap_closed"] == 1
    assert by["lfu", 20]["of_belady"] == pytest.approx(0.9) and by["lfu", 20]["gap_closed"] is None
    assert "of_belady" not in by["lru", 30]  # Belady did not run at 30 pages


def test_sweep_reports_the_gap_for_every_policy_and_capacity():
    trace = traces.synthetic("branching")
    result = sim.sweep(trace, 16, ("lru", "lfu"), (0.25, 0.5))
    for r in result["runs"]:
        best = next(b for b in result["runs"] if b["policy"] == "belady" and b["capacity_pages"] == r["capacity_pages"])
        lru = next(b for b in result["runs"] if b["policy"] == "lru" and b["capacity_pages"] == r["capacity_pages"])
        assert r["of_belady"] == pytest.approx(r["hit_rate"] / best["hit_rate"])
        gap = (r["hit_rate"] - lru["hit_rate"]) / (best["hit_rate"] - lru["hit_rate"])
        assert r["gap_closed"] == pytest.approx(gap)
    table = sim.format_table(result)
    assert "% of belady / gap closed %" in table
    lfu = next(line for line in table.splitlines()[-4:] if line.startswith("lfu"))
    r = next(r for r in result["runs"] if r["policy"] == "lfu")
    assert f"{100 * r['of_belady']:.1f} / {100 * r['gap_closed']:.1f}" in lfu
    # no LRU among the policies: the share of Belady without the gap
    no_lru = sim.sweep(trace, 16, ("fifo",), (0.25,))
    assert no_lru["runs"][0]["gap_closed"] is None and " / -" in sim.format_table(no_lru)
    # no Belady: no gap fields, no second table
    plain = sim.sweep(trace, 16, ("lru",), (0.25,), belady=False)
    assert "of_belady" not in plain["runs"][0] and "gap closed" not in sim.format_table(plain)


def test_return_oracle_drops_what_never_comes_back_first_then_the_least_recently_used():
    def req(base):
        return TraceRequest(array("i", range(base, base + 10)))  # two whole pages of 4, then two tokens

    a, b, c = 100, 200, 300
    back_to_a = [req(a), req(b), req(c), req(a)]  # 5 pages hold two prompts' pages: C's insertion evicts one
    assert sim.replay(back_to_a, 5, 4, "lru", arrivals=False).cached_per_request == (0, 0, 0, 0)  # A was oldest
    oracle = sim.replay(back_to_a, 5, 4, "return-oracle", arrivals=False)
    assert oracle.cached_per_request == (0, 0, 0, 8)  # B never comes back: it went, though newer than A
    assert oracle.cached_per_request == sim.replay(back_to_a, 5, 4, "belady", arrivals=False).cached_per_request
    back_to_b = [req(a), req(b), req(c), req(b)]  # A, oldest, never comes back either: as LRU
    assert sim.replay(back_to_b, 5, 4, "return-oracle", arrivals=False).cached_per_request == (0, 0, 0, 8)
    assert sim.replay(back_to_b, 5, 4, "lru", arrivals=False).cached_per_request == (0, 0, 0, 8)
