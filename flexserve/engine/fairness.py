"""Tenant fairness with the Virtual Token Counter (FlexLLM appendix C, algorithm 4); plain Python.

Every tenant i has a virtual counter c_i: the weighted service it has received (prompt tokens
admitted, tokens generated, fine-tuning tokens processed). The scheduler serves the queued tenant
with the smallest counter, so a tenant that has had less service goes first. A tenant that was
idle gets no credit for it: when it joins the queue again its counter is lifted to the smallest
counter among queued tenants (or to the counter of the last tenant that left an empty queue),
never lowered. Lemma 1 then bounds the spread of counters among queued tenants by
U = max(w_p * L_input, max(w_q, w_r) * M), and theorem 1 bounds the difference in weighted
service of two backlogged tenants over any interval by 2U.

Memory stays bounded however many tenants come and go: at most `MAX_IDLE_TENANTS` idle tenants
(no item in the queue) are remembered, the least recently served are forgotten first. A forgotten
tenant that returns is lifted like a new one, to the smallest queued counter; the credit it can
gain is what it was served beyond that counter while it was last active.

This module holds the counters and the queue membership only; the scheduler decides what a work
item is and when it enters or leaves the queue, and charges service as it schedules it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

DEFAULT_TENANT = "default"
MAX_IDLE_TENANTS = 64  # idle tenants remembered before the forgettable ones are dropped


@dataclass(slots=True, frozen=True)
class VTCWeights:
    """Cost of one token of each kind in virtual-counter units (w_p, w_q, w_r of algorithm 4)."""

    prompt: float = 1.0  # w_p: per input (prompt) token admitted
    output: float = 2.0  # w_q: per generated token
    finetune: float = 1.0  # w_r: per fine-tuning token (forward windows; backward: caller decides)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"VTC weight {f.name} must be a finite number > 0, got {value!r}")


def _check_num_tokens(num_tokens: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")


def _check_tenant(tenant: str) -> None:
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")


class VirtualTokenCounter:
    """Per-tenant virtual counters c_i of algorithm 4 and the queue Q they are lifted against.

    `Q` is the set of queued work items (waiting inference requests and fine-tuning jobs with work
    left), each owned by a tenant and named by a key unique across Q. The scheduler enqueues an item
    when it arrives, dequeues it when it leaves (admitted, finished, aborted, job ended), picks the
    tenant to serve with `pick` and charges what it scheduled with the `charge_*` methods.
    """

    def __init__(self, weights: VTCWeights = VTCWeights()) -> None:
        if not isinstance(weights, VTCWeights):
            raise ValueError(f"weights must be a VTCWeights, got {type(weights).__name__}")
        self.weights = weights
        self._counters: dict[str, float] = {}  # c_i; a tenant appears once it is seen
        self._tenant_of_key: dict[str, str] = {}  # key of each item in Q -> its tenant
        # Items in Q per tenant, in the order tenants (re)entered Q; a tenant with none is removed,
        # so the keys are exactly the tenants in Q and iteration order breaks ties in `pick`.
        self._num_queued: dict[str, int] = {}
        self._last_leaver: str | None = None  # l of line 8: the last tenant that left Q

    def enqueue(self, tenant: str, key: str) -> None:
        """A work item of `tenant` enters Q (algorithm 4 lines 5-12), lifting the tenant's counter
        if it had nothing queued. Raises ValueError if `key` is already queued."""
        _check_tenant(tenant)
        if key in self._tenant_of_key:
            raise ValueError(
                f"work item {key!r} is already queued (tenant {self._tenant_of_key[key]!r})"
            )
        counter = self._counters.pop(tenant, 0.0)  # re-inserted last: the newest served
        self._counters[tenant] = counter
        if tenant not in self._num_queued:
            # Counter lifting: a tenant (re)joining Q must not carry credit from its idle time.
            if not self._num_queued:
                if self._last_leaver is not None:
                    counter = max(counter, self._counters[self._last_leaver])
            else:
                counter = max(counter, min(self._counters[t] for t in self._num_queued))
            self._counters[tenant] = counter
            self._num_queued[tenant] = 0
        self._num_queued[tenant] += 1
        self._tenant_of_key[key] = tenant

    def dequeue(self, tenant: str, key: str) -> None:
        """The item leaves Q (admitted, finished, aborted, job ended). An unknown key is a no-op,
        so callers may dequeue on every exit path; a key queued for another tenant is an error."""
        owner = self._tenant_of_key.get(key)
        if owner is None:
            return
        if owner != tenant:
            raise ValueError(f"work item {key!r} is queued for tenant {owner!r}, not {tenant!r}")
        del self._tenant_of_key[key]
        self._num_queued[tenant] -= 1
        if self._num_queued[tenant] == 0:
            del self._num_queued[tenant]
            # Only read when Q is empty, and then the last tenant to leave Q is exactly the owner
            # of the last item dequeued, so recording it here is the same thing.
            self._last_leaver = tenant
            self._forget_idle_tenants()

    def _forget_idle_tenants(self) -> None:
        """Drop the least recently served idle tenants beyond MAX_IDLE_TENANTS (`_counters` is
        kept in the order tenants were last served or queued)."""
        excess = len(self._counters) - len(self._num_queued) - MAX_IDLE_TENANTS
        if excess <= 0:
            return
        for tenant in list(self._counters):
            if excess <= 0:
                break
            if tenant not in self._num_queued and tenant != self._last_leaver:
                del self._counters[tenant]
                excess -= 1

    @property
    def num_tenants(self) -> int:
        """Tenants with a remembered counter (queued, running or recently idle)."""
        return len(self._counters)

    def queued_tenants(self) -> list[str]:
        """Tenants with at least one item in Q, in the order they (re)entered Q."""
        return list(self._num_queued)

    def is_queued(self, key: str) -> bool:
        """Whether the work item `key` is in Q."""
        return key in self._tenant_of_key

    def pick(self, tenants: Iterable[str]) -> str | None:
        """The tenant with the smallest counter among `tenants` (lines 17 and 23); ties go to the
        first in iteration order; None if `tenants` is empty. Unknown tenants count as 0."""
        best: str | None = None
        best_counter = math.inf
        for tenant in tenants:
            counter = self._counters.get(tenant, 0.0)
            if best is None or counter < best_counter:
                best, best_counter = tenant, counter
        return best

    def charge_prompt(self, tenant: str, num_tokens: int) -> None:
        """Charge w_p per prompt token of an admitted request (line 20)."""
        self._charge(tenant, num_tokens, self.weights.prompt)

    def charge_output(self, tenant: str, num_tokens: int) -> None:
        """Charge w_q per generated token (line 30)."""
        self._charge(tenant, num_tokens, self.weights.output)

    def charge_finetune(self, tenant: str, num_tokens: int) -> None:
        """Charge w_r per fine-tuning token processed (line 26)."""
        self._charge(tenant, num_tokens, self.weights.finetune)

    def _charge(self, tenant: str, num_tokens: int, weight: float) -> None:
        _check_tenant(tenant)
        _check_num_tokens(num_tokens)
        # Popped and re-inserted: `_counters` stays in the order tenants were last served.
        self._counters[tenant] = self._counters.pop(tenant, 0.0) + weight * num_tokens

    def counter(self, tenant: str) -> float:
        """c_tenant; 0.0 for a tenant never seen."""
        return self._counters.get(tenant, 0.0)

    @property
    def counters(self) -> dict[str, float]:
        """A copy of every known tenant's counter."""
        return dict(self._counters)

    def fairness_bound(self, max_input_len: int, max_tokens: int) -> float:
        """Lemma 1's U = max(w_p * L_input, max(w_q, w_r) * M): the largest spread of counters among
        queued tenants. `max_input_len` is L_input, the longest prompt; `max_tokens` is M, the most
        tokens a running batch holds (what a tenant can still be charged after its last pick)."""
        for name, value in (("max_input_len", max_input_len), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        w = self.weights
        return max(w.prompt * max_input_len, max(w.output, w.finetune) * max_tokens)
