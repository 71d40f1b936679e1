"""Random interleavings of match / insert / lock / unlock / evict against a brute-force model.

The model is a dict from (namespace, token prefix of k whole pages) to the page id the
tree must return for that prefix's last page. It is updated from what each operation
is specified to do (insert adds the pages it did not have; evict removes what the tree
no longer holds, which must be unlocked tail pages), and every match is compared with
a scan of the model. Hostile inserts (a page the tree already holds, or one listed twice,
among the pages the tree would take) must raise and change nothing, and the tree keeps a
root only for the namespaces the model has pages in.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache import POLICIES, PageAllocator, RadixCache
from radixkv.kernels.pages import NumpyPages

CAPACITY = 40  # pages
MAX_LEN = 20  # tokens per sequence
MAX_RUNNING = 4


class TreeMachine(RuleBasedStateMachine):
    page_size = 1
    loops = None  # the compiled page loops where a C compiler is here

    @initialize(policy=st.sampled_from(sorted(POLICIES)))
    def setup(self, policy):
        self.alloc = PageAllocator(CAPACITY, self.loops)
        self.tree = RadixCache(self.alloc, self.page_size, policy)
        self.model: dict[tuple, int] = {}
        self.running: list[dict] = []
        self.seen: list[list[int]] = [[]]

    # -- helpers -------------------------------------------------------------

    def _tokens(self, data) -> list[int]:
        """A sequence that shares a prefix with one seen before (or not)."""
        base = data.draw(st.sampled_from(self.seen))
        cut = data.draw(st.integers(0, len(base)))
        ext = data.draw(st.lists(st.integers(0, 2), min_size=0 if cut else 1, max_size=6))
        tokens = (base[:cut] + ext)[:MAX_LEN]
        self.seen.append(tokens)
        return tokens

    def _expect(self, ns, tokens) -> list[int]:
        pages, k = [], self.page_size
        while k <= len(tokens) and (ns, tuple(tokens[:k])) in self.model:
            pages.append(self.model[(ns, tuple(tokens[:k]))])
            k += self.page_size
        return pages

    def _locked_pages(self) -> set[int]:
        return {int(p) for r in self.running for p in r["matched"]}

    def _evict(self, n: int, locked: set[int]) -> int:
        evictable = self.tree.evictable_pages
        free_before, evicted_before = self.alloc.num_free(), self.tree.evicted_pages
        freed = self.tree.evict(n)
        assert self.alloc.num_free() - free_before == freed  # frees exactly what it reports
        assert freed >= min(n, evictable)  # unlocked pages here are owned by the tree alone
        held = {int(p) for node in self.tree.nodes() for p in node.pages}
        removed = {k for k, p in self.model.items() if p not in held}
        assert len(removed) == self.tree.evicted_pages - evicted_before == freed
        assert not {self.model[k] for k in removed} & locked  # locked paths never evicted
        for k in removed:
            del self.model[k]
        for ns, prefix in self.model:  # what is left is still prefix-closed
            assert len(prefix) == self.page_size or (ns, prefix[: -self.page_size]) in self.model
        return freed

    # -- rules ---------------------------------------------------------------

    @precondition(lambda self: len(self.running) < MAX_RUNNING)
    @rule(data=st.data(), ns=st.sampled_from([None, "t"]))
    def start_request(self, data, ns):
        tokens = self._tokens(data)
        m = self.tree.match_prefix(tokens, ns)
        expected = self._expect(ns, tokens)
        assert m.pages.tolist() == expected and m.num_tokens == len(expected) * self.page_size
        self.tree.lock(m.node)
        need = -(-len(tokens) // self.page_size) - len(m.pages)
        short = need - self.alloc.num_free()
        if short > 0:
            self._evict(short, self._locked_pages() | set(m.pages.tolist()))
        if self.alloc.num_free() < need:
            self.tree.unlock(m.node)
            return
        self.alloc.incref(m.pages)
        table = np.concatenate([m.pages, self.alloc.alloc(need)])
        self.running.append(dict(tokens=tokens, ns=ns, node=m.node, table=table, matched=m.pages))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data):
        r = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        whole = len(r["tokens"]) // self.page_size
        expected_cached = len(self._expect(r["ns"], r["tokens"][: whole * self.page_size]))
        cached = self.tree.insert(r["tokens"], r["table"], r["ns"]).num_cached
        assert cached == expected_cached * self.page_size
        for i in range(expected_cached, whole):
            self.model[(r["ns"], tuple(r["tokens"][: (i + 1) * self.page_size]))] = int(r["table"][i])
        self.tree.unlock(r["node"])
        self.alloc.decref(r["table"])

    @rule(data=st.data(), ns=st.sampled_from([None, "t"]))
    def match_only(self, data, ns):
        tokens = self._tokens(data)
        assert self.tree.match_prefix(tokens, ns).pages.tolist() == self._expect(ns, tokens)

    @rule(data=st.data(), ns=st.sampled_from([None, "t"]), twice=st.booleans())
    def hostile_insert(self, data, ns, twice):
        """Finish a request whose new pages reuse a page the tree holds, or list one twice."""
        tokens = self._tokens(data)
        whole = len(tokens) // self.page_size
        cached = self._expect(ns, tokens[: whole * self.page_size])
        held = sorted(set(self.model.values()))
        new = whole - len(cached)
        if not held:
            twice = True
        if new < (2 if twice else 1) or self.alloc.num_free() < new - 1:
            return
        mine = self.alloc.alloc(new - 1).tolist()
        bad = data.draw(st.sampled_from(mine if twice else held))
        taken = list(mine)
        taken.insert(data.draw(st.integers(0, len(taken))), bad)
        with pytest.raises(ValueError, match=rf"pages .*{'twice' if twice else 'held by the tree'}.*\[{bad}\]"):
            self.tree.insert(tokens, cached + taken, ns)
        self.alloc.decref(mine)  # the integrity invariant then proves that nothing changed

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self._evict(n, self._locked_pages())

    @invariant()
    def integrity(self):
        if not hasattr(self, "tree"):
            return
        owners: dict[int, int] = {}
        for r in self.running:
            for p in r["table"].tolist():
                owners[p] = owners.get(p, 0) + 1
        self.tree.check_integrity(external_refs=owners)
        assert self.tree.cached_pages == len(self.model)
        assert set(self.tree._roots) == {ns for ns, _ in self.model}  # no root for an empty namespace

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        while self.running:  # every request finishes; then the pool empties completely
            r = self.running.pop()
            self.tree.insert(r["tokens"], r["table"], r["ns"])
            self.tree.unlock(r["node"])
            self.alloc.decref(r["table"])
        self.tree.evict(CAPACITY)
        assert self.alloc.num_free() == CAPACITY and self.tree.cached_pages == 0
        assert self.tree._roots == {}
        self.tree.check_integrity(external_refs={})


SETTINGS = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class TreeMachinePage1(TreeMachine):
    page_size = 1


class TreeMachinePage3(TreeMachine):
    page_size = 3
    loops = NumpyPages  # the fallback's contract, under the same rules


TestTreePage1 = TreeMachinePage1.TestCase
TestTreePage1.settings = SETTINGS
TestTreePage3 = TreeMachinePage3.TestCase
TestTreePage3.settings = SETTINGS
