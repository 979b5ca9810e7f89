"""CPU: op construction, signature parity with TE, repr, bad offload values, saved-tensor routing."""

import contextlib
import inspect

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.pytorch.ops.op import OperationContext
from transformer_engine.pytorch.tensor import GroupedTensorStorage

import te_offload_ops as teo
from te_offload_ops.policy import KEEP_ATTR

OPS = {
    teo.GroupedLinear: dict(num_groups=3, in_features=16, out_features=8, bias=False, device="cpu"),
    teo.ScaledSReLU: {},
    teo.ScaledTanhSReLU: dict(tanh_clamp_scale=2.0),
    teo.ScaledSwiGLU: {},
    teo.ScaledSiTUGLU: {},
    teo.ScaledClampedQGeGLU: {},
}


@pytest.mark.parametrize("cls", list(OPS), ids=lambda c: c.__name__)
def test_extends_the_te_op_of_the_same_name(cls):
    te_cls = getattr(te.ops, cls.__name__)
    assert issubclass(cls, te_cls) and cls.te_op is te_cls
    op = cls(**OPS[cls])
    assert isinstance(op, te_cls)  # TE's fusions match by isinstance
    assert op.offload is True


@pytest.mark.parametrize("cls", list(OPS), ids=lambda c: c.__name__)
def test_signature_is_te_signature_plus_offload(cls):
    ours = inspect.signature(cls.__init__).parameters
    theirs = inspect.signature(cls.te_op.__init__).parameters
    assert list(ours)[:-1] == list(theirs)
    assert all(ours[n] == theirs[n] for n in theirs)
    off = ours["offload"]
    assert off.kind is inspect.Parameter.KEYWORD_ONLY and off.default is True and off.annotation is bool


def test_te_arguments_pass_through():
    op = teo.GroupedLinear(2, 16, 8, bias=True, device="meta", dtype=torch.float16,
                           accumulate_into_main_grad=True, offload=False)
    assert (op.num_groups, op.in_features, op.out_features, op.use_bias) == (2, 16, 8, True)
    assert op.weight0.dtype == torch.float16 and op.weight0.device.type == "meta"
    assert op._accumulate_into_main_grad and op.offload is False
    act = teo.ScaledClampedQGeGLU(limit=5.0, offload=False)
    assert act._clamped.limit == 5.0 and act.offload is False
    with pytest.raises(TypeError):
        teo.GroupedLinear(2, 16, 8, no_such_arg=1)


@pytest.mark.parametrize("offload", [True, False])
def test_repr_shows_offload(offload):
    op = teo.GroupedLinear(4, 32, 16, bias=False, device="meta", offload=offload)
    text = repr(te.ops.Sequential(op, teo.ScaledSReLU(offload=offload)))
    assert f"GroupedLinear(num_groups=4, in_features=32, out_features=16, bias=False, offload={offload})" in text
    assert f"ScaledSReLU(offload={offload})" in text


@pytest.mark.parametrize("cls", list(OPS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", ["False", 0, 1, None, torch.tensor(True)])
def test_non_bool_offload_raises_naming_the_op_and_builds_nothing(cls, bad, monkeypatch):
    calls = []
    monkeypatch.setattr(cls.te_op, "__init__", lambda self, *a, **k: calls.append(1))
    with pytest.raises(TypeError, match=rf"{cls.__name__}: offload must be a bool"):
        cls(**OPS[cls], offload=bad)
    assert calls == []  # rejected before TE allocated anything


def test_offload_can_be_switched_after_construction_but_only_to_a_bool():
    op = teo.ScaledSReLU()
    op.offload = False
    assert op.offload is False and "offload=False" in repr(op)
    with pytest.raises(TypeError, match="ScaledSReLU: offload must be a bool"):
        op.offload = "no"
    assert op.offload is False


def test_user_subclass_keeps_its_own_constructor():
    class MyLinear(teo.GroupedLinear):
        def __init__(self, width, **kw):
            super().__init__(2, width, width, bias=False, device="meta", **kw)

    op = MyLinear(8, offload=False)
    assert op.in_features == 8 and op.offload is False


# --- what the ops hand to the policy -------------------------------------------------------


def _split_path_saved(op: teo.GroupedLinear, tokens=(3, 0, 5)):
    """TE's split-path layout: [split_sizes, None x4, *input slices, *weights]."""
    x = torch.randn(sum(tokens), op.in_features)
    xs = list(torch.split(x, list(tokens)))
    ws = [getattr(op, f"weight{i}") for i in range(op.num_groups)]
    return [torch.tensor(tokens), None, None, None, None, *xs, *ws], xs, ws


def _grouped_path_saved(op: teo.GroupedLinear):
    """TE's graph-safe layout: [split_sizes, 4 offset tensors, grouped input, *weights]."""
    meta = [torch.zeros(op.num_groups, dtype=torch.int64) for _ in range(5)]
    grouped_x = GroupedTensorStorage(
        shape=(8, op.in_features), dtype=torch.float32, num_tensors=op.num_groups, quantizer=None,
        data=torch.randn(8 * op.in_features), first_dims=torch.tensor([3, 0, 5]),
        tensor_offsets=torch.tensor([0, 3, 3, 8]) * op.in_features,
    )
    # A cast weight workspace (as under autocast) is a plain tensor, not a Parameter.
    ws = [getattr(op, f"weight{i}").detach().to(torch.bfloat16) for i in range(op.num_groups)]
    return [*meta, grouped_x, *ws], [grouped_x], ws


def _run_fuser_forward(op, saved, monkeypatch, input_=None, engine=True):
    """The op's forward with TE's compute stood in; ``engine``: under saved-tensor hooks, as a
    hook engine (teo, Megatron's) runs it, so the policy's marks are made."""
    def te_fuser_forward(self, basic_op_ctxs, input_, **kwargs):  # stands in for TE's compute
        basic_op_ctxs[0].save_for_backward(*saved)
        return input_, [()]

    monkeypatch.setattr(te.ops.GroupedLinear, "fuser_forward", te_fuser_forward)
    ctx = OperationContext()
    x = torch.empty(0, op.in_features) if input_ is None else input_
    splits = torch.zeros(op.num_groups, dtype=torch.int64)  # the op's input checks see one per group
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if engine else contextlib.nullcontext()
    with hooks:
        op.fuser_forward([ctx], x, basic_op_extra_inputs=[(splits,)],
                         prev_op_grad_output_quantizer=None, next_op_input_quantizer=None, basic_op_kwargs=[{}])
    return ctx


@pytest.mark.parametrize("layout", [_split_path_saved, _grouped_path_saved], ids=["split", "grouped"])
@pytest.mark.parametrize("offload", [True, False])
def test_grouped_linear_routes_saved_tensors_through_policy(layout, offload, monkeypatch):
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu", offload=offload)
    saved, acts, ws = layout(op)
    assert list(op.saved_weights(saved)) == ws
    ctx = _run_fuser_forward(op, saved, monkeypatch)
    if layout is _split_path_saved:
        acts = [acts[0]._base]  # the slices' buffer is saved in their place
        assert ctx.teo_input_rows == [3, 0, 5]
    assert list(ctx.to_save) == saved[:5] + acts + ws
    for w in ws:
        assert getattr(w, KEEP_ATTR, False)
    for a in acts:
        targets = [a] if isinstance(a, torch.Tensor) else [t for t in a.get_data_tensors() if t is not None]
        assert all(getattr(t, KEEP_ATTR, False) == (not offload) for t in targets)


def test_split_input_is_saved_as_one_buffer_and_cut_again_in_backward(monkeypatch):
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    x = torch.randn(8, 16)
    xs = list(torch.split(x, [3, 0, 5]))
    ws = [getattr(op, f"weight{i}") for i in range(3)]
    ctx = _run_fuser_forward(op, [torch.tensor([3, 0, 5]), None, None, None, None, *xs, *ws], monkeypatch, x)
    assert ctx.to_save[5] is x  # the layer input itself, not three views of it

    seen = {}
    monkeypatch.setattr(te.ops.GroupedLinear, "fuser_backward",
                        lambda self, ctxs, grad, **kw: seen.setdefault("saved", ctxs[0].saved_tensors))
    ctx.saved_tensors = ctx.to_save  # what autograd hands back
    op.fuser_backward([ctx], torch.empty(0), basic_op_grad_extra_outputs=[()])
    back = seen["saved"]
    assert len(back) == 5 + 3 + 3 and all(b is w for b, w in zip(back[-3:], ws))
    assert [t.shape[0] for t in back[5:8]] == [3, 0, 5]
    assert all(torch.equal(a, b) for a, b in zip(back[5:8], xs))


def test_slices_not_tiling_one_buffer_are_saved_as_they_are(monkeypatch):
    op = teo.GroupedLinear(2, 16, 8, bias=False, device="cpu")
    xs = [torch.randn(3, 16), torch.randn(5, 16)]  # separate tensors (as FP8 split_quantize gives)
    ws = [op.weight0, op.weight1]
    saved = [torch.tensor([3, 5]), None, None, None, None, *xs, *ws]
    ctx = _run_fuser_forward(op, saved, monkeypatch)
    assert list(ctx.to_save) == saved and getattr(ctx, "teo_input_rows", None) is None
    big = torch.randn(10, 16)
    gap = [big[0:3], big[4:9]]  # views with a gap between them
    ctx = _run_fuser_forward(op, [torch.tensor([3, 5]), None, None, None, None, *gap, *ws], monkeypatch)
    assert ctx.to_save[5] is gap[0]


def _fp8_slices(tokens, width):
    """What split_quantize saves for wgrad under FP8 delayed/current scaling: one storage per
    group, columnwise (transposed) data only, each allocated on its own."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    return [Float8TensorStorage(data=None, fp8_scale_inv=torch.ones(1), fp8_dtype=tex.DType.kFloat8E4M3,
                                data_transpose=torch.zeros(width, n, dtype=torch.uint8), fake_dtype=torch.float32)
            for n in tokens]


@pytest.mark.parametrize("offload", [True, False])
def test_fp8_slices_are_saved_as_they_are_under_the_policy(offload, monkeypatch):
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu", offload=offload)
    xs = _fp8_slices((3, 0, 5), 16)
    ws = [getattr(op, f"weight{i}") for i in range(3)]
    saved = [torch.tensor([3, 0, 5]), None, None, None, None, *xs, *ws]
    assert list(op.saved_weights(saved)) == ws
    ctx = _run_fuser_forward(op, saved, monkeypatch, torch.randn(8, 16))
    assert list(ctx.to_save) == saved and getattr(ctx, "teo_input_rows", None) is None
    for x in xs:  # data and scale-inverse follow the op's flag; weights stay
        assert all(getattr(t, KEEP_ATTR, False) == (not offload) for t in x.get_data_tensors() if t is not None)
    assert all(getattr(w, KEEP_ATTR, False) for w in ws)


def test_marks_are_made_only_where_an_engine_sees_the_saves(monkeypatch):
    """No engine on (no TE offload context, no saved-tensor hooks): the saves are not marked and
    the op saves what TE saved; TE's context on, or a hook engine: marked."""
    from te_offload_ops import policy, te_internals

    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu", offload=False)
    saved, acts, ws = _split_path_saved(op)
    assert not policy.engine_sees_saves()
    ctx = _run_fuser_forward(op, list(saved), monkeypatch, engine=False)
    assert not any(getattr(t, KEEP_ATTR, False) for t in [acts[0]._base, *ws])
    assert ctx.to_save[5] is acts[0]._base  # the input buffer is still saved once
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert policy.engine_sees_saves()
    monkeypatch.setattr(te_internals, "is_cpu_offload_enabled", lambda: True)
    assert policy.engine_sees_saves()
    _run_fuser_forward(op, list(saved), monkeypatch, engine=False)
    assert all(getattr(t, KEEP_ATTR, False) for t in [acts[0]._base, *ws])


def test_an_unknown_saved_tensor_hooks_api_counts_as_an_engine(monkeypatch):
    from te_offload_ops import policy

    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    assert policy.engine_sees_saves()


def test_unknown_saved_layout_is_an_error_not_a_silent_offload():
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    saved, _, _ = _split_path_saved(op)
    with pytest.raises(RuntimeError, match="matches no known GroupedLinear layout"):
        op.saved_weights(saved[1:])
    saved[-1] = torch.randn(5, 5)  # not weight-shaped where a weight should be
    with pytest.raises(RuntimeError, match="expected a weight"):
        op.saved_weights(saved)


def test_activation_ops_save_no_weights():
    x, probs = torch.randn(4, 8), torch.rand(4)
    assert teo.ScaledSReLU().saved_weights((x, probs)) == ()


def test_grouped_linear_rejects_bad_inputs_before_te_runs(monkeypatch):
    """Checked ahead of TE's forward, with the values named (TE would fail deeper or not at all)."""
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    ran = []
    monkeypatch.setattr(te.ops.GroupedLinear, "fuser_forward", lambda *a, **k: ran.append(1))
    ctx = OperationContext()
    kw = dict(prev_op_grad_output_quantizer=None, next_op_input_quantizer=None, basic_op_kwargs=[{}])
    with pytest.raises(ValueError, match=r"shape \(4, 12\).*in_features=16"):
        op.fuser_forward([ctx], torch.randn(4, 12), basic_op_extra_inputs=[(torch.tensor([1, 2, 1]),)], **kw)
    with pytest.raises(ValueError, match=r"one size per group \(3\)"):
        op.fuser_forward([ctx], torch.randn(4, 16), basic_op_extra_inputs=[(torch.tensor([2, 2]),)], **kw)
    with pytest.raises(TypeError, match="integer dtype"):
        op.fuser_forward([ctx], torch.randn(4, 16), basic_op_extra_inputs=[(torch.tensor([1.0, 2, 1]),)], **kw)
    assert ran == []


def test_scaled_activation_rejects_probs_of_the_wrong_count(monkeypatch):
    op = teo.ScaledSReLU()
    kw = dict(prev_op_grad_output_quantizer=None, next_op_input_quantizer=None, basic_op_kwargs=[{}])
    with pytest.raises(ValueError, match="probs have 3 values .* for 4 tokens"):
        op.fuser_forward([OperationContext()], torch.randn(4, 8), basic_op_extra_inputs=[(torch.rand(3),)], **kw)
