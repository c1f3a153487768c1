from django.db import models
from django.utils import timezone

AGENT_STATES = ("online", "offline", "draining")
# "" is an agent from before enrollment (registered by name; the intake never
# believes its messages); enrolled agents' messages are checked against their key;
# a revoked one's are refused.
ENROLLMENT_STATES = ("", "enrolled", "revoked")
ENROLLMENT_REQUEST_STATES = ("pending", "approved", "rejected")
DEPLOYMENT_STATES = (
    "deploying",
    "live",
    "superseded",
    "failed",
    "failed_verification",
    "rolled_back",
)
# A deployment in one of these states with no `ended` time is what an environment
# serves now: live, or failed verification and still running until an operator rolls
# back or another release replaces it (which ends it).
SERVING_STATES = ("live", "failed_verification")


def _iso(value):
    return value.isoformat() if value else None


class Environment(models.Model):
    team = models.ForeignKey(
        "accounts.Team", models.CASCADE, related_name="environments"
    )
    name = models.SlugField(max_length=50)
    created = models.DateTimeField(default=timezone.now)
    # How deploy jobs serve a release here (controlplane.fleet.backend): {} is
    # the project's engine; else kind, preset or command_template,
    # tensor_parallel_size, max_model_len, gpu_memory_utilization, health_timeout_s,
    # kv_scale_strategy, as validated by clean_backend (keys left out: defaults).
    serving_backend = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["team", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "name"], name="unique_environment_per_team"
            )
        ]

    def __str__(self) -> str:
        return f"{self.team.slug}/{self.name}"

    @property
    def live_deployment(self) -> "Deployment | None":
        """What the environment serves now (see SERVING_STATES); None while nothing
        does, e.g. during a rollback's deploy."""
        return self.deployments.serving().order_by("-started", "-id").first()

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "team": self.team.slug,
            "name": self.name,
            "serving_backend": self.serving_backend,
        }


class ServingPreset(models.Model):
    """A command template a platform operator (Django staff) names, for teams to
    choose as an environment's external backend ({"kind": "external", "preset":
    name}): a team admin picks a preset, never a command line. Written only by
    fleet.actions.do_set_serving_preset (the admin site)."""

    name = models.SlugField(max_length=50, unique=True)
    # An argv template (gpuagent.protocol.command_template_words' grammar) that
    # deploy jobs carry as BackendSpec.command_template.
    command_template = models.TextField()
    description = models.TextField(blank=True)
    created = models.DateTimeField(default=timezone.now)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "command_template": self.command_template,
            "description": self.description,
        }


class Agent(models.Model):
    STATE_CHOICES = [(s, s) for s in AGENT_STATES]

    name = models.CharField(max_length=100, unique=True)
    queue = models.CharField(max_length=100)
    gpu_model = models.CharField(max_length=100, blank=True)
    gpu_memory_bytes = models.BigIntegerField(default=0)
    # From the latest heartbeat: "cuda" or "cpu" (a CPU agent reports host memory
    # in the gpu_memory fields), free memory, the job ids it runs and the
    # deployment ids it serves.
    device = models.CharField(max_length=10, blank=True)
    gpu_memory_free_bytes = models.BigIntegerField(default=0)
    running_jobs = models.JSONField(default=list, blank=True)
    loaded_deployments = models.JSONField(default=list, blank=True)
    capabilities = models.JSONField(default=dict, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=20, choices=STATE_CHOICES, default="offline")
    # Which start of the agent's process beats now (random per start; "" until a
    # beat names one) and when it started, as the agent reports: another
    # incarnation under the same name means the agent restarted.
    incarnation = models.CharField(max_length=64, blank=True)
    started = models.DateTimeField(null=True, blank=True)
    # Identity, from the enrollment an operator approved (never from a message):
    # the agent's Ed25519 public key (raw, hex) and its sha256 (hex), the pool it
    # takes jobs from, whether it may sign, the programs an external backend may
    # start on it (preset names or command templates, whole argument shapes; the
    # control plane sends such deploys only to an agent allowed to start them, see
    # controlplane.fleet.programs; None: the agent's own list decides), and the
    # release-signing public key (PEM) its sign results must verify against.
    enrollment = models.CharField(max_length=10, blank=True, default="")
    public_key = models.CharField(max_length=64, blank=True)
    fingerprint = models.CharField(max_length=64, blank=True, db_index=True)
    pool_queue = models.CharField(max_length=100, blank=True)
    can_sign = models.BooleanField(default=False)
    allowed_programs = models.JSONField(null=True, blank=True)
    signing_public_key = models.TextField(blank=True)
    enrolled_at = models.DateTimeField(null=True, blank=True)
    # The devices the operator enrolled it to use ([{index, model,
    # memory_total_bytes}], as it reported them when it asked): what placement
    # plans over. `devices`: their state in the latest beat (each with
    # memory_free_bytes); `devices_outside_enrollment`: indices a beat named that
    # the enrollment does not hold (noted, never used).
    enrolled_devices = models.JSONField(default=list, blank=True)
    devices = models.JSONField(default=list, blank=True)
    devices_outside_enrollment = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_enrolled(self) -> bool:
        return self.enrollment == "enrolled"

    def enrolled_capabilities(self) -> dict:
        return {"can_sign": self.can_sign, "pool_queue": self.pool_queue}

    @property
    def device_indices(self) -> list[int]:
        return [d["index"] for d in self.enrolled_devices]

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "queue": self.queue,
            "gpu_model": self.gpu_model,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "device": self.device,
            "gpu_memory_free_bytes": self.gpu_memory_free_bytes,
            "running_jobs": self.running_jobs,
            "loaded_deployments": self.loaded_deployments,
            "capabilities": self.capabilities,
            "last_heartbeat": _iso(self.last_heartbeat),
            "state": self.state,
            "incarnation": self.incarnation,
            "started": _iso(self.started),
            "enrollment": self.enrollment,
            "fingerprint": self.fingerprint,
            "pool_queue": self.pool_queue,
            "can_sign": self.can_sign,
            "allowed_programs": self.allowed_programs,
            "enrolled_at": _iso(self.enrolled_at),
            "enrolled_devices": self.enrolled_devices,
            "devices": self.devices,
            "devices_outside_enrollment": self.devices_outside_enrollment,
        }


class EnrollmentRequest(models.Model):
    """An agent key seen in a sealed heartbeat that no enrolled agent holds: it
    asks to be enrolled, nothing more (an operator approves or rejects it). What
    it says of itself (name, pool, can sign) is a suggestion shown to the
    operator."""

    STATE_CHOICES = [(s, s) for s in ENROLLMENT_REQUEST_STATES]

    fingerprint = models.CharField(max_length=64, unique=True)
    public_key = models.CharField(max_length=64)
    requested_name = models.CharField(max_length=100)
    requested_pool = models.CharField(max_length=100, blank=True)
    signing_public_key = models.TextField(blank=True)
    device = models.CharField(max_length=10, blank=True)
    gpu_model = models.CharField(max_length=100, blank=True)
    # Every device it reported ([{index, model, memory_total_bytes}]): what an
    # operator enrolls it to use (all of them unless told otherwise).
    devices = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=10, choices=STATE_CHOICES, default="pending")
    first_seen = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now)
    agent = models.ForeignKey(
        Agent, models.SET_NULL, null=True, blank=True, related_name="enrollments"
    )

    class Meta:
        ordering = ["-first_seen", "-id"]

    def __str__(self) -> str:
        return f"{self.requested_name} ({self.fingerprint[:16]}, {self.state})"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "fingerprint": self.fingerprint,
            "public_key": self.public_key,
            "requested_name": self.requested_name,
            "requested_pool": self.requested_pool,
            "can_sign": bool(self.signing_public_key),
            "device": self.device,
            "gpu_model": self.gpu_model,
            "devices": self.devices,
            "state": self.state,
            "first_seen": _iso(self.first_seen),
            "last_seen": _iso(self.last_seen),
            "agent": self.agent.name if self.agent else None,
        }


class SeenMessage(models.Model):
    """A sealed message accepted from a signer: the same nonce again is a replay.
    Rows older than the allowed skew are pruned (a message that old is stale)."""

    signer = models.CharField(max_length=64)
    nonce = models.CharField(max_length=32)
    seen = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["signer", "nonce"], name="unique_seen_message"
            )
        ]

    def __str__(self) -> str:
        return f"{self.signer[:16]}/{self.nonce}"


class DeploymentQuerySet(models.QuerySet):
    def serving(self):
        return self.filter(state__in=SERVING_STATES, ended__isnull=True)


class Deployment(models.Model):
    STATE_CHOICES = [(s, s) for s in DEPLOYMENT_STATES]

    release = models.ForeignKey(
        "releases.Release", models.CASCADE, related_name="deployments"
    )
    environment = models.ForeignKey(
        Environment, models.CASCADE, related_name="deployments"
    )
    agent = models.ForeignKey(
        Agent, models.SET_NULL, null=True, blank=True, related_name="deployments"
    )
    state = models.CharField(max_length=30, choices=STATE_CHOICES, default="deploying")
    endpoint = models.CharField(max_length=300, blank=True)
    # The agent's own id of the server (gpuagent.serving's deployment id): what
    # undeploy and reverify jobs name on that agent.
    serving_id = models.CharField(max_length=100, blank=True)
    started = models.DateTimeField(default=timezone.now)
    ended = models.DateTimeField(null=True, blank=True)
    # Why it failed; for a rollback that found no release still verifying, every
    # release tried and why.
    reason = models.TextField(blank=True)
    # None: not a rollback's deployment; else the releases this rollback tried
    # before it, "model@version (why)" each.
    rollback_tried = models.JSONField(null=True, blank=True)
    # Its placement on its agent (controlplane.fleet.placement), as its deploy
    # job carries it (gpuagent.protocol.Placement: devices, memory budget per
    # device, the servers stopped first; None: not placed, the agent's whole
    # machine as before placement), what the release needs on each device
    # (bytes), and why it was placed so or not placed.
    placement = models.JSONField(null=True, blank=True)
    memory_need_bytes = models.BigIntegerField(default=0)
    placement_note = models.TextField(blank=True)
    # When its server was stopped (undeployed, or to make room for another): a
    # rollback to it then restarts it cold from its verified copy on disk. None
    # while a server it started may still run (warm).
    unloaded = models.DateTimeField(null=True, blank=True)

    objects = DeploymentQuerySet.as_manager()

    class Meta:
        ordering = ["-started", "-id"]

    def __str__(self) -> str:
        return f"{self.release} in {self.environment} ({self.state})"

    @property
    def warm(self) -> bool:
        """Whether a server it started may still run on its agent."""
        return bool(self.serving_id) and self.unloaded is None

    @property
    def devices(self) -> list[int] | None:
        return self.placement["devices"] if self.placement else None

    @property
    def memory_budget_bytes(self) -> int:
        return self.placement["memory_budget_bytes"] if self.placement else 0

    def placement_dict(self) -> dict:
        return {
            "devices": self.devices,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_need_bytes": self.memory_need_bytes,
            "note": self.placement_note,
            "warm": self.warm,
            "unloaded": _iso(self.unloaded),
        }

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "release_id": self.release_id,
            "release": str(self.release),
            "environment": self.environment.name,
            "agent": self.agent.name if self.agent else None,
            "state": self.state,
            "endpoint": self.endpoint,
            "started": _iso(self.started),
            "ended": _iso(self.ended),
            "reason": self.reason,
            "rollback": self.rollback_tried is not None,
            "placement": self.placement_dict(),
        }
