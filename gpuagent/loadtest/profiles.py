"""Named workload profiles (`profiles.toml` beside this file, or the user's own):
what the prompts are made of, how long prompts and answers are in tokens, and the
SLO a load level must meet."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

PROFILES_FILE = Path(__file__).resolve().parent / "profiles.toml"
SOURCES = ("english", "code", "korean")


class ProfileError(ValueError):
    """A profiles file that can't be used; the message names the profile and key."""


@dataclass(frozen=True)
class Profile:
    """One workload: chat requests of `prompt_tokens` with answers of
    `output_tokens`."""

    name: str
    source: str
    instruction: str
    prompt_tokens: int
    output_tokens: int
    description: str = ""
    fixed_output: bool = True
    # 0 is greedy; None sends none, so the server samples at its default (what
    # clients that don't set it, guidellm among them, ask for)
    temperature: float | None = 0.0
    slo_ttft_p99_ms: float = 2000.0
    slo_tpot_p99_ms: float = 150.0
    context_sweep: tuple[int, ...] = field(default_factory=tuple)

    @property
    def context_tokens(self) -> int:
        """Prompt plus answer: the KV a session of this profile holds at its end."""
        return self.prompt_tokens + self.output_tokens

    def with_lengths(
        self, prompt_tokens: int | None = None, output_tokens: int | None = None
    ) -> Profile:
        """The same profile with other lengths (a context sweep, a small run)."""
        return replace(
            self,
            prompt_tokens=prompt_tokens or self.prompt_tokens,
            output_tokens=output_tokens or self.output_tokens,
        )


def load_profiles(path: Path = PROFILES_FILE) -> dict[str, Profile]:
    """Every profile in a profiles file, `[defaults]` applied (ProfileError for an
    unknown key, a missing one or a bad value)."""
    try:
        data = tomllib.loads(path.read_text("utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ProfileError(f"{path}: {exc}") from None
    known = {f.name for f in fields(Profile)} - {"name"}
    defaults = data.get("defaults", {})
    profiles = {}
    for name, entries in data.get("profiles", {}).items():
        merged: dict[str, Any] = {**defaults, **entries}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ProfileError(f"profile {name!r}: unknown keys {unknown}")
        merged["context_sweep"] = tuple(merged.get("context_sweep", ()))
        try:
            profile = Profile(name=name, **merged)
        except TypeError as exc:
            raise ProfileError(f"profile {name!r}: {exc}") from None
        if profile.source not in SOURCES:
            raise ProfileError(
                f"profile {name!r}: source {profile.source!r} is not one of {SOURCES}"
            )
        if profile.prompt_tokens < 1 or profile.output_tokens < 1:
            raise ProfileError(f"profile {name!r}: lengths must be at least 1")
        temperature = profile.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            raise ProfileError(f"profile {name!r}: temperature must be a number")
        if temperature < 0:
            raise ProfileError(f"profile {name!r}: temperature must be at least 0")
        profiles[name] = profile
    if not profiles:
        raise ProfileError(f"{path} defines no [profiles.NAME]")
    return profiles
