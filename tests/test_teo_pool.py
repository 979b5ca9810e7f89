"""CPU: teo's pinned host buffers by size class, reused from step to step."""

import pytest
import torch

from te_offload_ops.engines.teo.pool import allocation_class, class_bytes, size_class
from teo_fakes import fake_pool


def test_size_classes_cover_and_waste_little():
    for n in (1, 65536, 65537, 262144, 300_000, 10**6, 123_456_789):
        size = class_bytes(size_class(n))
        assert size >= n and size % 512 == 0
        if n > 65536:
            assert size <= n * 1.095 + 512
            assert class_bytes(size_class(n) - 1) < n  # the smallest class that fits


def test_pool_reuses_buffers_across_steps():
    pool, made = fake_pool()
    sizes = [3 << 20, 1 << 20, 1 << 20, 5 << 20]
    for step in range(3):
        # per-expert slices change a little with routing from step to step
        bufs = [pool.acquire(n + step * 4096) for n in sizes]
        assert all(b.tensor.numel() >= n + step * 4096 for b, n in zip(bufs, sizes))
        assert pool.in_use == 4
        for b in bufs:
            pool.release(b, ready=f"event{step}")
        assert pool.in_use == 0
    assert pool.allocations == len(made) == 4  # only the first step allocated
    assert pool.allocated_bytes == sum(made) == pool.free_bytes
    again = pool.acquire(1 << 20)
    assert again.ready == "event2"  # the next user waits for the last GPU use


def test_pool_prefers_a_buffer_near_the_size_then_a_larger_free_one_to_pinning_anew():
    pool, made = fake_pool()
    big = pool.acquire(8 << 20)
    near = pool.acquire(1 << 20)
    pool.release(big, None)
    pool.release(near, None)
    small = pool.acquire(1 << 20)  # a buffer near its size is free: taken, the large one left
    assert small is near and pool.allocations == 2 and pool.oversized_reuses == 0
    # nothing near its size free: the free 16 MiB buffer (at most 16x the request) rather than new memory
    second = pool.acquire(1 << 20)
    assert second is big and pool.allocations == 2 and pool.oversized_reuses == 1
    pool.release(second, None)
    tiny = pool.acquire(512 << 10)  # 32x smaller than the free buffer: pinned anew
    assert tiny is not big and pool.allocations == 3
    a, b = pool.acquire(8 << 20), pool.acquire(8 << 20)  # never one buffer to two holders
    assert a is big and b is not a and pool.allocations == 4


def test_pool_clear_drops_free_buffers_only():
    pool, _ = fake_pool()
    held, free = pool.acquire(1 << 20), pool.acquire(1 << 20)
    pool.release(free, None)
    pool.clear()
    assert pool.free_bytes == 0
    pool.release(held, None)
    assert pool.free_bytes == held.tensor.numel()


def test_new_buffers_are_powers_of_two_with_room_to_grow():
    pool, made = fake_pool()
    # what a rank receives under expert parallelism changes from step to step by tens of percent
    first = pool.acquire(100 << 20)
    size = first.tensor.numel()
    assert size & (size - 1) == 0 and size >= 1.29 * (100 << 20)  # torch pins a power of two anyway
    pool.release(first, None)
    for n in (100 << 20, 129 << 20, 80 << 20, 125 << 20, 100 << 20):  # same, +29%, -20%, ...
        buf = pool.acquire(n)
        assert buf is first
        pool.release(buf, None)
    assert pool.allocations == 1
    for n in (1, 65536, 70_000, 1 << 20, 100 << 20, 123_456_789):
        k = size_class(n)
        got = class_bytes(allocation_class(k))
        assert got >= 1.29 * n and got & (got - 1) == 0 and (got <= 2.6 * n or n <= 65536)
        again = pool.acquire(n)
        pool.release(again, None)
        before = pool.allocations
        grown = pool.acquire(int(n * 1.29) + 1)  # grown by 29%: the buffer it had still serves it
        pool.release(grown, None)
        assert grown is again and pool.allocations == before


def test_pool_remembers_each_allocation_with_what_it_held_then():
    pool, made = fake_pool()
    first = pool.acquire(3 << 20)
    pool.release(first, None)
    pool.acquire(3 << 20)  # reused: not an allocation
    pool.acquire(3 << 20)  # a second at once: allocated, with nothing free
    assert pool.allocations == 2 and len(pool.recent_allocations) == 2
    a = pool.recent_allocations[-1]
    assert (a["requested"], a["allocated"], a["in_use"], a["free"], a["largest_free"]) == \
        (3 << 20, made[-1], 1, 0, 0)
    assert a["seconds"] >= 0 and pool.allocation_seconds >= a["seconds"]
    big = pool.acquire(64 << 20)
    pool.release(big, None)
    pool.acquire(1 << 20)  # the free one is far larger (128x): not taken, and the record says so
    assert pool.recent_allocations[-1]["free"] == 1 and pool.recent_allocations[-1]["largest_free"] == made[-2]


def test_the_oversized_buffer_taken_is_the_smallest_that_holds_the_request():
    pool, made = fake_pool()
    bufs = [pool.acquire(n) for n in (12 << 20, 24 << 20, 700 << 10)]  # 16 MiB, 32 MiB and 1 MiB pinned
    assert sorted(b.tensor.numel() for b in bufs) == [1 << 20, 16 << 20, 32 << 20]
    for b in bufs:
        pool.release(b, None)
    got = pool.acquire(2 << 20)  # nothing near 2 MiB free; 1 MiB is too small, 16 MiB the smallest that holds it
    assert got.tensor.numel() == 16 << 20 and pool.allocations == 3 and pool.oversized_reuses == 1


class _FakeDriver:
    """cuMemHostAlloc / cuMemFreeHost over host memory ctypes owns, recording the calls."""

    def __init__(self, rc=0):
        self.rc, self.blocks, self.freed, self.flags = rc, {}, [], []

    def cuMemHostAlloc(self, pptr, nbytes, flags):
        import ctypes

        self.flags.append(flags.value)
        if self.rc:
            return self.rc
        block = ctypes.create_string_buffer(nbytes.value)
        self.blocks[ctypes.addressof(block)] = block
        ctypes.cast(pptr, ctypes.POINTER(ctypes.c_void_p))[0] = ctypes.addressof(block)
        return 0

    def cuMemFreeHost(self, ptr):
        self.freed.append(ptr.value)
        return 0

    def cuCtxGetCurrent(self, pctx):
        import ctypes

        ctypes.cast(pctx, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0
        return 0

    def cuCtxPushCurrent(self, ctx):
        self.pushed = getattr(self, "pushed", []) + [ctx.value]
        return 0

    def cuCtxPopCurrent(self, pctx):
        self.popped = getattr(self, "popped", 0) + 1
        return 0


def test_write_combined_memory_is_freed_with_its_last_view_and_failures_say_so(monkeypatch):
    import gc

    from te_offload_ops.engines.teo import pool as pool_mod

    driver = _FakeDriver()
    monkeypatch.setattr(pool_mod, "_driver", lambda: driver)
    monkeypatch.setattr(pool_mod, "_is_pinned", lambda t: True)
    t = pool_mod.write_combined_bytes(4096)
    assert t.dtype == torch.uint8 and t.numel() == 4096
    assert driver.flags == [pool_mod._CU_MEMHOSTALLOC_PORTABLE | pool_mod._CU_MEMHOSTALLOC_WRITECOMBINED]
    t[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    address = t.data_ptr()
    assert address in driver.blocks and driver.blocks[address].raw[:3] == b"\x01\x02\x03"
    view = t[1:10]
    del t
    gc.collect()
    assert driver.freed == []  # a view still reads it
    del view
    gc.collect()
    assert driver.freed == [address]
    assert driver.pushed == [0xC0] and driver.popped == 1  # freed in the context it was made in

    monkeypatch.setattr(pool_mod, "_driver", lambda: _FakeDriver(rc=2))
    with pytest.raises(RuntimeError, match="cuMemHostAlloc of 4096 write-combined bytes failed \\(CUresult 2\\)"):
        pool_mod.write_combined_bytes(4096)
    for rc in (3, 201):
        monkeypatch.setattr(pool_mod, "_driver", lambda rc=rc: _FakeDriver(rc=rc))
        with pytest.raises(RuntimeError, match="no CUDA context current on this thread"):
            pool_mod.write_combined_bytes(4096)
    driver = _FakeDriver()
    monkeypatch.setattr(pool_mod, "_driver", lambda: driver)
    monkeypatch.setattr(pool_mod, "_is_pinned", lambda t: False)
    with pytest.raises(RuntimeError, match="not seen as pinned memory"):
        pool_mod.write_combined_bytes(4096)
    gc.collect()
    assert len(driver.freed) == 1  # the refused buffer went back


def test_the_default_pools_host_memory_comes_from_the_environment(monkeypatch):
    from te_offload_ops.engines.teo import pool as pool_mod

    monkeypatch.setattr(pool_mod, "_DEFAULT_POOL", None)
    monkeypatch.setenv(pool_mod.HOST_MEMORY_ENV, "write-combined")
    assert pool_mod.default_pool()._allocate is pool_mod.write_combined_bytes
    monkeypatch.setattr(pool_mod, "_DEFAULT_POOL", None)
    monkeypatch.delenv(pool_mod.HOST_MEMORY_ENV)
    assert pool_mod.default_pool()._allocate is pool_mod._pinned_bytes
    made = []
    monkeypatch.setitem(pool_mod._HOST_MEMORY, "pinned", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    assert pool_mod.host_bytes(1000).numel() == 1000 and made == [1000]  # host_bytes takes the same memory
    monkeypatch.setattr(pool_mod, "_DEFAULT_POOL", None)
    monkeypatch.setenv(pool_mod.HOST_MEMORY_ENV, "uncached")
    with pytest.raises(ValueError, match="TEO_HOST_MEMORY must be one of .*'write-combined'.*, got 'uncached'"):
        pool_mod.default_pool()


def test_clearing_the_pool_waits_for_each_free_buffers_last_copy():
    class Event:
        def __init__(self):
            self.waited = 0

        def synchronize(self):
            self.waited += 1

    pool, _ = fake_pool()
    bufs = [pool.acquire(1 << 20), pool.acquire(3 << 20)]
    events = [Event(), None]
    for b, e in zip(bufs, events):
        pool.release(b, ready=e)
    pool.clear()
    assert events[0].waited == 1 and pool.free_bytes == 0
