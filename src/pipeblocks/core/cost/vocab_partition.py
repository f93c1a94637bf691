"""The vocabulary split of vocabulary parallelism: V rows over p pipeline ranks, padded to equal shards.

Rank r holds rows ``[r·s, (r+1)·s)`` of the input embedding and of the head, ``s = ceil(V/p)``
(docs/vocab-parallel.md). When p does not divide V the last shard(s) end in zero rows, which the
softmax masks out and which never receive a gradient; `VocabPartition.note` is the one line that
says so. A split that would leave a rank without a real row is refused. The runtime
(`runtime.vocab_parallel`) and the price (`sim.vocab_costs`) both split by this.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VocabPartition", "partition_vocab"]


@dataclass(frozen=True)
class VocabPartition:
    """V rows over p ranks in contiguous blocks of ``shard_size = ceil(V/p)``; the tail is padding.

    >>> partition_vocab(10, 4)
    VocabPartition(vocab_size=10, ranks=4)
    >>> [partition_vocab(10, 4).rows(r) for r in range(4)]
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    """

    vocab_size: int
    ranks: int

    @property
    def shard_size(self) -> int:
        """rows each rank holds, padding included"""
        return -(-self.vocab_size // self.ranks)

    @property
    def padded_size(self) -> int:
        return self.shard_size * self.ranks

    @property
    def padding(self) -> int:
        """zero rows added in all (0 when p divides V)"""
        return self.padded_size - self.vocab_size

    def start(self, rank: int) -> int:
        return rank * self.shard_size

    def rows(self, rank: int) -> tuple[int, int]:
        """[first, last) vocabulary ids that are real rows on `rank`"""
        lo = min(self.start(rank), self.vocab_size)
        return lo, min(lo + self.shard_size, self.vocab_size)

    def real_rows(self, rank: int) -> int:
        lo, hi = self.rows(rank)
        return hi - lo

    def note(self) -> str | None:
        """the one line to tell the user when the vocabulary is padded; None when p divides V"""
        if not self.padding:
            return None
        return (f"vocabulary parallelism: V = {self.vocab_size} is not a multiple of p = {self.ranks}; "
                f"each rank holds {self.shard_size} rows and the last shard(s) end in {self.padding} zero "
                f"row(s) (masked out of the softmax, never updated)")


def partition_vocab(vocab_size: int, ranks: int) -> VocabPartition:
    """The vocabulary split of V rows over p ranks; refuses a split that leaves a rank no real row."""
    if ranks < 1 or vocab_size < 1:
        raise ValueError(f"vocabulary parallelism needs V >= 1 and p >= 1 (got V = {vocab_size}, p = {ranks})")
    part = VocabPartition(vocab_size, ranks)
    empty = [r for r in range(ranks) if part.real_rows(r) == 0]
    if empty:
        raise ValueError(
            f"vocabulary parallelism: V = {vocab_size} rows in shards of {part.shard_size} leave rank(s) "
            f"{empty} of p = {ranks} without a real row; use a vocabulary of at least "
            f"{(ranks - 1) * part.shard_size + 1} rows or fewer pipeline ranks")
    return part
