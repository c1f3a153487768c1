"""Command templates of external engines: argv lists without a shell, every
placeholder known, presets that refuse what their engine cannot do."""

import pytest

from gpuagent.serving import PLACEHOLDERS, TemplateError, parse_template, render_command
from gpuagent.serving.templates import (
    PRESETS,
    check_allowed_shape,
    preset_template,
    quantization_args,
    redacted_command,
)

VALUES = {name: f"<{name}>" for name in PLACEHOLDERS}


def test_it_renders_an_argv_list_one_argument_per_word():
    argv = render_command(
        "{python} -m gpuagent.engine serve {model_dir} --port {port}",
        {**VALUES, "model_dir": "/models/a b; rm -rf /", "port": "8101"},
    )

    # the value with a space and a ';' stays one argument: there is no shell
    assert argv == [
        "<python>",
        "-m",
        "gpuagent.engine",
        "serve",
        "/models/a b; rm -rf /",
        "--port",
        "8101",
    ]


def test_it_keeps_quoted_words_and_literal_braces():
    argv = render_command("srv --json '{{\"a\": 1}}' --name=m-{port}", VALUES)

    assert argv == ["srv", "--json", '{"a": 1}', "--name=m-<port>"]


def test_it_refuses_unknown_placeholders_naming_each():
    with pytest.raises(TemplateError) as info:
        parse_template("vllm serve {model_dir} --gpu {gpu_id} --x {secret} {gpu_id}")

    message = str(info.value)
    assert "{gpu_id}" in message and "{secret}" in message
    assert message.count("{gpu_id}") == 1 and "known: {python}" in message


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("", "empty command template"),
        ("   ", "empty command template"),
        ("vllm serve '{model_dir}", "cannot be split"),
        ("vllm serve {model_dir", "bad placeholder"),
        ("vllm serve {port:>6}", "only plain {name}"),
        ("vllm serve {model_dir!r}", "only plain {name}"),
        ("vllm serve {}", "only plain {name}"),
        ("vllm serve {0}", "unknown placeholder"),
        ("vllm serve {model_dir.__class__}", "{model_dir.__class__}"),
        ("{model_dir}/bin/serve", "must be a literal command"),
    ],
)
def test_it_refuses_bad_templates_with_a_clear_error(template, expected):
    with pytest.raises(TemplateError, match=None) as info:
        render_command(template, VALUES)

    assert expected in str(info.value)


def test_it_refuses_a_placeholder_without_a_value():
    with pytest.raises(TemplateError, match="no value for placeholder"):
        render_command("srv {port}", {"model_dir": "/m"})


def test_it_maps_the_kv_dtype_through_the_vllm_preset():
    template, kv = preset_template("vllm", "fp8")
    argv = render_command(template, {**VALUES, "kv_cache_dtype": kv})

    assert argv[:3] == ["vllm", "serve", "<model_dir>"]
    i = argv.index("--kv-cache-dtype")
    assert argv[i + 1] == "fp8"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "<tensor_parallel_size>"
    assert argv[argv.index("--max-model-len") + 1] == "<max_model_len>"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == (
        "<gpu_memory_utilization>"
    )


@pytest.mark.parametrize(
    ("quantized", "flags"),
    [(False, []), (True, ["--quantization", "compressed-tensors"])],
)
def test_the_vllm_preset_passes_a_quantization_flag_only_for_a_quantized_folder(
    quantized, flags
):
    template, kv = preset_template("vllm", "bf16")
    argv = render_command(
        template, {**VALUES, "quantization_args": quantization_args(quantized)}
    )

    # an empty list placeholder leaves no argument behind (not even "")
    assert argv[:3] == ["vllm", "serve", "<model_dir>"]
    assert argv[3:5] == (flags or ["--kv-cache-dtype", "<kv_cache_dtype>"])
    assert ("--quantization" in argv) is quantized and "" not in argv


def test_it_refuses_a_kv_dtype_or_preset_the_engine_does_not_have():
    with pytest.raises(TemplateError, match="no KV cache dtype 'int8'"):
        preset_template("vllm", "int8")
    with pytest.raises(TemplateError, match="unknown serving preset 'sglang'"):
        preset_template("sglang", "fp8")


def test_it_gives_each_served_name_its_own_argument():
    template = "srv --served-model-name {served_model_names} --port {port}"
    names = ["demo-llama", "demo-llama@1.0"]

    argv = render_command(template, {**VALUES, "served_model_names": names})
    preset, kv = preset_template("vllm", "fp8")
    vllm = render_command(
        preset, {**VALUES, "kv_cache_dtype": kv, "served_model_names": names}
    )

    assert argv == ["srv", "--served-model-name", *names, "--port", "<port>"]
    i = vllm.index("--served-model-name")
    assert vllm[i + 1 : i + 3] == names


def test_it_refuses_a_list_placeholder_inside_a_word():
    with pytest.raises(TemplateError) as info:
        render_command("srv --names={served_model_names}", VALUES)

    assert "{served_model_names} must stand alone" in str(info.value)


@pytest.mark.parametrize(
    "template",
    [
        "{python} -c 'import os; os.system(\"id\")'",
        "{python} -m gpuagent.engine serve {model_dir} --port {port} -c x",
        "vllm serve {model_dir} --port {port}",  # vllm, not the preset's shape
    ],
)
def test_an_allowed_shape_admits_no_other_arguments(template):
    allowed = ["vllm", "{python}", "{python} -m gpuagent.engine serve {model_dir}"]

    with pytest.raises(TemplateError, match="not an argument shape this agent"):
        check_allowed_shape(template, allowed)


@pytest.mark.parametrize(
    "template",
    [
        PRESETS["vllm"][0],  # the preset's name allows its whole template
        "{python}  -m  gpuagent.engine serve '{model_dir}'",  # same words
    ],
)
def test_an_allowed_shape_admits_its_own_words(template):
    allowed = ["vllm", "{python} -m gpuagent.engine serve {model_dir}"]

    check_allowed_shape(template, allowed)


def test_a_reported_command_line_hides_the_values_of_secret_flags():
    argv = [
        "vllm",
        "serve",
        "/models/m",
        "--api-key",
        "sk-123",
        "--hf-token=hf_abc",
        "HF_TOKEN=hf_def",
        "--key",
        "k",
        "--kv-cache-dtype",
        "fp8",
        "--public-key",
        "/keys/signer.pub",
    ]

    shown = redacted_command(argv)

    assert shown == [
        "vllm",
        "serve",
        "/models/m",
        "--api-key",
        "***",
        "--hf-token=***",
        "HF_TOKEN=***",
        "--key",
        "***",
        "--kv-cache-dtype",
        "fp8",
        "--public-key",
        "/keys/signer.pub",
    ]
    assert not {"sk-123", "hf_abc", "hf_def", "k"} & set(" ".join(shown).split())
