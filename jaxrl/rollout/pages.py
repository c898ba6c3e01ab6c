"""Host-side page bookkeeping for one instance's paged KV pool: free list and reference counts.

Page 0 is reserved as the scratch page that padding rows write to; real sequences never own it.
Pages shared by the n samples of one prompt carry a reference count and return to the free list when
the last holder frees them.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is scratch)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        return out

    def share(self, pages: list[int]) -> list[int]:
        for p in pages:
            assert self._refs[p] > 0, f"sharing free page {p}"
            self._refs[p] += 1
        return list(pages)

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"double free of page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
