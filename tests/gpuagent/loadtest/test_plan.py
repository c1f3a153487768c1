"""The LoadPlan schema: the default plan, and bad plans refused with the field
named."""

import pytest
from pydantic import ValidationError

from gpuagent.protocol import LOAD_PROFILES, JobRequest, LoadPlan, default_load_plan


def plan(**more) -> dict:
    body = {
        "workloads": [
            {
                "name": "chat",
                "task": "chat",
                "language": "ko",
                "prompt": {"tokens": 64},
                "output": {"tokens": 8},
            }
        ],
        "budget_s": 30,
    }
    return body | more


def error_of(body: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        LoadPlan.model_validate(body)
    first = caught.value.errors()[0]
    return ".".join(str(p) for p in first["loc"]) + ": " + first["msg"]


def test_the_default_plan_has_three_workloads_in_english_and_korean():
    default = default_load_plan()
    assert [w.name for w in default.workloads] == list(LOAD_PROFILES)
    assert {(w.task, w.language) for w in default.workloads} == {
        (task, lang) for task in ("chat", "rag", "code") for lang in ("en", "ko")
    }
    chat = default.workloads[0]
    assert chat.session.turns > 1 and chat.session.system_prompt_tokens > 0
    assert default.budget_s <= 90
    assert default.sweep_applies("context", "rag-ko")
    assert not default.sweep_applies("context", "chat")
    # it round-trips as JSON (the control plane stores it, the job carries it)
    assert LoadPlan.model_validate_json(default.model_dump_json()) == default


def test_it_refuses_unknown_keys_at_any_depth():
    assert error_of(plan(budget=3)).startswith("budget: Extra inputs")
    body = plan()
    body["workloads"][0]["session"] = {"turns": 2, "history": True}
    assert error_of(body).startswith("workloads.0.session.history: Extra inputs")


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"budget_s": 0}, "budget_s"),
        ({"budget_s": "soon"}, "budget_s"),
        ({"sweeps": {"concurrency": {"levels": [4, 2]}}}, "sweeps.concurrency.levels"),
        ({"sweeps": {"rates": {"rates": [0]}}}, "sweeps.rates.rates"),
        ({"sweeps": {"context": {"context_tokens": ["max"]}}}, "sweeps.context"),
        ({"workloads": []}, "workloads"),
    ],
)
def test_it_names_the_bad_field(change, where):
    assert error_of(plan(**change)).startswith(where)


def test_it_refuses_a_repeated_workload_and_a_sweep_of_an_unknown_one():
    body = plan()
    body["workloads"] *= 2
    assert "workload names must be unique: ['chat'] repeat" in error_of(body)
    body = plan(sweeps={"rates": {"rates": [1], "workloads": ["rag"]}})
    assert "sweeps.rates.workloads names ['rag']" in error_of(body)


def test_a_job_request_carries_a_plan():
    request = JobRequest.model_validate(
        {
            "job_id": 1,
            "release_id": 2,
            "kind": "load_test",
            "source_uri": "file:///x",
            "load_plan": plan(),
        }
    )
    assert request.load_plan == LoadPlan.model_validate(plan())
