"""CPU: bad inputs get errors that name the values (split sizes, devices, dtypes, shapes)."""

import pytest
import torch

from te_offload_ops.fused.split_check import CHECK_ENV, check_mode, check_now, problem
from te_offload_ops.ops.input_checks import check_input, check_scales, check_split_sizes

CUDA0 = torch.device("cuda", 0)  # a device object needs no GPU


def test_input_on_another_device_names_both():
    with pytest.raises(ValueError, match=r"input is on cpu, but the weights are on cuda:0"):
        check_input("fc1", torch.zeros(4, 8), 8, CUDA0)


def test_input_width_must_match_in_features():
    with pytest.raises(ValueError, match=r"shape \(4, 6\).*in_features=8"):
        check_input("fc1", torch.zeros(4, 6), 8, torch.device("cpu"))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        check_input("fc1", [1, 2], 8, torch.device("cpu"))
    check_input("fc1", torch.zeros(2, 3, 8), 8, torch.device("cpu"))  # any leading dims, as TE


@pytest.mark.parametrize("splits, match", [
    (torch.tensor([1.0, 2.0]), "integer dtype.*torch.float32"),
    (torch.tensor([True, False]), "integer dtype.*torch.bool"),
    (torch.tensor([1, 2, 3]), r"one size per group \(2\).*shape \(3,\)"),
    (torch.tensor([[1, 2]]), r"one size per group \(2\)"),
    ([1, 2], "integer torch.Tensor.*got list"),
])
def test_bad_split_sizes_arguments(splits, match):
    with pytest.raises((TypeError, ValueError), match=match):
        check_split_sizes("fc1", splits, 2, torch.device("cpu"))


def test_split_sizes_on_cpu_are_taken_for_a_gpu_op():
    check_split_sizes("fc1", torch.tensor([3, 1], dtype=torch.int32), 2, CUDA0)


def test_probs_must_be_one_per_token():
    x = torch.zeros(6, 8)
    with pytest.raises(ValueError, match=r"probs have 5 values .* for 6 tokens"):
        check_scales("act", torch.zeros(5), x)
    check_scales("act", torch.zeros(6, 1), x)  # any shape with one value per token
    check_scales("act", torch.zeros(2, 3), torch.zeros(2, 3, 8))


@pytest.mark.parametrize("values, tokens, expected", [
    ([3, 0, 5], 8, None),
    ([0, 0], 0, None),
    ([300, 100], 512, "sum to 400, not to the input's 512 tokens (fewer)"),
    ([500, 100], 512, "sum to 600, not to the input's 512 tokens (more)"),
    ([600, -88], 512, "negative sizes at expert 1: -88"),
    ([2**32 + 5, 0], 2**32 + 5, "past 2^31-1 at expert 0: 4294967301"),
])
def test_split_size_verdicts_name_the_values(values, tokens, expected):
    found = problem(values, tokens)
    if expected is None:
        assert found is None
    else:
        assert expected in found and str(values[:2]).replace(" ", "")[1:-1] in found.replace(" ", "")


def test_long_split_lists_are_shortened():
    found = problem(list(range(100)), 5)
    assert "..." in found and "100 experts" in found and "sum to 4950" in found


def test_cpu_split_sizes_are_checked_at_once():
    with pytest.raises(ValueError, match=r"fused MLP: bad split_sizes \[4, 4\] .* sum to 8, not to the input's 9"):
        check_now(torch.tensor([4, 4]), 9, "fused MLP")
    check_now(torch.tensor([4, 5]), 9, "fused MLP")


def test_check_mode_switch(monkeypatch):
    assert check_mode() == "deferred"
    monkeypatch.setenv(CHECK_ENV, "sync")
    assert check_mode() == "sync"
    monkeypatch.setenv(CHECK_ENV, "never")
    with pytest.raises(ValueError, match="deferred.*sync.*off"):
        check_mode()


# ------------------------------------------------------------------------------------------------
# A deferred check's verdict: raised once by a sweep at a later forward, again by its own backward


class _LandedEvent:
    def query(self):
        return True

    def synchronize(self):
        pass


@pytest.fixture
def landed_check(monkeypatch):
    """A check whose copy has landed, built without a GPU (the module's pools swapped for fresh ones)."""
    from collections import defaultdict

    from te_offload_ops.fused import split_check

    monkeypatch.setattr(split_check, "_POOL", defaultdict(list))
    monkeypatch.setattr(split_check, "_EVENTS", defaultdict(list))

    def make(values, tokens):
        c = split_check.SplitSizesCheck.__new__(split_check.SplitSizesCheck)
        c.num_tokens, c.where, c._key, c._error = tokens, "fused op", (len(values), torch.int64), None
        c._host, c._device, c._event = torch.tensor(values), 0, _LandedEvent()
        return c

    return make


def test_a_bad_check_swept_at_a_later_forward_raises_again_in_its_own_backward(landed_check):
    check = landed_check([100, 0, 200, 100], 512)
    with pytest.raises(ValueError, match=r"fused op: bad split_sizes \[100, 0, 200, 100\].*sum to 400"):
        check.resolve(again=False)  # the next forward's sweep: the first verdict raises
    assert check.landed
    check.resolve(again=False)  # another sweep: raised once already
    with pytest.raises(ValueError, match="sum to 400"):
        check.resolve()  # that call's backward must not run on its garbage


def test_a_bad_check_raised_in_backward_is_not_raised_again_by_a_later_forward(landed_check):
    check = landed_check([-1, 513], 512)
    with pytest.raises(ValueError, match="negative sizes at expert 0: -1"):
        check.resolve()
    check.resolve(again=False)  # the next forward's sweep: quiet, the process goes on


def test_a_good_check_never_raises(landed_check):
    check = landed_check([256, 0, 256], 512)
    check.resolve()
    check.resolve()
    check.resolve(again=False)


def test_the_split_sizes_copy_goes_on_the_side_stream_after_the_current_one(monkeypatch):
    """Where the copy runs, without a GPU: on the check's own high-priority stream, which first waits
    for the current stream's work; the current stream waits on nothing."""
    import contextlib
    from collections import defaultdict

    from te_offload_ops.fused import split_check

    log, where = [], ["current"]

    class _Stream:
        def __init__(self, name, priority=0):
            self.name, self.priority = name, priority

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    class _Event:
        def record(self, stream):
            log.append(f"event on {stream.name}")

    current = _Stream("current")
    monkeypatch.setattr(split_check, "_STREAMS", {})
    monkeypatch.setattr(split_check, "_POOL", defaultdict(list, {(3, torch.int64): [torch.zeros(3, dtype=torch.int64)]}))
    monkeypatch.setattr(split_check, "_EVENTS", defaultdict(list))
    monkeypatch.setattr(split_check, "_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: _Stream("side", priority))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Event", _Event)

    @contextlib.contextmanager
    def on(stream):
        where.append(stream.name)
        yield
        where.pop()

    monkeypatch.setattr(torch.cuda, "stream", on)
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: (
        log.append(f"copy on {where[-1]}"), real_copy(self, src))[1])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: log.append(f"sizes kept for {stream.name}"))
    check = split_check.SplitSizesCheck(torch.tensor([1, 2, 3]), 6, "op")
    assert log == ["side waits for current", "copy on side", "event on side", "sizes kept for side"]
    assert split_check.copy_stream(torch.device("cuda", 0)).priority == -1
    assert check._host.tolist() == [1, 2, 3]


def test_the_fused_op_hands_its_kernels_int32_split_sizes_and_checks_them_as_given(monkeypatch):
    import te_offload_ops as teo
    from te_offload_ops.fused import srelu_mlp

    fc1 = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    fc2 = teo.GroupedLinear(3, 8, 16, bias=False, device="cpu")
    op = srelu_mlp.FusedScaledSReLUMLP(fc1=fc1, activation=teo.ScaledSReLU(), fc2=fc2)
    x2d = torch.zeros(8, 16)
    sizes, check = op._device_split_sizes(x2d, torch.tensor([3, 0, 5]))  # on the CPU: checked at once
    assert sizes.dtype == torch.int32 and sizes.tolist() == [3, 0, 5] and check is None
    with pytest.raises(ValueError, match="sum to 7, not to the input's 8 tokens"):
        op._device_split_sizes(x2d, torch.tensor([3, 0, 4]))
    seen = []  # on a device: the deferred check gets the caller's tensor, the kernels an int32 copy
    monkeypatch.setattr(srelu_mlp, "start_check", lambda s, tokens, where: seen.append(s) or "check")
    given = torch.tensor([[3, 0, 5]], device="meta")
    sizes, check = op._device_split_sizes(x2d, given)
    assert seen == [given] and check == "check"
    assert sizes.dtype == torch.int32 and sizes.shape == (3,) and sizes.device.type == "meta"
