"""The vllm preset as a deploy renders it for each kind of folder: a stand-in
`vllm` program on PATH records the argv it was started with (and serves /health),
so the flags are those of a real deploy after verification. Where vLLM is
importable, the same argv is parsed with vLLM's own argument parser."""

import json
import os
import sys
from pathlib import Path

import pytest

from gpuagent.compress import compress
from gpuagent.integrity import file_digests, hash_model
from gpuagent.protocol import BackendSpec, Recipe
from gpuagent.serving import deploy
from gpuagent.serving.errors import DeployRefusedError
from gpuagent.serving.verify import check_weight_format
from tests.gpuagent.compress.conftest import TEST_CALIBRATION
from tests.gpuagent.serving_backends.conftest import (
    DEMO_MODEL,
    HEALTH_SERVER,
    Approved,
    spec_for,
)

# What a deploy passes per folder, and the demo model's max_position_embeddings.
DEMO_MAX_POSITIONS = 2048
FOLDERS = {
    "bf16": {"weights": "bf16", "kv_cache_dtype": "bf16"},
    "bf16-fp8kv": {"weights": "bf16", "kv_cache_dtype": "fp8"},
    "w4a16-g128": {"weights": "w4a16-g128", "kv_cache_dtype": "bf16"},
    "bf16-fp8kv-head": {"weights": "bf16", "kv_cache_dtype": "fp8"},
}
FAKE_VLLM = f"""#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_VLLM_ARGV"], "w") as f:
    json.dump(argv, f)
port = argv[argv.index("--port") + 1]
name = argv[argv.index("--served-model-name") + 1]
os.execv(sys.executable, [sys.executable, {str(HEALTH_SERVER)!r},
         "--port", port, "--name", name])
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Approved]:
    """The demo model compressed under each of FOLDERS, hashed as approved."""
    root = tmp_path_factory.mktemp("preset")
    made = {}
    for name, recipe in FOLDERS.items():
        out = root / name
        strategy = "attn_head" if name.endswith("-head") else "tensor"
        compress(
            DEMO_MODEL,
            recipe,
            out,
            calibration_size=TEST_CALIBRATION,
            kv_scale_strategy=strategy,
        )
        manifest = hash_model(out)
        made[name] = Approved(out, manifest.digest, file_digests(out, manifest))
    return made


@pytest.fixture
def fake_vllm(tmp_path) -> tuple[dict[str, str], Path]:
    """(server environment with a stand-in `vllm` first on PATH, the file it
    writes its argv to)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "vllm"
    program.write_text(FAKE_VLLM)
    program.chmod(0o755)
    argv_file = tmp_path / "vllm-argv.json"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    env["FAKE_VLLM_ARGV"] = str(argv_file)
    return env, argv_file


def deployed_argv(folders, name, registry, fake_vllm, **backend) -> list[str]:
    """The argv `vllm` was started with for a deploy of folder `name`."""
    env, argv_file = fake_vllm
    spec = spec_for(
        folders[name],
        BackendSpec(kind="external", preset="vllm", **backend),
        recipe=Recipe(**FOLDERS[name]),
    )
    result = deploy(folders[name].folder, spec, registry=registry, env=env)
    assert result.ok, result.error
    return json.loads(argv_file.read_text())


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "quantization", "kv"),
    [
        ("bf16", None, "auto"),  # no quantization_config: vLLM refuses the flag
        ("bf16-fp8kv", "compressed-tensors", "fp8"),  # a kv_cache_scheme-only one
        ("w4a16-g128", "compressed-tensors", "auto"),
    ],
)
def test_the_preset_passes_the_flags_of_the_folders_format(
    folders, registry, fake_vllm, name, quantization, kv
):
    argv = deployed_argv(folders, name, registry, fake_vllm)

    assert argv[:2] == ["serve", str(folders[name].folder.absolute())]
    if quantization is None:
        assert "--quantization" not in argv
    else:
        assert flag(argv, "--quantization") == quantization
    assert flag(argv, "--kv-cache-dtype") == kv
    # bounded by default: the model's own limit under the 8192 cap, 0.9 of the GPU
    assert flag(argv, "--max-model-len") == str(DEMO_MAX_POSITIONS)
    assert flag(argv, "--gpu-memory-utilization") == "0.9"


@pytest.mark.timeout(120)
def test_the_environments_context_and_memory_settings_are_passed(
    folders, registry, fake_vllm
):
    argv = deployed_argv(
        folders,
        "bf16",
        registry,
        fake_vllm,
        max_model_len=1024,
        gpu_memory_utilization=0.45,
    )

    assert flag(argv, "--max-model-len") == "1024"
    assert flag(argv, "--gpu-memory-utilization") == "0.45"


@pytest.mark.timeout(120)
def test_per_head_kv_scales_go_only_where_the_environment_takes_them(
    folders, registry, fake_vllm
):
    env, argv_file = fake_vllm
    approved = folders["bf16-fp8kv-head"]
    recipe = Recipe(**FOLDERS["bf16-fp8kv-head"])
    spec = spec_for(
        approved, BackendSpec(kind="external", preset="vllm"), recipe=recipe
    )

    refused = deploy(approved.folder, spec, registry=registry, env=env)

    assert not refused.ok and refused.error_code == "kv-scale-layout", refused.error
    assert "attn_head" in refused.error and not argv_file.exists()  # nothing ran
    argv = deployed_argv(
        folders, "bf16-fp8kv-head", registry, fake_vllm, kv_scale_strategy="attn_head"
    )
    assert flag(argv, "--kv-cache-dtype") == "fp8"


def test_a_template_that_drops_a_setting_is_refused_before_anything_starts(
    folders, registry, fake_vllm
):
    env, argv_file = fake_vllm
    template = "vllm serve {model_dir} --port {port} --host {host}"
    spec = spec_for(
        folders["bf16"],
        BackendSpec(kind="external", command_template=template, max_model_len=4096),
        recipe=Recipe(**FOLDERS["bf16"]),
    )

    result = deploy(folders["bf16"].folder, spec, registry=registry, env=env)

    assert not result.ok and result.error_code == "bad-template"
    assert "max_model_len set, but the command template has no {max_model_len}" in (
        result.error
    )
    assert not argv_file.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["bf16", "bf16-fp8kv", "w4a16-g128"])
def test_vllms_own_parser_takes_the_rendered_preset(folders, registry, fake_vllm, name):
    # The argv above, parsed by vLLM itself as `vllm serve` parses it, where vLLM
    # is installed (it is not in this project's environment: the flag checks
    # above run everywhere).
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = deployed_argv(folders, name, registry, fake_vllm)
    parser = FlexibleArgumentParser()
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    serve.validate(args)

    assert args.model_tag == str(folders[name].folder.absolute())
    assert args.max_model_len == DEMO_MAX_POSITIONS
    assert args.gpu_memory_utilization == 0.9
    assert args.quantization == ("compressed-tensors" if name != "bf16" else None)


@pytest.mark.parametrize(
    ("weights", "quant", "refused"),
    [
        ("bf16", None, ""),
        # dense weights with fp8 KV scales: a config with only kv_cache_scheme
        ("bf16", {"quant_method": "compressed-tensors", "config_groups": {}}, ""),
        (
            "bf16",
            {"quant_method": "compressed-tensors", "config_groups": {"g": {}}},
            "quantizes weights",
        ),
        ("w8a16", None, "has no quantization_config"),
        ("w8a16", {"quant_method": "gptq"}, "quant_method 'gptq'"),
    ],
)
def test_the_folders_format_must_be_the_recipes(tmp_path, weights, quant, refused):
    config = {"max_position_embeddings": 4096}
    if quant is not None:
        config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))

    if refused:
        with pytest.raises(DeployRefusedError, match=refused) as info:
            check_weight_format(tmp_path, weights)
        assert info.value.code == "recipe-mismatch"
    else:
        found = check_weight_format(tmp_path, weights)
        assert found.quantized is (quant is not None)
        assert found.max_position_embeddings == 4096
