"""A batch's CSR description as host lists, shared by every attention backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchShape:
    """The CSR arrays of a batch as host lists, and what follows from them."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_last_page_len: list[int]
    page_size: int

    @classmethod
    def from_csr(cls, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size: int) -> "BatchShape":
        shape = cls(*(torch.as_tensor(t).tolist() for t in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)),
                    page_size)
        shape.validate()
        return shape

    def validate(self) -> None:
        n = self.num_sequences
        if len(self.kv_indptr) != n + 1 or len(self.kv_last_page_len) != n:
            raise ValueError("qo_indptr, kv_indptr and kv_last_page_len describe different numbers of sequences")
        for i in range(n):
            if not 1 <= self.kv_last_page_len[i] <= self.page_size:
                raise ValueError(f"kv_last_page_len[{i}] = {self.kv_last_page_len[i]} is outside 1..{self.page_size}")
            if self.kv_indptr[i + 1] <= self.kv_indptr[i]:
                raise ValueError(f"sequence {i} has no pages")
            if not 1 <= self.q_len(i) <= self.kv_len(i):
                raise ValueError(f"sequence {i} has {self.q_len(i)} new tokens but {self.kv_len(i)} in its cache")

    @property
    def num_sequences(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token."""
        return all(self.q_len(i) == 1 for i in range(self.num_sequences))

    def q_len(self, i: int) -> int:
        return self.qo_indptr[i + 1] - self.qo_indptr[i]

    def num_pages(self, i: int) -> int:
        return self.kv_indptr[i + 1] - self.kv_indptr[i]

    def kv_len(self, i: int) -> int:
        return (self.num_pages(i) - 1) * self.page_size + self.kv_last_page_len[i]

    def pages(self, i: int) -> list[int]:
        return self.kv_indices[self.kv_indptr[i]:self.kv_indptr[i + 1]]

    def is_contiguous(self, i: int) -> bool:
        pages = self.pages(i)
        return pages == list(range(pages[0], pages[0] + len(pages)))
