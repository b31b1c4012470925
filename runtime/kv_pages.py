"""KV pages on the host: how many a sequence needs, and the pool that hands them out with the
shared-prefix cache over them (runtime/batch.py's batches keep one each; docs/serving.md, "The
prefix cache"). Bookkeeping only: the pages' floats live in the executor's arena."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions of one sequence."""
    return -(-tokens // page_size)


Key = tuple[int, tuple[int, ...]]  # (the previous page's node, this page's tokens)


class PagePool:
    """The KV pages of one arena and the shared-prefix cache over them (host bookkeeping only).

    A page is free (on the free list), held (by ``refs[p]`` >= 1 open sequences) or cached (held by
    none, kept in least-recently-used order because its tokens may come again). A FULL page can
    be registered under a key that covers every token from position 0 to its end, as a chain:
    (the node of the page before it, its own tokens), exact tuples compared by the dict (no hash
    collision can alias two prefixes). Node ids are never reused, so a key whose parent page was
    evicted and recycled can no longer be reached. Only full pages are keyed and a sequence only
    ever appends after its last position, so a registered page is never written again: sharing it
    is read-only. A closed sequence's keyed pages are cached (its last pages first in line for
    eviction, so a chain is evicted from its end), its others freed; at most ``cache_pages`` stay
    cached (beyond that the oldest is freed at once: untouched pages of the arena cost no memory,
    so a bounded cache bounds what serving touches). ``take`` hands out a free page, else evicts
    the least recently used cached page: eviction happens before a step is ever short of pages."""

    def __init__(self, pages_total: int, page_size: int, cache_pages: int):
        self.pages_total, self.page_size, self.cache_pages = pages_total, page_size, max(0, cache_pages)
        self.free = list(range(pages_total - 1, -1, -1))  # pop() hands out page 0 first
        self.refs = [0] * pages_total
        self.lru: dict[int, None] = {}  # cached pages, least recently used first (dicts keep order)
        self.index: dict[Key, int] = {}  # key -> its page
        self.key: dict[int, Key] = {}  # keyed page -> its key
        self.node: dict[int, int] = {}  # keyed page -> its node id (the parent of the next page's key)
        self._next_node = 1  # 0: the root, before position 0
        self.evictions = 0  # cached pages taken for a step (not counting trims to the cap)

    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def take(self) -> int:
        """A page to write: a free one, else the least recently used cached one (its key dropped)."""
        if self.free:
            page = self.free.pop()
        else:
            page = next(iter(self.lru))
            self._forget(page)
            self.evictions += 1
        self.refs[page] = 1
        return page

    def _forget(self, page: int) -> None:
        del self.lru[page]
        del self.index[self.key.pop(page)]
        del self.node[page]

    def match(self, tokens: Sequence[int], pages: int) -> tuple[list[int], list[int]]:
        """The keyed pages holding tokens[0:k*page_size] for the largest k <= `pages`, and their nodes."""
        found: list[int] = []
        nodes: list[int] = []
        parent, ps = 0, self.page_size
        if not self.cache_pages:
            return found, nodes
        for k in range(pages):
            page = self.index.get((parent, tuple(int(t) for t in tokens[k * ps:(k + 1) * ps])))
            if page is None:
                break
            found.append(page)
            parent = self.node[page]
            nodes.append(parent)
        return found, nodes

    def hold(self, page: int) -> None:
        """One more sequence maps `page` (a keyed page found by match)."""
        if self.refs[page] == 0:
            del self.lru[page]
        self.refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """A sequence lets go of `pages` (in position order)."""
        for page in reversed(pages):  # the last page first: it is evicted first
            self.refs[page] -= 1
            if self.refs[page]:
                continue
            if page in self.key:
                self.lru[page] = None
                if len(self.lru) > self.cache_pages:
                    old = next(iter(self.lru))
                    self._forget(old)
                    self.free.append(old)
            else:
                self.free.append(page)

    def register(self, page: int, parent: int, tokens: Sequence[int]) -> int:
        """Keys the full, held `page` as `tokens` after node `parent`; returns the node a following
        page's key chains from (an equal page's already keyed: then `page` stays private)."""
        if not self.cache_pages:
            return 0
        key = (parent, tuple(int(t) for t in tokens))
        have = self.index.get(key)
        if have is not None:
            return self.node[have]
        self.index[key], self.key[page], self.node[page] = page, key, self._next_node
        self._next_node += 1
        return self.node[page]

    def check(self, holders: Mapping[int, Sequence[int]], lengths: Mapping[int, int]) -> None:
        """The page invariants, given each open sequence's pages and length: every page is exactly
        one of free / held / cached; refcounts equal the holders; a page held twice or cached is
        keyed, full and before every holder's end; the index and the keys agree; the cache within
        its cap. AssertionError naming what is wrong."""
        count = [0] * self.pages_total
        for seq, pages in holders.items():
            assert len(set(pages)) == len(pages), f"sequence {seq} maps a page twice"
            assert len(pages) == pages_for(lengths[seq], self.page_size), f"sequence {seq} holds {len(pages)} pages"
            for k, page in enumerate(pages):
                count[page] += 1
                if page in self.key:
                    assert (k + 1) * self.page_size <= lengths[seq], f"keyed page {page} is not full in sequence {seq}"
        assert count == self.refs, "refcounts differ from the sequences holding the pages"
        free, cached = set(self.free), set(self.lru)
        held = {p for p in range(self.pages_total) if count[p]}
        assert len(free) == len(self.free), "a page is free twice"
        assert not free & held and not free & cached and not held & cached, "a page is in two states"
        assert free | held | cached == set(range(self.pages_total)), "pages are lost"
        assert all(count[p] == 1 or p in self.key for p in held), "a shared page has no key"
        assert cached <= set(self.key) and not free & set(self.key), "a cached page without a key, or a free one with"
        assert {self.index[k]: k for k in self.index} == self.key and set(self.node) == set(self.key), \
            "the index and the keys differ"
        assert len(self.lru) <= self.cache_pages, "the cache is over its cap"
