"""Integrity gate: decides whether a model folder is exactly what was approved.

Torch-free (the control plane imports it). Public API:

- `inspect_model(folder, policy)`: what the folder may hold (an allow-list the
  policy extends with `AllowedFile` patterns) and structural and content checks,
  report per file.
- `hash_model(folder, algorithm)`: manifest of digests, manifest digest;
  `file_digests(folder, manifest)`: its per-file digests as the agents report them.
- `sign_model(...)` / `verify_model(folder, signature, policy)`: model-signing
  signatures bound to a release.
- `read_verified_files(dir, manifest_digest, ...)`: verify-on-load; feed the
  result to `gpuagent.engine.loader.load_model(dir, files=...)`.
- `read_inspected_files(dir)`: the same without an approved digest (inspected
  only); returns the bytes and their digest.

The folder's limits (names, lengths, depth, entry count, total size, the
signature's size) are `FolderLimits`, in `Policy.limits`: every one of these
refuses by them alike, before reading anything.
"""

from gpuagent.integrity.errors import (
    BindingMismatchError,
    HashingError,
    IgnoreListError,
    IntegrityError,
    ManifestDigestMismatchError,
    ManifestMismatchError,
    ModelRejectedError,
    PolicyError,
    SignatureError,
    SignerNotTrustedError,
    SigningError,
    SparseFileError,
    UnsafePathError,
)
from gpuagent.integrity.inspection import (
    FileVerdict,
    Finding,
    InspectionReport,
    inspect_model,
)
from gpuagent.integrity.limits import FolderLimits
from gpuagent.integrity.manifest import (
    HashSpec,
    Manifest,
    Resource,
    file_digests,
    hash_model,
)
from gpuagent.integrity.policy import (
    DEFAULT_POLICY,
    AllowedFile,
    Policy,
    ReleaseBinding,
)
from gpuagent.integrity.signing import (
    SignResult,
    VerificationReport,
    key_fingerprint,
    sign_model,
    verify_model,
)
from gpuagent.integrity.verified_load import read_inspected_files, read_verified_files

__all__ = [
    "DEFAULT_POLICY",
    "AllowedFile",
    "BindingMismatchError",
    "FileVerdict",
    "FolderLimits",
    "Finding",
    "HashSpec",
    "HashingError",
    "IgnoreListError",
    "InspectionReport",
    "IntegrityError",
    "Manifest",
    "ManifestDigestMismatchError",
    "ManifestMismatchError",
    "ModelRejectedError",
    "Policy",
    "PolicyError",
    "ReleaseBinding",
    "Resource",
    "SignResult",
    "SignatureError",
    "SignerNotTrustedError",
    "SigningError",
    "SparseFileError",
    "UnsafePathError",
    "VerificationReport",
    "file_digests",
    "hash_model",
    "inspect_model",
    "key_fingerprint",
    "read_inspected_files",
    "read_verified_files",
    "sign_model",
    "verify_model",
]
