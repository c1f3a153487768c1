"""deploy() with real processes and the demo model: the folder is verified before
anything starts, the project's engine verifies again on load, an external engine is
started from a template (here: the project's engine), and refusals name the files."""

import socket

import httpx
import pytest

from gpuagent.integrity import ReleaseBinding, sign_model
from gpuagent.protocol import BackendSpec, Recipe
from gpuagent.serving import Trust, deploy, loaded_deployments, process, undeploy
from tests.gpuagent.integrity.builders import Keys
from tests.gpuagent.serving_backends.conftest import (
    new_marker,
    port_open,
    processes_with,
    spec_for,
    stand_in_backend,
)

RELEASE = ReleaseBinding(model="demo", version="1.0.0", recipe="weights=bf16,kv=int8")
RELEASE_FIELDS = {
    "release_model": RELEASE.model,
    "release_version": RELEASE.version,
    "release_recipe": RELEASE.recipe,
}
SMALL_ENGINE = {"kv_memory_gb": 0.005, "max_num_seqs": 2, "threads": 1, "device": "cpu"}
ENGINE_TEMPLATE = (
    "{python} -m gpuagent.engine serve {model_dir} --host {host} --port {port} "
    "--kv-cache-dtype {kv_cache_dtype} --served-model-name {served_model_names} "
    "--manifest-digest {manifest_digest} --kv-memory-gb 0.005 --max-num-seqs 2 "
    "--threads 1 --device cpu --dtype float32"
)


def complete(endpoint: str, model: str) -> dict:
    body = {"model": model, "prompt": "def ", "max_tokens": 3, "temperature": 0}
    reply = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def served_names(endpoint: str) -> list[str]:
    """The ids /v1/models lists, in order."""
    models = httpx.get(f"{endpoint}/v1/models", timeout=10).json()["data"]
    return [m["id"] for m in models]


@pytest.mark.timeout(180)
def test_it_deploys_a_signed_release_on_the_engine_and_undeploys_it(
    approved, registry, engine_env, tmp_path
):
    keys = Keys(tmp_path, "publisher")
    signature = approved.folder / "model.sig"
    sign_model(approved.folder, signature, release=RELEASE, private_key=keys.private)
    marker = new_marker()
    spec = spec_for(
        approved,
        BackendSpec(kind="engine", **SMALL_ENGINE),
        served_model_name=marker,
        **RELEASE_FIELDS,
    )
    trust = Trust(signature_path=signature, public_keys=(keys.public,))

    result = deploy(
        approved.folder, spec, registry=registry, trust=trust, env=engine_env
    )

    assert result.ok, result.error
    assert httpx.get(f"{result.endpoint}/health", timeout=5).status_code == 200
    assert complete(result.endpoint, marker)["usage"]["completion_tokens"] == 3
    (pid,) = processes_with(marker)
    cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    # the engine verifies on load: same digest, signature, key and release
    for flag, value in [
        (b"--manifest-digest", approved.digest),
        (b"--signature", str(signature)),
        (b"--public-key", str(keys.public)),
        (b"--release-recipe", RELEASE.recipe),
        (b"--kv-cache-dtype", "int8"),
    ]:
        assert cmdline[cmdline.index(flag) + 1] == value.encode()
    port = int(result.endpoint.rsplit(":", 1)[1])

    assert undeploy(result.deployment_id, registry=registry)

    assert not port_open(port) and processes_with(marker) == []
    assert loaded_deployments(registry) == []


@pytest.mark.timeout(180)
def test_it_serves_a_release_under_its_model_name_and_model_at_version(
    approved, registry, engine_env
):
    model = new_marker()  # the release's model name, as the dashboard shows it
    spec = spec_for(
        approved,
        BackendSpec(kind="engine", **SMALL_ENGINE),
        release_model=model,
        release_version="2.1.0",
    )

    result = deploy(approved.folder, spec, registry=registry, env=engine_env)

    assert result.ok, result.error
    assert served_names(result.endpoint) == [model, f"{model}@2.1.0"]
    assert complete(result.endpoint, model)["model"] == model
    assert complete(result.endpoint, f"{model}@2.1.0")["model"] == model
    (info,) = loaded_deployments(registry)
    assert info.served_model_name == model


@pytest.mark.timeout(180)
def test_it_starts_an_external_engine_from_a_template(approved, registry, engine_env):
    marker = new_marker()
    spec = spec_for(
        approved,
        BackendSpec(kind="external", command_template=ENGINE_TEMPLATE),
        served_model_name=marker,
        release_model="demo",
        release_version="1.0.0",
    )

    result = deploy(approved.folder, spec, registry=registry, env=engine_env)

    assert result.ok and result.backend == "external", result.error
    assert complete(result.endpoint, marker)["usage"]["completion_tokens"] == 3
    assert served_names(result.endpoint) == [marker, "demo@1.0.0"]
    assert undeploy(result.deployment_id, registry=registry)
    assert processes_with(marker) == []


def flip_a_byte(folder):
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))


def plant_a_file(folder):
    (folder / "notes.txt").write_text("planted after approval\n")


def remove_a_file(folder):
    (folder / "generation_config.json").unlink()


BACKENDS = {
    "engine": lambda: BackendSpec(kind="engine", **SMALL_ENGINE),
    "external": stand_in_backend,
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    ("tamper", "field", "path"),
    [
        (flip_a_byte, "changed", "model.safetensors"),
        (plant_a_file, "extra", "notes.txt"),
        (remove_a_file, "missing", "generation_config.json"),
    ],
)
def test_it_refuses_a_folder_changed_after_approval_and_starts_nothing(
    approved, registry, engine_env, backend, tamper, field, path
):
    tamper(approved.folder)
    marker = new_marker()
    spec = spec_for(approved, BACKENDS[backend](), served_model_name=marker)

    result = deploy(approved.folder, spec, registry=registry, env=engine_env)

    assert not result.ok and result.error_code == "manifest-mismatch"
    assert getattr(result, field) == [path] and path in result.error
    assert processes_with(marker) == []
    assert not (registry.state_dir / "logs").exists()  # no process was spawned
    assert loaded_deployments(registry) == []


def test_it_refuses_a_signed_folder_changed_after_signing(approved, registry, tmp_path):
    keys = Keys(tmp_path, "publisher")
    signature = approved.folder / "model.sig"
    sign_model(approved.folder, signature, release=RELEASE, private_key=keys.private)
    flip_a_byte(approved.folder)
    spec = spec_for(approved, stand_in_backend(), **RELEASE_FIELDS)

    result = deploy(
        approved.folder,
        spec,
        registry=registry,
        trust=Trust(signature_path=signature, public_keys=(keys.public,)),
    )

    assert not result.ok and result.changed == ["model.safetensors"]
    assert not (registry.state_dir / "logs").exists()


def test_it_refuses_a_signature_by_an_untrusted_key(approved, registry, tmp_path):
    publisher, intruder = Keys(tmp_path, "publisher"), Keys(tmp_path, "intruder")
    signature = approved.folder / "model.sig"
    sign_model(
        approved.folder, signature, release=RELEASE, private_key=intruder.private
    )
    spec = spec_for(approved, stand_in_backend(), **RELEASE_FIELDS)

    result = deploy(
        approved.folder,
        spec,
        registry=registry,
        trust=Trust(signature_path=signature, public_keys=(publisher.public,)),
    )

    assert not result.ok and result.error_code == "signer-not-trusted"
    assert not (registry.state_dir / "logs").exists()


def test_it_refuses_a_quarantined_digest(approved, registry):
    spec = spec_for(approved, stand_in_backend())
    told = spec.model_copy(update={"quarantined_digests": [approved.digest]})

    by_control_plane = deploy(approved.folder, told, registry=registry)
    registry.quarantine(approved.digest)
    by_this_agent = deploy(approved.folder, spec, registry=registry)

    for result in (by_control_plane, by_this_agent):
        assert not result.ok and result.error_code == "quarantined"
        assert approved.digest in result.error
    assert not (registry.state_dir / "logs").exists()


@pytest.mark.parametrize(
    ("backend", "recipe", "code", "message"),
    [
        (
            BackendSpec(kind="external", preset="vllm"),
            Recipe(weights="int4-g128", kv_cache_dtype="int8"),
            "bad-template",
            "no KV cache dtype 'int8'",
        ),
        (
            BackendSpec(kind="external", preset="vllm"),
            Recipe(weights="int4-g128", kv_cache_dtype="fp8"),
            "recipe-mismatch",
            "needs a compressed-tensors checkpoint",
        ),
        (
            BackendSpec(kind="external", command_template="srv {gpu}"),
            Recipe(weights="bf16", kv_cache_dtype="int8"),
            "bad-template",
            "{gpu}",
        ),
        (
            BackendSpec(kind="external", command_template=""),
            Recipe(weights="bf16", kv_cache_dtype="int8"),
            "bad-template",
            "exactly one of preset or command_template",
        ),
        (
            BackendSpec(kind="external", preset="vllm", threads=2),
            Recipe(weights="int4-g128", kv_cache_dtype="fp8"),
            "bad-template",
            "threads are settings of the engine backend",
        ),
        (
            BackendSpec(kind="engine", tensor_parallel_size=2),
            Recipe(weights="bf16", kv_cache_dtype="int8"),
            "bad-template",
            "tensor_parallel_size 1",
        ),
    ],
)
def test_it_refuses_what_the_backend_cannot_do_before_starting_anything(
    approved, registry, backend, recipe, code, message
):
    spec = spec_for(approved, backend, recipe=recipe)

    result = deploy(approved.folder, spec, registry=registry)

    assert not result.ok and result.error_code == code, result.error
    assert message in result.error
    assert not (registry.state_dir / "logs").exists()


def test_it_refuses_bytes_changed_while_an_external_engine_started(
    approved, registry, tmp_path
):
    # The stand-in "engine" flips a weight byte as it starts (as a second writer
    # could while a real engine reads): caught by the check after /health.
    wrapper = tmp_path / "tampering_server.py"
    wrapper.write_text(
        "import runpy, sys\n"
        f"p = {str(approved.folder / 'model.safetensors')!r}\n"
        "d = bytearray(open(p, 'rb').read()); d[-1] ^= 1; open(p, 'wb').write(d)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    template = stand_in_backend().command_template.replace(
        "{python} ", "{python} " + str(wrapper) + " ", 1
    )
    marker = new_marker()
    spec = spec_for(
        approved,
        BackendSpec(kind="external", command_template=template),
        served_model_name=marker,
    )

    result = deploy(approved.folder, spec, registry=registry, stop_grace_s=2)

    assert not result.ok and result.error_code == "changed-during-start"
    assert result.changed == ["model.safetensors"]
    assert processes_with(marker) == [] and loaded_deployments(registry) == []


def test_it_starts_only_the_programs_this_agent_allows(approved, registry):
    spec = spec_for(approved, stand_in_backend(), served_model_name=new_marker())

    result = deploy(approved.folder, spec, registry=registry, allowed_programs={"vllm"})

    assert not result.ok and result.error_code == "bad-template"
    assert "is not an argument shape this agent allows (allowed: vllm)" in (
        result.error
    )
    assert not (registry.state_dir / "logs").exists()


def test_an_allowed_interpreter_never_runs_other_arguments(approved, registry):
    # {python} is allowed (bare), and the stand-in's own template word for word;
    # the same program with other arguments is refused before anything starts.
    allowed = {"{python}", stand_in_backend().command_template}
    evil = BackendSpec(kind="external", command_template="{python} -c 'print(1)'")
    spec = spec_for(approved, evil, served_model_name=new_marker())

    result = deploy(approved.folder, spec, registry=registry, allowed_programs=allowed)

    assert not result.ok and result.error_code == "bad-template"
    assert "'{python}' -c 'print(1)'" in result.error
    assert not (registry.state_dir / "logs").exists()


@pytest.mark.timeout(180)
def test_the_engine_refuses_bytes_changed_after_the_agents_check(
    approved, registry, engine_env, monkeypatch
):
    # Between the agent's check and the engine's load, a weight byte flips: the
    # engine's verify-on-load refuses it, the start fails, nothing keeps running.
    import importlib

    deploy_module = importlib.import_module("gpuagent.serving.deploy")
    real_check = deploy_module.verify_for_deploy

    def check_then_tamper(*args, **kwargs):
        checked = real_check(*args, **kwargs)
        flip_a_byte(approved.folder)
        return checked

    monkeypatch.setattr(deploy_module, "verify_for_deploy", check_then_tamper)
    marker = new_marker()
    spec = spec_for(
        approved,
        BackendSpec(kind="engine", **SMALL_ENGINE),
        served_model_name=marker,
    )

    result = deploy(approved.folder, spec, registry=registry, env=engine_env)

    assert not result.ok and result.error_code == "changed-during-start"
    assert "refused to load" in result.error
    assert "[manifest-digest-mismatch]" in result.error  # the engine's own refusal
    assert result.changed == ["model.safetensors"]  # named by the agent's re-hash
    assert processes_with(marker) == [] and loaded_deployments(registry) == []


@pytest.mark.timeout(180)
def test_a_port_taken_before_the_server_binds_it_moves_the_server_on(
    approved, registry, engine_env, monkeypatch
):
    # The race between two agents on one host: the port found free is bound by
    # someone else before our server starts; the server must land on another one.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real_pick_port = process.pick_port
        picks = []

        def pick_port(host, wanted, port_range):
            picks.append(port_range)
            if len(picks) == 1:
                return port  # free when checked, taken when the server binds
            return real_pick_port(host, wanted, port_range)

        monkeypatch.setattr(process, "pick_port", pick_port)
        marker = new_marker()
        spec = spec_for(
            approved,
            BackendSpec(kind="engine", **SMALL_ENGINE),
            served_model_name=marker,
            port_range=(port, min(port + 50, 65535)),
        )

        result = deploy(approved.folder, spec, registry=registry, env=engine_env)

    try:
        assert result.ok, result.error
        assert not result.endpoint.endswith(f":{port}")
        assert picks[1][0] == port + 1  # the search went on past the lost port
        assert complete(result.endpoint, marker)["choices"]
    finally:
        undeploy(result.deployment_id, registry=registry, grace_s=2)
