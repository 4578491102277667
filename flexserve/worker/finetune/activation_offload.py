"""Layers of a fine-tuning sequence's activation store kept in host memory (pinned), not on the GPU.

An activation budget (`flexserve.peft.activation_budget`) may put some layers here instead of
recomputing them. Those layers' buffers live in pinned host memory; the device holds a ring of
`num_slots` slots, each one layer's buffers, through which every copy goes:

- forward: a window's rows of an offloaded layer are written into the layer's slot (the copy the
  store makes for every layer anyway), and a side stream copies them to the host buffers while
  the forward goes on. A slot is reused by a later offloaded layer only after its last
  device-to-host copy is done (the compute stream waits on an event, so at most `num_slots`
  layers are in flight and the forward never outruns the copies by more);
- backward: a layer's rows come back into a free slot (`prepare`) on the side stream, while the
  layers above it run their backward: every free slot is filled with the next offloaded layers
  below the one whose backward starts. The compute stream waits for a layer's copy before its
  first backward window; `release` hands its slot back after its last.

The copies read and write only memory that the ring and the host buffers own (never the
forward's own tensors, which later kernels may overwrite in place), and every slot is marked as
used by the side stream (`record_stream`), so the caching allocator does not hand it out while
a copy may still touch it. Nothing changes a value: a layer read through a slot holds exactly
the rows that were written. Without CUDA (the CPU reference) the host buffers are ordinary
tensors and the copies are synchronous: the same bookkeeping, testable on the CPU.
"""

from __future__ import annotations

import torch

from flexserve.peft.activation_budget import NUM_SLOTS


class HostOffload:
    """The offloaded layers of one `ActivationStore`: host buffers and the device ring.

    `layout` is the (name, row width, dtype) of one offloaded layer's buffers (every offloaded
    layer has the same), `layers` the offloaded layers; buffers hold `max_len` rows, the host
    ones max(`host_rows`, max_len): a job passes its longest sequence's length, so that every
    sequence asks torch's caching host allocator for the same sizes and reuses the pinned blocks
    of the ones before (a new size is a new cudaHostAlloc, ~0.4 s per GiB on the H200, on the
    engine thread).
    """

    def __init__(self, layout: list[tuple[str, int, torch.dtype]], layers: tuple[int, ...],
                 max_len: int, device: torch.device, num_slots: int = NUM_SLOTS,
                 host_rows: int | None = None) -> None:
        if not layers or num_slots < 1:
            raise ValueError(f"an offload needs layers ({layers}) and slots ({num_slots})")
        self.layers = tuple(sorted(layers))
        self.device = device
        self._cuda = device.type == "cuda"
        rows = max(max_len, host_rows or 0)
        self.host = {(layer, name): torch.empty((rows, width), dtype=dtype,
                                                pin_memory=self._cuda)
                     for layer in self.layers for name, width, dtype in layout}
        self.slots = [{name: torch.empty((max_len, width), dtype=dtype, device=device)
                       for name, width, dtype in layout} for _ in range(num_slots)]
        self.slot_bytes = sum(b.nbytes for b in self.slots[0].values())
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        # What each slot holds: a layer's forward rows on their way out, or its rows for the
        # backward; None when free. `_done[i]`: the side stream's last copy through slot i.
        self._slot_layer: list[int | None] = [None] * num_slots
        self._done: list[torch.cuda.Event | None] = [None] * num_slots
        self._released: list[torch.cuda.Event | None] = [None] * num_slots
        self._loaded: dict[int, int] = {}  # layer -> slot, for the backward
        self._freed: set[int] = set()
        self._index = {layer: i for i, layer in enumerate(self.layers)}

    def __contains__(self, layer: int) -> bool:
        return layer in self._index

    @property
    def done(self) -> bool:
        """Whether every offloaded layer has been released."""
        return len(self._freed) == len(self.layers)

    @property
    def host_bytes_left(self) -> int:
        """Host bytes of the layers not released yet."""
        return sum(b.nbytes for b in self.host.values())

    # ---------------------------------------------------------------------------- forward
    def write(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        """Copy rows [n, width] of `layer`'s `name` to positions [start, start + n) on the host,
        through the layer's slot."""
        slot = self._index[layer] % len(self.slots)
        if self._slot_layer[slot] != layer:
            # The slot's last copies (another layer's rows) must be out before it is reused.
            self._wait(self._done[slot])
            self._slot_layer[slot] = layer
        n = rows.shape[0]
        staged = self.slots[slot][name][start:start + n]
        staged.copy_(rows)
        self._copy(self.host[(layer, name)][start:start + n], staged, slot,
                   self.slots[slot][name])

    # --------------------------------------------------------------------------- backward
    def prepare(self, layer: int, num_rows: int) -> None:
        """Before `layer`'s first backward window (layers go from the top down): start copying
        the next offloaded layers at or below it into the free slots, and, if `layer` is
        offloaded, make the compute stream wait for its rows."""
        for below in reversed(self.layers):
            if below > layer or below in self._loaded or below in self._freed:
                continue
            # free: empty, or holding forward rows already on their way out
            free = [i for i, held in enumerate(self._slot_layer) if held not in self._loaded]
            if not free:
                break
            self._load(below, free[0], num_rows)
        if layer in self._loaded:
            self._wait(self._done[self._loaded[layer]])

    def read(self, layer: int, name: str) -> torch.Tensor:
        """`layer`'s buffer `name` in its slot (after `prepare(layer)`)."""
        slot = self._loaded.get(layer)
        if slot is None:
            raise RuntimeError(f"offloaded layer {layer} was read before prepare({layer})")
        return self.slots[slot][name]

    def release(self, layer: int) -> None:
        """`layer`'s backward is done: its slot is free once the compute stream has read it, and
        its host buffers go."""
        slot = self._loaded.pop(layer, None)
        if slot is not None:
            self._slot_layer[slot] = None
            if self._cuda:
                self._released[slot] = torch.cuda.Event()
                self._released[slot].record(torch.cuda.current_stream(self.device))
        self._freed.add(layer)  # a layer is released once: its backward is over
        for key in [key for key in self.host if key[0] == layer]:
            del self.host[key]

    # ------------------------------------------------------------------------------ copies
    def _load(self, layer: int, slot: int, num_rows: int) -> None:
        if self._cuda and self._released[slot] is not None:
            # The compute stream's reads of the slot's previous layer come first.
            self._stream.wait_event(self._released[slot])
        for name, buf in self.slots[slot].items():
            self._copy(buf[:num_rows], self.host[(layer, name)][:num_rows], slot, buf)
        self._slot_layer[slot] = layer
        self._loaded[layer] = slot

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, slot: int,
              slot_buffer: torch.Tensor) -> None:
        """dst <- src on the side stream after the compute stream's work so far; records the
        slot's `_done` event and marks `slot_buffer` (dst's or src's) as in use by the side
        stream. Synchronous without CUDA."""
        if not self._cuda:
            dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        slot_buffer.record_stream(self._stream)
        self._done[slot] = done

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if self._cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
