"""FCP cost profiles a request may use: built-in names, the operator's named files, or a
profile sent by value. No request-supplied path is ever opened.

The operator's files (``PLANNER_FCP_PROFILES``) are read once when the service starts and
offered under each profile's ``name``; a request that names one is sent to the solver
with the profile by value, so solver processes never read files either (they refuse
``file:`` specs, see ``fcp.cost_model.forbid_profile_files``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planner_service.core.errors import FieldError
from planner_service.fcp.cost_model import PROFILES, FcpProfile, load_profile


class ProfileCatalog:
    """Profile names a request may use, and the resolution of a request's profile spec."""

    def __init__(self, files: Sequence[str] = ()) -> None:
        self.configured: dict[str, dict[str, Any]] = {}
        for path in files:  # the operator's files, at start-up: errors stop the service
            profile = load_profile(path)
            self.configured[profile.name] = profile.to_dict()

    @property
    def names(self) -> list[str]:
        return sorted(set(PROFILES) | set(self.configured))

    def resolve(self, spec: Any, field: str) -> str | dict[str, Any]:
        """A built-in name unchanged, an operator's name as its profile by value, a profile
        object validated; anything else (a ``file:`` path included) is a FieldError that
        names the valid choices and never reveals anything about the server's files."""
        if isinstance(spec, dict):
            try:
                return FcpProfile.from_dict(spec).to_dict()
            except (ValueError, TypeError) as exc:
                raise FieldError(field, f"{field}: {str(exc)[:300]}") from None
        if isinstance(spec, str):
            if spec in PROFILES:
                return spec
            if spec in self.configured:
                return self.configured[spec]
        shown = repr(spec)[:40] if isinstance(spec, str) else type(spec).__name__
        raise FieldError(field, f"{field} must be a profile name ({', '.join(self.names)}) "
                         f"or a profile object, got {shown}; paths are not accepted")
