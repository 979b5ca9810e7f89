"""GPU (sm_90): CUDA graph capture of the fused SReLU grouped MLP, with and without TE's V2 offload.

What each test checks (run with ``-s`` to see the bytes moved):

* ``test_graph_replays_match_eager_steps``: an N-layer stack captured once (forward and backward,
  through ``torch.cuda.graph`` or TE's ``make_graphed_callables``, the whole stack as one callable
  or, without offload, one callable per layer), then replayed with new routing each step (same
  token count, new split sizes with experts of zero tokens, new x / probs / dy): output and every
  gradient (x, probs, each expert's weights) are bitwise equal to an eager step of an identical
  stack. Under TE V2 offload (``retain_pinned_cpu_buffers=True``), the bytes the engine chose to
  offload during the capture equal an eager offloaded step's, and after each replay the retained
  pinned buffer of layer 0 holds that step's input, so the copies run on every replay.
* ``test_fp8_graph_replays_match_eager_steps``: the same under ``Float8BlockScaling`` (the fused
  FP8 path: Triton quantization kernels and the grouped FP8 GEMMs captured with the rest), one
  ``torch.cuda.graph`` over the whole stack, bitwise against eager FP8 steps.
* ``test_graph_keeps_host_split_sizes_of_its_capture``: split sizes on the CPU (Megatron's
  drop-and-pad experts) are filled into the graph; replays match eager steps with those sizes.
* ``test_unfused_path_capture_is_refused``: TE's unfused GroupedLinear on its split path raises
  :class:`GraphCaptureError` in the capture, not a hang or a sync error, and the process goes on.
* ``test_capture_before_any_eager_step_is_refused``: a capture that would compile a kernel raises.
* ``test_v2_without_retained_buffers_is_refused``: TE V2 without ``retain_pinned_cpu_buffers``.
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te

from mlp_steps import (Config, _expert_grads, forward_plan, fused_path_problem, make_stack, quantized, recipe_problem,
                       run_step)
from te_offload_ops import capture
from te_offload_ops.capture import GraphCaptureError
from te_offload_ops.engines import active_engine, offload_context
from te_offload_ops.fused.selection import DISABLE_ENV

pytestmark = pytest.mark.skipif(fused_path_problem() is not None, reason=fused_path_problem() or "")

LAYERS, EXPERTS, HIDDEN, FFN = 3, 4, 512, 384
ROUTINGS = [  # 2048 tokens each: uneven, uniform, all on one expert, zero-token experts
    (0, 700, 1329, 19), (512, 512, 512, 512), (2048, 0, 0, 0), (1, 0, 2046, 1), (0, 0, 1024, 1024),
]
TOKENS = sum(ROUTINGS[0])
WARM_UP = 3


def _cfg(splits=ROUTINGS[0], recipe=None) -> Config:
    return Config(layers=LAYERS, experts=EXPERTS, hidden=HIDDEN, ffn=FFN, splits=splits, recipe=recipe)


def _values(step: int):
    """x, probs per layer and dy of step ``step`` (fixed seeds: eager and graphed see the same)."""
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    probs = [torch.rand(TOKENS, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, probs, dy


def _static_inputs():
    """Step 0's x and probs as leaf tensors the graph reads, and dy: a capture's static inputs."""
    x0, probs0, dy0 = _values(0)
    return x0.clone().requires_grad_(), [p.clone().requires_grad_() for p in probs0], dy0.clone()


def _eager(step: int, splits, recipe=None) -> dict:
    stack = make_stack(_cfg(recipe=recipe))  # same seed: same weights as the graphed stack
    x, probs, dy = _values(step)
    inputs = (x.requires_grad_(), [p.requires_grad_() for p in probs], dy,
              torch.tensor(splits, device="cuda", dtype=torch.int64))
    return run_step(stack, inputs, "none")


class _Stack(torch.nn.Module):
    """The whole stack as one callable, each layer in the offload context, as TE documents."""

    def __init__(self, stack, ctx, sync, recipe=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(stack)
        self.ctx, self.sync, self.recipe = ctx, sync, recipe

    def forward(self, x, splits, *probs):
        h = x * 1.0  # a non-leaf input, so offloading it really frees it
        for mlp, p in zip(self.layers, probs):
            with self.ctx, quantized(self.recipe):
                h = mlp(h, splits, p, splits)
            h = self.sync(h)
        return h


def _grads(stack, x, probs) -> dict:
    grads = {"x": x.grad, **{f"probs{i}": p.grad for i, p in enumerate(probs)}}
    for i, mlp in enumerate(stack):
        for j, op in enumerate(mlp):
            if isinstance(op, te.ops.GroupedLinear):
                for e, w in enumerate(_expert_grads(op)):
                    grads[f"L{i}.{j}.weight{e}"] = w
    return grads


def _zero_grads(tensors) -> None:
    for t in tensors:
        t.grad = None


class _TorchGraph:
    """forward + backward of the whole stack captured in one torch.cuda.graph."""

    def __init__(self, model, x, splits, probs, dy):
        self.model, self.x, self.splits, self.probs, self.dy = model, x, splits, probs, dy
        params = list(model.parameters())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles kernels, fills the pinned buffers
            for _ in range(WARM_UP):
                _zero_grads([x, *probs, *params])
                model(x, splits, *probs).backward(dy)
        torch.cuda.current_stream().wait_stream(side)
        _zero_grads([x, *probs, *params])  # the capture allocates the grads from the graph's pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = model(x, splits, *probs)
            out.backward(dy)
        self.out = out.detach()

    def step(self):
        self.graph.replay()
        return self.out


class _TEGraph:
    """TE's make_graphed_callables: the whole stack as one callable, or one per layer."""

    def __init__(self, model, x, splits, probs, dy, per_layer: bool):
        self.dy, self.per_layer = dy, per_layer
        self.x, self.splits, self.probs = x, splits, probs
        if per_layer:
            samples = tuple((torch.randn_like(x).requires_grad_(), splits, p, splits) for p in probs)
            self.callables = te.make_graphed_callables(tuple(model.layers), samples, num_warmup_iters=WARM_UP)
        else:
            self.callables = te.make_graphed_callables(model, (x, splits, *probs), num_warmup_iters=WARM_UP)
        self.params = list(model.parameters())

    def step(self):
        _zero_grads([self.x, *self.probs, *self.params])
        if self.per_layer:
            h = self.x * 1.0
            for f, p in zip(self.callables, self.probs):
                h = f(h, self.splits, p, self.splits)
        else:
            h = self.callables(self.x, self.splits, *self.probs)
        h.backward(self.dy)
        return h.detach()


def _pinned_input_of_layer0(ctx):
    """The retained pinned host buffer TE V2 copies layer 0's (tokens, hidden) input into."""
    state = ctx.offload_synchronizer.layer_states[0]
    found = [t for t in state.cpu_tensor_group.tensor_list if tuple(t.shape) == (TOKENS, HIDDEN)]
    assert len(found) == 1, [tuple(t.shape) for t in state.cpu_tensor_group.tensor_list]
    return found[0]


CAPTURES = [("torch", "none"), ("torch", "v2"), ("te-stack", "none"), ("te-stack", "v2"), ("te-per-layer", "none")]


@pytest.mark.parametrize("how, engine", CAPTURES, ids=[f"{h}-{e}" for h, e in CAPTURES])
def test_graph_replays_match_eager_steps(how, engine, monkeypatch):
    if engine != "none" and engine != active_engine():
        pytest.skip(f"this process runs TE's {active_engine()} engine")
    monkeypatch.setenv(DISABLE_ENV, "1")
    stack = make_stack(_cfg())
    ctx, sync, counter = offload_context(engine, num_layers=1, model_layers=LAYERS,
                                         retain_pinned_cpu_buffers=engine == "v2")
    model = _Stack(stack, ctx, sync)
    x, probs, dy = _static_inputs()
    splits = torch.tensor(ROUTINGS[0], device="cuda", dtype=torch.int64)
    if how == "torch":
        graphed = _TorchGraph(model, x, splits, probs, dy)
    else:
        graphed = _TEGraph(model, x, splits, probs, dy, per_layer=how == "te-per-layer")
    assert all(forward_plan(mlp) == ["FusedScaledSReLUMLP"] for mlp in stack)
    captured_bytes = counter.total  # counted while Python ran: warm-up steps and the capture
    for step, routing in enumerate(ROUTINGS):
        xv = _replay_and_compare(graphed, stack, step, routing, x, probs, dy, splits)
        if engine == "v2":  # the replay copied this step's layer-0 input to the retained pinned buffer
            assert torch.equal(_pinned_input_of_layer0(ctx), xv.cpu()), f"step {step}: offload copy not replayed"
    if engine == "v2":
        eager_ctx, eager_sync, eager_counter = offload_context(engine, num_layers=1, model_layers=LAYERS)
        eager_model = _Stack(make_stack(_cfg()), eager_ctx, eager_sync)
        xv, pv, dyv = _values(0)
        eager_model(xv.requires_grad_(), splits, *[p.requires_grad_() for p in pv]).backward(dyv)
        print(f"\n{how} + V2: {eager_counter.total / 2**20:.1f} MiB offloaded per eager step; "
              f"{captured_bytes / 2**20:.1f} MiB in the warm-up steps and the capture "
              f"({captured_bytes / max(eager_counter.total, 1):.2f} steps' worth)")
        assert eager_counter.total > 0
        assert captured_bytes % eager_counter.total == 0 and captured_bytes >= eager_counter.total, \
            "the captured steps offloaded other bytes than an eager step"


def _replay_and_compare(graphed, stack, step, routing, x, probs, dy, splits, recipe=None):
    """Step ``step``'s values and routing into the static inputs, one replay, then the output and
    every grad against an eager step of an identical stack, bitwise. Returns the step's x."""
    xv, pv, dyv = _values(step)
    with torch.no_grad():
        x.copy_(xv)
        dy.copy_(dyv)
        splits.copy_(torch.tensor(routing, device="cuda", dtype=torch.int64))
        for p, v in zip(probs, pv):
            p.copy_(v)
    out = graphed.step()
    torch.cuda.synchronize()
    want = _eager(step, routing, recipe)
    assert torch.equal(out, want["out"]), f"step {step} {routing}: output"
    got = _grads(stack, x, probs)
    assert got.keys() == want["grads"].keys()
    for name, g in got.items():
        assert g is not None and torch.equal(g, want["grads"][name]), f"step {step} {routing}: grad {name}"
    return xv


def test_fp8_graph_replays_match_eager_steps(monkeypatch):
    if (reason := recipe_problem("block")) is not None:  # asked here: it initialises CUDA
        pytest.skip(reason)
    monkeypatch.setenv(DISABLE_ENV, "1")
    stack = make_stack(_cfg(recipe="block"))
    ctx, sync, _ = offload_context("none", num_layers=1, model_layers=LAYERS)
    model = _Stack(stack, ctx, sync, recipe="block")
    x, probs, dy = _static_inputs()
    splits = torch.tensor(ROUTINGS[0], device="cuda", dtype=torch.int64)
    graphed = _TorchGraph(model, x, splits, probs, dy)
    assert all(forward_plan(mlp) == ["FusedScaledSReLUMLP"] for mlp in stack)
    for step, routing in enumerate(ROUTINGS):
        _replay_and_compare(graphed, stack, step, routing, x, probs, dy, splits, recipe="block")


@pytest.mark.parametrize("routing", [ROUTINGS[1], ROUTINGS[0]], ids=["uniform", "uneven"])
def test_graph_keeps_host_split_sizes_of_its_capture(routing, monkeypatch):
    """Split sizes on the CPU (as Megatron's drop-and-pad experts pass them) are written into the
    graph: replays with new x, probs and dy match eager steps with those sizes, bitwise."""
    monkeypatch.setenv(DISABLE_ENV, "1")
    stack = make_stack(_cfg())
    ctx, sync, _ = offload_context("none", num_layers=1, model_layers=LAYERS)
    model = _Stack(stack, ctx, sync)
    x, probs, dy = _static_inputs()
    splits = torch.tensor(routing, dtype=torch.int64)
    graphed = _TorchGraph(model, x, splits, probs, dy)
    assert all(forward_plan(mlp) == ["FusedScaledSReLUMLP"] for mlp in stack)
    for step in range(3):
        _replay_and_compare(graphed, stack, step, routing, x, probs, dy, splits)


def test_unfused_path_capture_is_refused(monkeypatch):
    from transformer_engine.pytorch import graph as te_graph

    monkeypatch.setenv(DISABLE_ENV, "0")
    stack = make_stack(_cfg())
    if not capture._te_takes_split_path(stack[0][0]):
        pytest.skip("TE's graph-safe grouped-tensor path runs here (cuBLASLt >= 13.4): nothing to refuse")

    class RefusedStack(_Stack):  # TE's make_graphed_callables patches this class's __call__ and,
        pass                     # when the capture raises, leaves it patched: keep it to this test

    model = RefusedStack(stack, *offload_context("none", num_layers=1, model_layers=LAYERS)[:2])
    x, probs, _ = _static_inputs()
    splits = torch.tensor(ROUTINGS[0], device="cuda", dtype=torch.int64)
    before = model(x, splits, *probs).detach()  # eager: runs unfused
    assert forward_plan(stack[0]) == ["GroupedLinear", "ScaledSReLU", "GroupedLinear"]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match="split_sizes.tolist"):
        with torch.cuda.graph(graph):
            model(x, splits, *probs)
    try:
        with pytest.raises(GraphCaptureError, match="split_sizes.tolist"):
            te.make_graphed_callables(model, (x, splits, *probs), num_warmup_iters=1)
    finally:
        te_graph.set_capture_end()  # TE leaves its capture flag set when the capture raises
    torch.cuda.synchronize()  # the process goes on: an eager step gives the same bits as before
    assert torch.equal(model(x, splits, *probs).detach(), before)


def test_capture_before_any_eager_step_is_refused(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    E, H, F, T = 5, 136, 72, 40  # a shape no other test compiles
    cfg = Config(layers=1, experts=E, hidden=H, ffn=F, splits=(8, 0, 16, 8, 8))
    mlp = make_stack(cfg)[0]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(cfg.splits, device="cuda", dtype=torch.int64)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match="compiled and loaded on its first call"):
        with torch.cuda.graph(graph):
            mlp(x, splits, probs, splits)
    torch.cuda.synchronize()


def test_v2_without_retained_buffers_is_refused(monkeypatch):
    if active_engine() != "v2":
        pytest.skip(f"this process runs TE's {active_engine()} engine")
    monkeypatch.setenv(DISABLE_ENV, "1")
    stack = make_stack(_cfg())
    ctx, sync, _ = offload_context("v2", num_layers=1, model_layers=LAYERS)
    model = _Stack(stack, ctx, sync)
    x, probs, dy = _static_inputs()
    splits = torch.tensor(ROUTINGS[0], device="cuda", dtype=torch.int64)
    model(x, splits, *probs).backward(dy)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphCaptureError, match="retain_pinned_cpu_buffers=True"):
        with torch.cuda.graph(graph):
            model(x, splits, *probs)
    torch.cuda.synchronize()
