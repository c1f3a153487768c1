"""Serving presets: command templates that only platform operators (Django staff)
name, and that team admins choose by name for an environment's external backend
(controlplane.fleet.backend, fleet.actions.do_set_serving_preset)."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.errors import Forbidden, ValidationFailed
from controlplane.fleet.actions import do_set_serving_backend, do_set_serving_preset
from controlplane.fleet.admin import EnvironmentForm, ServingPresetForm
from controlplane.fleet.backend import AGENT_PRESETS, clean_backend, job_backend
from controlplane.fleet.models import ServingPreset
from gpuagent.serving.templates import PRESETS

ENGINE = "{python} -m gpuagent.engine serve {model_dir} --host {host} --port {port}"


def test_an_operator_names_a_preset(operator):
    preset = do_set_serving_preset("own-engine", ENGINE, actor=operator)

    assert ServingPreset.objects.get(name="own-engine") == preset
    event = AuditEvent.objects.get(verb="serving_preset.set")
    assert event.after["command_template"] == ENGINE


@pytest.mark.parametrize("who", ["owner", "teammate", "outsider"])
def test_no_team_member_names_a_preset(request, who):
    with pytest.raises(Forbidden, match="only by platform operators"):
        do_set_serving_preset("mine", ENGINE, actor=request.getfixturevalue(who))

    assert not ServingPreset.objects.exists()


@pytest.mark.parametrize(
    ("name", "template", "field"),
    [
        ("own", "{python} -c {shell}", "command_template"),  # unknown placeholder
        ("own", "   ", "command_template"),
        ("vllm", ENGINE, "name"),  # the agent's own preset
        ("not a slug", ENGINE, "name"),
    ],
)
def test_it_refuses_a_preset_the_agent_could_not_run(operator, name, template, field):
    with pytest.raises(ValidationFailed) as refused:
        do_set_serving_preset(name, template, actor=operator)

    assert refused.value.field == field


def test_a_team_admin_may_not_set_a_raw_command_template(owner, environment):
    with pytest.raises(Forbidden) as refused:
        do_set_serving_backend(
            environment, {"kind": "external", "command_template": ENGINE}, actor=owner
        )

    assert refused.value.field == "backend.command_template"
    environment.refresh_from_db()
    assert environment.serving_backend == {}


def test_a_team_admin_chooses_an_operators_preset_by_name(owner, operator, environment):
    do_set_serving_preset("own-engine", ENGINE, actor=operator)

    do_set_serving_backend(
        environment, {"kind": "external", "preset": "own-engine"}, actor=owner
    )

    environment.refresh_from_db()
    assert environment.serving_backend["preset"] == "own-engine"
    sent = job_backend(environment.serving_backend)
    assert (sent.preset, sent.command_template) == ("", ENGINE)


def test_a_preset_changed_by_its_operator_goes_with_the_next_deploy(
    owner, operator, environment
):
    do_set_serving_preset("own-engine", ENGINE, actor=operator)
    do_set_serving_backend(
        environment, {"kind": "external", "preset": "own-engine"}, actor=owner
    )

    do_set_serving_preset("own-engine", ENGINE + " --threads 1", actor=operator)

    environment.refresh_from_db()
    sent = job_backend(environment.serving_backend)
    assert sent.command_template.endswith("--threads 1")


def test_an_unknown_preset_is_refused_naming_the_known_ones(owner, environment):
    with pytest.raises(ValidationFailed) as refused:
        do_set_serving_backend(
            environment, {"kind": "external", "preset": "sglang"}, actor=owner
        )

    assert refused.value.field == "backend.preset"
    assert "known: vllm" in refused.value.message


def test_the_agents_own_presets_are_sent_by_name(owner, environment):
    do_set_serving_backend(
        environment, {"kind": "external", "preset": "vllm"}, actor=owner
    )

    environment.refresh_from_db()
    assert job_backend(environment.serving_backend).preset == "vllm"


def test_the_control_plane_knows_the_agents_presets():
    assert AGENT_PRESETS == tuple(PRESETS)


def test_the_admin_forms_take_templates_from_operators_only(environment):
    data = {"team": environment.team_id, "name": environment.name}
    raw = '{"kind": "external", "command_template": "vllm serve {model_dir}"}'
    environment_form = EnvironmentForm(
        {**data, "serving_backend": raw}, instance=environment
    )
    bad_preset = ServingPresetForm({"name": "own", "command_template": "{python} {x}"})

    assert environment_form.is_valid(), environment_form.errors  # staff only
    assert not bad_preset.is_valid()
    assert "{x}" in str(bad_preset.errors["command_template"])


def test_an_operators_template_must_have_a_place_for_the_settings_given(db):
    """max_model_len set, but the template has no {max_model_len} to pass it on:
    the engine would never see it (operators set raw templates in the admin)."""
    with pytest.raises(ValidationFailed) as refused:
        clean_backend(
            {
                "kind": "external",
                "command_template": "srv {model_dir} --port {port}",
                "max_model_len": 4096,
            },
            operator=True,
        )

    assert refused.value.field == "backend.max_model_len"
