"""Compression of DeepSeek-V3 (MLA + MoE) and GLM-4.5 (GQA + MoE) checkpoints on
random tiny configs: the compressed-tensors layout and `ignore` list (read back
by the compressed-tensors package), GPTQ's per-expert Hessians from exactly the
tokens the router sends each expert, the RTN fallback named in the result, the
engine's logits on the compressed folder against the dequantized reference, and
the MoE size classes.

`python -m pytest -q -s tests/gpuagent/compress/test_moe.py` prints the parity
diffs.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file

from gpuagent.compress import compress
from gpuagent.compress.calibration import run_layer
from gpuagent.compress.gptq import quantize_gptq_batch
from gpuagent.compress.moe import (
    input_hessians,
    layer_groups,
    mlp_inputs,
    run_attention,
    run_mlp,
)
from gpuagent.compress.pipeline import CompressError
from gpuagent.compress.quantize import quantize_rtn
from gpuagent.compress.recipes import RecipeError, weight_scheme
from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import save_byte_tokenizer
from gpuagent.protocol import Recipe
from kernels.weight_matmul import pack_int32
from tests.gpuagent.compress.conftest import DEMO_MODEL
from tests.gpuagent.compress.test_oracle import _decompressed
from tests.gpuagent.engine.paged_driver import run_paged
from tests.gpuagent.engine.test_moe_archs import deepseek_folder, glm_folder

CALIBRATION = (6, 64)
ATOL = 1e-4  # float32 on both sides, the same weights
# int4 groups of 32 divide every input width here (the published configs' widths
# are multiples of 128); the byte tokenizer's 264 ids
SHAPES = {
    "deepseek_v3": dict(
        vocab_size=264, moe_intermediate_size=32, q_lora_rank=64, v_head_dim=16
    ),
    "glm4_moe": dict(vocab_size=264, moe_intermediate_size=32),
}
BUILDERS = {"deepseek_v3": deepseek_folder, "glm4_moe": glm_folder}
RECIPES = {
    "w8a16": {"weights": "w8a16", "kv_cache_dtype": "bf16"},
    "w4a16-g32-gptq": {
        "weights": "w4a16-g32",
        "kv_cache_dtype": "bf16",
        "method": "gptq",
    },
    "fp8": {"weights": "fp8", "kv_cache_dtype": "bf16"},
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One tiny random folder per architecture, with the byte tokenizer."""
    out = {}
    for arch, build in BUILDERS.items():
        folder = tmp_path_factory.mktemp(arch)
        build(folder, **SHAPES[arch])
        save_byte_tokenizer(folder)
        out[arch] = folder
    return out


@pytest.fixture(scope="module")
def compressed(sources, tmp_path_factory):
    """(folder, CompressResult) per (arch, recipe name), compressed once."""
    root = tmp_path_factory.mktemp("compressed")
    cache = {}

    def get(arch, name):
        if (arch, name) not in cache:
            out = root / f"{arch}-{name}"
            result = compress(
                sources[arch], RECIPES[name], out, calibration_size=CALIBRATION
            )
            cache[arch, name] = (out, result)
        return cache[arch, name]

    return get


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def _reference_weights(tensors, modules):
    """module -> float32 W, decoded here from the stored codes and scales with the
    compressed-tensors package's own unpacking (not our kernels')."""
    out = {}
    for module in modules:
        scale = tensors[f"{module}.weight_scale"].float()
        if f"{module}.weight" in tensors:  # fp8
            out[module] = tensors[f"{module}.weight"].float() * scale
            continue
        n, k = tensors[f"{module}.weight_shape"].tolist()
        bits = 32 * tensors[f"{module}.weight_packed"].shape[1] // k
        codes = unpack_from_int32(
            tensors[f"{module}.weight_packed"], bits, torch.Size([n, k])
        ).float()
        groups = scale.shape[1]
        out[module] = (codes.view(n, groups, -1) * scale[..., None]).view(n, k)
    return out


# ----------------------------------------------------------------------- layout


@pytest.mark.parametrize("arch", BUILDERS)
@pytest.mark.parametrize("name", RECIPES)
def test_layout_and_ignore_list(compressed, arch, name):
    folder, result = compressed(arch, name)
    tensors = load_file(folder / "model.safetensors")
    qc = _config(folder)["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # compressed-tensors' own model
    config = _config(folder)
    layers, experts = config["num_hidden_layers"], config["n_routed_experts"]
    dense = config["first_k_dense_replace"]
    fp8 = name == "fp8"
    weight_key = "weight" if fp8 else "weight_packed"

    # every routed expert of every MoE layer, its own tensors
    for i in range(dense, layers):
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                module = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                assert f"{module}.{weight_key}" in tensors, module
                assert f"{module}.weight_scale" in tensors, module
                assert f"{module}.weight" not in tensors or fp8
                if fp8:
                    assert tensors[f"{module}.weight"].dtype == torch.float8_e4m3fn
        # the router: weight bf16, correction bias float32, in `ignore`
        gate = f"model.layers.{i}.mlp.gate"
        assert tensors[f"{gate}.weight"].dtype == torch.bfloat16
        assert tensors[f"{gate}.e_score_correction_bias"].dtype == torch.float32
    assert r"re:.*mlp\.gate$" in parsed.ignore and "lm_head" in parsed.ignore
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    for key, t in tensors.items():  # norms untouched (MLA's and GLM's q/k included)
        if key.rsplit(".", 2)[-2].endswith("norm"):
            assert t.dtype == torch.bfloat16 and key.endswith(".weight"), key
    for i in range(layers):
        if arch == "deepseek_v3":
            prefix = f"model.layers.{i}.self_attn"
            for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
                assert f"{prefix}.{proj}.weight_scale" in tensors
            # kv_b_proj: bf16 by rule (the absorbed decode dequantizes it anyway)
            assert tensors[f"{prefix}.kv_b_proj.weight"].dtype == torch.bfloat16
            assert f"{prefix}.kv_b_proj" in parsed.ignore
            for norm in ("q_a_layernorm", "kv_a_layernorm"):
                assert tensors[f"{prefix}.{norm}.weight"].dtype == torch.bfloat16
        else:  # GLM's q/k/v keep their biases dense beside the codes
            for proj in ("q_proj", "k_proj", "v_proj"):
                module = f"model.layers.{i}.self_attn.{proj}"
                assert f"{module}.weight_scale" in tensors
                assert tensors[f"{module}.bias"].dtype == torch.bfloat16
    # every quantized module is targeted and not ignored; every dense Linear
    # weight is either targeted by nothing or ignored
    quantized = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    assert result.quantized_layers == len(quantized)

    def targeted(module):
        return any(
            re.match(t[3:], module)
            for g in parsed.config_groups.values()
            for t in g.targets
        )

    def ignored(module):
        return any(
            (i.startswith("re:") and re.match(i[3:], module)) or i == module
            for i in parsed.ignore
        )

    for module in quantized:
        assert targeted(module) and not ignored(module), module
    for key in tensors:
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module not in quantized and targeted(module):
            assert ignored(module), module


@pytest.mark.parametrize("arch", BUILDERS)
def test_shared_experts_and_dense_layers_are_recipe_options(sources, tmp_path, arch):
    recipe = {
        "weights": "w8a16",
        "kv_cache_dtype": "bf16",
        "quantize_shared_experts": False,
        "quantize_dense_layers": False,
    }
    result = compress(sources[arch], recipe, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    ignore = _config(tmp_path / "out")["quantization_config"]["ignore"]
    dense_mlp = [k for k in tensors if k.startswith("model.layers.0.mlp.")]
    shared = [k for k in tensors if ".shared_experts." in k]
    assert dense_mlp and shared
    for key in dense_mlp + shared:
        assert key.endswith(".weight") and tensors[key].dtype == torch.bfloat16, key
        assert key.removesuffix(".weight") in ignore
    assert any(".experts.0.gate_proj.weight_packed" in k for k in tensors)
    sizes = {s.tensor_class: s for s in result.sizes}
    assert sizes["shared_experts"].bytes_after == sizes["shared_experts"].bytes_bf16
    assert sizes["dense_mlp"].bytes_after == sizes["dense_mlp"].bytes_bf16
    assert (
        sizes["routed_experts"].bytes_after < sizes["routed_experts"].bytes_bf16 / 1.9
    )


def test_it_refuses_what_it_does_not_do_for_moe(sources, tmp_path):
    src = sources["deepseek_v3"]
    with pytest.raises(RecipeError, match="kv_cache_dtype 'fp8'"):
        compress(src, {"weights": "w8a16", "kv_cache_dtype": "fp8"}, tmp_path / "a")
    with pytest.raises(RecipeError, match="awq is not implemented for MoE"):
        compress(
            src,
            {"weights": "w8a16", "kv_cache_dtype": "bf16", "awq": True},
            tmp_path / "b",
        )
    with pytest.raises(CompressError, match="layer by layer only"):
        compress(
            src,
            {"weights": "w8a16", "kv_cache_dtype": "bf16"},
            tmp_path / "c",
            sequential=False,
        )
    with pytest.raises(RecipeError, match="apply to MoE models"):
        compress(
            DEMO_MODEL,
            {
                "weights": "w8a16",
                "kv_cache_dtype": "bf16",
                "quantize_dense_layers": False,
            },
            tmp_path / "d",
        )
    gptq = {"weights": "w8a16", "kv_cache_dtype": "bf16", "method": "gptq"}
    with pytest.raises(RecipeError, match="min_expert_tokens apply to MoE models"):
        compress(DEMO_MODEL, gptq | {"min_expert_tokens": 8}, tmp_path / "e")
    assert not any(tmp_path.iterdir())  # nothing written, no temporary left


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_expert_tokens": 0}, "greater than or equal to 1"),
        ({"min_expert_tokens": -3}, "greater than or equal to 1"),
        ({"min_expert_tokens": "16"}, "valid integer"),
        ({"min_expert_tokens": 16.0}, "valid integer"),
        ({"min_expert_tokens": True}, "valid integer"),
        ({"min_expert_tokens": 16, "method": "rtn"}, "needs method 'gptq'"),
        ({"min_expert_tokens": 16, "weights": "bf16"}, "min_expert_tokens do not"),
        (
            {"min_expert_token": 16},
            r"unknown recipe option\(s\) \['min_expert_token'\]",
        ),
    ],
)
def test_it_refuses_a_min_expert_tokens_it_cannot_take(options, message):
    recipe = {"weights": "w8a16", "kv_cache_dtype": "bf16", "method": "gptq"}
    with pytest.raises(RecipeError, match=message):
        weight_scheme(recipe | options)


def test_min_expert_tokens_goes_from_the_recipe_to_the_scheme_and_report():
    recipe = {"weights": "w8a16", "kv_cache_dtype": "bf16", "method": "gptq"}
    assert weight_scheme(recipe).min_expert_tokens == 32  # the default
    assert weight_scheme(recipe | {"min_expert_tokens": 5}).min_expert_tokens == 5
    # carried in the job's recipe as the API sends it, and left out when default
    assert (
        Recipe.model_validate_json(
            Recipe(**recipe, min_expert_tokens=5).model_dump_json()
        ).min_expert_tokens
        == 5
    )
    assert "min_expert_tokens" not in Recipe(**recipe).model_dump(exclude_defaults=True)


# ------------------------------------------------------------ per-expert GPTQ


@pytest.mark.parametrize("arch", BUILDERS)
def test_each_expert_hessian_sees_only_its_routed_tokens(sources, arch):
    model = load_model(sources[arch])
    layer = model.layers[1]  # the first MoE layer
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 264, (3, 40), generator=gen)
    cos, sin = model._rope(torch.arange(40))
    with torch.no_grad():
        hidden = model.layers[0].forward_dense(model.embed_tokens(tokens), cos, sin)
        # the router run by hand on the MLP's input
        x = hidden + layer.self_attn.forward_dense(
            layer.input_layernorm(hidden), cos, sin
        )
        mlp_in = layer.post_attention_layernorm(x).reshape(-1, x.shape[-1])
        _, ids = layer.mlp.gate(mlp_in)  # [T, k]
    scheme = weight_scheme({"weights": "w8a16", "kv_cache_dtype": "bf16"})
    gate_up = layer_groups(layer, scheme)[-2]
    # what quantize_moe_layer runs: the MLP's inputs taken once, the MLP alone
    inputs = mlp_inputs(layer, hidden, cos, sin)
    torch.testing.assert_close(inputs, mlp_in, rtol=0, atol=0)
    accs = input_hessians(layer, gate_up, lambda: run_mlp(layer, inputs))

    experts = len(layer.mlp.experts)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert int(counts.sum()) == tokens.numel() * ids.shape[1]
    assert (counts > 0).sum() >= 2  # the routing spreads the tokens
    for e in range(experts):
        acc = accs[f"mlp.experts.{e}.gate_proj"]
        assert acc.num_rows == int(counts[e]), e
        if acc.num_rows:
            rows = mlp_in[(ids == e).any(dim=-1)].double()
            expected = 2 * rows.t() @ rows / rows.shape[0]
            torch.testing.assert_close(acc.hessian, expected, rtol=1e-5, atol=1e-7)
    shared = accs["mlp.shared_experts.gate_proj"]  # every token
    assert shared.num_rows == tokens.numel()


@pytest.mark.parametrize("arch", BUILDERS)
def test_attention_groups_are_calibrated_without_running_the_mlp(sources, arch):
    model = load_model(sources[arch])
    layer = model.layers[1]  # the first MoE layer
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 264, (10, 24), generator=gen)  # two batches of 8
    cos, sin = model._rope(torch.arange(24))
    with torch.no_grad():
        hidden = model.embed_tokens(tokens)
    scheme = weight_scheme({"weights": "w8a16", "kv_cache_dtype": "bf16"})
    attention = [s for g in layer_groups(layer, scheme)[:-2] for s in g]
    mlp_calls = []
    counting = layer.mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    try:
        alone = input_hessians(
            layer, attention, lambda: run_attention(layer, hidden, cos, sin)
        )
        # each group's own pass, its forward stopped once its input is taken
        stopped = {}
        for s in attention:
            run = functools.partial(run_attention, layer, hidden, cos, sin, s.hook)
            stopped.update(input_hessians(layer, [s], run))
        inputs = mlp_inputs(layer, hidden, cos, sin)
        assert mlp_calls == []  # no expert ran
        whole = input_hessians(
            layer, attention, lambda: run_layer(layer, hidden, cos, sin)
        )
        seen = []
        run_layer(layer, hidden, cos, sin, {"mlp": seen.append})
    finally:
        counting.remove()
    # bit for bit what the whole layer's forward gives (so the same codes)
    for s in attention:
        for accs in (alone, stopped):
            assert accs[s.hook].num_rows == whole[s.hook].num_rows == tokens.numel()
            assert torch.equal(accs[s.hook].hessian, whole[s.hook].hessian), s.hook
    assert torch.equal(inputs, torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]))


def _fallback_run(sources, tmp_path, min_tokens, name="out"):
    # the threshold as a recipe option
    recipe = RECIPES["w4a16-g32-gptq"] | {"min_expert_tokens": min_tokens}
    return compress(
        sources["deepseek_v3"], recipe, tmp_path / name, calibration_size=CALIBRATION
    )


def test_experts_with_too_few_tokens_fall_back_to_rtn_and_are_named(sources, tmp_path):
    # a threshold no expert meets: every routed expert of every MoE layer is
    # named, with the tokens it saw (each token goes to top_k distinct experts)
    everyone = _fallback_run(sources, tmp_path, 10**9, "all")
    config = _config(sources["deepseek_v3"])
    layers = range(config["first_k_dense_replace"], config["num_hidden_layers"])
    named = {(f.layer, f.expert) for f in everyone.rtn_fallback_experts}
    assert named == {(i, e) for i in layers for e in range(config["n_routed_experts"])}
    tokens = CALIBRATION[0] * CALIBRATION[1] * config["num_experts_per_tok"]
    for i in layers:
        assert sum(f.tokens for f in everyone.rtn_fallback_experts if f.layer == i) == (
            tokens
        )
    assert everyone.min_expert_tokens == everyone.recipe.min_expert_tokens == 10**9
    # ... and their codes are the round-to-nearest codes of the source weights
    source = load_file(sources["deepseek_v3"] / "model.safetensors")
    out = load_file(tmp_path / "all" / "model.safetensors")
    scheme = weight_scheme(RECIPES["w4a16-g32-gptq"])
    module = "model.layers.2.mlp.experts.3.down_proj"
    rtn = quantize_rtn(source[f"{module}.weight"], scheme)
    assert torch.equal(out[f"{module}.weight_packed"], pack_int32(rtn.codes, 4))

    # a threshold between the counts: exactly the experts under it in layer 1,
    # whose routing (after the same dense layer and GPTQ'd attention) is the same
    seen = {f.expert: f.tokens for f in everyone.rtn_fallback_experts if f.layer == 1}
    threshold = sorted(seen.values())[len(seen) // 2]
    some = _fallback_run(sources, tmp_path, threshold, "some")
    first = {f.expert: f.tokens for f in some.rtn_fallback_experts if f.layer == 1}
    assert first == {e: n for e, n in seen.items() if n < threshold}
    assert 0 < len(first) < len(seen)
    # a GPTQ'd expert's codes are not RTN's
    calibrated = next(e for e in seen if e not in first)
    module = f"model.layers.1.mlp.experts.{calibrated}.gate_proj"
    rtn = quantize_rtn(source[f"{module}.weight"], scheme)
    packed = load_file(tmp_path / "some" / "model.safetensors")[
        f"{module}.weight_packed"
    ]
    assert not torch.equal(packed, pack_int32(rtn.codes, 4))


# -------------------------------------------------------------- engine parity


@pytest.mark.parametrize("arch", BUILDERS)
@pytest.mark.parametrize("name", RECIPES)
def test_engine_runs_the_compressed_folder_as_its_dequantized_reference(
    compressed, sources, arch, name
):
    folder, _ = compressed(arch, name)
    engine = load_model(folder)  # float32, the quantized layers' torch reference
    tensors = load_file(folder / "model.safetensors")
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    reference = load_model(sources[arch])
    state = dict(reference.state_dict())
    with torch.no_grad():
        for module, w in _reference_weights(tensors, modules).items():
            state[module.removeprefix("model.") + ".weight"].copy_(w)
        for key, t in tensors.items():  # the dense tensors as written (bf16)
            name_in_model = key.removeprefix("model.")
            if name_in_model in state and key.removesuffix(".weight") not in modules:
                state[name_in_model].copy_(t.float())
    quantized = [m for m in engine.modules() if type(m).__name__ == "QuantLinear"]
    assert len(quantized) == len(modules)

    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 264, (2, 17), generator=gen)
    with torch.no_grad():
        diff = (engine.forward_dense(tokens) - reference.forward_dense(tokens)).abs()
    seqs = [tokens[0].tolist(), tokens[1, :9].tolist()]
    paged = run_paged(engine, seqs, [6, 3], chunk=5)
    with torch.no_grad():
        want = [reference.forward_dense(torch.tensor([s]))[0] for s in seqs]
    paged_diff = max(
        (p - w).abs().max().item() for p, w in zip(paged, want, strict=True)
    )
    print(f"{arch} {name}: dense {diff.max():.2e}, paged {paged_diff:.2e}")
    assert diff.max() <= ATOL and paged_diff <= ATOL


@pytest.mark.parametrize("arch", BUILDERS)
def test_compressed_tensors_decompresses_every_expert(compressed, arch):
    # the package's decompressor gives our reference weights (it rounds its
    # product to bf16, relative 2^-8)
    folder, _ = compressed(arch, "w4a16-g32-gptq")
    _, modules = _decompressed(folder)
    tensors = load_file(folder / "model.safetensors")
    ours = _reference_weights(tensors, modules)
    assert any(".experts." in m for m in modules)
    for module, (weight, _) in modules.items():
        torch.testing.assert_close(weight.float(), ours[module], atol=1e-6, rtol=2**-8)


# ----------------------------------------------------------------- size report


@pytest.mark.parametrize("arch", BUILDERS)
def test_size_classes_sum_to_the_total_and_count_active_parameters(
    compressed, sources, arch
):
    folder, result = compressed(arch, "w4a16-g32-gptq")
    sizes = {s.tensor_class: s for s in result.sizes}
    assert set(sizes) == {
        "attention",
        "routed_experts",
        "shared_experts",
        "router",
        "dense_mlp",
        "embeddings",
        "norms",
        "other",
    }
    written = load_file(folder / "model.safetensors")
    source = load_file(sources[arch] / "model.safetensors")
    nbytes = sum(t.numel() * t.element_size() for t in written.values())
    assert sum(s.bytes_after for s in sizes.values()) == result.total_bytes_after
    assert result.total_bytes_after == nbytes
    assert sum(s.bytes_before for s in sizes.values()) == result.total_bytes_before
    assert result.total_bytes_before == sum(
        t.numel() * t.element_size() for t in source.values()
    )
    assert sizes["other"].bytes_before == sizes["other"].bytes_after == 0

    def class_bytes(tensors, test):
        return sum(t.numel() * t.element_size() for k, t in tensors.items() if test(k))

    assert sizes["routed_experts"].bytes_after == class_bytes(
        written, lambda k: ".mlp.experts." in k
    )
    assert sizes["router"].bytes_after == class_bytes(
        written, lambda k: ".mlp.gate." in k
    )
    assert sizes["norms"].bytes_after == class_bytes(written, lambda k: "norm." in k)
    # parameters, by hand from the config
    c = _config(sources[arch])
    total = sum(t.numel() for t in source.values())
    moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"]
    routed = moe_layers * c["n_routed_experts"] * expert
    assert result.total_parameters == total
    assert result.active_parameters == (
        total - routed + moe_layers * c["num_experts_per_tok"] * expert
    )


def test_a_kimi_k2_folder_with_its_head_quantized(sources, tmp_path):
    # Kimi K2's model_type (DeepSeek-V3's architecture), lm_head quantized as the
    # dense recipe's option does it: no longer in `ignore`, targeted by name
    src = tmp_path / "kimi"
    src.mkdir()
    for f in sources["deepseek_v3"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    config = _config(src)
    config["model_type"] = "kimi_k2"
    (src / "config.json").write_text(json.dumps(config))
    recipe = {"weights": "w8a16", "kv_cache_dtype": "bf16", "quantize_lm_head": True}

    result = compress(src, recipe, tmp_path / "out")

    tensors = load_file(tmp_path / "out" / "model.safetensors")
    qc = QuantizationConfig.model_validate(
        _config(tmp_path / "out")["quantization_config"]
    )
    assert "lm_head.weight_packed" in tensors and "lm_head.weight" not in tensors
    assert "lm_head" not in qc.ignore and r"re:.*mlp\.gate$" in qc.ignore
    assert result.total_parameters and result.active_parameters
    model = load_model(tmp_path / "out")
    assert type(model.lm_head).__name__ == "QuantLinear"
    assert model.config.model_type == "kimi_k2"


def test_a_published_block_fp8_source_is_dequantized_layer_by_layer(tmp_path):
    # DeepSeek-V3 / Kimi K2 as released: fp8 weights with 128x128 (here 16x16)
    # block scales. Each weight is read with its scales and dequantized when its
    # layer is built; the recipe then sees the same float32 weights the engine's
    # loader makes of that folder.
    from tests.gpuagent.engine.test_moe_archs import _to_block_fp8

    src = tmp_path / "fp8-source"
    deepseek_folder(src, **SHAPES["deepseek_v3"])
    save_byte_tokenizer(src)
    dequantized = _to_block_fp8(src, block=16)
    recipe = RECIPES["w4a16-g32-gptq"] | {"method": "rtn"}

    result = compress(src, recipe, tmp_path / "int4")
    dense = compress(
        src, {"weights": "bf16", "kv_cache_dtype": "bf16"}, tmp_path / "bf16"
    )

    tensors = load_file(tmp_path / "int4" / "model.safetensors")
    scheme = weight_scheme(recipe)
    for module in (
        "model.layers.1.mlp.experts.5.down_proj",
        "model.layers.2.self_attn.q_b_proj",
    ):
        rtn = quantize_rtn(dequantized[f"{module}.weight"], scheme)
        assert torch.equal(tensors[f"{module}.weight_packed"], pack_int32(rtn.codes, 4))
    assert not any(k.endswith("_scale_inv") for k in tensors)
    qc = _config(tmp_path / "int4")["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    QuantizationConfig.model_validate(qc)
    load_model(tmp_path / "int4")
    # bf16 out: no quantization_config left, the dequantized weights in bf16
    assert "quantization_config" not in _config(tmp_path / "bf16")
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert torch.equal(bf16[name], dequantized[name].to(torch.bfloat16))
    # sizes: the source's fp8 bytes and scales before; parameters without scales
    assert result.total_parameters == dense.total_parameters
    assert result.total_parameters == sum(t.numel() for k, t in bf16.items())


def test_experts_calibrated_in_bounded_passes_get_the_same_codes(sources, monkeypatch):
    # one expert's Hessian per pass and per GPTQ batch (a 1-byte budget: the
    # per-expert path) or all at once, the experts of a shape in one batch with
    # the rounded-to-nearest ones left out of it: the same Hessians, the same
    # GPTQ codes, the same fallbacks
    import copy

    from gpuagent.compress import moe
    from gpuagent.compress.moe import quantize_moe_layer

    batch_sizes = []

    def spy(weights, hessians, scheme):
        batch_sizes.append(len(hessians))
        return quantize_gptq_batch(weights, hessians, scheme)

    monkeypatch.setattr(moe, "quantize_gptq_batch", spy)

    model = load_model(sources["glm4_moe"])
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 264, (2, 48), generator=gen)
    cos, sin = model._rope(torch.arange(48))
    with torch.no_grad():
        hidden = model.layers[0].forward_dense(model.embed_tokens(tokens), cos, sin)
    scheme = weight_scheme(RECIPES["w4a16-g32-gptq"] | {"min_expert_tokens": 12})
    runs = []
    sizes = []
    for budget in (1, 1 << 40):
        batch_sizes.clear()
        layer, quantized, fallbacks = copy.deepcopy(model.layers[1]), {}, []
        with torch.no_grad():
            quantize_moe_layer(
                1,
                layer,
                scheme,
                quantized,
                (hidden, cos, sin),
                hessian_budget_bytes=budget,
                fallbacks=fallbacks,
            )
        runs.append((quantized, fallbacks))
        sizes.append(list(batch_sizes))
    (one, fell_one), (all_, fell_all) = runs
    # 192 (token, expert) pairs over 8 experts: some get fewer than 12
    assert fell_one == fell_all and fell_one
    calibrated = 8 - len(fell_one)
    assert set(sizes[0]) == {1}
    # the attention groups alone; gate/up: the calibrated experts and the shared
    # expert (one expert wide: the same shapes) at once, then down likewise
    assert sizes[1] == [1, 1, calibrated + 1, calibrated + 1] and calibrated > 1
    assert one.keys() == all_.keys()
    assert len([k for k in one if ".experts." in k]) == 8 * 3
    for name in one:
        assert torch.equal(one[name].codes, all_[name].codes), name


@pytest.mark.parametrize("arch", BUILDERS)
def test_transformers_loads_the_compressed_experts(compressed, arch):
    # transformers (with compressed-tensors) decompresses each expert's codes into
    # its fused expert tensors: the weights are the engine's up to the bf16
    # rounding of compressed-tensors' product (it keeps them in bf16 whatever the
    # dtype asked), and so are the logits (random experts would be off by the
    # logits' own scale). Its "Could not match re:.*mlp\.experts\.\d+..." warning
    # is about its fused expert modules; the per-expert tensors are read anyway.
    import transformers

    folder, _ = compressed(arch, "w4a16-g32-gptq")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine = load_model(folder)
    q = engine.layers[1].mlp.experts[3].down_proj
    ours = q(torch.eye(q.in_features)).t()  # [N, K]
    theirs = hf.model.layers[1].mlp.experts.down_proj[3].float()
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=2**-8)
    tokens = torch.tensor([[5, 17, 33, 99, 120, 7, 200, 42]])
    with torch.no_grad():
        diff = (hf(tokens).logits[0] - engine.forward_dense(tokens)[0]).abs().max()
    print(f"{arch}: transformers vs engine logits max abs diff {diff:.2e}")
    assert diff < 0.05
