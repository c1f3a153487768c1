from django.urls import path

from controlplane.dashboard.views import (
    audit,
    cost,
    decisions,
    enrollment,
    environments,
    favicon,
    fleet,
    load_plan,
    releases,
    remeasure,
    reopen,
    sizing,
    tokens,
)

app_name = "dashboard"

urlpatterns = [
    path("", releases.release_list, name="release-list"),
    path("pipelines/", releases.running_pipelines, name="running-pipelines"),
    path("releases/<int:release_id>/", releases.release_detail, name="release-detail"),
    path(
        "releases/<int:release_id>/status/",
        releases.release_status,
        name="release-status",
    ),
    path(
        "releases/<int:release_id>/reverifications/",
        releases.release_reverifications,
        name="release-reverifications",
    ),
    path(
        "releases/<int:release_id>/approve/",
        decisions.approve_release,
        name="approve-release",
    ),
    path(
        "releases/<int:release_id>/reject/",
        decisions.reject_release,
        name="reject-release",
    ),
    path(
        "releases/<int:release_id>/reopen/",
        reopen.reopen_release,
        name="reopen-release",
    ),
    path(
        "releases/<int:release_id>/remeasure/",
        remeasure.remeasure_release,
        name="remeasure-release",
    ),
    path("environments/", environments.environment_list, name="environment-list"),
    path("environments/rows/", environments.environment_rows, name="environment-rows"),
    path(
        "environments/<int:environment_id>/rollback/",
        environments.rollback_environment,
        name="rollback-environment",
    ),
    path(
        "environments/<int:environment_id>/load-plan/",
        load_plan.load_plan,
        name="load-plan",
    ),
    path("fleet/", fleet.fleet, name="fleet"),
    path(
        "fleet/enrollments/<int:enrollment_id>/enroll/",
        enrollment.enroll_agent,
        name="enroll-agent",
    ),
    path(
        "fleet/enrollments/<int:enrollment_id>/reject/",
        enrollment.reject_enrollment,
        name="reject-enrollment",
    ),
    path(
        "fleet/agents/<int:agent_id>/revoke/",
        enrollment.revoke_agent,
        name="revoke-agent",
    ),
    path("cost/", cost.cost, name="cost"),
    path("cost.csv", cost.cost_csv, name="cost-csv"),
    path("sizing/", sizing.sizing, name="sizing"),
    path("audit/", audit.audit_log, name="audit-log"),
    path("tokens/", tokens.token_list, name="token-list"),
    path("tokens/new/", tokens.create_token, name="token-create"),
    path("tokens/<int:token_id>/revoke/", tokens.revoke_token, name="token-revoke"),
    path("favicon.ico", favicon.favicon, name="favicon"),
]
