"""Chapter 35: a JSON schema (a useful subset) compiled to a regular expression.

    schema_to_regex(schema, whitespace=OPTIONAL_SPACE) -> a pattern for regex_dfa.compile_regex

Every string the pattern matches is a JSON document that validates against the schema, so
a guide built from it (serve/guided.py) makes a model's output parse and validate. The
subset:
- "type": "string", "number", "integer", "boolean", "null", "object", "array", or a list
  of them (any one); "enum" and "const" (any JSON values, keys in the order given); "anyOf".
- strings: "minLength", "maxLength" (counted in characters, as JSON Schema counts them);
- arrays: "items" (one schema for every item), "minItems", "maxItems";
- objects: "properties". EVERY listed property is generated, in the order the schema lists
  them; that is valid whether or not "required" names them (a name in "required" that is
  not in "properties" is refused), and no other property is ever generated.
- Annotations ("title", "description", "default", "examples", "$schema", "$id") and
  "additionalProperties" are accepted and change nothing. Any other keyword ("pattern",
  "minimum", "$ref", "format", ...) is refused with a ValueError that names it and where it
  sits, rather than ignored: ignoring it would let the model write invalid output.

Whitespace policy: no whitespace anywhere except `whitespace` after every ":" and "," (by
default at most one space, as in Python's json.dumps). Bounded on purpose: an unbounded
whitespace rule lets a model emit spaces until max_tokens instead of a value.
"""
from __future__ import annotations

import json
from typing import Any

from .regex_dfa import escape

OPTIONAL_SPACE = "[ ]?"

# One character of a JSON string: anything but a quote, a backslash or a control
# character; or an escape. \\u escapes name non-surrogate code points only, so that every
# unit here is exactly one character of the decoded string (minLength and maxLength count).
STRING_CHARACTER = (r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
                    r"|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))")
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
PRIMITIVES = {"integer": INTEGER, "number": NUMBER, "boolean": "(?:true|false)", "null": "null"}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "additionalProperties"}
KEYWORDS_BY_TYPE = {
    "string": {"minLength", "maxLength"},
    "array": {"items", "minItems", "maxItems"},
    "object": {"properties", "required"},
}


def compact_json(value: Any) -> str:
    """`value` as the most compact JSON text."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _count(schema: dict[str, Any], name: str, where: str, default: int | None) -> int | None:
    value = schema.get(name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"schema at {where}: {name} must be a non-negative integer, got {value!r}")
    return value


def _repeat(unit: str, low: int, high: int | None) -> str:
    if high is not None and high < low:
        raise ValueError(f"a maximum count ({high}) below the minimum ({low}) admits nothing")
    return f"(?:{unit}){{{low},{'' if high is None else high}}}"


def schema_to_regex(schema: Any, whitespace: str = OPTIONAL_SPACE) -> str:
    """A pattern matching JSON documents that validate against `schema` (a dict, or its
    JSON text). ValueError names the unsupported keyword or bad value and its place
    ("$.properties.age")."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
    separator = "," + whitespace
    colon = ":" + whitespace

    def literal(value: Any) -> str:
        """One JSON value exactly, spaced by the same whitespace rule as everything else."""
        if isinstance(value, dict):
            members = (escape(compact_json(k)) + colon + literal(v) for k, v in value.items())
            return r"\{" + separator.join(members) + r"\}"
        if isinstance(value, list):
            return r"\[" + separator.join(literal(v) for v in value) + r"\]"
        return escape(compact_json(value))

    def compile_node(node: Any, where: str) -> str:
        if not isinstance(node, dict):
            raise ValueError(f"schema at {where}: expected an object, got {node!r}")
        if "enum" in node or "const" in node:
            choices = node["enum"] if "enum" in node else [node["const"]]
            if not isinstance(choices, list) or not choices:
                raise ValueError(f"schema at {where}: enum must be a non-empty list, got {choices!r}")
            unknown = set(node) - {"enum", "const", "type"} - ANNOTATIONS
            if unknown:
                raise ValueError(f"schema at {where}: {sorted(unknown)[0]!r} is not supported next to enum/const")
            return "(?:" + "|".join(literal(choice) for choice in choices) + ")"
        if "anyOf" in node:
            options = node["anyOf"]
            if not isinstance(options, list) or not options or set(node) - {"anyOf"} - ANNOTATIONS:
                raise ValueError(f"schema at {where}: anyOf must be a non-empty list and stand alone")
            return "(?:" + "|".join(compile_node(option, f"{where}.anyOf[{i}]")
                                    for i, option in enumerate(options)) + ")"
        kind = node.get("type")
        if isinstance(kind, list):
            if not kind:
                raise ValueError(f"schema at {where}: an empty type list admits nothing")
            return "(?:" + "|".join(compile_node({**node, "type": k}, where) for k in kind) + ")"
        allowed = {"type"} | ANNOTATIONS | KEYWORDS_BY_TYPE.get(str(kind), set())
        refused = sorted(set(node) - allowed)
        if refused:
            raise ValueError(f"schema at {where}: keyword {refused[0]!r} is not supported"
                             + ("" if kind else " (give a type)"))
        if kind in PRIMITIVES:
            return PRIMITIVES[kind]
        if kind == "string":
            low = _count(node, "minLength", where, 0)
            return '"' + _repeat(STRING_CHARACTER, low or 0, _count(node, "maxLength", where, None)) + '"'
        if kind == "array":
            if "items" not in node:
                raise ValueError(f"schema at {where}: an array needs an 'items' schema")
            item = compile_node(node["items"], f"{where}.items")
            low = _count(node, "minItems", where, 0) or 0
            high = _count(node, "maxItems", where, None)
            if high == 0:
                return r"\[\]"
            rest = _repeat(separator + item, max(low - 1, 0), None if high is None else high - 1)
            items = f"{item}{rest}"
            return r"\[" + (items if low > 0 else f"(?:{items})?") + r"\]"
        if kind == "object":
            properties = node.get("properties", {})
            if not isinstance(properties, dict):
                raise ValueError(f"schema at {where}: properties must be an object")
            missing = [name for name in node.get("required", []) if name not in properties]
            if missing:
                raise ValueError(f"schema at {where}: required property {missing[0]!r} has no schema in "
                                 f"properties")
            members = [escape(compact_json(name)) + colon + compile_node(sub, f"{where}.properties.{name}")
                       for name, sub in properties.items()]
            return r"\{" + separator.join(members) + r"\}"
        raise ValueError(f"schema at {where}: type {kind!r} is not supported (known: string, number, integer, "
                         f"boolean, null, object, array)")

    return compile_node(schema, "$")
