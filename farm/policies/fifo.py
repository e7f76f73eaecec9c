"""async-FIFO (docs/scheduling.md): every idle worker at once gets ``min(chunk, remaining)``; no
barrier."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from farm.policies.base import Policy, WorkerId, require_positive


class FifoPolicy(Policy):
    """Fixed-size chunks handed out first come, first served.

    ``chunk`` is the paper's ``c`` (tried: 500, 1000, 2000, 3000).  A worker
    may hold a second chunk while enough remains for every worker (prefetch):
    with fixed sizes this hides the round trip and changes nothing else.
    """

    name = "fifo"
    prefetch = True

    def __init__(
        self,
        total: int,
        workers: Iterable[WorkerId] = (),
        speeds: Mapping[WorkerId, float] | None = None,
        chunk: int = 500,
    ) -> None:
        require_positive(chunk=chunk)
        super().__init__(total, workers, speeds)
        self.chunk = chunk

    def chunk_size(self, worker: WorkerId) -> int:
        return self.chunk

    def offer_order(self) -> list[WorkerId]:
        """Workers that hold nothing, each of which takes a chunk; then those that hold
        some, only while a chunk for every worker remains (the same for all of them)."""
        order = self.free_in_order()
        size = self.chunk if self.max_chunk is None else min(self.chunk, self.max_chunk)
        if len(self.free) < len(self.idle) and self.remaining >= size * len(self.in_flight):
            order += sorted(
                (w for w in self.idle if w not in self.free), key=lambda w: len(self.in_flight[w])
            )
        return order
