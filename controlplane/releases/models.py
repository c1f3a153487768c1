from django.conf import settings
from django.db import models
from django.utils import timezone

from controlplane.releases.gates import GatePolicy

# The states a release can be in; which moves between them are legal is decided in one
# place only: TRANSITIONS in controlplane/releases/actions/transitions.py.
RELEASE_STATES = (
    "registered",
    "verifying",
    "compressing",
    "evaluating",
    "gated",
    "awaiting_approval",
    "approved",
    "deploying",
    "live",
    "superseded",
    "rejected",
    "failed",
    "failed_verification",
    "quarantined",
    "rolled_back",
)
JOB_STATES = ("queued", "running", "succeeded", "failed")
# Jobs that check a model's bytes on the way to deploy: inspecting the source,
# hashing and signing the candidate, verifying it on another agent.
INTEGRITY_JOB_KINDS = ("inspect", "verify_source", "sign", "verify")
# Jobs that check a live copy after its deploy (beat, every interval): no stage of
# the pipeline, so pages and the API show their count and the latest, not each one.
AFTER_DEPLOY_JOB_KINDS = ("reverify",)
# "skipped": a check that does not apply, with why (a comparison with live where
# nothing is live); it neither passes a release nor holds it.
GATE_OUTCOMES = ("pass", "fail", "inconclusive", "skipped")
DECISIONS = ("approve", "reject")


def _iso(value):
    return value.isoformat() if value else None


class TeamScopedQuerySet(models.QuerySet):
    team_path = "team"

    def visible_to(self, user):
        """Rows of the teams `user` belongs to; nothing for anyone else."""
        if user is None or not user.is_authenticated:
            return self.none()
        return self.filter(**{f"{self.team_path}__memberships__user": user})

    def of_team(self, team):
        return self.filter(**{self.team_path: team})


class ReleaseQuerySet(TeamScopedQuerySet):
    team_path = "model__team"


class ModelFamily(models.Model):
    """A model as the team knows it ("llama-3-8b-support"); releases are versions."""

    team = models.ForeignKey(
        "accounts.Team", models.CASCADE, related_name="model_families"
    )
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True)
    created = models.DateTimeField(default=timezone.now)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["team", "name"]
        verbose_name_plural = "model families"
        constraints = [
            models.UniqueConstraint(
                fields=["team", "name"], name="unique_model_family_per_team"
            )
        ]

    def __str__(self) -> str:
        return self.name

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "team": self.team.slug,
            "name": self.name,
            "description": self.description,
            "created": _iso(self.created),
        }


class Release(models.Model):
    STATE_CHOICES = [(s, s) for s in RELEASE_STATES]

    model = models.ForeignKey(ModelFamily, models.CASCADE, related_name="releases")
    version = models.CharField(max_length=100)
    source_uri = models.CharField(max_length=1000)
    recipe = models.JSONField(default=dict)
    target_environment = models.ForeignKey(
        "fleet.Environment", models.PROTECT, related_name="targeted_releases"
    )
    state = models.CharField(
        max_length=30, choices=STATE_CHOICES, default="registered", db_index=True
    )
    failure_reason = models.TextField(blank=True)
    # Control state the pipeline reads, kept with the state it belongs to (set by
    # do_transition_release, never derived from the audit log): when the release
    # entered its state (jobs from before belong to an earlier pass), and when it
    # last moved back to registered (approvals from before no longer bind it).
    state_entered_at = models.DateTimeField(default=timezone.now)
    reopened_at = models.DateTimeField(null=True, blank=True)
    manifest_digest = models.CharField(max_length=200, blank=True)
    signature = models.TextField(blank=True)
    parent = models.ForeignKey(
        "self", models.SET_NULL, null=True, blank=True, related_name="children"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, models.PROTECT, related_name="registered_releases"
    )
    created_by_token = models.ForeignKey(
        "accounts.ApiToken",
        models.SET_NULL,
        null=True,
        blank=True,
        related_name="registered_releases",
    )
    # sha256 over the canonical registration body: the same body again is a no-op,
    # a different body for the same model+version is a conflict.
    registration_body_digest = models.CharField(max_length=64)
    created = models.DateTimeField(default=timezone.now)
    updated = models.DateTimeField(auto_now=True)

    objects = ReleaseQuerySet.as_manager()

    class Meta:
        ordering = ["-created", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "version"], name="unique_release_version"
            )
        ]

    def __str__(self) -> str:
        return f"{self.model.name}@{self.version}"

    @property
    def team(self):
        return self.model.team

    @property
    def team_id(self) -> int:
        return self.model.team_id

    def to_dict(self, *, detail: bool = False) -> dict:
        data = {
            "id": self.id,
            "team": self.model.team.slug,
            "model": self.model.name,
            "version": self.version,
            "source_uri": self.source_uri,
            "recipe": self.recipe,
            "target_environment": self.target_environment.name,
            "state": self.state,
            "failure_reason": self.failure_reason,
            "manifest_digest": self.manifest_digest,
            "parent_id": self.parent_id,
            "created_by": self.created_by.username,
            "created": _iso(self.created),
            "updated": _iso(self.updated),
        }
        if detail:
            data["signature"] = self.signature
            data["artifacts"] = [a.to_dict() for a in self.artifacts.all()]
            # The pipeline's jobs; a live copy's re-verifications grow without
            # bound and are counted apart (evidence.reverifications).
            pipeline_jobs = self.jobs.exclude(kind__in=AFTER_DEPLOY_JOB_KINDS)
            data["jobs"] = [j.to_dict() for j in pipeline_jobs.select_related("agent")]
            data["gate_results"] = [g.to_dict() for g in self.gate_results.all()]
            data["approvals"] = [a.to_dict() for a in self.approvals.all()]
            data["deployments"] = [d.to_dict() for d in self.deployments.all()]
        return data


class Artifact(models.Model):
    release = models.ForeignKey(Release, models.CASCADE, related_name="artifacts")
    path = models.CharField(max_length=1000)
    size_bytes = models.BigIntegerField()
    digest = models.CharField(max_length=200)

    class Meta:
        ordering = ["path"]
        constraints = [
            models.UniqueConstraint(
                fields=["release", "path"], name="unique_artifact_path"
            )
        ]

    def __str__(self) -> str:
        return self.path

    def to_dict(self) -> dict:
        return {"path": self.path, "size_bytes": self.size_bytes, "digest": self.digest}


class Job(models.Model):
    STATE_CHOICES = [(s, s) for s in JOB_STATES]

    release = models.ForeignKey(Release, models.CASCADE, related_name="jobs")
    kind = models.CharField(max_length=30)
    state = models.CharField(max_length=20, choices=STATE_CHOICES, default="queued")
    agent = models.ForeignKey(
        "fleet.Agent", models.SET_NULL, null=True, blank=True, related_name="jobs"
    )
    progress = models.FloatField(default=0.0)
    attempts = models.PositiveIntegerField(default=0)
    created = models.DateTimeField(default=timezone.now)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)
    # While running: until when its worker holds it (extended by each progress
    # heartbeat). Another task may resume the job only once this has passed; None
    # when not running.
    lease_expires = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    # The deployment a deploy or reverify job acts on, fixed when it is sent: its
    # answer is about that copy, whatever the environment serves by then.
    deployment = models.ForeignKey(
        "fleet.Deployment", models.SET_NULL, null=True, blank=True, related_name="jobs"
    )

    class Meta:
        ordering = ["created", "id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(progress__gte=0.0, progress__lte=1.0),
                name="job_progress_in_unit_interval",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} for {self.release_id} ({self.state})"

    @property
    def duration_s(self) -> float | None:
        if self.started and self.finished:
            return (self.finished - self.started).total_seconds()
        return None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "kind": self.kind,
            "state": self.state,
            "agent": self.agent.name if self.agent else None,
            "progress": self.progress,
            "attempts": self.attempts,
            "started": _iso(self.started),
            "finished": _iso(self.finished),
            "lease_expires": _iso(self.lease_expires),
            "duration_s": self.duration_s,
            "result": self.result,
            "error": self.error,
        }


class GateResult(models.Model):
    OUTCOME_CHOICES = [(o, o) for o in GATE_OUTCOMES]

    release = models.ForeignKey(Release, models.CASCADE, related_name="gate_results")
    gate = models.CharField(max_length=100)
    metric = models.CharField(max_length=100)
    observed = models.FloatField(null=True, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    outcome = models.CharField(max_length=20, choices=OUTCOME_CHOICES)
    reason = models.TextField(blank=True)
    # EnvironmentGatePolicy.version of the policy it was held against (0: the
    # default policy of an environment that never set one).
    policy_version = models.PositiveIntegerField(default=0)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created", "id"]

    def __str__(self) -> str:
        return f"{self.gate}: {self.outcome}"

    def to_dict(self) -> dict:
        return {
            "gate": self.gate,
            "metric": self.metric,
            "observed": self.observed,
            "threshold": self.threshold,
            "outcome": self.outcome,
            "reason": self.reason,
            "policy_version": self.policy_version,
            "created": _iso(self.created),
        }


class Approval(models.Model):
    DECISION_CHOICES = [(d, d) for d in DECISIONS]

    release = models.ForeignKey(Release, models.CASCADE, related_name="approvals")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, models.PROTECT, related_name="approvals"
    )
    token = models.ForeignKey(
        "accounts.ApiToken",
        models.SET_NULL,
        null=True,
        blank=True,
        related_name="approvals",
    )
    decision = models.CharField(max_length=10, choices=DECISION_CHOICES)
    comment = models.TextField(blank=True)
    # What the approver saw: an approval is bound to exactly these bytes.
    manifest_digest = models.CharField(max_length=200, blank=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created", "id"]

    def __str__(self) -> str:
        return f"{self.decision} by {self.user} for {self.release_id}"

    def to_dict(self) -> dict:
        return {
            "user": self.user.username,
            "via_token": self.token.name if self.token else None,
            "decision": self.decision,
            "comment": self.comment,
            "manifest_digest": self.manifest_digest,
            "created": _iso(self.created),
        }


class EnvironmentGatePolicy(models.Model):
    """The gate policy of one environment, as gates.GatePolicy's JSON (validated by
    the action that writes it). An environment without a row uses the default
    GatePolicy()."""

    environment = models.OneToOneField(
        "fleet.Environment", models.CASCADE, related_name="gate_policy"
    )
    policy = models.JSONField(default=dict)
    # Bumped by every write (actions.gate_policies): gate results record the
    # version they were held against, so an approval can tell the policy changed.
    version = models.PositiveIntegerField(default=0)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "environment gate policies"

    def __str__(self) -> str:
        return f"gate policy of {self.environment}"

    @property
    def spec(self) -> GatePolicy:
        return GatePolicy.model_validate(self.policy)
