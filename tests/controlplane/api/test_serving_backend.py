import pytest

from controlplane.audit.models import AuditEvent
from controlplane.fleet.actions import do_set_serving_preset
from controlplane.fleet.admin import EnvironmentForm
from controlplane.fleet.backend import backend_spec, clean_backend
from tests.controlplane.api.helpers import error_of, field_names, put_json

VLLM = {"kind": "external", "preset": "vllm", "tensor_parallel_size": 2}


def url(environment_id) -> str:
    return f"/api/v1/environments/{environment_id}/serving-backend"


@pytest.fixture
def admin_token(make_token, owner):
    return make_token(owner, "admin", "read")


def put(api, environment, body, token):
    return put_json(api, url(environment.pk), body, token)


def patch(api, environment, body, token):
    return api.client.patch(
        url(environment.pk),
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


def test_the_engine_is_the_default(api, owner_token, environment):
    response = api.get(url(environment.pk), token=owner_token)

    assert response.status_code == 200, response.content
    assert response.json()["backend"] == {
        "kind": "engine",
        "preset": "",
        "command_template": "",
        "tensor_parallel_size": 1,
        "max_model_len": None,
        "gpu_memory_utilization": None,
        "health_timeout_s": None,
        "kv_scale_strategy": "tensor",
        "gate_evidence": "in_process",
    }


def test_an_admin_sets_an_external_backend(api, admin_token, environment):
    response = put(api, environment, VLLM, admin_token)

    assert response.status_code == 200, response.content
    assert response.json()["backend"]["preset"] == "vllm"
    environment.refresh_from_db()
    assert environment.serving_backend["tensor_parallel_size"] == 2
    event = AuditEvent.objects.get(verb="environment.serving_backend_set")
    assert event.after["serving_backend"]["kind"] == "external"


def test_unknown_keys_are_refused_by_name(api, admin_token, environment):
    response = put(api, environment, {**VLLM, "gpus": 4}, admin_token)

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"gpus"}, error
    environment.refresh_from_db()
    assert environment.serving_backend == {}


@pytest.mark.parametrize(
    "body, code, field",
    [
        ({"kind": "engine", "preset": "vllm"}, "validation_failed", "backend.preset"),
        (
            {"kind": "engine", "tensor_parallel_size": 2},
            "validation_failed",
            "backend.tensor_parallel_size",
        ),
        ({"kind": "external"}, "validation_failed", "backend.preset"),
        ({"kind": "k8s"}, "validation_error", "kind"),
        # an external engine's flags: the engine backend would not read them
        (
            {"kind": "engine", "max_model_len": 4096},
            "validation_failed",
            "backend.max_model_len",
        ),
        (
            {"kind": "engine", "gpu_memory_utilization": 0.5},
            "validation_failed",
            "backend.gpu_memory_utilization",
        ),
        (
            {**VLLM, "gpu_memory_utilization": 1.5},
            "validation_error",
            "gpu_memory_utilization",
        ),
        ({**VLLM, "max_model_len": 0}, "validation_error", "max_model_len"),
        ({**VLLM, "health_timeout_s": 0}, "validation_error", "health_timeout_s"),
        ({**VLLM, "health_timeout_s": 86400}, "validation_error", "health_timeout_s"),
        (
            {**VLLM, "kv_scale_strategy": "head"},
            "validation_error",
            "kv_scale_strategy",
        ),
    ],
)
def test_settings_the_backend_would_not_read_are_refused(
    api, admin_token, environment, body, code, field
):
    response = put(api, environment, body, admin_token)

    error = error_of(response, 422, code)
    assert field in field_names(error), error


def test_an_external_engines_context_memory_health_and_kv_layout_are_stored(
    api, admin_token, environment
):
    body = {
        **VLLM,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.45,
        "health_timeout_s": 3600,
        "kv_scale_strategy": "attn_head",
        "gate_evidence": "serving_backend",
    }

    response = put(api, environment, body, admin_token)

    assert response.status_code == 200, response.content
    assert response.json()["backend"] == {**body, "command_template": ""}
    environment.refresh_from_db()
    assert backend_spec(environment.serving_backend).health_timeout_s == 3600


def test_a_setting_stored_before_the_newer_keys_reads_as_their_defaults(
    api, owner_token, environment
):
    environment.serving_backend = {
        "kind": "external",
        "preset": "vllm",
        "command_template": "",
        "tensor_parallel_size": 2,
    }
    environment.save()

    response = api.get(url(environment.pk), token=owner_token)

    backend = response.json()["backend"]
    assert backend["max_model_len"] is None and backend["health_timeout_s"] is None
    assert backend["kv_scale_strategy"] == "tensor"


def test_it_needs_the_admin_scope(api, owner_token, environment):
    assert put(api, environment, VLLM, owner_token).status_code == 403


def test_the_admin_form_validates_through_the_same_rules(environment):
    data = {"team": environment.team_id, "name": environment.name}
    bad = EnvironmentForm(
        {**data, "serving_backend": '{"kind": "external", "preset": "vllm", "x": 1}'},
        instance=environment,
    )
    good = EnvironmentForm(
        {**data, "serving_backend": '{"kind": "external", "preset": "vllm"}'},
        instance=environment,
    )

    assert not bad.is_valid() and "x" in str(bad.errors["serving_backend"])
    assert good.is_valid(), good.errors
    assert good.cleaned_data["serving_backend"]["preset"] == "vllm"


def test_a_team_admin_cannot_set_a_command_template(api, admin_token, environment):
    body = {"kind": "external", "command_template": "{python} -c 'print(1)'"}

    response = put(api, environment, body, admin_token)

    error = error_of(response, 403, "forbidden")
    assert "backend.command_template" in error["message"]
    assert "choose a preset by name" in error["message"]
    environment.refresh_from_db()
    assert environment.serving_backend == {}


def test_a_staff_users_token_cannot_either(api, make_token, owner, environment):
    owner.is_staff = owner.is_superuser = True
    owner.save(update_fields=["is_staff", "is_superuser"])
    body = {"kind": "external", "command_template": "vllm serve {model_dir}"}

    response = put(api, environment, body, make_token(owner, "admin"))

    error_of(response, 403, "forbidden")


def test_a_team_admin_chooses_an_operators_preset(
    api, admin_token, operator, environment
):
    do_set_serving_preset("own-engine", "{python} -m x {port}", actor=operator)

    response = put(
        api, environment, {"kind": "external", "preset": "own-engine"}, admin_token
    )

    assert response.status_code == 200, response.content
    assert response.json()["backend"]["preset"] == "own-engine"
    assert response.json()["backend"]["command_template"] == ""


def test_a_team_lists_the_presets_it_may_choose(api, owner_token, operator):
    do_set_serving_preset("own-engine", "{python} -m x {port}", actor=operator)

    response = api.get("/api/v1/serving-presets", token=owner_token)

    assert response.status_code == 200, response.content
    names = [p["name"] for p in response.json()["presets"]]
    assert names == ["vllm", "own-engine"]


def test_a_patch_changes_the_gate_evidence_and_keeps_the_rest(
    api, admin_token, environment
):
    put(api, environment, {**VLLM, "max_model_len": 4096}, admin_token)

    response = patch(
        api, environment, {"gate_evidence": "serving_backend"}, admin_token
    )

    assert response.status_code == 200, response.content
    backend = response.json()["backend"]
    assert backend["gate_evidence"] == "serving_backend"
    assert backend["preset"] == "vllm" and backend["kind"] == "external"
    assert backend["tensor_parallel_size"] == 2 and backend["max_model_len"] == 4096
    environment.refresh_from_db()
    assert environment.serving_backend["gate_evidence"] == "serving_backend"
    assert environment.serving_backend["max_model_len"] == 4096
    assert backend_spec(environment.serving_backend).gate_evidence == (
        "serving_backend"
    )


def test_a_patch_of_another_key_keeps_the_gate_evidence(api, admin_token, environment):
    patch(api, environment, {"gate_evidence": "serving_backend"}, admin_token)

    response = patch(api, environment, {"health_timeout_s": 600.0}, admin_token)

    assert response.status_code == 200, response.content
    assert response.json()["backend"]["gate_evidence"] == "serving_backend"
    assert response.json()["backend"]["health_timeout_s"] == 600.0


def test_a_patch_is_checked_whole_and_names_the_bad_key(api, admin_token, environment):
    put(api, environment, VLLM, admin_token)

    bad_value = patch(api, environment, {"gate_evidence": "somewhere"}, admin_token)
    engine_with_preset = patch(api, environment, {"kind": "engine"}, admin_token)
    unknown = patch(api, environment, {"evidence": "http"}, admin_token)
    nothing = patch(api, environment, {}, admin_token)

    assert field_names(error_of(bad_value, 422, "validation_error")) == {
        "gate_evidence"
    }
    assert field_names(error_of(engine_with_preset, 422, "validation_failed")) == {
        "backend.preset"
    }
    assert field_names(error_of(unknown, 422, "validation_error")) == {"evidence"}
    assert "name at least one key" in str(error_of(nothing, 422, "validation_error"))
    environment.refresh_from_db()
    assert environment.serving_backend["gate_evidence"] == "in_process"
    assert environment.serving_backend["preset"] == "vllm"


def test_a_team_admin_patches_an_environment_whose_template_an_operator_set(
    api, admin_token, environment
):
    # as the admin site stores an operator's template
    template = {"kind": "external", "command_template": "vllm serve {model_dir}"}
    environment.serving_backend = clean_backend(template, operator=True)
    environment.save(update_fields=["serving_backend"])

    kept = patch(api, environment, {"gate_evidence": "serving_backend"}, admin_token)
    rewritten = patch(
        api, environment, {"command_template": "{python} -c 'x'"}, admin_token
    )

    assert kept.status_code == 200, kept.content
    assert kept.json()["backend"]["command_template"] == "vllm serve {model_dir}"
    error_of(rewritten, 403, "forbidden")
    environment.refresh_from_db()
    assert environment.serving_backend["command_template"] == "vllm serve {model_dir}"
    assert environment.serving_backend["gate_evidence"] == "serving_backend"
