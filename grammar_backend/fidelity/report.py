"""The fidelity reports: which keywords decoding leaves unenforced, and what post-validation found."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Enforcement", "KeywordFidelity", "RefusedConstruct", "UnenforcedKeyword", "ValidationReport",
           "Violation", "result_json"]



@dataclass(frozen=True, slots=True)
class UnenforcedKeyword:
    """A schema keyword whose violation can survive constrained decoding.

    Attributes
    ----------
    pointer : str
        JSON pointer (RFC 6901) into the schema to the keyword, e.g.
        ``"/properties/tags/uniqueItems"``; for one ``required`` name it points at
        the array element (``"/required/1"``).
    keyword : str
        The keyword, e.g. ``"uniqueItems"``.
    note : str
        Why it is not enforced, in words a client can act on.
    """

    pointer: str
    keyword: str
    note: str


class Enforcement(str, enum.Enum):
    """How xgrammar 0.2.9 treats a keyword during decoding."""

    ENFORCED = "enforced"
    CONDITIONAL = "conditional"
    NOT_ENFORCED = "not_enforced"


@dataclass(frozen=True, slots=True)
class KeywordFidelity:
    """One row of :data:`KEYWORD_TABLE`.

    Attributes
    ----------
    keyword : str
        The Draft 2020-12 assertion keyword.
    enforcement : Enforcement
        Observed treatment.
    detail : str
        The conditions, as observed.
    """

    keyword: str
    enforcement: Enforcement
    detail: str


@dataclass(frozen=True, slots=True)
class RefusedConstruct:
    """A schema construct that xgrammar 0.2.9 refuses to compile.

    Attributes
    ----------
    name : str
        Short identifier.
    schema : str
        A minimal schema (JSON text) that shows the refusal.
    message : str
        A fragment of xgrammar's ``RuntimeError`` message.
    """

    name: str
    schema: str
    message: str


@dataclass(frozen=True, slots=True)
class Violation:
    """One failed assertion of a validated output.

    Attributes
    ----------
    pointer : str
        JSON pointer into the *instance* (``""`` is the whole document).
    message : str
        ``jsonschema``'s message, cut to :data:`_MAX_MESSAGE_CHARS` characters.
    keyword : str
        The failing schema keyword (``"duplicate-key"`` for a repeated object key,
        which is not a schema keyword).
    schema_pointer : str
        JSON pointer into the schema to the failing keyword (``""`` for
        ``duplicate-key``).
    """

    pointer: str
    message: str
    keyword: str
    schema_pointer: str


@dataclass(frozen=True, slots=True)
class ValidationReport:
    """The outcome of validating one output.

    Attributes
    ----------
    parsed : bool
        Whether the text is one JSON value.
    parse_error : str or None
        ``"line L column C: reason"`` when ``parsed`` is false.
    valid : bool or None
        ``None`` when not parsed; otherwise whether there is no violation.
    violations : tuple of Violation
        Sorted by instance location (array indices numerically), then keyword,
        then message.
    truncated : bool
        True when more violations existed than the validator's
        ``max_violations``; only the first ones found are listed.
    """

    parsed: bool
    parse_error: str | None
    valid: bool | None
    violations: tuple[Violation, ...]
    truncated: bool

    def to_dict(self) -> dict[str, Any]:
        """Return the contract's ``json`` object without its ``unenforced`` member.

        Returns
        -------
        dict
            ``{"parsed", "parse_error", "valid", "violations": [{"pointer", "message"}]}``.
        """
        return {
            "parsed": self.parsed,
            "parse_error": self.parse_error,
            "valid": self.valid,
            "violations": [{"pointer": v.pointer, "message": v.message} for v in self.violations],
        }


def result_json(report: ValidationReport, unenforced: Sequence[UnenforcedKeyword]) -> dict[str, Any]:
    """Build the ``json`` member of the ensemble's ``RESULT`` (see the tensor contract).

    Parameters
    ----------
    report : ValidationReport
        The validation of the final output.
    unenforced : sequence of UnenforcedKeyword
        The constraint's unenforced keywords.

    Returns
    -------
    dict
        ``{"parsed", "parse_error", "valid", "violations", "unenforced": [{"pointer", "keyword"}]}``.
    """
    out = report.to_dict()
    out["unenforced"] = [{"pointer": u.pointer, "keyword": u.keyword} for u in unenforced]
    return out
