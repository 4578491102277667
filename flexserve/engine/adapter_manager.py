"""Adapter registry and device-slot residency for multi-LoRA serving (bookkeeping only, no torch).

The worker holds `max_loras` device slots; every token of a batch uses at most one of them, so
`max_loras` is also the number of distinct adapters one batch can mix. This manager decides which
adapter sits in which slot:

- A running request pins its adapter's slot (a reference count): a pinned slot is never
  reassigned, so no row of a plan can see its adapter replaced under it.
- A slot whose adapter has no running request stays loaded (a later request needs no copy) until
  another adapter needs room; then the least recently used unpinned slot is reused.
- Unloading an adapter removes its name at once (new requests get "not found"), while requests
  already accepted (waiting or running) finish with it; the adapter and its slot are freed when
  the last of them ends.

Other threads (HTTP handlers listing models) read only `names`, an immutable snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from flexserve.engine.lora_request import LoRARequest


class AdapterNotFoundError(ValueError):
    """No servable adapter has this name (never loaded, unloaded, or failed to load)."""


class AdapterExistsError(ValueError):
    """An adapter with this name is already loaded."""


class NoFreeSlotError(ValueError):
    """Every LoRA slot is pinned by running requests now; a fine-tuning job may retry later."""


class AdapterLoadError(RuntimeError):
    """The worker could not copy an adapter into its slot; the requests using it were ended."""


@dataclass(slots=True, eq=False)
class _Adapter:
    lora_request: LoRARequest  # what the worker loads
    num_requests: int = 0  # unfinished requests using it (waiting or running)
    num_running: int = 0  # running requests: while > 0 its slot is pinned
    slot: int = -1  # device slot holding it; -1: not resident
    last_pinned: int = 0  # tick of the latest pin (orders candidates for draining)
    unloading: bool = False  # its name is gone; freed when num_requests reaches 0


class AdapterManager:
    """Which adapters exist, which device slot each occupies, and which requests use them."""

    def __init__(self, max_loras: int) -> None:
        if type(max_loras) is not int or max_loras <= 0:
            raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}")
        self.max_loras = max_loras
        self._by_name: dict[str, _Adapter] = {}  # servable adapters
        self._by_id: dict[int, _Adapter] = {}  # every live adapter, unloading ones too
        self._slots: list[_Adapter | None] = [None] * max_loras
        self._idle_slots: OrderedDict[int, None] = OrderedDict()  # resident, unpinned; LRU first
        self._users: dict[str, int] = {}  # request id -> adapter id, for unfinished requests
        self._pins: dict[str, int] = {}  # request id -> adapter id, for running requests
        self._freed_ids: list[int] = []  # freed since the last pop_freed_ids()
        self._tick = 0
        self.names: tuple[str, ...] = ()  # servable names; replaced (never mutated) on change
        self.lora_requests: tuple[LoRARequest, ...] = ()  # servable adapters, same snapshot rule

    # ------------------------------------------------------------------------------ registry
    def register(self, lora_request: LoRARequest) -> None:
        """Make an adapter servable under its name; AdapterExistsError if the name is taken."""
        name = lora_request.lora_name
        if name in self._by_name:
            raise AdapterExistsError(f"The lora adapter '{name}' has already been loaded.")
        if lora_request.lora_int_id in self._by_id:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already in use")
        adapter = _Adapter(lora_request)
        self._by_name[name] = adapter
        self._by_id[lora_request.lora_int_id] = adapter
        self._publish()

    def unregister(self, name: str) -> int:
        """Stop serving `name`; returns how many accepted requests still finish with it.

        The adapter is freed now when none use it, else when the last of them ends.
        """
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
        adapter.unloading = True
        self._publish()
        if adapter.num_requests == 0:
            self._free(adapter)
        return adapter.num_requests

    def mark_failed(self, lora_int_id: int) -> None:
        """Stop serving an adapter the worker could not load, and forget its slot contents."""
        adapter = self._by_id.get(lora_int_id)
        if adapter is None:
            return
        name = adapter.lora_request.lora_name
        if self._by_name.get(name) is adapter:
            del self._by_name[name]
            self._publish()
        adapter.unloading = True
        if adapter.num_requests == 0:
            self._free(adapter)

    def lookup(self, name: str) -> LoRARequest:
        """The servable adapter called `name`; AdapterNotFoundError otherwise."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
        return adapter.lora_request

    def get(self, lora_int_id: int) -> LoRARequest | None:
        """A live adapter by id (servable or still draining), or None."""
        adapter = self._by_id.get(lora_int_id)
        return None if adapter is None else adapter.lora_request

    def pop_freed_ids(self) -> list[int]:
        """Ids of adapters freed since the last call (the worker may drop their host copies)."""
        freed, self._freed_ids = self._freed_ids, []
        return freed

    # ------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, lora_int_id: int) -> None:
        """An accepted request uses this adapter until `finish_request`."""
        if request_id in self._users:
            raise ValueError(f"request {request_id!r} already uses an adapter")
        adapter = self._by_id.get(lora_int_id)
        if adapter is None or adapter.unloading:
            raise AdapterNotFoundError(f"adapter id {lora_int_id} is not being served")
        adapter.num_requests += 1
        self._users[request_id] = lora_int_id

    def finish_request(self, request_id: str) -> None:
        """The request ended: unpin its slot and drop its use (a no-op for unknown ids)."""
        self.unpin(request_id)
        lora_int_id = self._users.pop(request_id, None)
        if lora_int_id is None:
            return
        adapter = self._by_id[lora_int_id]
        adapter.num_requests -= 1
        if adapter.unloading and adapter.num_requests == 0:
            self._free(adapter)

    # ------------------------------------------------------------------------------ slots
    def slot_of(self, lora_int_id: int) -> int:
        """The adapter's device slot, -1 when not resident."""
        adapter = self._by_id.get(lora_int_id)
        return -1 if adapter is None else adapter.slot

    def can_pin(self, lora_int_id: int) -> bool:
        """Whether `pin` would succeed: resident already, or a slot is empty or unpinned."""
        adapter = self._by_id[lora_int_id]
        return adapter.slot >= 0 or None in self._slots or bool(self._idle_slots)

    def pin(self, request_id: str, lora_int_id: int) -> tuple[int, bool]:
        """Pin the adapter's slot for a request being admitted; returns (slot, needs_load).

        A non-resident adapter takes an empty slot, else the least recently used unpinned one
        (whose adapter stays registered and is simply loaded again when next needed).
        """
        if request_id in self._pins:
            raise ValueError(f"request {request_id!r} already pins a slot")
        adapter = self._by_id[lora_int_id]
        needs_load = False
        if adapter.slot < 0:
            if None in self._slots:
                slot = self._slots.index(None)
            elif self._idle_slots:
                slot, _ = self._idle_slots.popitem(last=False)
                evicted = self._slots[slot]
                assert evicted is not None
                evicted.slot = -1
            else:
                raise RuntimeError("no device slot is free; call can_pin() first")
            self._slots[slot] = adapter
            adapter.slot = slot
            needs_load = True
        if adapter.num_running == 0:
            self._idle_slots.pop(adapter.slot, None)
        adapter.num_running += 1
        self._tick += 1
        adapter.last_pinned = self._tick
        self._pins[request_id] = lora_int_id
        return adapter.slot, needs_load

    def unpin(self, request_id: str) -> None:
        """The request stopped running (finished or preempted); a no-op when it pins nothing."""
        lora_int_id = self._pins.pop(request_id, None)
        if lora_int_id is None:
            return
        adapter = self._by_id[lora_int_id]
        adapter.num_running -= 1
        if adapter.num_running == 0 and adapter.slot >= 0:
            self._idle_slots[adapter.slot] = None  # most recently used end

    def drain_candidate(self, exclude: set[int]) -> int | None:
        """The pinned adapter to stop admitting for, so its slot frees up for a blocked one.

        Fewest running requests first (it drains soonest), then the one pinned longest ago.
        """
        best: _Adapter | None = None
        for adapter in self._slots:
            if adapter is None or adapter.num_running == 0:
                continue
            if adapter.lora_request.lora_int_id in exclude:
                continue
            if best is None or (adapter.num_running, adapter.last_pinned) < (
                best.num_running, best.last_pinned
            ):
                best = adapter
        return None if best is None else best.lora_request.lora_int_id

    # ------------------------------------------------------------------------------ jobs
    def reserve_slot(self, owner: str, lora_request: LoRARequest) -> int | None:
        """Pin a device slot for a fine-tuning job's adapter (id and name from `lora_request`,
        never servable by name) until `release_slot(owner)`; None when every slot is pinned.
        The caller fills the slot itself: nothing is loaded from a path."""
        if lora_request.lora_int_id in self._by_id:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already in use")
        adapter = _Adapter(lora_request, unloading=True)  # unloading: not servable, freed at 0
        self._by_id[lora_request.lora_int_id] = adapter
        if not self.can_pin(lora_request.lora_int_id):
            del self._by_id[lora_request.lora_int_id]
            return None
        adapter.num_requests += 1
        self._users[owner] = lora_request.lora_int_id
        slot, _ = self.pin(owner, lora_request.lora_int_id)
        return slot

    def release_slot(self, owner: str) -> None:
        """The job ended: its slot becomes free (a no-op for an unknown owner)."""
        self.finish_request(owner)

    # ------------------------------------------------------------------------------ stats
    @property
    def num_resident(self) -> int:
        """Adapters loaded in device slots (pinned or not)."""
        return sum(adapter is not None for adapter in self._slots)

    def users_of_path(self, lora_path: str) -> tuple[int, set[str]]:
        """(unfinished requests, servable names) of the live adapters loaded from `lora_path`,
        draining ones included: whether its directory may be deleted."""
        num_requests, names = 0, set()
        for adapter in self._by_id.values():
            if adapter.lora_request.lora_path == lora_path:
                num_requests += adapter.num_requests
                if not adapter.unloading:
                    names.add(adapter.lora_request.lora_name)
        return num_requests, names

    def num_running_by_name(self) -> dict[str, int]:
        """Running requests per adapter name, every servable name included (0 when idle)."""
        counts = {name: 0 for name in self._by_name}
        for adapter in self._by_id.values():
            if adapter.num_running:
                name = adapter.lora_request.lora_name
                counts[name] = counts.get(name, 0) + adapter.num_running
        return counts

    def check_invariants(self) -> None:
        """Raise AssertionError unless slots, pins and counts agree (tests)."""
        for slot, adapter in enumerate(self._slots):
            if adapter is not None:
                assert adapter.slot == slot, (slot, adapter)
                assert self._by_id.get(adapter.lora_request.lora_int_id) is adapter
                assert (slot in self._idle_slots) == (adapter.num_running == 0), slot
        assert all(self._slots[s] is not None for s in self._idle_slots)
        for adapter in self._by_id.values():
            lora_int_id = adapter.lora_request.lora_int_id
            assert adapter.num_running == sum(v == lora_int_id for v in self._pins.values())
            assert adapter.num_requests == sum(v == lora_int_id for v in self._users.values())
            assert adapter.num_running <= adapter.num_requests
            assert adapter.unloading or self._by_name[adapter.lora_request.lora_name] is adapter
            assert not (adapter.unloading and adapter.num_requests == 0), "not freed"
        assert set(self._pins) <= set(self._users)

    # ------------------------------------------------------------------------------ internals
    def _free(self, adapter: _Adapter) -> None:
        del self._by_id[adapter.lora_request.lora_int_id]
        if adapter.slot >= 0:
            self._slots[adapter.slot] = None
            self._idle_slots.pop(adapter.slot, None)
            adapter.slot = -1
        self._freed_ids.append(adapter.lora_request.lora_int_id)

    def _publish(self) -> None:
        adapters = list(self._by_name.values())
        self.lora_requests = tuple(a.lora_request for a in adapters)
        self.names = tuple(a.lora_request.lora_name for a in adapters)
