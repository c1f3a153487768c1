"""/sizing/: a release manager pastes a published config.json, picks the knobs and
reads the report; bad input is shown on the form with a 400; CSRF-protected."""

import html
import json
from pathlib import Path

from django.test import Client

URL = "/sizing/"
CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


def form(name: str = "kimi-k2-instruct", **changes) -> dict:
    return {
        "config": (CONFIGS / f"{name}.json").read_text(),
        "gpu_memory_gib": "141",
        "devices": "8",
        "context_tokens": "65536",
        "sessions": "16",
        "weights": "w4a16-g128",
        "kv_cache_dtype": "fp8",
        "gpu_memory_utilization": "0.9",
        "activation_headroom_gib": "4",
        "parallelism": "tensor",
        **changes,
    }


def test_it_shows_the_form(client, member):
    client.force_login(member)

    response = client.get(URL)

    assert response.status_code == 200
    body = response.content.decode()
    assert 'id="sizing-form"' in body
    assert 'id="sizing-report"' not in body
    assert 'aria-current="page">Sizing</a>' in body


def test_it_sizes_a_pasted_kimi_k2_config(client, member):
    client.force_login(member)

    response = client.post(URL, form())

    assert response.status_code == 200, response.content
    body = html.unescape(response.content.decode())
    report = response.context["report"]
    assert report.total_params == 1_026_408_232_448
    assert "kimi_k2: 1,026.41 B parameters, 32.86 B active per token" in body
    # the MLA latent at bf16: 61 layers x (512 + 64) x 2 bytes
    assert '<td class="num">70272</td>' in body
    assert "35.6x" in body  # expanded K/V over the latent
    command = body.split('id="vllm-command">')[1].split("</pre>")[0]
    assert "--tensor-parallel-size 8" in command
    assert "--enable-expert-parallel" in command
    assert "--kv-cache-dtype fp8" in command
    assert "--max-model-len 65536" in command


def test_it_says_vllm_lacks_an_int4_kv_cache(client, member):
    client.force_login(member)

    response = client.post(URL, form("glm-4.5", kv_cache_dtype="int4"))

    assert response.status_code == 200
    body = html.unescape(response.content.decode())
    assert 'id="vllm-command"' not in body
    assert "vLLM has no int4 KV cache" in body


def test_it_shows_what_is_wrong_with_the_config(client, member):
    client.force_login(member)
    config = json.loads((CONFIGS / "glm-4.5.json").read_text())
    config["model_type"] = "bert"

    response = client.post(URL, form(config=json.dumps(config)))

    assert response.status_code == 400
    assert 'model_type "bert" is not supported' in html.unescape(
        response.content.decode()
    )
    assert response.context["report"] is None


def test_it_refuses_text_that_is_not_json(client, member):
    client.force_login(member)

    response = client.post(URL, form(config='{"model_type": "llama",'))

    assert response.status_code == 400
    assert "not valid JSON" in response.content.decode()


def test_it_refuses_a_knob_out_of_range(client, member):
    client.force_login(member)

    response = client.post(URL, form(gpu_memory_utilization="1.5"))

    assert response.status_code == 400
    assert "gpu_memory_utilization" in response.context["form"].errors


def test_it_asks_for_a_login(client):
    response = client.get(URL)

    assert response.status_code == 302
    assert "/login/" in response["Location"]


def test_it_checks_csrf(member):
    client = Client(enforce_csrf_checks=True)
    client.force_login(member)

    assert client.post(URL, form()).status_code == 403


def test_it_renders_data_parallel_attention(client, member):
    client.force_login(member)

    response = client.post(URL, form(parallelism="data"))

    assert response.status_code == 200
    plan = response.context["report"].deployment
    assert (plan.parallelism, plan.devices) == ("data", 8)
    command = html.unescape(response.content.decode()).split('id="vllm-command">')[1]
    assert "--tensor-parallel-size 1 " in command
    assert "--data-parallel-size 8" in command


def test_it_leaves_ticked_classes_in_bf16_and_shows_the_published_size(client, member):
    client.force_login(member)

    response = client.post(
        URL, form(weights="w4a16-g32", keep_bf16=["attention", "shared_experts"])
    )

    assert response.status_code == 200, response.content
    report = response.context["report"]
    assert report.knobs.keep_bf16 == ("attention", "shared_experts")
    body = html.unescape(response.content.decode())
    assert "fp8-block128x128 (published)" in body
