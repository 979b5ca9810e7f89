"""CPU: use_teo_offload's wiring into a Megatron-like model (stand-in layers named as Megatron's).

Which modules each scope finds, that each runs inside teo's context with its output through the
sync function, what is refused and why, and that teo on the CPU (where nothing moves) leaves a
step's outputs and grads unchanged. The GPU run is tests/test_megatron_ep_gpu.py (case "teo").
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from te_offload_ops import engines
from te_offload_ops.megatron import find_offload_modules, teo_offload_problems, use_teo_offload


class TEGroupedMLP(torch.nn.Module):  # the names are what use_teo_offload looks for
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x, tokens_per_expert=None, probs=None):
        return torch.relu(self.fc(x)) ** 2, None


class MoELayer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.router = torch.nn.Linear(width, 2)
        self.experts = TEGroupedMLP(width)

    def forward(self, hidden_states):
        out, _ = self.experts(hidden_states * torch.sigmoid(self.router(hidden_states)[:, :1]))
        return out, None


class TransformerLayer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attn = torch.nn.Linear(width, width)
        self.mlp = MoELayer(width)

    def forward(self, hidden_states, context=None, attention_mask=None):
        h = hidden_states + torch.tanh(self.attn(hidden_states))
        out, _ = self.mlp(h)
        return h + out, context


class TransformerBlock(torch.nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(TransformerLayer(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x, _ = layer(hidden_states=x, context="ctx")
        return x


class GPTModel(torch.nn.Module):
    def __init__(self, width=8, layers=3, **config):
        super().__init__()
        self.embedding = torch.nn.Linear(width, width)
        self.decoder = TransformerBlock(width, layers)
        self.config = SimpleNamespace(pipeline_model_parallel_size=1, **config)

    def forward(self, x):
        return self.decoder(self.embedding(x)).sum()


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


class SpyContext:
    """Stands in for teo's pair: records entries, exits and syncs, and which module ran inside."""

    def __init__(self, log):
        self.log, self.inside = log, False

    def __enter__(self):
        self.inside = True
        self.log.append("enter")

    def __exit__(self, *exc):
        self.inside = False
        self.log.append("exit" if exc[0] is None else f"exit {exc[0].__name__}")
        return False

    def sync(self, tensor):
        assert not self.inside and tensor.grad_fn is not None
        self.log.append("sync")
        return tensor.view_as(tensor)  # a new tensor: the caller must return what sync returned


@pytest.fixture
def spy(monkeypatch):
    calls = {"log": [], "kwargs": None}

    def fake_offload_context(engine, **kwargs):
        assert engine == "teo"
        calls["kwargs"] = kwargs
        ctx = SpyContext(calls["log"])
        calls["ctx"] = ctx
        return ctx, ctx.sync, engines.OffloadCounter()

    monkeypatch.setattr(engines, "offload_context", fake_offload_context)
    return calls


# -- which modules ------------------------------------------------------------------------------


def test_each_scope_finds_its_outermost_modules_in_forward_order():
    model = GPTModel(layers=3)
    layers = list(model.decoder.layers)
    assert find_offload_modules(model, "layer") == layers
    assert find_offload_modules(model, "moe") == [layer.mlp for layer in layers]
    assert find_offload_modules(model, "experts") == [layer.mlp.experts for layer in layers]
    # inside Megatron's wrappers (DDP keeps the model in .module), or as a one-chunk list
    assert find_offload_modules(DistributedDataParallel(model), "moe") == [layer.mlp for layer in layers]
    assert find_offload_modules([DistributedDataParallel(model)], "layer") == layers


def test_bad_scopes_and_model_chunks_are_refused():
    with pytest.raises(ValueError, match="scope must be one of"):
        find_offload_modules(GPTModel(), "attention")
    with pytest.raises(ValueError, match="one model chunk; got 2"):
        find_offload_modules([GPTModel(), GPTModel()], "layer")
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        find_offload_modules("model", "layer")
    with pytest.raises(ValueError, match="no TransformerLayer modules"):
        use_teo_offload(torch.nn.Linear(2, 2), scope="layer")


# -- wiring ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["layer", "moe", "experts"])
def test_each_module_runs_inside_the_context_and_its_output_goes_through_sync(spy, scope):
    model = GPTModel(layers=3)
    x = torch.randn(4, 8)
    expected = model(x)
    handle = use_teo_offload(DistributedDataParallel(model), scope=scope, num_layers=2, memory_budget=5 << 30,
                             reload_ahead=1)
    assert spy["kwargs"] == {"num_layers": 2, "model_layers": 3, "memory_budget": 5 << 30,
                             "reload_ahead": 1, "classify": None}
    assert handle.model_layers == 3 and handle.num_layers == 2
    out = model(x)
    assert spy["log"] == ["enter", "exit", "sync"] * 3
    torch.testing.assert_close(out, expected)
    out.backward()  # the graph through sync's outputs is whole
    assert all(p.grad is not None for p in model.parameters())


def test_the_wrapped_forward_runs_inside_and_extra_outputs_pass_through(spy):
    model = GPTModel(layers=2)
    inside = []
    real = TransformerLayer.forward

    def recording(self, *args, **kwargs):
        inside.append(spy["ctx"].inside)
        return real(self, *args, **kwargs)

    TransformerLayer.forward = recording
    try:
        use_teo_offload(model, scope="layer")
        layer = model.decoder.layers[0]
        out, context = layer(hidden_states=torch.randn(2, 8, requires_grad=True), context="kept")
    finally:
        TransformerLayer.forward = real
    assert inside == [True] and context == "kept" and out.grad_fn is not None


def test_forwards_without_grad_run_outside_teo(spy):
    model = GPTModel(layers=2)
    use_teo_offload(model, scope="moe")
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert spy["log"] == []


def test_a_module_out_of_order_is_refused_and_a_new_forward_starts_over(spy):
    model = GPTModel(layers=3)
    use_teo_offload(model, scope="layer")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="saw layer 2 of 3 start where layer 1 was due"):
        h, _ = model.decoder.layers[0](x)
        model.decoder.layers[2](h)
    model(x).backward()  # layer 0 begins a new forward
    assert spy["log"][-9:] == ["enter", "exit", "sync"] * 3


def test_an_error_inside_a_layer_leaves_the_context(spy):
    model = GPTModel(layers=2)
    use_teo_offload(model, scope="experts")
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        model.decoder.layers[0].mlp.experts(torch.randn(2, 5))
    assert spy["log"] == ["enter", "exit RuntimeError"]


def test_remove_gives_back_the_forward_and_a_second_install_is_refused_until_then(spy):
    model = GPTModel(layers=2)
    handle = use_teo_offload(model, scope="layer")
    with pytest.raises(RuntimeError, match="runs under teo already"):
        use_teo_offload(model, scope="layer")
    handle.remove()
    assert all("forward" not in vars(layer) for layer in model.decoder.layers)
    model(torch.randn(2, 8))
    assert spy["log"] == []
    use_teo_offload(model, scope="layer")  # allowed again


def test_a_forward_set_on_the_instance_is_kept_under_teo_and_given_back(spy):
    model = GPTModel(layers=1)
    layer = model.decoder.layers[0]
    calls = []
    own = layer.forward

    def instance_forward(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    layer.forward = instance_forward
    handle = use_teo_offload(model, scope="layer")
    model(torch.randn(2, 8))
    assert calls == [1] and spy["log"] == ["enter", "exit", "sync"]
    handle.remove()
    assert layer.forward is instance_forward


def test_outputs_without_a_leading_tensor_are_refused(spy):
    class Odd(torch.nn.Module):
        def forward(self, x):
            return {"out": x * 2}

    odd = Odd()
    use_teo_offload(torch.nn.Sequential(odd), scope="layer", modules=[odd])
    with pytest.raises(TypeError, match="tensor or a tuple starting with one; Odd returned dict"):
        odd(torch.randn(2, requires_grad=True))


@pytest.mark.parametrize("kwargs, match", [
    ({"num_layers": 4}, r"num_layers must be an int in \[0, 3\]"),
    ({"num_layers": -1}, r"num_layers must be an int"),
    ({"num_layers": True}, r"num_layers must be an int"),
    ({"memory_budget": 0}, "memory_budget must be a positive int"),
    ({"memory_budget": 1.5e9}, "memory_budget must be a positive int"),
    ({"scope": "mlp"}, "scope must be one of"),
])
def test_bad_arguments_are_refused_before_anything_is_wrapped(spy, kwargs, match):
    model = GPTModel(layers=3)
    with pytest.raises(ValueError, match=match):
        use_teo_offload(model, **kwargs)
    assert all("forward" not in vars(layer) for layer in model.decoder.layers) and spy["kwargs"] is None


# -- configurations teo cannot follow -------------------------------------------------------------


@pytest.mark.parametrize("config, scope, match", [
    ({"pipeline_model_parallel_size": 2}, "layer", "pipeline_model_parallel_size=2"),
    ({"overlap_moe_expert_parallel_comm": True}, "moe", "EP-overlap schedule"),
    ({"recompute_granularity": "full"}, "layer", "recompute_granularity='full'"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, "experts", "recompute_modules has 'moe'"),
    ({"fine_grained_activation_offloading": True}, "layer", "Megatron's own offloading"),
    ({"cpu_offloading": True}, "layer", "TE's offloading"),
    ({"cuda_graph_impl": "transformer_engine"}, "layer", "CUDA graph"),
])
def test_settings_that_break_teos_step_are_refused_with_the_reason(spy, config, scope, match):
    model = GPTModel(layers=2)
    model.config = SimpleNamespace(**{"pipeline_model_parallel_size": 1, **config})
    with pytest.raises(ValueError, match=match):
        use_teo_offload(model, scope=scope)
    assert spy["kwargs"] is None


def test_cuda_graphs_are_refused_only_where_they_capture_what_teo_wraps():
    import enum

    class CudaGraphModule(enum.Enum):  # Megatron's enum, as __post_init__ leaves cuda_graph_modules
        attn, mlp, moe, moe_router, moe_preprocess = 1, 2, 3, 4, 5

    def graphs(*names, impl="transformer_engine"):
        return SimpleNamespace(cuda_graph_impl=impl, cuda_graph_modules=[CudaGraphModule[n] for n in names])

    around_experts = graphs("attn", "moe_router", "moe_preprocess")
    assert teo_offload_problems(around_experts, "experts") == []
    assert teo_offload_problems(graphs("attn", impl="local"), "moe") == []
    [moe] = teo_offload_problems(around_experts, "moe")
    assert "capture moe_router, moe_preprocess" in moe and "attn, mlp for this scope" in moe
    [layer] = teo_offload_problems(graphs("attn"), "layer")
    assert "capture attn" in layer and "(none for this scope)" in layer
    assert "capture moe" in teo_offload_problems(graphs("moe"), "experts")[0]
    assert "whole transformer layers" in teo_offload_problems(graphs(), "experts")[0]  # [] after "full"
    assert "whole transformer layers" in teo_offload_problems(
        SimpleNamespace(cuda_graph_impl="local", cuda_graph_modules="full"), "experts")[0]
    assert "the whole iteration" in teo_offload_problems(graphs(impl="full_iteration"), "experts")[0]
    assert teo_offload_problems(SimpleNamespace(cuda_graph_impl="transformer_engine",
                                                cuda_graph_modules="attn,moe_router"), "experts") == []
    assert teo_offload_problems(graphs("attn", impl="none"), "layer") == []
    one = SimpleNamespace(cuda_graph_impl="transformer_engine", cuda_graph_modules=CudaGraphModule.moe_router)
    assert teo_offload_problems(one, "experts") == [] and len(teo_offload_problems(one, "moe")) == 1


def test_selective_moe_recompute_is_fine_outside_the_experts_scope():
    config = SimpleNamespace(recompute_granularity="selective", recompute_modules=["moe"])
    assert teo_offload_problems(config, "moe") == [] and teo_offload_problems(config, "layer") == []
    assert len(teo_offload_problems(config, "experts")) == 1


# -- the real engine on the CPU ------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["layer", "moe", "experts"])
def test_teo_on_the_cpu_leaves_outputs_and_grads_as_they_are(scope):
    torch.manual_seed(0)
    plain, ours = GPTModel(layers=3), GPTModel(layers=3)
    ours.load_state_dict(plain.state_dict())
    handle = use_teo_offload(ours, scope=scope)
    for step in range(2):  # a second step: teo counts steps by layer entries
        x = torch.randn(4, 8)
        a, b = plain(x), ours(x)
        a.backward()
        b.backward()
        assert torch.equal(a, b)
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert handle.counter.total == 0  # CPU tensors stay where they are
    with contextlib.suppress(AttributeError):
        handle.remove()
