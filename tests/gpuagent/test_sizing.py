"""gpuagent.sizing on the published configs (tests/data/configs, as their model
folders ship them), checked by hand, and against the layouts it mirrors (the
compressed-tensors tensors gpuagent.compress writes, kernels/kv_quant's cache)."""

import json
from pathlib import Path

import pytest

from gpuagent import sizing
from gpuagent.sizing import Knobs, SizingError, size_deployment

CONFIGS = Path(__file__).resolve().parent.parent / "data" / "configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def report(name: str, **knobs):
    return size_deployment(config(name), Knobs(**{"gpu_memory_gib": 80, **knobs}))


def test_it_counts_kimi_k2_by_class():
    """Kimi K2 (hidden 7168, 61 layers, 1 dense then 60 MoE, 64 heads, vocab 163840):

    attention per layer: q_a 7168x1536 = 11,010,048; q_b 1536x(64x192) = 18,874,368;
      kv_a 7168x576 = 4,128,768; kv_b 512x(64x256) = 8,388,608; o 8192x7168 =
      58,720,256 -> 101,122,048 x 61 = 6,168,444,928
    routed: 384 x 3 x 7168 x 2048 = 16,911,433,728 a layer x 60 = 1,014,686,023,680;
      active 8 of 384 -> 21,139,292,160
    shared: 3 x 7168 x 2048 x 60 = 2,642,411,520
    router: (384 x 7168 + 384 bias) x 60 = 165,173,760
    dense MLP: 3 x 7168 x 18432 = 396,361,728
    embeddings + head: 2 x 163840 x 7168 = 2,348,810,240
    norms: (2 x 7168 + the q_a/kv_a layernorms 1536 + 512) x 61 + 7168 = 1,006,592
    total 1,026,408,232,448 (~1.03T); active 32,861,500,928 (~32B, the model card's
    count, embeddings included)."""
    r = report("kimi-k2-instruct")

    assert r.params_by_class == {
        "attention": 6_168_444_928,
        "routed_experts": 1_014_686_023_680,
        "shared_experts": 2_642_411_520,
        "router": 165_173_760,
        "dense_mlp": 396_361_728,
        "embeddings": 2_348_810_240,
        "norms": 1_006_592,
    }
    assert r.active_params_by_class["routed_experts"] == 21_139_292_160
    assert r.total_params == 1_026_408_232_448
    assert r.active_params == 32_861_500_928
    assert r.mtp_params == 0


def test_it_counts_glm_4_5_by_class():
    """GLM-4.5 (hidden 5120, 92 layers: 3 dense then 89 MoE; 96 heads x 128, 8 KV
    heads, q/k/v biases, q/k norms; 160 experts of 1536, 8 a token, 1 shared):

    attention per layer: q 5120x12288 + 12288 bias = 62,926,848; k and v 5120x1024
      + 1024 = 5,243,904 each; o 12288x5120 = 62,914,560 -> 136,329,216 x 92 =
      12,542,287,872
    routed: 160 x 3 x 5120 x 1536 = 3,774,873,600 x 89 = 335,963,750,400;
      active 8 of 160 -> 16,798,187,520
    shared 3 x 5120 x 1536 x 89 = 2,099,773,440; router (160 x 5120 + 160) x 89 =
      72,923,040; dense 3 x 3 x 5120 x 12288 = 566,231,040;
      embeddings + head 2 x 151552 x 5120 = 1,551,892,480; norms (2 x 5120 + the
      q/k norms 2 x 128) x 92 + 5120
    total 352,797,829,024; with the MTP layer (3,988,069,792) 356.8B: the model
    card's 355B. Active without embeddings 32,080,373,664: the card's 32B."""
    r = report("glm-4.5")

    assert r.params_by_class["attention"] == 12_542_287_872
    assert r.params_by_class["routed_experts"] == 335_963_750_400
    assert r.active_params_by_class["routed_experts"] == 16_798_187_520
    assert r.params_by_class["shared_experts"] == 2_099_773_440
    assert r.params_by_class["router"] == 72_923_040
    assert r.params_by_class["dense_mlp"] == 566_231_040
    assert r.params_by_class["embeddings"] == 1_551_892_480
    assert r.params_by_class["norms"] == (2 * 5120 + 2 * 128) * 92 + 5120
    assert r.total_params == 352_797_829_024
    assert abs(r.total_params + r.mtp_params - 355e9) / 355e9 < 0.01
    assert r.active_params_no_embeddings == 32_080_373_664


def test_it_counts_llama_3_1():
    """Llama-3.1-8B: embed + head 2 x 128256 x 4096 = 1,050,673,152; per layer q/o
    4096x4096 x 2 + k/v 4096x1024 x 2 = 41,943,040, MLP 3 x 4096 x 14336 =
    176,160,768, norms 8192 -> 218,112,000 x 32 = 6,979,584,000; final norm 4096:
    8,030,261,248. 70B likewise: 70,553,706,496."""
    assert report("llama-3.1-8b").total_params == 8_030_261_248
    assert report("llama-3.1-70b").total_params == 70_553_706_496
    assert report("llama-3.1-8b").active_params == 8_030_261_248


def test_it_sizes_the_mla_latent_per_kv_dtype():
    """MLA caches kv_lora_rank + qk_rope_head_dim = 576 values a layer, one head:
    bf16 61 x 576 x 2 = 70,272 bytes a token; fp8 576; int8 576 + 2 (a float16
    scale); int4 288 + 2. Expanded K/V: 64 heads x (192 + 128) x 2 x 61 =
    2,498,560 bf16 bytes, 35.6x the latent."""
    kv = {k.kv_dtype: k for k in report("kimi-k2-instruct").kv}

    assert kv["bf16"].bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert kv["fp8"].bytes_per_token == 61 * 576
    assert kv["int8"].bytes_per_token == 61 * 578
    assert kv["int4"].bytes_per_token == 61 * 290
    assert kv["bf16"].expanded_bytes_per_token == 64 * (192 + 128) * 2 * 61
    assert kv["int4"].window_bytes_per_sequence == 61 * 576 * 2 * 18


@pytest.mark.parametrize("kv_dtype", sizing.KV_DTYPES)
@pytest.mark.parametrize("name", ["glm-4.5", "llama-3.1-8b"])
def test_it_sizes_gqa_kv_as_the_engine_cache_does(name, kv_dtype):
    from gpuagent.engine.engine import DEFAULT_KV_WINDOW
    from kernels.kv_quant import kv_bytes_per_token, kv_static_bytes

    r = report(name)
    shape = sizing.model_shape(config(name))
    if kv_dtype == "int4c" and name == "glm-4.5":  # Llama attention only
        assert kv_dtype not in [k.kv_dtype for k in r.kv]
        with pytest.raises(sizing.SizingError, match="int4c KV is for model_type"):
            report(name, kv_cache_dtype=kv_dtype)
        return
    kv = next(k for k in r.kv if k.kv_dtype == kv_dtype)

    expected = kv_bytes_per_token(kv_dtype, shape.num_kv_heads, shape.head_dim)
    assert kv.bytes_per_token_per_layer == expected
    assert kv.bytes_per_token == expected * shape.num_layers
    static = kv_static_bytes(kv_dtype, shape.num_kv_heads, shape.head_dim)
    assert kv.static_bytes == static * shape.num_layers
    if kv_dtype != "fp8":  # vLLM serves fp8, without the engine's window
        assert kv.window_tokens == DEFAULT_KV_WINDOW.get(kv_dtype, 0)


@pytest.mark.parametrize(
    "fmt", ["w8a16", "w4a16-g128", "w4a16-g128-asym", "w4a16-g64", "fp8"]
)
@pytest.mark.parametrize(("n", "k"), [(48, 256), (40, 192), (24, 576)])
def test_it_counts_the_bytes_compress_writes(fmt, n, k):
    import torch

    from gpuagent.compress.checkpoint import quantized_tensors
    from gpuagent.compress.quantize import quantize_rtn
    from gpuagent.compress.recipes import weight_scheme

    format_ = sizing.weight_format(fmt)
    weights = "w4a16-g" + str(format_.group_size) if format_.bits == 4 else fmt
    scheme = weight_scheme(
        {"weights": weights, "kv_cache_dtype": "bf16", "symmetric": format_.symmetric}
    )
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))

    tensors = quantized_tensors("p", quantize_rtn(w, scheme))

    written = sum(t.numel() * t.element_size() for t in tensors.values())
    assert sizing.linear_weight_bytes(format_, n, k) == written
    if format_.bits == 4:
        assert format_.group_for(k) == scheme.group_size_for(k)


def test_it_refuses_a_width_no_int4_group_divides():
    with pytest.raises(SizingError, match="in_features=200"):
        sizing.weight_format("w4a16-g128").group_for(200)


def test_it_sizes_weights_per_format():
    """Llama-3.1-8B bf16: 2 bytes each of 8,030,261,248 = 16,060,522,496. w4a16-g128
    keeps embeddings, head and norms in bf16 and packs the rest at half a byte plus
    a bf16 scale per 128: below a third of bf16."""
    weights = {w.format: w for w in report("llama-3.1-8b").weights}

    assert weights["bf16"].total_bytes == 2 * 8_030_261_248
    assert weights["w4a16-g128"].by_class["embeddings"] == 2 * 1_050_673_152
    linear = 6_979_584_000 - 32 * 8192  # the layers' Linear weights
    int4 = (
        weights["w4a16-g128"].by_class["attention"]
        + weights["w4a16-g128"].by_class["dense_mlp"]
    )
    assert linear // 2 < int4 < linear // 2 + linear // 64 + 32 * 7 * 16 + 1
    assert weights["fp8"].total_bytes == weights["w8a16"].total_bytes - 32 * 7 * 16


def test_it_plans_sessions_per_device_by_hand():
    """Llama-3.1-8B bf16 on 1 x 80 GiB at 0.9 with 4 GiB headroom: 72 GiB budget
    (77,309,411,328) - 16,060,522,496 weights - 4 GiB = 56,953,921,536 bytes for KV
    at 131,072 a token = 434,523 tokens = 53 sessions of 8192."""
    r = report("llama-3.1-8b", context_tokens=8192, devices=1)

    budget = int(80 * 2**30 * 0.9)
    free = budget - 16_060_522_496 - 4 * 2**30
    assert r.deployment.kv_budget_bytes == free
    assert r.deployment.token_capacity == free // 131_072
    assert r.deployment.sessions_at_context == free // (8192 * 131_072) == 53


def test_it_keeps_the_whole_mla_latent_on_every_rank():
    """vLLM replicates the MLA cache over tensor-parallel ranks; GQA heads split."""
    kimi = sizing.model_shape(config("kimi-k2-instruct"))
    llama = sizing.model_shape(config("llama-3.1-70b"))
    kv_kimi = sizing.kv_bytes(kimi, "bf16")
    kv_llama = sizing.kv_bytes(llama, "bf16")

    assert sizing.kv_bytes_per_rank(kimi, kv_kimi, 8)[0] == 70_272
    assert sizing.kv_bytes_per_rank(llama, kv_llama, 8)[0] == 327_680 // 8
    assert sizing.kv_bytes_per_rank(llama, kv_llama, 16)[0] == 327_680 // 8


def test_it_finds_the_devices_needed():
    """Kimi K2 w4a16 (496 GiB) does not fit 4 x 80 GiB; on 8 the weights take
    ~62.7 GiB a device; 2 sessions of 32k fit there and not on fewer."""
    r = report(
        "kimi-k2-instruct",
        devices=8,
        context_tokens=32768,
        sessions=2,
        weights="w4a16-g128",
        kv_cache_dtype="fp8",
    )

    assert r.devices_needed.devices == 8
    assert r.devices_needed.sessions_at_context >= 2
    four = sizing.plan_devices(
        sizing.model_shape(config("kimi-k2-instruct")),
        next(w for w in r.weights if w.format == "w4a16-g128"),
        next(k for k in r.kv if k.kv_dtype == "fp8"),
        r.knobs,
        4,
    )
    assert not four.fits_weights
    assert report("kimi-k2-instruct", sessions=10**5).devices_needed is None


def test_it_renders_the_vllm_preset_with_expert_parallel_for_moe():
    r = report(
        "kimi-k2-instruct",
        devices=8,
        context_tokens=65536,
        weights="w4a16-g128",
        kv_cache_dtype="fp8",
    )

    argv = r.vllm_argv
    assert argv[:3] == ["vllm", "serve", "MODEL_DIR"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert argv[argv.index("--max-model-len") + 1] == "65536"
    assert argv[argv.index("--quantization") + 1] == "compressed-tensors"
    assert "--enable-expert-parallel" in argv
    assert "remote code" in r.vllm_note
    assert "gpuagent.models.import_published" in r.vllm_note
    assert "no config class for model_type kimi_k2" in r.vllm_note
    llama = report("llama-3.1-8b", weights="bf16", kv_cache_dtype="bf16").vllm_argv
    assert "--enable-expert-parallel" not in llama
    assert "--quantization" not in llama
    assert llama[llama.index("--kv-cache-dtype") + 1] == "auto"


def test_it_sizes_int4c_as_int4_plus_its_key_means_for_llama_only():
    r = report("llama-3.1-8b", kv_cache_dtype="int4c")
    shape = sizing.model_shape(config("llama-3.1-8b"))
    kv = {k.kv_dtype: k for k in r.kv}

    assert kv["int4c"].bytes_per_token == kv["int4"].bytes_per_token
    assert kv["int4c"].window_bytes_per_sequence == (
        kv["int4"].window_bytes_per_sequence
    )
    # one float32 key mean [kv_heads, head_dim] per layer: 32 x 8 x 128 x 4
    assert kv["int4c"].static_bytes == 32 * 8 * 128 * 4
    assert shape.num_layers * shape.num_kv_heads * shape.head_dim == 32 * 8 * 128
    assert r.sessions_by_kv_dtype["int4c"] <= r.sessions_by_kv_dtype["int4"]
    assert r.vllm_argv == [] and "vLLM has no int4c KV cache" in r.vllm_note
    for name in ("kimi-k2-instruct", "glm-4.5"):
        assert "int4c" not in report(name).sessions_by_kv_dtype


def test_it_gives_no_vllm_command_for_a_kv_dtype_vllm_lacks():
    r = report("glm-4.5", kv_cache_dtype="int4", weights="w4a16-g128", devices=8)

    assert r.vllm_argv == [] and r.vllm_command == ""
    assert "no int4 KV cache" in r.vllm_note


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen9"}, 'model_type "qwen9" is not supported'),
        ({"kv_lora_rank": None}, "'kv_lora_rank' must be an integer"),
        ({"hidden_size": True}, "'hidden_size' must be an integer"),
        ({"n_routed_experts": 0}, "'n_routed_experts' must be in \\[1, "),
        ({"num_experts_per_tok": 500}, "num_experts_per_tok 500 > n_routed_experts"),
        ({"tie_word_embeddings": "no"}, "'tie_word_embeddings' must be true or false"),
    ],
)
def test_it_names_what_is_wrong_with_a_config(change, message):
    bad = {**config("kimi-k2-instruct"), **change}

    with pytest.raises(SizingError, match=message):
        size_deployment(bad, Knobs(gpu_memory_gib=80))


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"gpu_memory_gib": 0}, "gpu_memory_gib"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"devices": 0}, "devices"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
        ({"weights": "w4a16-g16"}, "unknown weights format 'w4a16-g16'"),
        ({"activation_headroom_gib": 90}, "activation_headroom_gib"),
    ],
)
def test_it_names_a_bad_knob(knobs, message):
    with pytest.raises(SizingError, match=message):
        size_deployment(
            config("llama-3.1-8b"), Knobs(**{"gpu_memory_gib": 80, **knobs})
        )


def test_it_reads_a_kimi_k25_text_config():
    wrapped = {"model_type": "kimi_k25", "text_config": config("kimi-k2-instruct")}

    assert (
        report("kimi-k2-instruct").total_params
        == size_deployment(wrapped, Knobs(gpu_memory_gib=80)).total_params
    )


def test_it_runs_from_the_command_line(capsys):
    rc = sizing.main(
        [
            str(CONFIGS / "kimi-k2-instruct.json"),
            "--gpu-memory-gib",
            "141",
            "--devices",
            "8",
            "--context",
            "32768",
            "--weights",
            "w4a16-g128",
            "--kv",
            "fp8",
        ]
    )

    out = capsys.readouterr().out
    assert rc == 0
    assert "1,026.41B parameters" in out
    assert "--enable-expert-parallel" in out


def test_it_refuses_a_bad_config_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "model_type": "llama"}')

    rc = sizing.main([str(path), "--gpu-memory-gib", "80"])

    assert rc == 2
    assert "duplicate" in capsys.readouterr().err.lower()


@pytest.mark.parametrize(
    ("layers", "first", "freq"),
    [(61, 1, 1), (92, 3, 1), (27, 1, 2), (4, 0, 3), (3, 5, 1)],
)
def test_it_counts_moe_layers_as_transformers_places_them(layers, first, freq):
    shape = sizing.model_shape(
        {
            **config("kimi-k2-instruct"),
            "num_hidden_layers": layers,
            "first_k_dense_replace": first,
            "moe_layer_freq": freq,
        }
    )

    assert shape.num_moe_layers == sum(shape.is_moe_layer(i) for i in range(layers))


def test_it_plans_data_parallel_attention_for_mla():
    """Kimi K2 w4a16, fp8 KV on 8 x 141 GiB. Tensor parallel: every rank holds the
    whole latent (35,136 bytes a token). Data-parallel attention: each device holds
    the non-expert weights whole plus 1/8 of the routed experts and the latent of
    its own sessions, so the deployment holds 8 devices' worth of sessions."""
    kw = {
        "gpu_memory_gib": 141,
        "devices": 8,
        "context_tokens": 32768,
        "weights": "w4a16-g128",
        "kv_cache_dtype": "fp8",
    }
    tensor = size_deployment(config("kimi-k2-instruct"), Knobs(**kw))
    data = size_deployment(config("kimi-k2-instruct"), Knobs(**kw, parallelism="data"))

    w4 = next(w for w in data.weights if w.format == "w4a16-g128")
    routed = w4.by_class["routed_experts"]
    assert data.deployment.weight_bytes == w4.total_bytes - routed + -(-routed // 8)
    assert tensor.deployment.weight_bytes < data.deployment.weight_bytes
    assert data.deployment.kv_bytes_per_token == tensor.deployment.kv_bytes_per_token
    assert data.deployment.kv_bytes_per_token == 61 * 576
    per_device = data.deployment.kv_budget_bytes // (32768 * 61 * 576)
    assert data.deployment.sessions_at_context == 8 * per_device
    assert (
        data.deployment.sessions_at_context > 4 * tensor.deployment.sessions_at_context
    )
    argv = data.vllm_argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert argv[argv.index("--data-parallel-size") + 1] == "8"
    assert "--enable-expert-parallel" in argv


def test_it_splits_gqa_heads_under_tensor_parallelism_not_data():
    kw = {"gpu_memory_gib": 80, "devices": 8, "weights": "w4a16-g128"}
    tensor = size_deployment(config("llama-3.1-70b"), Knobs(**kw))
    data = size_deployment(config("llama-3.1-70b"), Knobs(**kw, parallelism="data"))

    assert tensor.deployment.kv_bytes_per_token == 327_680 // 8
    assert data.deployment.kv_bytes_per_token == 327_680
    assert "--enable-expert-parallel" not in data.vllm_argv


@pytest.mark.parametrize("parallelism", ["tensor", "data"])
def test_vllms_own_parser_takes_the_sizing_command(parallelism):
    # where vLLM is installed (not in this project's environment)
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    r = report(
        "kimi-k2-instruct",
        devices=8,
        weights="w4a16-g128",
        kv_cache_dtype="fp8",
        parallelism=parallelism,
    )
    parser = FlexibleArgumentParser()
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(r.vllm_argv[1:])
    serve.validate(args)

    assert args.enable_expert_parallel
    assert args.kv_cache_dtype == "fp8"
    assert args.tensor_parallel_size == (8 if parallelism == "tensor" else 1)
    assert args.data_parallel_size == (1 if parallelism == "tensor" else 8)


def test_it_leaves_the_named_classes_in_bf16():
    """Kimi K2 Thinking's layout: int4 (group 32) routed experts, attention and
    shared experts in bf16: attention is 2 bytes a parameter, the experts are not."""
    r = report(
        "kimi-k2-instruct",
        weights="w4a16-g32",
        keep_bf16=("attention", "shared_experts"),
    )
    w = next(w for w in r.weights if w.format == "w4a16-g32")

    assert w.by_class["attention"] == 2 * r.params_by_class["attention"]
    assert w.by_class["shared_experts"] == 2 * r.params_by_class["shared_experts"]
    routed = r.params_by_class["routed_experts"]
    # half a byte a value plus a bf16 scale per 32, plus weight_shape per Linear
    assert w.by_class["routed_experts"] == routed // 2 + routed // 32 * 2 + (
        60 * 384 * 3 * 16
    )
    assert w.by_class["dense_mlp"] < 2 * r.params_by_class["dense_mlp"]


def test_it_refuses_a_class_it_cannot_leave_in_bf16():
    with pytest.raises(SizingError, match="keep_bf16 takes .* not router"):
        report("kimi-k2-instruct", keep_bf16=("router",))


def test_it_sizes_the_checkpoint_as_published():
    """Kimi K2 ships fp8 in 128x128 blocks: each Linear 1 byte a value plus a
    float32 scale per block; embeddings, head, router, norms bf16. 958.5 GiB, about
    the 1.03 TB its folder takes. GLM-4.5's config names no quantization."""
    r = report("kimi-k2-instruct")
    published = r.published_weights
    q_b = 1536 * 64 * 192 + 4 * (64 * 192 // 128) * (1536 // 128)

    assert published.format == "fp8-block128x128 (published)"
    assert published.by_class["embeddings"] == 2 * r.params_by_class["embeddings"]
    assert published.by_class["router"] == 2 * r.params_by_class["router"]
    assert q_b * 61 < published.by_class["attention"]
    assert abs(published.total_bytes / 1.03e12 - 1) < 0.01
    assert report("glm-4.5").published_weights is None


def test_it_leaves_out_a_reported_format_the_widths_refuse():
    """A hidden size of 4100 takes no int4 group of 32 or more: the table drops
    w4a16-g128 and says why, unless that is the format asked for."""
    odd = {**config("llama-3.1-8b"), "hidden_size": 4100, "head_dim": 128}

    r = size_deployment(odd, Knobs(gpu_memory_gib=80))

    assert [w.format for w in r.weights] == ["bf16", "fp8", "w8a16"]
    assert any("w4a16-g128 not shown" in n and "4100" in n for n in r.notes)
    with pytest.raises(SizingError, match="in_features=4100"):
        size_deployment(odd, Knobs(gpu_memory_gib=80, weights="w4a16-g128"))


def test_it_refuses_heads_that_kv_heads_do_not_divide():
    bad = {**config("glm-4.5"), "num_key_value_heads": 7}

    with pytest.raises(
        SizingError, match="96 is not a multiple of num_key_value_heads 7"
    ):
        size_deployment(bad, Knobs(gpu_memory_gib=80))


def test_it_counts_deepseek_v3_as_its_model_card():
    """DeepSeek-V3 (128 heads, 3 dense layers, 256 experts, vocab 129280): the card
    says 671B total, 37B activated, and Hugging Face 685B for the checkpoint, which
    adds the MTP module (its decoder layer plus its own copies of embeddings and
    head: 2 x 129280 x 7168): 684.49B, 684.53B with the fp8 block scales it counts.
    Attention a layer: q_a 11,010,048, q_b 1536 x 128 x 192 = 37,748,736, kv_a
    4,128,768, kv_b 512 x 128 x 256 = 16,777,216, o 16384 x 7168 = 117,440,512,
    187,105,280 x 61 = 11,413,422,080 (the q_a/kv_a layernorms are norms)."""
    r = report("deepseek-v3")

    assert r.params_by_class["attention"] == 187_105_280 * 61 == 11_413_422_080
    assert round(r.total_params / 1e9) == 671
    assert round(r.active_params / 1e9) in (37, 38)  # 37.55B
    mtp_on_hub = r.mtp_params + 2 * 129280 * 7168
    assert round((r.total_params + mtp_on_hub) / 1e9, 2) == 684.49


def test_it_counts_sessions_per_kv_dtype_on_the_same_devices():
    """Llama-3.1-70B w4a16 on 8 x 80 GiB at 32k: the same KV budget a device,
    40,960 bf16 bytes a token a device (one KV head), half that in fp8."""
    r = report("llama-3.1-70b", devices=8, weights="w4a16-g128")
    free = r.deployment.kv_budget_bytes

    assert r.sessions_by_kv_dtype["bf16"] == free // (32768 * 40_960)
    fp8_free = free - 80 * 2 * 4  # fp8's per-head scales, one head a device
    assert r.sessions_by_kv_dtype["fp8"] == fp8_free // (32768 * 20_480)
    assert r.sessions_by_kv_dtype["int4"] > r.sessions_by_kv_dtype["int8"]


def _tiny_moe_config(tmp_path, build) -> dict:
    # a tiny random checkpoint as transformers writes it (its config.json names
    # no topk_method)
    build(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_it_counts_a_tiny_deepseek_v3_by_hand(tmp_path):
    """tests.gpuagent.engine.test_moe_archs.deepseek_folder: hidden 64, 3 layers
    (1 dense, 2 MoE), 4 heads, q_lora 48, kv_lora 32, qk 16 + 8, v 12, vocab 97,
    8 routed experts of 24 (3 a token), 1 shared, dense MLP 96, head untied.

    attention a layer: q_a 64x48 = 3072; q_b 48x(4 x 24) = 4608; kv_a 64x(32 + 8)
      = 2560; kv_b 32x(4 x (16 + 12)) = 3584; o 48x64 = 3072 -> 16,896 x 3 = 50,688
    norms: (input 64 + post-attention 64 + q_a_layernorm 48 + kv_a_layernorm 32)
      x 3 + final 64 = 688
    router: (8 x 64 gate + 8 e_score_correction_bias) x 2 = 1040
    routed: 3 x 64 x 24 = 4608 x 8 x 2 = 73,728; shared 4608 x 2 = 9216
    dense: 3 x 64 x 96 = 18,432; embeddings + head: 2 x 97 x 64 = 12,416"""
    from tests.gpuagent.engine.test_moe_archs import deepseek_folder

    config = _tiny_moe_config(tmp_path, deepseek_folder)
    assert "topk_method" not in config

    shape = sizing.model_shape(config)

    assert shape.router_bias
    assert sizing.params_by_class(sizing.model_tensors(shape)) == {
        "attention": 50_688,
        "routed_experts": 73_728,
        "shared_experts": 9_216,
        "router": 1_040,
        "dense_mlp": 18_432,
        "embeddings": 12_416,
        "norms": 688,
    }
    # DeepSeek's routing before V3's (no correction bias) keeps no bias
    greedy = sizing.model_shape({**config, "topk_method": "greedy"})
    assert not greedy.router_bias


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_its_classes_are_the_size_reports_for_every_tensor_written(tmp_path, arch):
    # every tensor of a tiny checkpoint, classed by its name as the compress size
    # report does: the same parameters per class as sizing counts from the config
    from safetensors.torch import load_file

    from gpuagent.compress.size_report import tensor_class
    from tests.gpuagent.engine.test_moe_archs import deepseek_folder, glm_folder

    build = deepseek_folder if arch == "deepseek_v3" else glm_folder
    config = _tiny_moe_config(tmp_path, build)
    tensors = load_file(tmp_path / "model.safetensors")
    written = dict.fromkeys(sizing.TENSOR_CLASSES, 0)
    for name, t in tensors.items():
        written[tensor_class(name, moe=True)] += t.numel()

    counted = sizing.params_by_class(sizing.model_tensors(sizing.model_shape(config)))

    assert written == counted
    assert counted["norms"] > (2 * config["num_hidden_layers"] + 1) * 64
