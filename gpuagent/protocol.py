"""Message schemas shared by the control plane and the agent (torch-free, pydantic v2).

The control plane sends job requests to agent queues by task name; agents answer with a
JSON result that validates against one of the `*Result` models here. Nothing in this
module imports torch or Django, so both sides can import it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

KV_CACHE_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")
# Weight formats a recipe may ask for; int4 carries its quantization group size.
WEIGHT_FORMAT_PATTERN = re.compile(r"^(bf16|fp16|int8|int4-g(32|64|128))$")

JobKind = Literal[
    "inspect",
    "verify_source",
    "compress",
    "sign",
    "verify",
    "evaluate",
    "load_test",
    "gate",
    "deploy",
    "reverify",
]
JOB_KINDS: tuple[str, ...] = JobKind.__args__  # type: ignore[attr-defined]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Recipe(_Message):
    """How a release is compressed: weight format and KV-cache dtype."""

    weights: str = Field(description="bf16, fp16, int8 or int4-g{32,64,128}")
    kv_cache_dtype: str = Field(description="one of " + ", ".join(KV_CACHE_DTYPES))

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, value: str) -> str:
        if not WEIGHT_FORMAT_PATTERN.match(value):
            raise ValueError(
                f"unknown weight format {value!r}; expected bf16, fp16, int8 or "
                "int4-g32/int4-g64/int4-g128"
            )
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {value!r}; expected one of "
                + ", ".join(KV_CACHE_DTYPES)
            )
        return value


class FileDigest(_Message):
    """One file of a model folder: path relative to the folder, size and digest."""

    path: str
    size_bytes: int = Field(ge=0)
    digest: str = Field(description="'<algorithm>:<hex>', e.g. sha256:ab12...")


class JobRequest(_Message):
    """What the control plane sends to an agent task."""

    job_id: int
    release_id: int
    kind: JobKind
    source_uri: str
    recipe: Recipe | None = None
    manifest_digest: str = ""


class InspectResult(_Message):
    """Structure check of a source folder: files, formats, anything refused."""

    ok: bool
    files: list[FileDigest] = []
    problems: list[str] = []


class HashResult(_Message):
    """A manifest over the candidate's files; `manifest_digest` names the algorithm."""

    manifest_digest: str
    files: list[FileDigest]
    signature: str = ""


class VerifyResult(_Message):
    """Outcome of re-hashing a copy against an expected manifest digest."""

    ok: bool
    manifest_digest: str
    missing: list[str] = []
    extra: list[str] = []
    changed: list[str] = []


class MetricResult(_Message):
    """One measured number from an evaluate or load-test job."""

    metric: str
    value: float
    unit: str = ""


class EvaluateResult(_Message):
    metrics: list[MetricResult]


class DeployResult(_Message):
    ok: bool
    endpoint: str = ""
    manifest_digest: str = ""
    error: str = ""


class JobResult(_Message):
    """Envelope every agent job returns; `payload` holds the kind-specific result."""

    job_id: int
    kind: JobKind
    ok: bool
    agent: str = ""
    started: datetime | None = None
    finished: datetime | None = None
    error: str = ""
    payload: dict = {}
