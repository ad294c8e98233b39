"""Strict mode (``openai_api.strict.check_strict``): every keyword some serving backend enforces is taken,
and a keyword no backend that may serve the schema enforces is refused with its path and the reason."""

from __future__ import annotations

from typing import Any

import pytest

from openai_api.errors import BadRequest
from openai_api.strict import check_strict, pointer_path

P = "response_format.json_schema.schema"
STRING = {"type": "string"}


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# (schema, backend asked for, backend the request must be served by)
ACCEPTED = [
    # OpenAI's subset, and what its clients send (pydantic through openai's .parse(): every property required).
    (obj(location=STRING, unit={"type": ["string", "null"], "enum": ["F", "C", None]}), "auto", "auto"),
    ({**obj(root={"$ref": "#/$defs/node"}),
      "$defs": {"node": obj(value=STRING, children={"type": "array", "items": {"$ref": "#/$defs/node"}})}},
     "auto", "auto"),
    # Beyond OpenAI's subset: string lengths, array and object bounds, open objects, optional properties.
    (obj(name={"type": "string", "minLength": 1, "maxLength": 20},
         tags={"type": "array", "items": STRING, "minItems": 1, "maxItems": 3}), "auto", "auto"),
    ({"type": "object", "properties": {"a": STRING, "b": {"type": "integer"}}, "required": ["a"]}, "auto", "auto"),
    ({"type": "object", "minProperties": 1, "maxProperties": 2, "additionalProperties": {"type": "integer"}},
     "auto", "auto"),
    (obj(a={"allOf": [STRING]}), "auto", "auto"),
    # One backend enforces it all: that one is asked for (auto would try llguidance first).
    (obj(when={"type": "string", "format": "date"}), "auto", "llguidance"),
    (obj(mail={"type": "string", "format": "email", "maxLength": 40}), "auto", "llguidance"),
    (obj(mail={"type": "string", "format": "email", "maxLength": 40}), "llguidance", "llguidance"),
    (obj(n={"type": "integer", "multipleOf": 3}), "xgrammar", "xgrammar"),
]


@pytest.mark.parametrize(("schema", "backend", "served"), ACCEPTED)
def test_accepted(schema: dict[str, Any], backend: str, served: str) -> None:
    assert check_strict(schema, P, backend) == served


REFUSED = [
    (obj(a={"type": "array", "items": STRING, "uniqueItems": True}), "auto", f"{P}.properties.a.uniqueItems",
     ("keyword 'uniqueItems' is not enforced by either grammar backend (xgrammar: uniqueItems is ignored by "
     "xgrammar; llguidance: not implemented by llguidance (ignored while decoding))")),
    (obj(a={"type": "string", "not": {"const": "x"}}), "auto", f"{P}.properties.a.not",
     "keyword 'not' is not enforced by either grammar backend"),
    ({**obj(a=STRING), "dependentRequired": {"a": ["b"]}}, "auto", f"{P}.dependentRequired",
     "keyword 'dependentRequired' is not enforced by either grammar backend"),
    (obj(a={"type": "string", "format": "idn-email"}), "auto", f"{P}.properties.a.format",
     "keyword 'format' is not enforced by either grammar backend (xgrammar: format 'idn-email' is not enforced"),
    (obj(a={"anyOf": [STRING, {"type": "array", "items": STRING, "contains": {"const": "x"}}]}), "auto",
     f"{P}.properties.a.anyOf[1].contains", "keyword 'contains' is not enforced by either grammar backend"),
    # The backend the request names, alone.
    (obj(mail={"type": "string", "format": "email", "maxLength": 40}), "xgrammar", f"{P}.properties.mail.maxLength",
     ("keyword 'maxLength' is not enforced by xgrammar (xgrammar: ignored by xgrammar when combined with format "
     "'email')")),
    (obj(when={"type": "string", "format": "date"}), "xgrammar", f"{P}.properties.when.format",
     "keyword 'format' is not enforced by xgrammar (xgrammar: format 'date': checked syntactically only"),
]


@pytest.mark.parametrize(("schema", "backend", "param", "reason"), REFUSED)
def test_refused(schema: dict[str, Any], backend: str, param: str, reason: str) -> None:
    with pytest.raises(BadRequest) as info:
        check_strict(schema, P, backend)
    assert info.value.param == param
    assert info.value.message.startswith(f"{param}: strict mode: {reason}")
    assert info.value.message.endswith("remove it, or set strict to false to decode without it and have the "
                                       "report name it")
    assert (info.value.http_status, info.value.type) == (400, "invalid_request_error")


@pytest.mark.parametrize(("pointer", "path"), [
    ("", P), ("/properties/a/anyOf/1/contains", f"{P}.properties.a.anyOf[1].contains"),
    ("/required/0", f"{P}.required[0]"), ("/properties/a~1b/x~0y", f"{P}.properties.a/b.x~y"),
    ("/properties/0", f"{P}.properties.0"),
])
def test_pointer_path(pointer: str, path: str) -> None:
    assert pointer_path(P, pointer) == path
