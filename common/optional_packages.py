"""Packages a feature needs that a plain `pip install pdserve` may lack, and the refusal a request
for that feature gets when one is missing: HTTP 501 naming the package and the command that
installs it, never a 500.

Who checks: the router's grammar checker process (router/grammar_check.py) before any worker is
asked, and each engine's grammar backend (common/grammar/backend.py) at its first compile.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

MISSING_PACKAGE_STATUS = 501  # Not Implemented: this install cannot serve the feature; retrying will not help
MISSING_PACKAGE_CODE = "missing_package"


@dataclass(frozen=True)
class OptionalPackage:
    module: str  # the import name
    feature: str  # what a client asked for that needs it
    install: str  # the command that installs it (in the same environment as pdserve)

    def import_problem(self) -> str | None:
        """None when the module imports; else why not (the ImportError's own words)."""
        try:
            importlib.import_module(self.module)
        except ImportError as e:
            return f"{type(e).__name__}: {e}"
        return None

    def refusal(self, where: str) -> str:
        """The client-facing message for a request that needs this package (where: "router" / "instance").
        The ImportError's own words (which can name paths) are for the log, not the client."""
        return (f"{self.feature} is not available: the Python package '{self.module}' cannot be imported in "
                f"this {where}'s environment. Install it with: {self.install}")


XGRAMMAR = OptionalPackage(
    module="xgrammar",
    feature="structured output (response_format, json_schema / regex / ebnf)",
    install="pip install 'pdserve[grammar]' && pip install --no-deps xgrammar==0.2.8",
)


class MissingPackage(Exception):
    """A request needs an OptionalPackage this process cannot import; str(e) is the refusal."""

    status_code = MISSING_PACKAGE_STATUS
