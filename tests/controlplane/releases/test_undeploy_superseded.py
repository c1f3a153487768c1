"""Superseded servers don't pile up: the previous live release stays loaded for
rollback; one superseded beyond that gets an undeploy job on its agent."""

from controlplane.releases import tasks
from controlplane.releases.models import Release
from gpuagent.protocol import DeployResult, UndeployResult


def go_live(release, local_agent, serving_id):
    assert tasks.run_deployment(release.pk) == "deploying"
    local_agent.answer(
        "deploy",
        DeployResult(
            ok=True, endpoint=f"http://a:{8100 + release.pk}", deployment_id=serving_id
        ),
    )
    assert Release.objects.get(pk=release.pk).state == "live"


def undeploys(local_agent):
    return [(r.release_id, r.serving_id) for _, r in local_agent.pending("undeploy")]


def test_it_undeploys_a_release_superseded_beyond_the_rollback_target(
    make_release, local_agent
):
    first, second, third = (make_release(state="approved") for _ in range(3))
    go_live(first, local_agent, "srv-1")
    go_live(second, local_agent, "srv-2")
    assert undeploys(local_agent) == []  # the first is the rollback target

    go_live(third, local_agent, "srv-3")

    assert undeploys(local_agent) == [(first.pk, "srv-1")]
    (message, request), *_ = local_agent.pending("undeploy")
    assert message.queue == "agent.local"  # the agent that serves it
    local_agent.answer("undeploy", UndeployResult(deployment_id=0, stopped=True))
    assert first.jobs.get(kind="undeploy").state == "succeeded"
    assert Release.objects.get(pk=first.pk).state == "superseded"  # moved nothing
    assert Release.objects.get(pk=second.pk).deployments.get().serving_id == "srv-2"


def test_it_sends_one_undeploy_per_superseded_server(make_release, local_agent):
    releases = [make_release(state="approved") for _ in range(4)]
    for n, release in enumerate(releases, 1):
        go_live(release, local_agent, f"srv-{n}")

    assert sorted(undeploys(local_agent)) == [
        (releases[0].pk, "srv-1"),
        (releases[1].pk, "srv-2"),
    ]
