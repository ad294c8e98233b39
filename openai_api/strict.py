"""``"strict": true``: the schema is guaranteed, so a keyword no grammar backend enforces is refused.

OpenAI's strict mode takes a subset of JSON Schema (every object closed,
every property required, no ``minLength``...) because that is what its
decoder can guarantee.  Here strict means the same promise, judged against
what this server's decoders guarantee instead: a schema under
``response_format.json_schema.strict`` or a tool's ``function.strict`` is
taken whole when every keyword in it is enforced while decoding by the
grammar backend that will serve it, and refused, naming the keyword's path,
when some keyword is enforced by neither backend (``uniqueItems``,
``contains``, ``not``, ``if``/``then``/``else``, ``dependentRequired``,
formats neither knows, ...).  So a client's pydantic model with
``Field(max_length=...)`` (``maxLength``) is served exactly, and a schema
OpenAI would refuse for being open or having optional properties is served
too: both backends enforce those exactly.

Which backend serves: the request's ``backend`` option when it names one;
under ``auto`` either may (llguidance first for JSON, xgrammar where
llguidance refuses the schema), so a keyword passes when one of them enforces
it and the choice goes to that one (:mod:`grammar_service.engine`).  What each
leaves unenforced is the backends' own fidelity report
(:func:`grammar_backend.values.unenforced_for`: llguidance's warnings,
xgrammar's fidelity table), the same one RESULT's ``json.unenforced`` reports.

Non-strict requests are not checked here: they take any schema, and RESULT's
report names what decoding did not enforce.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from contract import BACKENDS
from grammar_backend import llg
from grammar_backend.backends import auto_order
from grammar_backend.spec import ConstraintKind, ConstraintOptions, ConstraintSpec
from grammar_backend.values import unenforced_for
from openai_api.errors import BadRequest

__all__ = ["check_strict", "pointer_path"]

#: Keywords whose values are arrays (a pointer's number after them is an index, ``[1]``).
_ARRAY_KEYWORDS: Final = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "enum", "items", "required", "tags",
                                    "triggers"})


def pointer_path(base: str, pointer: str) -> str:
    """The body path of the JSON pointer ``pointer`` under ``base``, in dotted form (``base.a.anyOf[1]``)."""
    path, previous = base, ""
    for raw in pointer.split("/"):
        if not raw:
            continue
        part = raw.replace("~1", "/").replace("~0", "~")
        path += f"[{part}]" if part.isdigit() and previous in _ARRAY_KEYWORDS else f".{part}"
        previous = part
    return path


def check_strict(schema: Mapping[str, Any], param: str, backend: str = "auto") -> str:
    """The backend that guarantees ``schema`` whole; refuse it where no backend that may serve it does.

    Parameters
    ----------
    schema : mapping
        The JSON schema, already checked against the meta-schema.
    param : str
        Its dotted path in the request body
        (``response_format.json_schema.schema``, ``tools[0].function.parameters``).
    backend : str
        The backend the request asks for (``contract.POLICIES["backend"]``); a structural tag (tool
        calls) is xgrammar's.

    Returns
    -------
    str
        ``backend`` itself, or under ``auto`` the one backend that enforces every keyword where only one
        does (the request must then ask for it: ``auto`` would try llguidance first).

    Raises
    ------
    BadRequest
        ``param`` extended to the first keyword at fault (of the backend ``auto`` tries first), and why.
    """
    spec = ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema), ConstraintOptions(), schema)
    candidates = BACKENDS if backend == "auto" else (backend,)
    if backend == "auto" and llg.refusal(spec) is not None:
        candidates = ("xgrammar",)
    gaps = {name: {(u.pointer, u.keyword): u.note for u in unenforced_for(spec, name)} for name in candidates}
    whole = [name for name in candidates if not gaps[name]]
    if len(whole) == len(candidates):
        return backend
    if whole:
        return whole[0]
    first = auto_order(spec)[0] if backend == "auto" and len(candidates) > 1 else candidates[0]
    pointer, keyword = min(gaps[first])
    notes = "; ".join(f"{name}: {gap[(pointer, keyword)]}" for name, gap in gaps.items() if (pointer, keyword) in gap)
    served = "either grammar backend" if len(candidates) > 1 else candidates[0]
    raise BadRequest(pointer_path(param, pointer),
                     f"strict mode: keyword {keyword!r} is not enforced by {served} ({notes}); remove it, or set "
                     "strict to false to decode without it and have the report name it")
