"""`python -m gpuagent.engine serve`: verify-on-load of a signed model from the command
line (manifest digest + signature + trusted public key), and refusals with exit codes.

The shipped demo model is copied and signed in the test with a key generated here;
one real `serve` process is started (127.0.0.1, bounded in time and requests).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gpuagent.engine.__main__ import build_parser, main, signature_policy
from gpuagent.integrity import ReleaseBinding, sign_model
from tests.gpuagent.integrity.builders import Keys

DEMO_MODEL = Path(__file__).resolve().parents[3] / "gpuagent" / "engine" / "demo_model"
REPO = Path(__file__).resolve().parents[3]
RELEASE = ReleaseBinding(model="demo", version="1.0.0", recipe="fp32-kv")
RELEASE_FLAGS = [
    "--release-model",
    RELEASE.model,
    "--release-version",
    RELEASE.version,
    "--release-recipe",
    RELEASE.recipe,
]


@pytest.fixture(scope="module")
def signed_demo(tmp_path_factory):
    """(model folder, manifest digest, publisher keys, intruder keys)."""
    root = tmp_path_factory.mktemp("signed_demo")
    folder = root / "model"
    shutil.copytree(DEMO_MODEL, folder)
    publisher, intruder = Keys(root, "publisher"), Keys(root, "intruder")
    result = sign_model(
        folder, folder / "model.sig", release=RELEASE, private_key=publisher.private
    )
    return folder, result.manifest.digest, publisher, intruder


def serve_argv(folder, digest, public_key, *extra):
    return [
        "serve",
        str(folder),
        "--manifest-digest",
        digest,
        "--signature",
        str(folder / "model.sig"),
        "--public-key",
        str(public_key),
        "--device",
        "cpu",
        "--kv-memory-gb",
        "0.005",
        "--log-level",
        "warning",
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def refusal(argv) -> str:
    """Run the CLI in-process; it must exit with an error message (status 1)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = info.value.code
    assert isinstance(message, str), message  # SystemExit(str): exit status 1
    return message


@pytest.mark.timeout(180)
def test_it_serves_a_signed_model_verified_against_its_public_key(signed_demo):
    from transformers import AutoTokenizer

    folder, digest, publisher, _ = signed_demo
    port = free_port()
    argv = serve_argv(folder, digest, publisher.public, *RELEASE_FLAGS)
    argv[1] = folder.name  # relative to the server's folder, not to this test's
    argv += ["--port", str(port), "--kv-cache-dtype", "fp32", "--max-num-seqs", "2"]
    argv += ["--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)  # the engine runs the torch references on CPU
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuagent.engine", *argv],
        cwd=folder.parent,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
        # served under the path as given on the command line, as vLLM does
        body = {"model": argv[1], "prompt": "def ", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        (card,) = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        tokens = httpx.post(f"{base}/tokenize", json={"prompt": "def f(x):"}).json()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    # `root` finds the folder from anywhere: what guidellm's --tokenizer takes
    assert card["id"] == folder.name and card["root"] == str(folder)
    assert Path.cwd() != folder.parent
    tokenizer = AutoTokenizer.from_pretrained(card["root"])
    assert tokenizer("def f(x):").input_ids == tokens["tokens"]
    # --kv-cache-dtype fp32 was taken: K and V, 4 bytes per element, no scales.
    config = json.loads((folder / "config.json").read_text())
    want = 2 * 4 * config["num_hidden_layers"] * config["num_key_value_heads"]
    want *= config["head_dim"]
    (line,) = [
        line
        for line in metrics.splitlines()
        if line.startswith("engine_kv_bytes_per_token{")
    ]
    assert 'kv_cache_dtype="fp32"' in line and float(line.rsplit(" ", 1)[1]) == want
    assert "engine_torch_threads 1.0" in metrics.splitlines()  # --threads 1


def test_it_parses_served_model_names_threads_and_the_default_answer_length():
    from gpuagent.engine.__main__ import served_model_names

    plain = build_parser().parse_args(["serve", "rel/model_dir"])
    named = build_parser().parse_args(
        ["serve", "m", "--served-model-name", "a", "b", "--threads", "3"]
    )
    with pytest.raises(SystemExit, match="--threads"):
        main(["serve", str(DEMO_MODEL), "--threads", "0"])
    with pytest.raises(SystemExit, match="--default-max-tokens"):
        main(["serve", str(DEMO_MODEL), "--default-max-tokens", "0"])

    assert served_model_names(plain) == ["rel/model_dir"]  # the path as given
    assert served_model_names(named) == ["a", "b"]
    assert named.threads == 3 and plain.threads is None
    assert plain.default_max_tokens == 1024


def test_it_refuses_a_signature_by_a_key_it_does_not_trust(signed_demo):
    folder, digest, _, intruder = signed_demo

    message = refusal(serve_argv(folder, digest, intruder.public, *RELEASE_FLAGS))

    assert "refused to load" in message and "[signer-not-trusted]" in message


def test_it_refuses_a_tampered_file_and_names_it(signed_demo, tmp_path):
    folder, digest, publisher, _ = signed_demo
    tampered = tmp_path / "model"
    shutil.copytree(folder, tampered)
    weights = tampered / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight
    weights.write_bytes(bytes(data))

    message = refusal(serve_argv(tampered, digest, publisher.public, *RELEASE_FLAGS))

    assert "[manifest-mismatch]" in message and "model.safetensors" in message


def test_it_refuses_a_signature_bound_to_another_release(signed_demo):
    folder, digest, publisher, _ = signed_demo
    flags = [*RELEASE_FLAGS[:-1], "int4-kv"]  # same model and version, other recipe

    message = refusal(serve_argv(folder, digest, publisher.public, *flags))

    assert "[binding-mismatch]" in message and "int4-kv" in message


def test_it_exits_nonzero_with_the_reason_when_run_as_a_module(signed_demo):
    folder, digest, _, intruder = signed_demo
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuagent.engine",
            *serve_argv(folder, digest, intruder.public, *RELEASE_FLAGS),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 1
    assert "refused to load" in done.stderr and "signer-not-trusted" in done.stderr
    assert "Traceback" not in done.stderr


def test_it_builds_the_policy_from_the_trust_flags(signed_demo):
    folder, digest, publisher, intruder = signed_demo
    argv = serve_argv(folder, digest, publisher.public, "--public-key")
    argv += [str(intruder.public), *RELEASE_FLAGS]

    policy = signature_policy(build_parser().parse_args(argv))

    assert policy.signature_mode == "key"
    assert policy.public_keys_pem == (publisher.public_pem, intruder.public_pem)
    assert policy.release == RELEASE


@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        (["--public-key"], "trusted public key"),  # a signature, nobody trusted
        (["--release-version", "--release-recipe"], "go together"),  # half a release
        (["--signature"], "need --signature"),  # trust flags without one
        # a signature checked without its release could be replayed from another
        (["--release-model", "--release-version", "--release-recipe"], "bound to"),
    ],
)
def test_it_rejects_incomplete_trust_flags(signed_demo, drop, expected):
    folder, digest, publisher, _ = signed_demo
    argv = serve_argv(folder, digest, publisher.public, *RELEASE_FLAGS)
    for flag in drop:
        i = argv.index(flag)
        del argv[i : i + 2]

    assert expected in refusal(argv)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--kv-cache-dtype", "bf16", "--kv-window", "8"], "quantized caches"),
        (["--kv-memory-gb", "0"], "holds no block"),
    ],
)
def test_it_rejects_engine_settings_that_cannot_work(signed_demo, flags, expected):
    folder, digest, publisher, _ = signed_demo
    argv = serve_argv(folder, digest, publisher.public, *RELEASE_FLAGS, *flags)

    assert expected in refusal(argv)


def test_it_inspects_a_folder_served_without_a_manifest_digest(tmp_path, caplog):
    from gpuagent.engine.__main__ import build_engine
    from gpuagent.integrity import hash_model

    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, folder)
    argv = ["serve", str(folder), "--device", "cpu", "--kv-memory-gb", "0.005"]

    with caplog.at_level("WARNING", logger="gpuagent.engine.__main__"):
        build_engine(build_parser().parse_args(argv))
    # Nothing pinned, so it says so, and names the digest to pin.
    assert "not checked against an approved manifest" in caplog.text
    assert hash_model(folder).digest in caplog.text

    (folder / "modeling_llama.py").write_text("import os\n")
    message = refusal(argv)
    assert "refused to load" in message and "[model-rejected]" in message
    assert "modeling_llama.py" in message


def test_it_refuses_to_serve_a_folder_whose_tokenizer_or_template_fails_its_probe(
    tmp_path,
):
    from tests.gpuagent.engine.test_tokenizer import backtracking_tokenizer

    hostile_tokenizer, hostile_template = tmp_path / "tok", tmp_path / "tpl"
    for folder in (hostile_tokenizer, hostile_template):
        shutil.copytree(DEMO_MODEL, folder)
    backtracking_tokenizer().save(str(hostile_tokenizer / "tokenizer.json"))
    (hostile_template / "chat_template.jinja").write_text("{{ 'x' * 4000000000 }}")
    flags = ["--device", "cpu", "--kv-memory-gb", "0.005", "--log-level", "warning"]

    tokenizer_refused = refusal(["serve", str(hostile_tokenizer), *flags])
    template_refused = refusal(["serve", str(hostile_template), *flags])

    assert "tokenizer.json is refused" in tokenizer_refused
    assert "PanicException" in tokenizer_refused
    assert "refused to serve" in template_refused
    assert "chat template failed its probe" in template_refused
    assert "MiB of memory" in template_refused


def test_it_turns_prefix_caching_off_only_when_asked():
    from gpuagent.engine.__main__ import build_engine

    argv = ["serve", str(DEMO_MODEL), "--device", "cpu", "--kv-memory-gb", "0.005"]

    default = build_engine(build_parser().parse_args(argv))
    off = build_engine(build_parser().parse_args([*argv, "--no-enable-prefix-caching"]))

    assert default.kv.blocks.prefix_caching
    assert not off.kv.blocks.prefix_caching


def test_it_serves_with_the_int8_head_copy_when_asked():
    from gpuagent.engine.__main__ import build_engine
    from gpuagent.engine.weights import Int8Head

    argv = ["serve", str(DEMO_MODEL), "--device", "cpu", "--kv-memory-gb", "0.005"]

    engine = build_engine(build_parser().parse_args([*argv, "--quantize-head", "int8"]))

    assert isinstance(engine.model.lm_head, Int8Head)
    assert not isinstance(
        build_engine(build_parser().parse_args(argv)).model.lm_head, Int8Head
    )


def test_int8_activations_are_asked_for_by_flag_and_refused_without_int4():
    from gpuagent.engine.__main__ import build_engine
    from gpuagent.engine.weights import Int8ActivationsError

    argv = ["serve", str(DEMO_MODEL), "--device", "cpu", "--kv-memory-gb", "0.005"]

    assert build_parser().parse_args([*argv, "--int8-activations"]).int8_activations
    assert not build_parser().parse_args(argv).int8_activations
    # the demo model is float32: no int4 layer to round activations for
    with pytest.raises(Int8ActivationsError, match="int4 weights"):
        build_engine(build_parser().parse_args([*argv, "--int8-activations"]))
