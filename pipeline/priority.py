"""Priority classes and fair shares between tenants (pure: used alike by the live roles and the simulator).

Two classes, as llm-d's flow control has priority bands and vLLM's `--scheduling-policy priority` has a priority
per request (lower value runs first):
- `interactive` (0, the default): chat and completion requests from the HTTP API;
- `batch` (1): the Batch API's and `rackflow jobs`' requests. Batch work runs in the capacity interactive work
  leaves idle, and yields when interactive work arrives:
  - admission never sheds an interactive request to keep a batch one (pipeline/admission.py counts only the
    interactive queue against an interactive request);
  - a window places interactive requests first, and batch requests only on nodes with a free sequence slot
    (pipeline/batching/window.py): batch work waits in the window, not in an engine's queue;
  - an engine with a scheduler of its own runs interactive sequences first, and preempts a batch sequence to start
    an interactive one when it has no free slot (`yield_mode: preempt`; `hold` only holds batch work back).

Within a class, requests are served in virtual-token-counter order (Sheng et al., "Fairness in Serving Large
Language Models", OSDI '24): each tenant has a counter of the service it received (prompt tokens weighted
`w_in`, generated tokens `w_out`); the next request comes from the waiting tenant with the smallest counter; a
tenant that comes back after waiting nothing is lifted to the smallest counter of the tenants waiting, so idle time
earns no credit. The counter is charged with the output length the gateway expects when a request is placed (the
batchers do not see results; the expectation is the user's own output-length history, pipeline/profiling.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pipeline.errors import RackflowError

INTERACTIVE = 0
BATCH = 1
CLASSES: dict[str, int] = {"interactive": INTERACTIVE, "batch": BATCH}
NAMES: dict[int, str] = {v: k for k, v in CLASSES.items()}
HEADER = "X-Priority"
"""Request header naming the class of one request (`interactive` or `batch`)."""
CLAIM = "priority"
"""JWT claim naming the class of a token's requests (`interactive` or `batch`)."""


class PriorityError(RackflowError, ValueError):
    """A priority class that does not exist; the message lists the ones that do."""


def parse_class(name: str | int | None, where: str = "priority") -> int:
    """The class value of `name` (`interactive`, `batch`, or their values 0 and 1); None: interactive."""
    if name is None or name == "":
        return INTERACTIVE
    if isinstance(name, int) and not isinstance(name, bool) and name in NAMES:
        return name
    if isinstance(name, str) and name.strip().lower() in CLASSES:
        return CLASSES[name.strip().lower()]
    raise PriorityError(f"{where} {name!r} is not a priority class; allowed: {', '.join(CLASSES)}")


def class_name(value: int) -> str:
    return NAMES.get(value, "batch" if value > BATCH else "interactive")


def is_batch(priority: int) -> bool:
    return priority >= BATCH


def class_of(requested: int | None, tenant_default: int | None, token_class: int | None) -> int:
    """The class a request runs in. A token's claim is a ceiling set by whoever issued it: a `batch` token cannot
    ask for `interactive`. A request may always lower itself to `batch`. Otherwise the request's own choice, else
    the tenant's configured class, else interactive."""
    cls = requested if requested is not None else (tenant_default if tenant_default is not None else INTERACTIVE)
    if token_class is not None:
        cls = max(cls, token_class)
    return cls


_T = TypeVar("_T")


@dataclass(slots=True)
class VirtualTokenCounter:
    """Per tenant, the weighted tokens of service it received (VTC)."""

    w_in: float = 1.0
    w_out: float = 2.0
    """Weights of a prompt token and a generated token (the OSDI '24 paper's default ratio: decode costs more)."""
    counters: dict[str, float] = field(default_factory=dict)

    def cost(self, in_tokens: int, out_tokens: int) -> float:
        return self.w_in * in_tokens + self.w_out * out_tokens

    def charge(self, tenant: str, in_tokens: int, out_tokens: int) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + self.cost(in_tokens, out_tokens)

    def lift(self, tenant: str, floor: float) -> None:
        """A tenant back after waiting nothing starts at `floor` (the least counter of those waiting), never below
        what it had: idle time earns no credit."""
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def get(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)


class FairQueue(Generic[_T]):
    """Waiting items per tenant, handed out in VTC order across tenants and in arrival order within one.

    `tenant_of` and `tokens_of` (prompt tokens, expected output tokens) read an item. `pop` charges its tenant.
    """

    def __init__(self, tenant_of: Callable[[_T], str], tokens_of: Callable[[_T], tuple[int, int]],
                 vtc: VirtualTokenCounter | None = None) -> None:
        self.tenant_of = tenant_of
        self.tokens_of = tokens_of
        self.vtc = vtc if vtc is not None else VirtualTokenCounter()
        self._queues: dict[str, deque[_T]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def _floor(self) -> float:
        return min((self.vtc.get(t) for t, q in self._queues.items() if q), default=0.0)

    def push(self, item: _T) -> None:
        t = self.tenant_of(item)
        q = self._queues.get(t)
        if q is None or not q:
            # back after waiting nothing: at the least counter of those waiting (none waiting: the largest any
            # tenant has), never below its own
            self.vtc.lift(t, self._floor() if self._len else max(self.vtc.counters.values(), default=0.0))
            if q is None:
                q = self._queues[t] = deque()
        q.append(item)
        self._len += 1

    def tenants(self) -> list[str]:
        """The tenants with waiting items, least served first."""
        return sorted((t for t, q in self._queues.items() if q), key=lambda t: (self.vtc.get(t), t))

    def pop(self) -> _T:
        """The next item: the oldest of the waiting tenant with the smallest counter; its tenant is charged."""
        best = min((t for t, q in self._queues.items() if q), key=lambda t: (self.vtc.get(t), t))
        item = self._queues[best].popleft()
        self._len -= 1
        i, o = self.tokens_of(item)
        self.vtc.charge(best, i, o)
        return item

    def drain_order(self) -> Iterator[_T]:
        """Every waiting item in the order `pop` would hand them out if each were placed (a dry run: nothing is
        charged or removed)."""
        counters = {t: self.vtc.get(t) for t, q in self._queues.items() if q}
        heads = {t: 0 for t in counters}
        heap = [(c, t) for t, c in counters.items()]
        heapq.heapify(heap)
        while heap:
            c, t = heapq.heappop(heap)
            q = self._queues[t]
            k = heads[t]
            item = q[k]
            yield item
            heads[t] = k + 1
            if k + 1 < len(q):
                i, o = self.tokens_of(item)
                heapq.heappush(heap, (c + self.vtc.cost(i, o), t))

    def remove(self, items: Iterable[_T]) -> None:
        """Take placed items out (found by identity) without charging: `drain_order` + `remove` + `charge` is
        `pop` for many at once."""
        by_tenant: dict[str, set[int]] = {}
        for it in items:
            by_tenant.setdefault(self.tenant_of(it), set()).add(id(it))
        for t, ids in by_tenant.items():
            q = self._queues.get(t)
            if not q:
                continue
            kept = deque(x for x in q if id(x) not in ids)
            self._len -= len(q) - len(kept)
            self._queues[t] = kept

    def items(self) -> list[_T]:
        return [x for q in self._queues.values() for x in q]
