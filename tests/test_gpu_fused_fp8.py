"""GPU (sm_90): the fused SReLU grouped MLP under TE's Float8BlockScaling.

Against an fp32 computation on operands quantized by TE's own ``Float8BlockQuantizer`` the way the
recipe asks (the same quantization points), against the bf16 fp32 reference (the FP8 error's
size), with Megatron's settings, and the saved bytes and what an engine moves.
"""

import pytest
import torch

from mlp_steps import (POLICIES, Config, assert_moves_follow_policy, attach_main_grads, copy_weights, forward_plan,
                       fused_path_problem, make_inputs, make_stack, recipe_problem, run_step)
from te_offload_ops.fused import block_fp8

pytestmark = pytest.mark.skipif((fused_path_problem() or recipe_problem("block")) is not None,
                                reason=fused_path_problem() or recipe_problem("block") or "")

CASES = {  # name -> (experts, hidden, ffn, splits)
    "uneven-zero-partial-ffn": (4, 384, 320, (0, 130, 1, 253)),  # ffn not a multiple of 128
    "mlp-shape": (8, 2688, 1856, (2048, 0, 4096, 1, 1500, 2047, 300, 2500)),
    "one-token-experts": (4, 256, 256, (1, 1, 0, 1)),
}


def _deq_rows(t, q):
    parts = q(t.contiguous()).get_metadata()
    return block_fp8.dequantize_rows(block_fp8.Rows(parts["rowwise_data"], parts["rowwise_scale_inv"]),
                                     torch.float32)


def _deq_weight(w, q):
    return q(w.contiguous()).dequantize(dtype=torch.float32)


def quantized_reference(mlp, x, probs, dy, splits, recipe):
    """fp32 forward and backward with FP8 operands where the recipe quantizes them, TE's quantizers."""
    qx, qw, qg = (block_fp8.quantizer(recipe, r) for r in ("input", "weight", "grad"))
    fc1, _, fc2 = mlp
    E = fc1.num_groups
    w1 = [_deq_weight(getattr(fc1, f"weight{e}").detach(), qw) for e in range(E)]
    w2 = [_deq_weight(getattr(fc2, f"weight{e}").detach(), qw) for e in range(E)]
    rows = splits.tolist()
    xq = _deq_rows(x.detach(), qx).split(rows)
    p = probs.detach().float().split(rows)
    z = [xe @ w1[e].t() for e, xe in enumerate(xq)]
    act = [torch.relu(ze) ** 2 * pe[:, None] for ze, pe in zip(z, p)]
    actq = _deq_rows(torch.cat(act).bfloat16(), qx).split(rows)
    y = torch.cat([ae @ w2[e].t() for e, ae in enumerate(actq)])
    dyq = _deq_rows(dy, qg).split(rows)
    dys = dy.float().split(rows)
    zq = _deq_rows(torch.cat(z).bfloat16(), qx).split(rows)  # z is saved in FP8
    grads = {"x": [], "probs0": [], **{f"L0.0.weight{e}": None for e in range(E)},
             **{f"L0.2.weight{e}": None for e in range(E)}}
    dzs = []
    for e in range(E):
        dact = dyq[e] @ w2[e]
        r = torch.relu(zq[e])
        grads["probs0"].append((dact * r * r).sum(1))
        grads[f"L0.2.weight{e}"] = dys[e].t() @ (r * r * p[e][:, None])
        dzs.append(dact * 2 * r * p[e][:, None])
    dzq = _deq_rows(torch.cat(dzs).bfloat16(), qg).split(rows)
    for e in range(E):
        grads["x"].append(dzq[e] @ w1[e])
        grads[f"L0.0.weight{e}"] = dzs[e].t() @ xq[e]
    grads["x"], grads["probs0"] = torch.cat(grads["x"]), torch.cat(grads["probs0"])
    return y, grads


def plain_reference(mlp, x, probs, dy, splits):
    """The same step in fp32 without quantization (autograd, expert by expert)."""
    fc1, _, fc2 = mlp
    E = fc1.num_groups
    x32 = x.detach().float().requires_grad_()
    p32 = probs.detach().float().requires_grad_()
    w1 = [getattr(fc1, f"weight{e}").detach().float().requires_grad_() for e in range(E)]
    w2 = [getattr(fc2, f"weight{e}").detach().float().requires_grad_() for e in range(E)]
    rows = splits.tolist()
    y = torch.cat([(torch.relu(xe @ w1[e].t()) ** 2 * pe[:, None]) @ w2[e].t()
                   for e, (xe, pe) in enumerate(zip(x32.split(rows), p32.split(rows)))])
    y.backward(dy.float())
    grads = {"x": x32.grad, "probs0": p32.grad, **{f"L0.0.weight{e}": w.grad for e, w in enumerate(w1)},
             **{f"L0.2.weight{e}": w.grad for e, w in enumerate(w2)}}
    return y.detach(), grads


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _block_stack(E, H, F, splits, **kw):
    cfg = Config(layers=1, experts=E, hidden=H, ffn=F, splits=splits, recipe="block", **kw)
    return cfg, make_stack(cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_block_scaling_runs_fused_and_matches_fp32_on_the_same_fp8_operands(case):
    E, H, F, splits = CASES[case]
    cfg, stack = _block_stack(E, H, F, splits)
    inputs = make_inputs(cfg)
    got = run_step(stack, inputs, "none")
    assert forward_plan(stack[0]) == ["FusedScaledSReLUMLP"]
    assert stack[0]._module_groups[0]._forward_ops[0][0].last_fallback_reasons == []
    x, probs, dy, s = inputs
    from transformer_engine.common.recipe import Float8BlockScaling

    ref_y, ref_grads = quantized_reference(stack[0], x, probs[0], dy, s, Float8BlockScaling())
    plain_y, plain_grads = plain_reference(stack[0], x, probs[0], dy, s)
    checks = {"out": (got["out"], ref_y, plain_y)}
    checks.update({k: (got["grads"][k], ref_grads[k], plain_grads[k]) for k in ref_grads})
    for name, (ours, ref, plain) in checks.items():
        assert ours is not None and ours.shape == ref.shape, name
        assert torch.isfinite(ours).all(), name
        if plain.abs().max() == 0:  # an expert without tokens
            assert torch.count_nonzero(ours) == 0, name
            continue
        # same FP8 operands: bf16 rounding of outputs and intermediates, and the few values that
        # round to the next FP8 step because an intermediate differs by a bf16 ulp
        assert rel_err(ours, ref) < 2e-2, (name, rel_err(ours, ref))
        # the FP8 error itself (e4m3: 3 mantissa bits) against the unquantized step
        assert rel_err(ours, plain) < 1e-1, (name, rel_err(ours, plain))


@pytest.mark.parametrize("megatron", [("main_grad",), ("main_grad", "delay"), ("single", "main_grad", "delay")],
                         ids=["main_grad", "main_grad+delay", "single+main_grad+delay"])
def test_block_scaling_with_megatrons_settings_gives_the_plain_ops_grads(megatron, monkeypatch):
    if "single" in megatron:
        monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    E, H, F, splits = CASES["uneven-zero-partial-ffn"]
    cfg, plain = _block_stack(E, H, F, splits)
    cfg_m, ours = _block_stack(E, H, F, splits, megatron=megatron)
    copy_weights(plain, ours)
    attach_main_grads(ours)
    inputs = make_inputs(cfg)
    base = run_step(plain, inputs, "none")
    got = run_step(ours, inputs, "none")
    assert forward_plan(ours[0]) == ["FusedScaledSReLUMLP"]
    torch.testing.assert_close(got["out"], base["out"], rtol=0, atol=0)
    for name, g in base["grads"].items():
        if name.startswith("L0."):  # main_grad gains the fp32 wgrad; .grad holds it in bf16
            assert rel_err(got["grads"][name], g.float()) < 1e-2 if g.abs().max() > 0 else \
                torch.count_nonzero(got["grads"][name]) == 0, name
        else:
            assert torch.equal(got["grads"][name], g), name


def test_micro_batches_after_the_first_reuse_its_fp8_weights(monkeypatch):
    """Megatron's is_first_microbatch: the step's first micro-batch quantizes the weights, the
    next ones reuse them (one quantization per op and step) and give the same bits as quantizing
    again; the next step's first micro-batch quantizes the weights the optimizer wrote."""
    E, H, F, splits = CASES["uneven-zero-partial-ffn"]
    cfg, kept = _block_stack(E, H, F, splits)
    _, fresh = _block_stack(E, H, F, splits)
    copy_weights(fresh, kept)
    linears = [op for op in kept[0] if hasattr(op, "is_first_microbatch")]
    assert len(linears) == 2
    made = []
    real = block_fp8.quantize_weights
    monkeypatch.setattr(block_fp8, "quantize_weights", lambda *a, **k: made.append(1) or real(*a, **k))
    for step in range(2):
        for op in linears:
            op.is_first_microbatch = True  # as MegatronModule.set_is_first_microbatch at a step's start
        before = len(made)
        for micro in range(3):
            inputs = make_inputs(Config(**{**cfg.__dict__, "seed": 100 * step + micro}))
            got, want = run_step(kept, inputs, "none"), run_step(fresh, inputs, "none")
            assert torch.equal(got["out"], want["out"]), (step, micro)
            for name, g in want["grads"].items():
                assert torch.equal(got["grads"][name], g), (step, micro, name)
        assert len(made) - before == 2 + 3 * 2  # kept: fc1 and fc2 once; fresh: both every micro-batch
        with torch.no_grad():  # the optimizer's step, through .data as Megatron's writes it
            for a, b in zip(kept[0].parameters(), fresh[0].parameters()):
                a.data.mul_(0.5)
                b.data.mul_(0.5)


def test_fp8_saves_about_half_the_bf16_paths_bytes_and_offloads_them_under_the_policy():
    E, H, F, splits = CASES["mlp-shape"]
    cfg, fp8 = _block_stack(E, H, F, splits)
    bf16 = make_stack(Config(layers=1, experts=E, hidden=H, ffn=F, splits=splits))
    inputs = make_inputs(cfg)
    got = {name: run_step(stack, inputs, "spy") for name, stack in (("fp8", fp8), ("bf16", bf16))}
    assert forward_plan(fp8[0]) == forward_plan(bf16[0]) == ["FusedScaledSReLUMLP"]
    moved = {name: sum(n for (op, kind), n in r["moved"].items() if kind == "activation") for name, r in got.items()}
    assert 0.45 < moved["fp8"] / moved["bf16"] <= 0.55, moved
    for r in got.values():
        assert_moves_follow_policy(r["moved"], POLICIES["all"], r["recorder"].entries, layers=[0])


@pytest.mark.parametrize("policy", ["keep-fc1", "keep-act"])
def test_fp8_saves_of_an_op_with_offload_false_stay(policy):
    E, H, F, splits = CASES["uneven-zero-partial-ffn"]
    cfg, stack = _block_stack(E, H, F, splits, offload=POLICIES[policy])
    got = run_step(stack, make_inputs(cfg), "spy")
    assert_moves_follow_policy(got["moved"], POLICIES[policy], got["recorder"].entries, layers=[0])


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2-scales", "fp32-scales"])
def test_row_kernels_write_te_quantizers_bytes(pow2):
    from te_offload_ops.kernels import fp8_rows
    from transformer_engine.common.recipe import Float8BlockScaling, QParams

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    recipe = Float8BlockScaling()
    recipe.fp8_quant_fwd_inp = recipe.fp8_quant_bwd_grad = QParams(power_2_scale=pow2, amax_epsilon=0.0)
    qx, qg = block_fp8.quantizer(recipe, "input"), block_fp8.quantizer(recipe, "grad")
    g = torch.Generator(device="cuda").manual_seed(3)
    t, f = 301, 320  # rows not a multiple of 4, a partial last block
    z = (torch.randn(t, f, device="cuda", generator=g) * 4).bfloat16()
    z[7] = 0  # an all-zero row: scale 1
    z[9, :128] = -1  # a block that SReLU zeroes
    probs = torch.rand(t, device="cuda", generator=g).bfloat16()

    def same_rows(got_data, got_scales, ref: block_fp8.Rows):
        assert torch.equal(got_data, ref.data)
        assert torch.equal(got_scales[:, :t], ref.scale_inv[:, :t])

    same_rows(*fp8_rows.quantize(z, 0.0, pow2), block_fp8.quantize_rows(z, qx))
    act_d, act_s, z_d, z_s = fp8_rows.srelu_quantize(z, probs, 0.0, pow2)
    same_rows(act_d, act_s, block_fp8.quantize_rows(block_fp8.scaled_srelu(z, probs), qx))
    same_rows(z_d, z_s, block_fp8.quantize_rows(z, qx))
    zq = block_fp8.Rows(z_d, z_s)
    assert torch.equal(fp8_rows.dequantize(z_d, z_s, torch.bfloat16), block_fp8._dequantized_pass(zq, 0, t).bfloat16())

    dact = torch.randn(t, f, device="cuda", generator=g).bfloat16()
    ref_dz, ref_dprobs, ref_act = block_fp8.dscaled_srelu(dact.clone(), zq, probs)
    dz, dz_d, dz_s, dprobs, act = fp8_rows.dsrelu_quantize(dact, z_d, z_s, probs, 0.0, pow2)
    assert torch.equal(dz, ref_dz) and torch.equal(act, ref_act)
    # another summation order: within fp32's rounding of a sum of F terms, relative to their sizes
    r = torch.relu(block_fp8._dequantized_pass(zq, 0, t))
    sizes = (dact.float().abs() * r * r).sum(dim=1)
    assert ((dprobs - ref_dprobs).abs() <= 1e-6 * f * sizes.clamp_min(1e-30)).all()
    same_rows(dz_d, dz_s, block_fp8.quantize_rows(ref_dz, qg))


def test_row_kernels_and_torch_passes_give_the_same_step(monkeypatch):
    from te_offload_ops.kernels import fp8_rows

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    E, H, F, splits = CASES["uneven-zero-partial-ffn"]
    runs = {}
    for rows in ("torch", "triton", "gemm"):
        monkeypatch.setenv(block_fp8.ROWS_ENV, rows)
        cfg, stack = _block_stack(E, H, F, splits)
        runs[rows] = run_step(stack, make_inputs(cfg), "none")
    assert torch.equal(runs["torch"]["out"], runs["triton"]["out"])
    for name, g in runs["torch"]["grads"].items():
        if name.startswith("probs"):
            torch.testing.assert_close(runs["triton"]["grads"][name], g, rtol=1e-2, atol=1e-3)
        else:
            assert torch.equal(runs["triton"]["grads"][name], g), name
    # SReLU and its backward in the GEMMs' epilogues write the row kernels' bytes: the same step,
    # bitwise but for dprob (summed per 128-column tile, then over the tiles)
    assert torch.equal(runs["gemm"]["out"], runs["triton"]["out"])
    for name, g in runs["triton"]["grads"].items():
        if name.startswith("probs"):
            torch.testing.assert_close(runs["gemm"]["grads"][name], g, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(runs["gemm"]["grads"][name], g), name


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pow2, eps", [(True, 0.0), (False, 0.0), (False, 1e-6)], ids=["pow2", "fp32", "eps"])
@pytest.mark.parametrize("f", [1856, 320, 64])
def test_srelu_quantize_epilogue_writes_the_row_kernels_bytes(f, pow2, eps, out_dtype):
    """fc1's GEMM with the quantizing SReLU epilogue against the plain GEMM then the Triton row
    pass (TE's quantizer's bytes, checked above): act and z data and scales bitwise, for experts
    of 0, 1 and 127-555 tokens (tiles that start mid-expert), a partial last 128-column block,
    rows whose prob is 0 (act all zero: scale 1), and a row of tiny values."""
    from te_offload_ops import kernels
    from te_offload_ops.kernels import fp8_rows

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(11)
    splits = torch.tensor([0, 1, 127, 128, 129, 300, 0, 555], device="cuda")
    e, k, t = len(splits), 256, int(splits.sum()) + 3  # rows past the experts' sum stay unwritten
    x = torch.randn(t, k, device="cuda", generator=g).to(out_dtype)
    x[5] *= 1e-3  # small z: a scale far from the others'
    w = (torch.randn(e, f, k, device="cuda", generator=g) * 0.05).to(out_dtype)
    probs = torch.rand(t, device="cuda", generator=g).to(out_dtype)
    probs[[0, 200, 700]] = 0
    xd, xs = fp8_rows.quantize(x, eps, pow2)
    wd, ws, _, _ = fp8_rows.quantize_weights(w, False, eps, pow2)
    z = kernels.grouped_gemm_fp8_blockwise(xd, xs, wd, ws, splits, out_dtype)
    used = int(splits.sum())
    ref = fp8_rows.srelu_quantize(z[:used].contiguous(), probs[:used].contiguous(), eps, pow2)
    got = kernels.grouped_gemm_fp8_srelu_quantize(xd, xs, wd, ws, splits, probs, eps=eps, pow2=pow2,
                                                  out_dtype=out_dtype)
    for name, r, o in zip(("act", "act scales", "z", "z scales"), ref, got):
        if name.endswith("scales"):
            assert torch.equal(o[:, :used], r[:, :used]), name
        else:
            assert torch.equal(o[:used], r), name


@pytest.mark.parametrize("n, k", [(320, 384), (256, 200)], ids=["partial-n", "partial-k"])
def test_weight_kernel_writes_te_quantizers_bytes_in_both_orientations(n, k):
    from te_offload_ops.kernels import fp8_rows
    from transformer_engine.common.recipe import Float8BlockScaling

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    e, pad = 3, 24
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(e, n, k, device="cuda", generator=g).bfloat16()
    w[1, :128, :128] = 0  # an all-zero block: scale 1
    buf = torch.zeros(e * (n * k + pad), device="cuda", dtype=torch.bfloat16)
    for j in range(e):  # Megatron's layout: experts last first, with padding between them
        buf[j * (n * k + pad): j * (n * k + pad) + n * k] = w[e - 1 - j].reshape(-1)
    laid_out = buf.as_strided((e, n, k), (n * k + pad, k, 1))
    rows, row_s, cols, col_s = fp8_rows.quantize_weights(laid_out, True, 0.0, True)
    q = block_fp8.quantizer(Float8BlockScaling(), "weight")
    nb, kb = -(-n // 128), -(-k // 128)
    for i in range(e):
        ref = q(w[i]).get_metadata()
        assert torch.equal(rows[i], ref["rowwise_data"]) and torch.equal(cols[i], ref["columnwise_data"])
        assert torch.equal(row_s[i, :, :kb], ref["rowwise_scale_inv"][:, :kb])
        assert torch.equal(col_s[i, :, :nb], ref["columnwise_scale_inv"][:, :nb])


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize("k", [2688, 200])
def test_column_kernel_writes_te_quantizers_columnwise_bytes_per_expert(k, pow2):
    """Each expert's columnwise copy (tokens in 128 x 1 blocks), as TE quantizes that expert's
    tokens alone, side by side with each expert's tokens padded to 128 (an FP8 wgrad's operands)."""
    from te_offload_ops.kernels import fp8_rows

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    splits = torch.tensor([0, 1, 127, 128, 129, 300, 2047, 5], device="cuda")
    t = int(splits.sum())
    g = torch.Generator(device="cuda").manual_seed(9)
    x = (torch.randn(t, k, device="cuda", generator=g) * 2).bfloat16()
    x[3] = 0
    x[400:420] *= 1e-4  # a block of small values: another scale
    data, scales = fp8_rows.quantize_columns(x, splits, 0.0, pow2)
    _, poff = fp8_rows.expert_offsets(splits)
    q = _te_quantizer(columnwise=True, pow2=pow2)
    off = [0] + torch.cumsum(splits, 0).tolist()
    for e, te in enumerate(splits.tolist()):
        p0, p1 = int(poff[e]), int(poff[e + 1])
        assert p1 - p0 == -(-te // 128) * 128
        if te == 0:
            continue
        ref = q(x[off[e]:off[e + 1]]).get_metadata()
        assert torch.equal(data[:, p0:p0 + te], ref["columnwise_data"].view(torch.uint8)), e
        assert torch.equal(scales[p0 // 128:p1 // 128, :k], ref["columnwise_scale_inv"][:, :k]), e
        assert bool((data[:, p0 + te:p1] == 0).all()), e


def _te_quantizer(columnwise: bool, pow2: bool):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import Float8BlockQuantizer

    return Float8BlockQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=not columnwise, columnwise=columnwise,
                                amax_epsilon=0.0, force_pow_2_scales=pow2, block_scaling_dim=1)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize("f", [1856, 320, 64])
def test_dsrelu_quantize_epilogue_writes_the_row_kernels_bytes(f, pow2, out_dtype):
    """fc2's dgrad with the SReLU backward in its epilogue against the plain dgrad then the Triton
    row pass: dz, act and dz's FP8 data and scales bitwise; dprob within fp32 summation-order
    rounding and the same from run to run; experts of 0, 1 and 127-555 tokens, a partial last
    128-column block, rows whose prob is 0, a z row SReLU zeroes."""
    from te_offload_ops import kernels
    from te_offload_ops.kernels import fp8_rows

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(13)
    splits = torch.tensor([0, 1, 127, 128, 129, 300, 0, 555], device="cuda")
    e, h = len(splits), 256
    t = int(splits.sum())
    dy = torch.randn(t, h, device="cuda", generator=g).to(out_dtype)
    w2t = (torch.randn(e, f, h, device="cuda", generator=g) * 0.05).to(out_dtype)  # fc2's weights transposed
    z = (torch.randn(t, f, device="cuda", generator=g) * 2).to(out_dtype)
    z[9] = -1  # SReLU zeroes the row
    probs = torch.rand(t, device="cuda", generator=g).to(out_dtype)
    probs[[0, 200, 700]] = 0
    dyd, dys = fp8_rows.quantize(dy, 0.0, pow2)
    wd, ws, _, _ = fp8_rows.quantize_weights(w2t, False, 0.0, pow2)
    _, _, zd, zs = fp8_rows.srelu_quantize(z, probs, 0.0, pow2)
    dact = kernels.grouped_gemm_fp8_blockwise(dyd, dys, wd, ws, splits, out_dtype)
    ref_dz, ref_q, ref_qs, ref_dp, ref_act = fp8_rows.dsrelu_quantize(dact.clone(), zd, zs, probs, 0.0, pow2)
    runs = [kernels.grouped_gemm_fp8_dsrelu_quantize(dyd, dys, wd, ws, splits, zd, zs, probs, pow2=pow2,
                                                     out_dtype=out_dtype) for _ in range(2)]
    dz, q, qs, dp, act = runs[0]
    assert torch.equal(dz, ref_dz) and torch.equal(act, ref_act)
    assert torch.equal(q, ref_q) and torch.equal(qs[:, :t], ref_qs[:, :t])
    r = torch.relu(zd.view(torch.float8_e4m3fn).float() * zs[:, :t].t().repeat_interleave(128, dim=1)[:, :f])
    sizes = (dact.float().abs() * r * r).sum(dim=1)
    assert ((dp - ref_dp).abs() <= 1e-6 * f * sizes.clamp_min(1e-30)).all()
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))  # deterministic
