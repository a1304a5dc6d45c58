"""The pages of a paged KV cache: allocation, reference counts and the prefix cache.

Plain Python over page numbers; the cache itself is a planned array of `num_pages` pages of
`page_size` slots per layer. Page 0 is reserved: it pads page-table rows and is never handed
out, so it never holds real data.

Prefix caching: once a page is full of a sequence's tokens, it is published, once, under a key
that hashes its tokens with the key of the page before it (`page_key`), so equal keys mean
equal prefixes. A later sequence whose prompt starts with the same pages takes them (a reference
each) instead of computing them again. A published page that no sequence references stays
cached until its page is needed, the least recently used first.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxlm.errors import JaxlmError

PADDING_PAGE = 0


class OutOfPagesError(JaxlmError):
    """Raised when an allocation asks for more pages than are free or evictable."""


def page_key(previous: int, tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full page of `tokens` after the page keyed `previous` (0 for a
    sequence's first page): a 128-bit BLAKE2 hash of both, so that a key names the whole prefix
    up to its page's end. A cryptographic hash, as vLLM's: clients choose the tokens, and a
    crafted collision of a weaker hash would hand one request another's cached keys and values."""
    h = hashlib.blake2b(previous.to_bytes(16, "little"), digest_size=16)
    h.update(np.asarray(tokens, np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def page_keys(tokens: Sequence[int], page_size: int) -> list[int]:
    """The key of each full page of `tokens`, in order."""
    keys, previous = [], 0
    for start in range(0, len(tokens) - page_size + 1, page_size):
        previous = page_key(previous, tokens[start : start + page_size])
        keys.append(previous)
    return keys


class PagePool:
    """The pages `1 .. num_pages - 1` of a paged cache (page 0 pads), with their references.

    Example:
        >>> pool = PagePool(num_pages=9, page_size=4)
        >>> pages = pool.allocate(2)
        >>> for page, key in zip(pages, page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)):
        ...     pool.publish(page, key)  # both pages are full
        >>> pool.release(pages)
        >>> pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == pages
        True
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError(f"`num_pages` must be at least 2 (page 0 pads), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"`page_size` must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self._free = collections.deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self._key_of: dict[int, int] = {}
        self._page_of: dict[int, int] = {}
        # Published pages that no sequence references, least recently used first.
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out: all but the padding page."""
        return self.num_pages - 1

    @property
    def num_available(self) -> int:
        """Pages an allocation can take now: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Published pages held for the prefix cache, referenced or not."""
        return len(self._key_of)

    @property
    def num_in_use(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_usable - self.num_available

    def refs(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """`n` pages with one reference each; idle cached pages are evicted, oldest first, once
        no free page is left. Raises `OutOfPagesError` (taking nothing) if fewer are available."""
        if n > self.num_available:
            raise OutOfPagesError(f"{n} pages asked for, {self.num_available} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each of `pages`; a page no sequence references becomes free,
        or idle in the prefix cache if it was published."""
        for page in pages:
            if self._refs[page] < 1:
                raise ValueError(f"page {page} is not in use")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def cached(self, tokens: Sequence[int], keys: list[int] | None = None) -> list[int]:
        """The cached pages that hold the longest run of full pages `tokens` starts with (no
        reference taken); `[]` when the prefix cache is off. `keys`, the keys of the first
        pages of `tokens` known already, is extended with those hashed here.

        The last token of `tokens` is never covered, so that a step still computes it and its
        logits."""
        if not self.prefix_cache:
            return []
        keys = [] if keys is None else keys
        size, pages = self.page_size, []
        for i in range((len(tokens) - 1) // size):
            if i == len(keys):
                keys.append(page_key(keys[-1] if keys else 0, tokens[i * size : (i + 1) * size]))
            page = self._page_of.get(keys[i])
            if page is None:
                break
            pages.append(page)
        return pages

    def match_prefix(self, tokens: Sequence[int], keys: list[int] | None = None) -> list[int]:
        """`cached(tokens, keys)`, a reference taken on each page."""
        pages = self.cached(tokens, keys)
        for page in pages:
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1
        return pages

    def publish(self, page: int, key: int) -> None:
        """Publish `page`, full of a sequence's tokens, under its `key` (`page_key`) for later
        sequences to share. A key already cached under another page keeps that page."""
        if self.prefix_cache and key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def clear_cache(self) -> None:
        """Forget every idle cached page (they become free); referenced pages stay published."""
        for page in list(self._idle):
            del self._page_of[self._key_of.pop(page)]
            self._free.append(page)
        self._idle.clear()
