"""The control plane's own check of a sign result: the signature file it carries
must verify against the release-signing key the signer's enrollment pinned, be
bound to this release (model, version, recipe) and sign the very manifest digest
the result reports, before that digest is recorded (torch-free: model-signing
and gpuagent.integrity only; the files themselves are not here to re-hash)."""

import tempfile
from pathlib import Path

from controlplane.fleet.models import Agent
from controlplane.releases.models import Release
from gpuagent.integrity import IntegrityError
from gpuagent.integrity.policy import Policy, ReleaseBinding
from gpuagent.integrity.signing import check_binding, read_signed_statement
from gpuagent.protocol import HashResult, Recipe


def release_binding(release: Release) -> ReleaseBinding:
    """What the sign job binds a signature to (gpuagent.tasks._binding)."""
    recipe = Recipe.model_validate(release.recipe)
    return ReleaseBinding(
        model=release.model.name,
        version=release.version,
        recipe=f"weights={recipe.weights},kv={recipe.kv_cache_dtype}",
    )


def sign_result_problem(release: Release, payload: dict, agent: Agent) -> str:
    """Why a successful sign result of `agent` for `release` is not believed
    ("" when it is)."""
    if not (agent.can_sign and agent.signing_public_key):
        return f"agent {agent.name} is not enrolled to sign"
    try:
        signed = HashResult.model_validate(payload)
    except ValueError as exc:
        return f"malformed sign result: {exc}"
    binding = release_binding(release)
    policy = Policy(
        public_keys_pem=(agent.signing_public_key.encode(),), release=binding
    )
    try:
        with tempfile.TemporaryDirectory(prefix="rg-signcheck-") as tmp:
            path = Path(tmp) / "model.sig"
            path.write_text(signed.signature)
            statement = read_signed_statement(path, policy)
        check_binding(statement, binding)
    except IntegrityError as exc:
        return (
            f"the signature does not verify against {agent.name}'s enrolled "
            f"signing key and release {binding.model}@{binding.version}: {exc}"
        )
    if statement.manifest.digest != signed.manifest_digest:
        return (
            f"the signature signs {statement.manifest.digest}, the result "
            f"reports {signed.manifest_digest}"
        )
    signed_paths = set(statement.manifest.files())
    reported = {f.path for f in signed.files}
    if reported != signed_paths:
        return "the result's file list is not the signed manifest's"
    return ""
