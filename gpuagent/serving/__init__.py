"""Serving of approved releases on this agent (no Django; torch only inside the
engine process this package starts).

Public API (what the agent's job handlers call):

- `deploy(model_dir, spec, *, registry, trust=None, env=None) -> DeployResult`:
  verify the folder against `spec.manifest_digest` (and `trust`'s signature) before
  any process starts, start `spec.backend`'s server, wait for `/health`, return the
  endpoint. Refusals and failed starts come back as `ok=False` with the reason.
- `undeploy(deployment_id, *, registry) -> bool`: SIGTERM, SIGKILL after a grace;
  idempotent.
- `loaded_deployments(registry)`, `recover_deployments(registry, stop=...)`: what
  runs, for heartbeats and for an agent that restarts.
- `reverify(model_dir, manifest_digest, ...) -> VerifyResult`,
  `reverify_deployment(deployment_id, *, registry)`: re-hash a deployed copy now.
- `check_rollback_target(deployment_id, *, registry) -> RollbackCheck`: re-hash
  plus `/health`.

Backends: `engine` (`python -m gpuagent.engine serve`, verify-on-load) and
`external` (a command template or a named preset such as `vllm`; see `templates`).
"""

from gpuagent.serving.deploy import (
    check_rollback_target,
    deploy,
    loaded_deployments,
    recover_deployments,
    reverify_deployment,
    undeploy,
)
from gpuagent.serving.errors import (
    DeployRefusedError,
    ServingError,
    StartError,
    TemplateError,
)
from gpuagent.serving.registry import DeploymentRecord, Registry
from gpuagent.serving.templates import (
    PLACEHOLDERS,
    PRESETS,
    parse_template,
    render_command,
)
from gpuagent.serving.verify import Trust, reverify

__all__ = [
    "PLACEHOLDERS",
    "PRESETS",
    "DeployRefusedError",
    "DeploymentRecord",
    "Registry",
    "ServingError",
    "StartError",
    "TemplateError",
    "Trust",
    "check_rollback_target",
    "deploy",
    "loaded_deployments",
    "parse_template",
    "recover_deployments",
    "render_command",
    "reverify",
    "reverify_deployment",
    "undeploy",
]
