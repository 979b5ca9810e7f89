"""Checking split sizes that live on the GPU without a host sync on every call.

The fused path never reads ``split_sizes`` on the host while it launches its kernels (that is
what lets the host run ahead and, later, CUDA graphs capture it). Bad split sizes (negative, not
summing to the token count, too large for int32) are still caught:

* forward queues a copy of the split sizes into pinned host memory and records an event: a few
  microseconds of host time and a copy of E integers, no wait. The copy runs on a side stream
  (after the work that made the sizes): a device-to-host copy on the compute stream would queue
  behind whatever copy to the host is in flight, such as an offload engine's copy of the previous
  layer's activations (hundreds of MiB), and stall the compute stream until it ends (measured on
  an H100: 14 ms per step of the MoE step at MLP 4 of 8 offloaded, 20-40 ms with 64 experts);
* the check is *resolved* when the fused op's backward starts if the copy has landed by then
  (the usual case in a model of several layers), before any of its backward kernels; if not,
  at the end of that backward pass (an autograd final callback), where the host waits for that
  copy only if it is still in flight. So a bad step raises by the time its ``backward()``
  returns, without making the host wait in the middle of the step. Every call's check is also
  resolved at the op's next forward once its copy has landed: calls without grad, and calls
  whose backward never runs (or runs later: pipeline schedules run several forwards first), so a
  bad call raises at the latest at the op's next call or its own backward. A bad verdict raises
  again at that call's backward if the next forward raised first (its grads would be garbage),
  not again at a later forward.
* a bad result raises ``ValueError`` naming the values, the token count and what is wrong.

Until then the kernels treat the sizes defensively (negative counts as 0, counts clamped so
that no expert reaches past the last token), so nothing reads or writes out of bounds; the
forward output of a bad call is not meaningful, and its backward raises.

``TEO_CHECK_SPLIT_SIZES``: ``deferred`` (default), ``sync`` (resolve in forward: a host sync,
for debugging), ``off``. Split sizes on the CPU are checked at once (no sync needed). Under CUDA
graph capture nothing is queued (a captured copy would not say which replay it came from), so
replays of a graph do not check split sizes: the kernels' clamping keeps them in bounds.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Optional

import torch

from ..capture import capturing

CHECK_ENV = "TEO_CHECK_SPLIT_SIZES"
CHECK_MODES = ("deferred", "sync", "off")
_INT32_MAX = 2**31 - 1
_SHOWN = 16  # split sizes printed in an error

# pinned host buffers and events, reused: allocating them costs more host time than the check
_POOL: dict = defaultdict(list)
_EVENTS: dict = defaultdict(list)  # device index -> free events (an event records on one device only)
_STREAMS: dict = {}  # device index -> the side stream the copies run on


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that copies split sizes of ``device`` to the host (one per device)."""
    index = _index(device)
    if index not in _STREAMS:
        # high priority: a stream of its own pool, never one of the default-priority pool streams an
        # offload engine copies on (torch hands those out round-robin), where it would queue again
        _STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _STREAMS[index]


def check_mode() -> str:
    mode = os.environ.get(CHECK_ENV, "deferred") or "deferred"
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV} must be one of {CHECK_MODES}, got {mode!r}")
    return mode


def _shown(values: list[int]) -> str:
    head = ", ".join(map(str, values[:_SHOWN]))
    return f"[{head}{', ...' if len(values) > _SHOWN else ''}]"


def problem(values: list[int], num_tokens: int) -> Optional[str]:
    """What is wrong with these split sizes for ``num_tokens`` tokens, or None."""
    issues = []
    negative = [(i, v) for i, v in enumerate(values) if v < 0]
    if negative:
        issues.append("negative sizes at " + ", ".join(f"expert {i}: {v}" for i, v in negative[:_SHOWN]))
    huge = [(i, v) for i, v in enumerate(values) if v > _INT32_MAX]
    if huge:
        issues.append("sizes past 2^31-1 at " + ", ".join(f"expert {i}: {v}" for i, v in huge[:_SHOWN]))
    total = sum(values)
    if total != num_tokens:
        issues.append(f"they sum to {total}, not to the input's {num_tokens} tokens"
                      f" ({'fewer' if total < num_tokens else 'more'})")
    if not issues:
        return None
    return f"bad split_sizes {_shown(values)} for {len(values)} experts: " + "; ".join(issues)


class SplitSizesCheck:
    """One call's split sizes on their way to the host, and the verdict once they are there."""

    def __init__(self, split_sizes: torch.Tensor, num_tokens: int, where: str):
        self.num_tokens, self.where = num_tokens, where
        key = (split_sizes.numel(), split_sizes.dtype)
        self._key = key
        self._error: Optional[str] = None  # the verdict, once resolved bad
        self._host = _POOL[key].pop() if _POOL[key] else torch.empty(key[0], dtype=key[1], pin_memory=True)
        self._device = _index(split_sizes.device)
        self._event = _EVENTS[self._device].pop() if _EVENTS[self._device] else torch.cuda.Event()
        side = copy_stream(split_sizes.device)
        side.wait_stream(torch.cuda.current_stream(split_sizes.device))  # after the kernels that made them
        with torch.cuda.stream(side):
            self._host.copy_(split_sizes.reshape(-1), non_blocking=True)
            self._event.record(side)
        # the caller may free the sizes at once: their block is not reused before the copy has read it
        # (the whole block, where the sizes are a view of a larger buffer: held until the host sees
        # this small copy done, which can be a while behind an offload engine's copies)
        split_sizes.record_stream(side)

    @property
    def landed(self) -> bool:
        """The copy is on the host (or the check was resolved already)."""
        return self._host is None or self._event.query()

    def resolve(self, again: bool = True) -> None:
        """Wait for the copy if needed, release the buffers, raise ValueError if the sizes are bad.
        Resolved already: a bad verdict raises again if ``again`` (the call's backward), not for a
        sweep of earlier calls at a later forward (``again=False``)."""
        if self._host is None:
            if again and self._error is not None:
                raise ValueError(self._error)
            return
        self._event.synchronize()
        values = self._host.tolist()
        _POOL[self._key].append(self._host)
        _EVENTS[self._device].append(self._event)
        self._host = self._event = None
        found = problem(values, self.num_tokens)
        if found is not None:
            self._error = f"{self.where}: {found}"
            raise ValueError(self._error)


def resolve_in_backward(check: Optional[SplitSizesCheck]) -> None:
    """In a backward: resolve now if the copy landed, else when this backward pass ends."""
    if check is None:
        return
    if check.landed:
        check.resolve()
    else:
        torch.autograd.Variable._execution_engine.queue_callback(check.resolve)


def check_now(split_sizes: torch.Tensor, num_tokens: int, where: str) -> None:
    """Check split sizes the host can read without waiting for the GPU (CPU tensors)."""
    found = problem(split_sizes.reshape(-1).tolist(), num_tokens)
    if found is not None:
        raise ValueError(f"{where}: {found}")


def start_check(split_sizes: torch.Tensor, num_tokens: int, where: str) -> Optional[SplitSizesCheck]:
    """Begin checking CUDA split sizes per :data:`CHECK_ENV`; returns the pending check, if any."""
    mode = check_mode()
    if mode == "off" or capturing():
        return None
    check = SplitSizesCheck(split_sizes, num_tokens, where)
    if mode == "sync":
        check.resolve()
        return None
    return check
