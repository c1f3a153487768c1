"""An environment's serving backend goes with its deploy jobs: set to `external`
with an operator's preset whose template starts the project's own engine, the
release is deployed through that template (verified first), and answers a
completion."""

import shutil
from pathlib import Path

import gpuagent.engine
from controlplane.fleet.actions import do_set_serving_backend, do_set_serving_preset
from controlplane.fleet.models import Deployment
from controlplane.releases.actions.approvals import do_approve_release
from controlplane.releases.models import Job, Release
from controlplane.releases.tasks import run_deployment
from gpuagent.serving import loaded_deployments, undeploy
from tests.controlplane.releases.test_pipeline import BF16, promote_to_approval
from tests.controlplane.test_agent_pipeline import complete

DEMO = Path(gpuagent.engine.__file__).parent / "demo_model"
ENGINE_TEMPLATE = (
    "{python} -m gpuagent.engine serve {model_dir} --host {host} --port {port} "
    "--kv-cache-dtype {kv_cache_dtype} --served-model-name {served_model_name} "
    "--manifest-digest {manifest_digest} --kv-memory-gb 0.01 --max-num-seqs 2 "
    "--threads 1 --device cpu --dtype float32"
)


def test_an_external_backend_deploys_through_its_template(
    make_release, make_source, local_agent, teammate, owner, operator
):
    source = make_source("demo")
    source.rmdir()
    shutil.copytree(DEMO, source)
    release = make_release(source_uri=source.as_uri(), recipe=BF16)
    do_set_serving_preset("own-engine", ENGINE_TEMPLATE, actor=operator)
    do_set_serving_backend(
        release.target_environment,
        {"kind": "external", "preset": "own-engine"},
        actor=owner,
    )
    promote_to_approval(release, local_agent)
    do_approve_release(release, teammate)
    assert run_deployment(release.pk) == "deploying"
    (_, request), *_ = local_agent.pending("deploy")
    assert request.backend.kind == "external"
    assert request.backend.command_template == ENGINE_TEMPLATE

    local_agent.work(kinds=("deploy",))
    registry = local_agent.agent.registry
    try:
        job = Job.objects.get(release=release, kind="deploy")
        assert Release.objects.get(pk=release.pk).state == "live", job.error
        deployment = Deployment.objects.get(release=release)
        assert job.result["backend"] == "external"
        assert deployment.serving_id == job.result["deployment_id"]
        (served,) = loaded_deployments(registry)
        assert served.backend == "external"
        assert complete(deployment.endpoint, release.model.name, max_tokens=2)[
            "choices"
        ]
    finally:
        for info in loaded_deployments(registry):
            undeploy(info.deployment_id, registry=registry, grace_s=5)
