"""The control plane's own Ed25519 key: it seals every job request, and agents are
given its public half (GPUAGENT_CONTROLPLANE_KEY) to refuse any other.

The key lives at settings.RELEASEGATE_CONTROLPLANE_KEY, created there on first use
(mode 0600): in production point that at a key file kept off the repository."""

import logging
from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings

from gpuagent.integrity import identity
from gpuagent.protocol import JobRequest, Seal

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def _key_at(path: Path) -> Ed25519PrivateKey:
    if not path.exists():
        log.warning("no control-plane key at %s: creating one (dev/first use)", path)
    return identity.load_or_create_key(path)


def controlplane_key() -> Ed25519PrivateKey:
    return _key_at(Path(settings.RELEASEGATE_CONTROLPLANE_KEY))


def controlplane_public_pem() -> str:
    """The PEM of the control plane's public key: what agents are given."""
    return (
        controlplane_key()
        .public_key()
        .public_bytes(
            serialization.Encoding.PEM,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        )
        .decode()
    )


def write_controlplane_public_key(path: Path) -> Path:
    """Write the control plane's public key (PEM) to `path`, for an agent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(controlplane_public_pem())
    return path


def seal_job_request(request: JobRequest, body: dict) -> dict:
    """The seal of a job request's JSON `body` (sent beside it)."""
    sealed: Seal = identity.seal(
        controlplane_key(),
        body,
        type="job",
        job_id=request.job_id,
        attempt=request.attempt,
        kind=request.kind,
        release_id=request.release_id,
    )
    return sealed.model_dump(mode="json")
