"""Point-to-point transfers for the executor: tags, the receive-posting plan, the mailbox.

* Tags. Every tensor of a step has its own tag, from its `Comm.key` (payload, producing
  stage, microbatch, sequence chunk) and its leaf index in the activation (a tuple or dict
  activation crosses as one message per leaf; shapes.py), so a message can only land in
  its own buffer. The leaf index varies slowest, so tags grow with leaves only when used.
* Posting plan. A receive is posted one compute action before the action that consumes
  it (so the transfer overlaps that compute) and waited for just before use. Backends
  without tags (NCCL) match messages per peer in issue order, so receives from one peer
  are posted in the order that peer sends them: the plan moves a receive earlier when a
  later-consumed tensor is sent first. The leaves of one activation are sent together,
  in leaf order, and their receives are posted together in the same order.
* Mailbox. Sends and receives are queued and issued together right before the next
  compute or wait (sends never block). Every wait has a timeout. NCCL gets one
  `batch_isend_irecv` (it coalesces the batch). Gloo does not coalesce, and there the
  batch wrapper's Python checks cost about as much as the transfers themselves, which sit
  on the pipeline's critical path: the Mailbox calls the process group's `send`/`recv`
  directly, sends first, since a peer's next compute may be waiting on them.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.ir.actions import Action
from ..core.ir.ops import Comm, Overlap
from ..core.ir.program import Program

__all__ = ["PeerTimeoutError", "Tags", "leaf_key", "receive_posts", "Mailbox"]


class PeerTimeoutError(TimeoutError):
    """A transfer did not complete within the runner's timeout (a peer failed or hangs)."""


@dataclass(frozen=True)
class Tags:
    """Tags for one Program's tensors and for the shape pass (two messages per stage input:
    the length of the metadata stream, then the stream; shapes.py)."""

    num_stages: int
    m: int
    seq_chunks: int

    def data(self, key: tuple[str, int, int, int], leaf: int = 0) -> int:
        payload, producer, mb, chunk = key
        kind = 0 if payload == "F" else 1
        per_leaf = 2 * self.num_stages * self.m * self.seq_chunks  # tensors of one leaf index
        index = ((kind * self.num_stages + producer) * self.m + mb) * self.seq_chunks + chunk
        return 1 + 2 * self.num_stages + leaf * per_leaf + index

    def shapes(self, stage: int, part: int = 0) -> int:
        """part 0: the stream's length; part 1: the stream."""
        return 1 + 2 * stage + part


def leaf_key(key: tuple, leaf: int) -> tuple:
    """The mailbox key of one leaf of the tensor `key` names (leaf 0 keeps the key itself)."""
    return key if leaf == 0 else (*key, leaf)


def receive_posts(program: Program, rank: int) -> dict[int, list[Comm]]:
    """Op index -> the receives to post when the executor reaches that op (in posting order)."""
    ops = program.ranks[rank]
    wanted_at: dict[tuple, int] = {}
    recv_of: dict[tuple, Comm] = {}
    last_compute = 0
    for index, op in enumerate(ops):
        if isinstance(op, (Action, Overlap)):
            last_compute = index
        elif isinstance(op, Comm) and not op.send:
            wanted_at[op.key] = last_compute if last_compute < index else index
            recv_of[op.key] = op
    posts: dict[int, list[Comm]] = {}
    peers = {op.peer for op in recv_of.values()}
    for peer in sorted(peers):
        order = [op.key for op in program.ranks[peer] if isinstance(op, Comm) and op.send and op.peer == rank]
        order = [key for key in order if key in recv_of]
        at = len(ops)
        placed = []
        for key in reversed(order):  # suffix minimum keeps per-peer posting in send order
            at = min(at, wanted_at[key])
            placed.append((at, key))
        for at, key in reversed(placed):
            posts.setdefault(at, []).append(recv_of[key])
    return posts


class Mailbox:
    """Queued, batched isend/irecv with per-key receive buffers and timed waits."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float, rank: int) -> None:
        self._group = group
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._timeout_s = timeout_s
        self._rank = rank
        # sends and receives queued since the last flush: (tensor, peer's group rank, tag, label)
        # and (recv key, buffer, peer's group rank, tag); sends are issued first
        self._send_queue: list[tuple[torch.Tensor, int, int, str]] = []
        self._recv_queue: list[tuple[tuple, torch.Tensor, int, int]] = []
        self._pending_recv: dict[tuple, tuple[dist.Work, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor, str]] = []
        self._direct = dist.get_backend(group) == "gloo"
        self._pg = (group if group is not None else dist.group.WORLD) if self._direct else None

    def _global(self, peer: int) -> int:
        if self._group is None:
            return peer
        return dist.get_global_rank(self._group, peer)

    def send(self, tensor: torch.Tensor, peer: int, tag: int, label: str) -> None:
        self._send_queue.append((tensor, peer, tag, label))

    def recv(self, key: tuple, buffer: torch.Tensor, peer: int, tag: int) -> None:
        self._recv_queue.append((key, buffer, peer, tag))

    def flush(self) -> None:
        """Issue everything queued, sends first; drop sends that have completed."""
        sends, recvs = self._send_queue, self._recv_queue
        if sends or recvs:
            self._send_queue, self._recv_queue = [], []
            pg = self._pg
            if pg is not None:
                for tensor, peer, tag, label in sends:
                    self._sends.append((pg.send([tensor], peer, tag), tensor, label))
                for key, buffer, peer, tag in recvs:
                    self._pending_recv[key] = (pg.recv([buffer], peer, tag), buffer)
            else:
                works = dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend, tensor, self._global(peer), self._group, tag)
                     for tensor, peer, tag, _label in sends]
                    + [dist.P2POp(dist.irecv, buffer, self._global(peer), self._group, tag)
                       for _key, buffer, peer, tag in recvs]
                )
                for work, (tensor, _peer, _tag, label) in zip(works, sends):
                    self._sends.append((work, tensor, label))
                for work, (key, buffer, _peer, _tag) in zip(works[len(sends):], recvs):
                    self._pending_recv[key] = (work, buffer)
        if self._sends and self._sends[0][0].is_completed():
            self._sends = [s for s in self._sends if not s[0].is_completed()]

    def arrived(self, key: tuple) -> bool:
        """Whether the receive of `key` has completed (issues what is queued first)."""
        self.flush()
        return self._pending_recv[key][0].is_completed()

    def wait(self, key: tuple, label: str) -> torch.Tensor:
        self.flush()
        work, buffer = self._pending_recv.pop(key)
        self._wait(work, f"receiving {label}")
        return buffer

    def finish(self) -> None:
        """Wait for every send of the step."""
        self.flush()
        sends, self._sends = self._sends, []
        for work, _tensor, label in sends:
            self._wait(work, f"sending {label}")

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as err:
            if "imed out" in str(err) or "imeout" in str(err):
                raise PeerTimeoutError(
                    f"rank {self._rank} timed out after {self._timeout_s:g} s {what}: the peer rank failed, "
                    "hangs, or runs a different schedule (raise timeout_s if its compute is that slow)"
                ) from None
            raise RuntimeError(f"rank {self._rank}: transfer failed while {what}: {err}") from err
