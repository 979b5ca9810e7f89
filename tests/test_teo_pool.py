"""CPU: teo's pinned host buffers by size class, reused from step to step."""

from te_offload_ops.engines.teo.pool import class_bytes, size_class
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


def test_pool_does_not_hand_out_much_larger_buffers_or_shared_ones():
    pool, made = fake_pool()
    big = pool.acquire(8 << 20)
    pool.release(big, None)
    small = pool.acquire(1 << 20)  # three octaves smaller: a buffer of its own
    assert small is not big and pool.allocations == 2
    a, b = pool.acquire(8 << 20), pool.acquire(8 << 20)
    assert a is big and b is not a and pool.allocations == 3


def test_pool_clear_drops_free_buffers_only():
    pool, _ = fake_pool()
    held, free = pool.acquire(1 << 20), pool.acquire(1 << 20)
    pool.release(free, None)
    pool.clear()
    assert pool.free_bytes == 0
    pool.release(held, None)
    assert pool.free_bytes == held.tensor.numel()
