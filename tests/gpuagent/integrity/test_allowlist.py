"""The allow-list: the folders the project ships and converts pass; any other
file is refused for its reason unless the policy names it."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from gpuagent.integrity import (
    DEFAULT_POLICY,
    AllowedFile,
    ModelRejectedError,
    hash_model,
    inspect_model,
    read_verified_files,
    sign_model,
)
from tests.gpuagent.integrity.builders import RELEASE, rejected_files, write_model

DEMO = Path(__file__).resolve().parents[3] / "gpuagent" / "engine" / "demo_model"


def varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def field(number: int, wire: int, payload: bytes) -> bytes:
    key = varint(number << 3 | wire)
    return key + (varint(len(payload)) + payload if wire == 2 else payload)


def sentencepiece_model(pieces: list[str]) -> bytes:
    """A sentencepiece ModelProto: pieces (piece, score, type), a trainer spec
    and a normalizer spec, in protobuf wire format."""
    out = b""
    for i, piece in enumerate(pieces):
        body = field(1, 2, piece.encode()) + field(2, 5, struct.pack("<f", -i))
        body += field(3, 0, varint(1))
        out += field(1, 2, body)
    out += field(2, 2, field(1, 2, b"corpus.txt") + field(3, 0, varint(2)))
    out += field(3, 2, field(1, 2, b"nmt_nfkc"))
    return out


def test_it_accepts_the_demo_model_as_shipped(tmp_path):
    report = inspect_model(DEMO)

    kinds = {f.path: f.kind for f in report.files}
    assert kinds["training_report.json"] == "json"
    assert kinds["model.safetensors"] == "safetensors"
    assert "file" not in kinds.values()


def test_it_accepts_a_folder_converted_from_gguf(tmp_path):
    # What the converter writes for SmolLM2: an HF folder of five files.
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(
        save({"model.embed_tokens.weight": np.zeros((4, 8), np.float32)})
    )
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m }}{% endfor %}"})
    )
    (folder / "generation_config.json").write_text('{"eos_token_id": 2}')

    assert inspect_model(folder).ok


def test_it_accepts_a_compressed_tensors_folder_with_its_reports(tmp_path):
    folder = write_model(tmp_path / "model")
    quantization = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": None}},
    }
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "size_report.json").write_text('{"bytes": {"weights": 123}}')
    (folder / "lossless_header.json").write_text('{"planes": ["exponent"]}')

    assert inspect_model(folder).ok


def test_it_accepts_tokenizer_files_and_text_by_their_formats(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "tokenizer.model").write_bytes(sentencepiece_model(["<unk>", "▁a"]))
    (folder / "vocab.json").write_text('{"a": 0, "b": 1}')
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    (folder / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool.jinja").write_text("{{ t }}")
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# 모델\n")
    (folder / "LICENSE").write_text("Apache License\nVersion 2.0\n\x0c\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (folder / "original").mkdir()
    (folder / "original" / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")
    (folder / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")  # Kimi K2's name

    report = inspect_model(folder)

    kinds = {f.path: f.kind for f in report.files}
    assert kinds["tokenizer.model"] == kinds["original/tokenizer.model"]
    assert kinds["tokenizer.model"] == kinds["tiktoken.model"] == "tokenizer-model"
    assert kinds["merges.txt"] == kinds["LICENSE"] == "text"


@pytest.mark.parametrize(
    ("name", "content", "code"),
    [
        ("optimizer.state", b"\x00\x01\x02", "file-not-allowed"),
        ("weights.npz", b"not a zip", "pickle-extension"),
        ("tf_model.h5", b"\x89HDF\r\n\x1a\n", "file-not-allowed"),
        ("tokenizer.model", b"\x0a\x05hello world", "tokenizer-model-invalid"),
        ("tokenizer.model", b"\x80\x02]q\x00.", "pickle-protocol"),
        ("tiktoken.model", b"IQ== 0\nnot ranks\n", "tokenizer-model-invalid"),
        ("merges.txt", b"a b\n\xff\xfe", "text-invalid"),
        ("README.md", b"# x\n\x00\x01", "text-invalid"),
        ("chat_template.jinja", b"cos\nsystem\n(S'id'\ntR.", "pickle-protocol"),
    ],
    ids=[
        "unknown-name",
        "npz",
        "hdf5",
        "tokenizer-model-not-protobuf",
        "tokenizer-model-pickle",
        "tiktoken-model-not-ranks",
        "merges-not-utf8",
        "readme-with-nul",
        "template-that-is-a-pickle",
    ],
)
def test_it_refuses_what_the_allow_list_or_its_formats_do_not_admit(
    tmp_path, name, content, code
):
    folder = write_model(tmp_path / "model")
    (folder / name).write_bytes(content)

    assert code in rejected_files(folder)[name]


def test_it_admits_a_file_the_policy_names_and_still_checks_its_content(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "calibration").mkdir()
    (folder / "calibration" / "scales.f32").write_bytes(b"\x01\x02\x03\x04" * 8)
    (folder / "calibration" / "evil.f32").write_bytes(b"cos\nsystem\n(S'id'\ntR.")
    policy = DEFAULT_POLICY.replace(
        extra_allowed_files=(AllowedFile("calibration/*.f32", "KV scales"),)
    )

    found = rejected_files(folder, policy)

    assert found == {"calibration/evil.f32": {"pickle-protocol"}}
    assert rejected_files(folder)["calibration/scales.f32"] == {"file-not-allowed"}


def test_it_does_not_let_a_policy_pattern_weaken_a_built_in_format(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "config.json").write_text('{"a": 1, "a": 2}')
    policy = DEFAULT_POLICY.replace(extra_allowed_files=(AllowedFile("*", "all"),))

    assert rejected_files(folder, policy) == {"config.json": {"json-duplicate-key"}}


def test_it_accepts_the_signature_and_the_git_files_a_hub_repo_carries(tmp_path, keys):
    folder = write_model(tmp_path / "model")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs\n")
    (folder / ".gitignore").write_text("*.tmp\n")
    sign_model(folder, folder / "model.sig", release=RELEASE, private_key=keys.private)

    report = inspect_model(folder)

    kinds = {f.path: f.kind for f in report.files}
    assert kinds["model.sig"] == "signature"
    assert kinds[".gitattributes"] == kinds[".gitignore"] == "text"


def test_it_refuses_a_file_outside_the_allow_list_on_load_too(tmp_path):
    # A digest approved under an older policy: verify-on-load applies the list.
    folder = Path(shutil.copytree(DEMO, tmp_path / "demo"))
    (folder / "extra.dat").write_bytes(b"\x00" * 16)

    with pytest.raises(ModelRejectedError) as refused:
        read_verified_files(folder, hash_model(folder).digest)

    assert refused.value.report.codes() == {"file-not-allowed"}
