"""GPU: teo's allocator_room model against PyTorch's caching allocator under a cap: what it says fits is
served without a release of the cache, what it says does not fit makes the allocator retry."""

import torch

from conftest import requires_gpu
from te_offload_ops.engines.teo.allocator_room import free_blocks, most_room, short_of

MiB = 2**20


def _retries() -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


@requires_gpu
def test_the_model_tells_which_allocations_the_allocator_serves_without_a_retry():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    # holes larger than any free block earlier tests left in segments still in use
    left = max(free_blocks(torch.cuda.memory_snapshot(), torch.cuda.current_stream(device).cuda_stream), default=0)
    hole = max(256 * MiB, -(-(left + 64 * MiB) // (20 * MiB)) * 20 * MiB)
    blocks = []
    try:
        # the cap: what is reserved now plus four holes' worth (whole 20 MiB pages) and 60 MiB to spare
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + 4 * hole + 60 * MiB) / total,
                                                   device)
        blocks = [torch.empty(hole, dtype=torch.uint8, device=device) for _ in range(4)]
        blocks[0] = blocks[2] = None  # two holes, not side by side
        assert short_of([hole - 56 * MiB], device) == []
        before = _retries()
        fits = torch.empty(hole - 56 * MiB, dtype=torch.uint8, device=device)  # into a hole
        assert _retries() == before
        assert short_of([hole + 44 * MiB], device) == [hole + 44 * MiB]  # no hole that large, no room to map
        # the bound teo's budget asks before giving held bytes back for it counts every free block (the
        # other hole and the 56 MiB left of this one) and the room to map: it does not give up on this size
        assert most_room(device) >= hole + 56 * MiB + 59 * MiB  # (the 60 MiB to map, less the fraction's rounding)
        big = torch.empty(hole + 44 * MiB, dtype=torch.uint8, device=device)  # the allocator releases its cache
        assert _retries() == before + 1
        del fits, big
    finally:
        blocks.clear()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


_EXPANDABLE_CHILD = r"""
import json, torch
from te_offload_ops.engines.teo.allocator_room import short_of
MiB = 2**20
dev = torch.device("cuda", 0)
total = torch.cuda.get_device_properties(dev).total_memory
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(dev) + 460 * MiB) / total, dev)
a = torch.empty(200 * MiB, dtype=torch.uint8, device=dev)
b = torch.empty(200 * MiB, dtype=torch.uint8, device=dev)
del b  # the mapped range ends with a 200 MiB free block; the cap leaves 60 MiB to map
asked = {"250": short_of([250 * MiB], dev), "40": short_of([40 * MiB], dev)}
before = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
c = torch.empty(250 * MiB, dtype=torch.uint8, device=dev)
retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) - before
print(json.dumps({"asked": asked, "retries": retries}))
"""


@requires_gpu
def test_under_a_cap_the_free_block_ending_an_expandable_segment_does_not_spare_the_retry():
    """In a process with expandable segments: a 250 MiB allocation fits no free block (200 MiB ends
    the mapped range) nor the 60 MiB the cap leaves to map. The block and 60 MiB of new pages would
    hold it, but the allocator checks the whole size against the cap first: it releases its cache
    and retries. The model says so (short); a 40 MiB allocation it says fits."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", str(torch.cuda.current_device())).split(",")[0]}
    done = subprocess.run([sys.executable, "-c", _EXPANDABLE_CHILD], env=env, capture_output=True, text=True,
                          timeout=180, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"asked": {"250": [250 * MiB], "40": []}, "retries": 1}, got
