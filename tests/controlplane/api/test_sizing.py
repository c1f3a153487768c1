"""POST /api/v1/sizing: the memory report of a published config, strictly read."""

import json
from pathlib import Path

import pytest

from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/sizing"
CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


def kimi() -> dict:
    return json.loads((CONFIGS / "kimi-k2-instruct.json").read_text())


def body(**changes) -> dict:
    return {
        "config": kimi(),
        "gpu_memory_gib": 141,
        "devices": 8,
        "context_tokens": 65536,
        "sessions": 4,
        "weights": "w4a16-g128",
        "kv_cache_dtype": "fp8",
        **changes,
    }


def test_it_sizes_kimi_k2(api, owner_token):
    response = api.post(URL, body(), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["total_params"] == 1_026_408_232_448
    assert data["active_params"] == 32_861_500_928
    kv = {k["kv_dtype"]: k for k in data["kv"]}
    assert kv["bf16"]["bytes_per_token"] == 61 * (512 + 64) * 2
    assert data["deployment"]["devices"] == 8
    assert data["deployment"]["sessions_at_context"] >= 4
    assert data["devices_needed"]["devices"] == 8
    argv = data["vllm_argv"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert "--enable-expert-parallel" in argv
    assert data["knobs"]["weights"] == "w4a16-g128"


def test_it_takes_any_token_with_read(api, approver_token):
    assert api.post(URL, body(), token=approver_token).status_code == 200


def test_it_refuses_no_token(api):
    error_of(api.post(URL, body()), 401, "not_authenticated")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"gpu_memory_gib": 0}, "gpu_memory_gib"),
        ({"gpu_memory_gib": "80"}, "gpu_memory_gib"),
        ({"devices": 2.0}, "devices"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
        ({"weights": "int4"}, "weights"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"config": [1, 2]}, "config"),
        ({"max_batch": 8}, "max_batch"),
        ({"parallelism": "pipeline"}, "parallelism"),
        ({"keep_bf16": ["router"]}, "keep_bf16.0"),
    ],
)
def test_it_names_a_bad_knob(api, owner_token, changes, field):
    error = error_of(
        api.post(URL, body(**changes), token=owner_token), 422, "validation_error"
    )

    assert field in field_names(error)


def test_it_requires_the_memory_of_a_device(api, owner_token):
    payload = body()
    del payload["gpu_memory_gib"]

    error = error_of(api.post(URL, payload, token=owner_token), 422, "validation_error")

    assert "gpu_memory_gib" in field_names(error)


@pytest.mark.parametrize(
    ("config_change", "message"),
    [
        ({"model_type": "bert"}, 'model_type "bert" is not supported'),
        ({"kv_lora_rank": "512"}, "'kv_lora_rank' must be an integer"),
    ],
)
def test_it_names_what_is_wrong_with_the_config(
    api, owner_token, config_change, message
):
    payload = body(config={**kimi(), **config_change})

    error = error_of(api.post(URL, payload, token=owner_token), 422, "invalid_config")

    assert message in error["message"]


def test_it_refuses_a_body_that_is_not_json(api, owner_token):
    response = api.post(URL, raw="{", token=owner_token)

    error_of(response, 400, "bad_request")


def test_it_sizes_data_parallel_attention(api, owner_token):
    response = api.post(URL, body(parallelism="data"), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["deployment"]["parallelism"] == "data"
    assert "--data-parallel-size" in data["vllm_argv"]


def test_it_leaves_named_classes_in_bf16(api, owner_token):
    payload = body(weights="w4a16-g32", keep_bf16=["attention", "shared_experts"])

    response = api.post(URL, payload, token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert data["knobs"]["keep_bf16"] == ["attention", "shared_experts"]
    w4 = next(w for w in data["weights"] if w["format"] == "w4a16-g32")
    assert w4["by_class"]["attention"] == 2 * data["params_by_class"]["attention"]
    assert data["published_weights"]["format"] == "fp8-block128x128 (published)"


def test_it_takes_tokens_not_dashboard_sessions(api, owner):
    # a POST is for tokens only, so a session cannot be CSRF'd into one
    api.client.force_login(owner)

    error_of(api.post(URL, body()), 401, "not_authenticated")
