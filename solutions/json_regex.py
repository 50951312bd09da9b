"""Chapter 35: a JSON schema compiled to a byte automaton (Chapter 35's regex engine).

    compile_schema(schema, whitespace=OPTIONAL_SPACE) -> a minimal DFA (regex_dfa.DFA)
    schema_to_nfa(schema, whitespace=OPTIONAL_SPACE)  -> its NFA, before determinising

Every string the automaton accepts is a JSON document that validates against the schema
(sound); most documents that validate are accepted when they are written compactly or the
way json.dumps writes them (the rules below say exactly which are not). The schema is
compiled to NFA fragments wired together directly, not to regex text: a sub-schema is built
once and the fragments that use it share it through loops, so nested arrays or optional
properties grow the automaton linearly, where a regex would write the items pattern twice
per level.

What is honoured (anything else is refused with a ValueError naming the keyword, its place
"$.properties.age" and the reason, never ignored):
- "type" (one or a list; without "type" every type is allowed), "enum" and "const" (JSON
  equality: 1 and 1.0 are one value, true is not 1), "anyOf", "oneOf" (its options must be
  disjoint: checked on their automata), "allOf" (options merged into one schema when their
  keywords do not disagree), local "$ref" ("#", "#/$defs/...", "#/definitions/...").
- integers: "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum" (digit-range
  automata); an integer is written without exponent, "1.0" counts as the integer 1 (one
  zero after the point, as encoders of floats write it; never "1.00").
- strings: "minLength"/"maxLength" (characters, as JSON Schema counts them), "pattern"
  (a search, as JSON Schema reads it, through regex_dfa; the matched part is written with
  unescaped characters only), "format" in FORMATS.
- arrays: "items" (a schema, true, or false), "prefixItems", "minItems", "maxItems".
- objects: "properties" (written in the order listed; a property not in "required" may be
  left out), "required", "additionalProperties" (false; true or a schema: extra keys, none
  equal to a listed name, after the listed ones), "minProperties"/"maxProperties" (without
  extra keys).
Limits, stated: a "$ref" inside its own expansion is followed MAX_REF_DEPTH times, deeper
values of it cannot be written; a free-form value (the schema true, or {}; an array without
"items"; extra properties under "additionalProperties": true) nests at most FREE_DEPTH
containers deep; schema nesting is at most regex_dfa.MAX_NESTING levels; the automaton's
size is bounded by regex_dfa.MAX_NFA_STATES and MAX_DFA_STATES.
Whitespace: none anywhere except `whitespace` after every "," and ":" (by default at most
one space, so both compact output and json.dumps's ", "/": " are accepted; indented output
is not). Bounded on purpose: an unbounded rule lets a model write spaces until max_tokens.
"""
from __future__ import annotations

import json
import math
from typing import Any

from .regex_dfa import (
    DFA,
    MAX_DFA_STATES,
    MAX_NESTING,
    NFA,
    Alt,
    Chars,
    CharSet,
    Concat,
    Node,
    Repeat,
    add_fragment,
    add_repeat,
    compile_nfa,
    complement,
    escape,
    intersection,
    parse_regex,
)

OPTIONAL_SPACE = "[ ]?"
MAX_REF_DEPTH = 3
MAX_JSON_DEPTH = 256                 # lists and dicts nested in the schema's JSON, enum values included
FREE_DEPTH = 2

# One character of a JSON string: anything but a quote, a backslash or a control
# character; or an escape. A \\u escape names a non-surrogate code point, or a high and a
# low surrogate together (how json.dumps writes a character past U+FFFF, an emoji say);
# never a lone surrogate, so that every unit here is exactly one character of the decoded
# string (minLength and maxLength count characters).
STRING_CHARACTER = (r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
                    r"|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})"
                    r"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})")
RAW_CHARACTERS: CharSet = complement(((0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))))
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
# 1.0 is the integer 1 in JSON Schema, and encoders of floats write it so; one zero only,
# because a model that may add zeros forever (SmolLM2 did, "11.000...") never ends the number.
INTEGER_FRACTION = r"(?:\.0)?"
_DATE = (r"[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")        # February 29 left out: every date written exists
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": _DATE + "T" + _TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)+",
    "ipv4": _OCTET + r"(?:\." + _OCTET + "){3}",
}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs",
               "definitions", "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding"}
KEYWORDS_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": set(),
    "boolean": set(), "null": set(),
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties"},
}
TYPES = tuple(KEYWORDS_BY_TYPE)
COMBINATORS = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}
WHY_REFUSED = {
    "not": "a negation is not compiled", "if": "conditionals are not compiled",
    "uniqueItems": "uniqueness would need the automaton to remember every item",
    "contains": "contains is not compiled", "multipleOf": "multipleOf is not compiled",
    "patternProperties": "property names by pattern are not compiled",
    "propertyNames": "property-name schemas are not compiled",
    "dependentRequired": "dependencies between properties are not compiled",
    "dependentSchemas": "dependencies between properties are not compiled",
    "unevaluatedProperties": "unevaluated* keywords are not compiled",
    "unevaluatedItems": "unevaluated* keywords are not compiled",
    "$dynamicRef": "only local $ref is followed",
}


def compact_json(value: Any) -> str:
    """`value` as the most compact JSON text."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_equal(a: Any, b: Any) -> bool:
    """JSON Schema's equality: numbers by value (1 == 1.0), booleans apart from numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def json_type_of(value: Any) -> set[str]:
    """The schema types `value` is an instance of (an integral number is also an integer)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"number", "integer"} if float(value).is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _digits_between(lo: str, hi: str) -> str:
    """A pattern for the digit strings of one length from lo to hi (inclusive)."""
    if lo == hi:
        return lo
    if lo[1:] == "0" * (len(lo) - 1) and hi[1:] == "9" * (len(hi) - 1):
        return f"[{lo[0]}-{hi[0]}]" + ("[0-9]" * (len(lo) - 1))
    if lo[0] == hi[0]:
        return lo[0] + _digits_between(lo[1:], hi[1:])
    rest = len(lo) - 1
    parts = [lo[0] + _digits_between(lo[1:], "9" * rest)]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]" + "[0-9]" * rest)
    parts.append(hi[0] + _digits_between("0" * rest, hi[1:]))
    return "(?:" + "|".join(parts) + ")"


def _naturals_between(low: int, high: int | None) -> list[str]:
    """Patterns for the integers low..high (0 <= low; high None: no bound), no leading zeros."""
    parts = []
    length = len(str(low))
    while high is None or length <= len(str(high)):
        first = max(low, 10 ** (length - 1) if length > 1 else 0)
        if high is None and first == 10 ** (length - 1) and length > 1:
            parts.append("[1-9][0-9]{%d,}" % (length - 1))      # every longer number too
            break
        last = 10 ** length - 1 if high is None else min(high, 10 ** length - 1)
        if first <= last:
            parts.append(_digits_between(str(first), str(last)))
        length += 1
    return parts


def integer_range(low: int | None, high: int | None) -> str:
    """A pattern for the integers from low to high (None: unbounded) as JSON writes them."""
    parts = []
    if low is None or low < 0:                      # the negative ones: "-" and 1..-low
        negatives = _naturals_between(max(1, -high) if high is not None else 1, None if low is None else -low)
        if negatives:
            parts.append("-(?:" + "|".join(negatives) + ")")
    if high is None or high >= 0:
        parts += _naturals_between(max(0, low if low is not None else 0), high)
    return "(?:" + "|".join(parts) + ")"


def _restrict(node: Node, chars: CharSet) -> Node:
    """`node` with every character class cut down to `chars`."""
    if isinstance(node, Chars):
        return Chars(intersection(node.chars, chars))
    if isinstance(node, Concat):
        return Concat(tuple(_restrict(part, chars) for part in node.parts))
    if isinstance(node, Alt):
        return Alt(tuple(_restrict(option, chars) for option in node.options))
    return Repeat(_restrict(node.node, chars), node.low, node.high)


def _disjoint(a: DFA, b: DFA) -> bool:
    """Do the two automata accept no string in common? (a search of the product automaton)"""
    seen = {(a.start, b.start)}
    todo = [(a.start, b.start)]
    while todo:
        s, t = todo.pop()
        if a.accepting[s] and b.accepting[t]:
            return False
        both = (a.transitions[s] >= 0) & (b.transitions[t] >= 0)
        for pair in set(zip(a.transitions[s][both].tolist(), b.transitions[t][both].tolist())):
            if pair not in seen:
                if len(seen) >= MAX_DFA_STATES:
                    raise ValueError(f"deciding whether oneOf's options overlap needs more than "
                                     f"MAX_DFA_STATES={MAX_DFA_STATES} states")
                seen.add(pair)
                todo.append(pair)
    return True


Fragment = tuple[int, int]


class _SchemaCompiler:
    """Builds one schema's NFA, fragment by fragment (see the module docstring)."""

    def __init__(self, root: Any, whitespace: str) -> None:
        self.root = root
        self.whitespace = whitespace
        self.nfa = NFA()
        self.separator = parse_regex("," + whitespace)
        self.colon = parse_regex(":" + whitespace)
        self.nodes: dict[str, Node] = {}

    # --- small pieces ---
    def pattern(self, text: str) -> Fragment:
        node = self.nodes.get(text)
        if node is None:
            node = self.nodes[text] = parse_regex(text)
        return add_fragment(self.nfa, node)

    def nothing(self) -> Fragment:
        """A fragment that accepts no string: the place of a value that cannot be written."""
        return self.nfa.choice([])

    def literal(self, value: Any, depth: int = 0) -> Fragment:
        """One JSON value, every spelling of it this compiler writes: keys in the value's
        order, integral numbers with or without ".0", non-ASCII characters raw or escaped."""
        if depth > MAX_NESTING:
            raise ValueError(f"an enum or const value nested more than MAX_NESTING={MAX_NESTING} levels")
        if isinstance(value, dict):
            members = [self.nfa.chain([self.literal(key), self.pattern(":" + self.whitespace),
                                       self.literal(item, depth + 1)]) for key, item in value.items()]
            return self.joined("{", members, "}")
        if isinstance(value, list):
            return self.joined("[", [self.literal(item, depth + 1) for item in value], "]")
        if isinstance(value, str):
            return self.pattern('"' + "".join(self.spellings(char) for char in value) + '"')
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return self.pattern(escape(str(int(value))) + INTEGER_FRACTION)
        return self.pattern(escape(compact_json(value)))

    def spellings(self, char: str) -> str:
        """The pattern of one character inside a JSON string: raw, and also \\u-escaped
        (either case of hex digits) where json.dumps's ASCII output escapes it."""
        raw = json.dumps(char, ensure_ascii=False)[1:-1]
        options = [escape(raw)]
        ascii_form = json.dumps(char)[1:-1]
        if ascii_form != raw:
            options.append("".join(r"\\u" + "".join(_hex_digit(h) for h in unit)
                                   for unit in ascii_form.split("\\u")[1:]))
        return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"

    def joined(self, opening: str, parts: list[Fragment], closing: str) -> Fragment:
        pieces = [self.pattern(escape(opening))]
        for k, part in enumerate(parts):
            if k:
                pieces.append(add_fragment(self.nfa, self.separator))
            pieces.append(part)
        pieces.append(self.pattern(escape(closing)))
        return self.nfa.chain(pieces)

    # --- schemas ---
    def value(self, schema: Any, where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """The fragment of the JSON values that validate against `schema`."""
        if depth > MAX_NESTING:
            raise ValueError(f"schema at {where}: nested more than MAX_NESTING={MAX_NESTING} levels")
        if schema is True:
            return self.free(FREE_DEPTH)
        if schema is False:
            return self.nothing()
        if not isinstance(schema, dict):
            raise ValueError(f"schema at {where}: a schema is an object or a boolean, got {schema!r}")
        known = ANNOTATIONS | COMBINATORS | set().union(*KEYWORDS_BY_TYPE.values())
        for keyword in schema:
            if keyword not in known:
                reason = WHY_REFUSED.get(keyword, "it is not a keyword this compiler knows")
                raise ValueError(f"schema at {where}: keyword {keyword!r} is not supported: {reason}")
        rest = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
        if "$ref" in rest:
            return self.reference(rest, where, depth, refs)
        if "allOf" in rest:
            return self.value(self.merged(rest, where), f"{where}.allOf", depth + 1, refs)
        for combinator in ("anyOf", "oneOf"):
            if combinator in rest:
                return self.options(combinator, rest, where, depth, refs)
        if "enum" in rest or "const" in rest:
            return self.choices(rest, where)
        types = self.types_of(rest, where)
        return self.nfa.choice([self.typed(kind, rest, where, depth, refs) for kind in types])

    def types_of(self, schema: dict[str, Any], where: str) -> list[str]:
        kind = schema.get("type", list(TYPES))
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"schema at {where}: type must be a type name or a list of them, got {kind!r}")
        for k in kinds:
            if k not in KEYWORDS_BY_TYPE:
                raise ValueError(f"schema at {where}: type {k!r} is not a JSON Schema type (known: {', '.join(TYPES)})")
        if "integer" in kinds and "number" in kinds:
            # Unbounded, number writes every integer too; bounded, only integers are written.
            bounded = bool(set(schema) & KEYWORDS_BY_TYPE["integer"])
            kinds = [k for k in kinds if k != ("number" if bounded else "integer")]
        return kinds

    def reference(self, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        ref = schema["$ref"]
        if len(schema) > 1:
            raise ValueError(f"schema at {where}: $ref beside {sorted(set(schema) - {'$ref'})[0]!r} is not supported "
                             f"(wrap them in allOf)")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"schema at {where}: only local references ('#/$defs/...') are followed, got {ref!r}")
        if refs.count(ref) >= MAX_REF_DEPTH:
            return self.nothing()                  # recursion bounded: deeper values cannot be written
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"schema at {where}: $ref {ref!r} points at nothing")
            target = target[part]
        return self.value(target, ref, depth + 1, refs + (ref,))

    def merged(self, schema: dict[str, Any], where: str) -> dict[str, Any]:
        """allOf's options and the schema around them as one schema; ValueError where they
        disagree (two values for one keyword other than properties and required)."""
        options = schema["allOf"]
        if not isinstance(options, list) or not options:
            raise ValueError(f"schema at {where}: allOf must be a non-empty list")
        result = {k: v for k, v in schema.items() if k != "allOf"}
        parts = [result]
        for i, option in enumerate(options):
            while isinstance(option, dict) and set(option) - ANNOTATIONS == {"$ref"}:
                option = self.resolve(option["$ref"], f"{where}.allOf[{i}]")
            if not isinstance(option, dict):
                raise ValueError(f"schema at {where}.allOf[{i}]: only object schemas can be merged")
            parts.append(option)
        # additionalProperties (items) sees only the properties (prefixItems) beside it: merged
        # with another part's, it would wrongly stop applying to them.
        for listed, rest in (("properties", "additionalProperties"), ("prefixItems", "items")):
            owners = {i for i, part in enumerate(parts) if listed in part or rest in part}
            if len(owners) > 1 and any(rest in parts[i] for i in owners):
                raise ValueError(f"schema at {where}: allOf parts with {rest} and another part's {listed} do not "
                                 f"merge into one schema")
        for i, option in enumerate(options):
            option = parts[i + 1]
            for key, item in option.items():
                if key in ANNOTATIONS:
                    continue
                if key == "properties" and isinstance(item, dict):
                    properties = dict(result.get("properties", {}))
                    for name, sub in item.items():
                        if name in properties and properties[name] != sub:
                            raise ValueError(f"schema at {where}.allOf[{i}]: property {name!r} has two schemas")
                        properties[name] = sub
                    result["properties"] = properties
                elif key == "required" and isinstance(item, list):
                    result["required"] = list(result.get("required", [])) + [n for n in item
                                                                             if n not in result.get("required", [])]
                elif key in result and result[key] != item:
                    raise ValueError(f"schema at {where}.allOf[{i}]: {key!r} disagrees with another option "
                                     f"(only options that merge are supported)")
                else:
                    result[key] = item
        return result

    def resolve(self, ref: Any, where: str) -> Any:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"schema at {where}: only local references ('#/$defs/...') are followed, got {ref!r}")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"schema at {where}: $ref {ref!r} points at nothing")
            target = target[part]
        return target

    def options(self, combinator: str, schema: dict[str, Any], where: str, depth: int,
                refs: tuple[str, ...]) -> Fragment:
        options = schema[combinator]
        if not isinstance(options, list) or not options:
            raise ValueError(f"schema at {where}: {combinator} must be a non-empty list")
        if set(schema) != {combinator}:
            raise ValueError(f"schema at {where}: {combinator} beside {sorted(set(schema) - {combinator})[0]!r} is "
                             f"not supported (put the keyword inside every option)")
        if combinator == "oneOf":                 # exactly one option: they must not overlap
            automata = [compile_schema_part(self.root, option, self.whitespace) for option in options]
            for i in range(len(options)):
                for j in range(i):
                    if not _disjoint(automata[i], automata[j]):
                        raise ValueError(f"schema at {where}: oneOf options {j} and {i} overlap (a value valid "
                                         f"for both is invalid for oneOf); only disjoint options are supported")
        return self.nfa.choice([self.value(option, f"{where}.{combinator}[{i}]", depth + 1, refs)
                                for i, option in enumerate(options)])

    def choices(self, schema: dict[str, Any], where: str) -> Fragment:
        if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
            raise ValueError(f"schema at {where}: enum must be a non-empty list, got {schema['enum']!r}")
        values = list(schema["enum"]) if "enum" in schema else [schema["const"]]
        if "const" in schema:
            values = [v for v in values if json_equal(v, schema["const"])]
        beside = set(schema) - {"enum", "const", "type"}
        if beside:
            raise ValueError(f"schema at {where}: {sorted(beside)[0]!r} is not supported next to enum/const")
        if "type" in schema:
            kinds = set(self.types_of(schema, where)) | ({"integer"} if "number" in self.types_of(schema, where)
                                                         else set())
            values = [v for v in values if json_type_of(v) & kinds]
        return self.nfa.choice([self.literal(v) for v in values])

    def typed(self, kind: str, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """The values of one type that satisfy that type's keywords in `schema`."""
        if kind == "null":
            return self.pattern("null")
        if kind == "boolean":
            return self.pattern("(?:true|false)")
        if kind == "number":
            bounds = sorted(KEYWORDS_BY_TYPE["integer"] & set(schema))
            if bounds:
                raise ValueError(f"schema at {where}: {bounds[0]!r} on a number is not supported (only integers "
                                 f"are bounded; give type integer)")
            return self.pattern(NUMBER)
        if kind == "integer":
            return self.pattern(self.integer_pattern(schema, where))
        if kind == "string":
            return self.string(schema, where)
        if kind == "array":
            return self.array(schema, where, depth, refs)
        return self.object(schema, where, depth, refs)

    def integer_pattern(self, schema: dict[str, Any], where: str) -> str:
        lows: list[int] = []
        highs: list[int] = []
        for name in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if name not in schema:
                continue
            bound = schema[name]
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
                raise ValueError(f"schema at {where}: {name} must be a finite number, got {bound!r}")
            if name == "minimum":
                lows.append(math.ceil(bound))
            elif name == "exclusiveMinimum":
                lows.append(math.floor(bound) + 1)
            elif name == "maximum":
                highs.append(math.floor(bound))
            else:
                highs.append(math.ceil(bound) - 1)
        low, high = (max(lows) if lows else None), (min(highs) if highs else None)
        if low is not None and high is not None and low > high:
            raise ValueError(f"schema at {where}: no integer lies between minimum {low} and maximum {high}")
        return integer_range(low, high) + INTEGER_FRACTION

    def count(self, schema: dict[str, Any], name: str, where: str) -> int | None:
        value = schema.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"schema at {where}: {name} must be a non-negative integer, got {value!r}")
        return value

    def string(self, schema: dict[str, Any], where: str) -> Fragment:
        low = self.count(schema, "minLength", where) or 0
        high = self.count(schema, "maxLength", where)
        if high is not None and high < low:
            raise ValueError(f"schema at {where}: maxLength {high} is below minLength {low}")
        shaped = [k for k in ("pattern", "format") if k in schema]
        if len(shaped) > 1 or (shaped and ("minLength" in schema or "maxLength" in schema)):
            raise ValueError(f"schema at {where}: {shaped[0]!r} together with "
                             f"{'format' if len(shaped) > 1 else 'minLength/maxLength'} is not supported")
        quote = self.pattern('"')
        if "format" in schema:
            name = schema["format"]
            if not isinstance(name, str) or name not in FORMATS:
                raise ValueError(f"schema at {where}: format {name!r} is not supported (supported: "
                                 f"{', '.join(FORMATS)})")
            body = self.pattern(FORMATS[name])
        elif "pattern" in schema:
            body = self.search(schema["pattern"], where)
        else:
            character = self.nodes.get(STRING_CHARACTER) or parse_regex(STRING_CHARACTER)
            self.nodes[STRING_CHARACTER] = character
            body = add_repeat(self.nfa, lambda: add_fragment(self.nfa, character), low, high)
        return self.nfa.chain([quote, body, self.pattern('"')])

    def search(self, pattern: Any, where: str) -> Fragment:
        """A string body containing a match of `pattern` (JSON Schema's patterns are searches,
        anchored only by ^ and $ at its ends); the matched part uses unescaped characters."""
        if not isinstance(pattern, str):
            raise ValueError(f"schema at {where}: pattern must be a string, got {pattern!r}")
        anchored_start = pattern.startswith("^")
        trailing_backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
        anchored_end = pattern.endswith("$") and trailing_backslashes % 2 == 0 and len(pattern) > anchored_start
        body = pattern[int(anchored_start):len(pattern) - int(anchored_end)]
        try:
            tree = parse_regex(body)
        except ValueError as error:
            raise ValueError(f"schema at {where}: pattern: {error}") from None
        if isinstance(tree, Alt) and (anchored_start or anchored_end):
            raise ValueError(f"schema at {where}: pattern {pattern!r}: an anchor beside a top-level | is not "
                             f"supported (group the alternatives)")
        pieces = [] if anchored_start else [self.pattern(STRING_CHARACTER + "*")]
        pieces.append(add_fragment(self.nfa, _restrict(tree, RAW_CHARACTERS)))
        if not anchored_end:
            pieces.append(self.pattern(STRING_CHARACTER + "*"))
        return self.nfa.chain(pieces)

    def array(self, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True)
        if not isinstance(prefix, list):
            raise ValueError(f"schema at {where}: prefixItems must be a list of schemas")
        if isinstance(items, list):
            raise ValueError(f"schema at {where}: items as a list is the old tuple form; write prefixItems")
        low = self.count(schema, "minItems", where) or 0
        high = self.count(schema, "maxItems", where)
        if items is False:
            high = len(prefix) if high is None else min(high, len(prefix))
        if high is not None and high < low:
            raise ValueError(f"schema at {where}: maxItems {high} is below minItems {low} (or items false)")
        nfa = self.nfa
        opening, closing = self.pattern(r"\["), self.pattern(r"\]")
        here = opening[1]
        for k, sub in enumerate(prefix[:high]):
            if k >= low:
                nfa.link(here, closing[0])
            item = self.value(sub, f"{where}.prefixItems[{k}]", depth + 1, refs)
            entry = nfa.chain([add_fragment(nfa, self.separator), item]) if k else item
            nfa.link(here, entry[0])
            here = entry[1]
        if high is not None and high <= len(prefix):
            nfa.link(here, closing[0])
            return opening[0], closing[1]

        def make() -> Fragment:
            return self.value(items, f"{where}.items", depth + 1, refs)

        def separator() -> Fragment:
            return add_fragment(nfa, self.separator)

        rest_low = max(0, low - len(prefix))
        rest_high = None if high is None else high - len(prefix)
        if prefix:
            rest = add_repeat(nfa, lambda: nfa.chain([separator(), make()]), rest_low, rest_high)
        else:
            rest = add_repeat(nfa, make, rest_low, rest_high, separator)
        nfa.link(here, rest[0])
        nfa.link(rest[1], closing[0])
        return opening[0], closing[1]

    def object(self, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise ValueError(f"schema at {where}: properties must be an object of schemas")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise ValueError(f"schema at {where}: required must be a list of property names, got {required!r}")
        missing = [name for name in required if name not in properties]
        if missing:
            raise ValueError(f"schema at {where}: required property {missing[0]!r} has no schema in properties")
        extra = schema.get("additionalProperties", None if properties else True)
        low = self.count(schema, "minProperties", where) or 0
        high = self.count(schema, "maxProperties", where)
        counted = "minProperties" in schema or "maxProperties" in schema
        if counted and extra not in (None, False):
            raise ValueError(f"schema at {where}: minProperties/maxProperties with additionalProperties are not "
                             f"supported (list the properties and set additionalProperties false)")
        nfa = self.nfa
        opening, closing = self.pattern(r"\{"), self.pattern(r"\}")
        # state[k]: after the properties considered so far, k of them written (counting only
        # when min/maxProperties ask; otherwise k is 0 or 1, "has a comma to write first").
        limit = (high if high is not None else len(properties)) if counted else 1
        states = [nfa.new_state() for _ in range(limit + 1)]
        nfa.link(opening[1], states[0])
        for name, sub in properties.items():
            following = [nfa.new_state() for _ in range(limit + 1)]
            member_where = f"{where}.properties.{name}"
            if not counted:                       # one shared member: entered with or without a comma
                member = nfa.chain([self.literal(name), add_fragment(nfa, self.colon),
                                    self.value(sub, member_where, depth + 1, refs)])
                nfa.link(states[0], member[0])
                comma = add_fragment(nfa, self.separator)
                nfa.link(states[1], comma[0])
                nfa.link(comma[1], member[0])
                nfa.link(member[1], following[1])
            else:
                for k in range(limit):
                    pieces = [add_fragment(nfa, self.separator)] if k else []
                    pieces += [self.literal(name), add_fragment(nfa, self.colon),
                               self.value(sub, member_where, depth + 1, refs)]
                    member = nfa.chain(pieces)
                    nfa.link(states[k], member[0])
                    nfa.link(member[1], following[k + 1])
            if name not in required:
                for k in range(limit + 1):
                    nfa.link(states[k], following[k])
            states = following
        if extra not in (None, False):
            key = self.key_other_than(list(properties))
            value = self.value(extra, f"{where}.additionalProperties", depth + 1, refs)
            member = nfa.chain([key, add_fragment(nfa, self.colon), value])
            nfa.link(states[0], member[0])
            comma = add_fragment(nfa, self.separator)
            nfa.link(states[1], comma[0])
            nfa.link(comma[1], member[0])
            nfa.link(member[1], states[1])
        for k, state in enumerate(states):
            if not counted or low <= k:
                nfa.link(state, closing[0])
        return opening[0], closing[1]

    def key_other_than(self, names: list[str]) -> Fragment:
        """A JSON string of unescaped characters that differs from every one of `names`
        (a trie of the names; leaving it leads to a state that takes any character)."""
        nfa = self.nfa
        end = self.pattern('"')[1]
        close_start = nfa.new_state()
        quote = self.pattern('"')
        nfa.link(close_start, quote[0])
        nfa.link(quote[1], end)
        free = nfa.new_state()
        loop = add_fragment(nfa, Chars(RAW_CHARACTERS))
        nfa.link(free, loop[0])
        nfa.link(loop[1], free)
        nfa.link(free, close_start)

        def node(prefix: str) -> int:
            state = nfa.new_state()
            following = sorted({name[len(prefix)] for name in names
                                if name.startswith(prefix) and len(name) > len(prefix)})
            for char in following:
                step = add_fragment(nfa, Chars(((ord(char), ord(char)),)))
                nfa.link(state, step[0])
                nfa.link(step[1], node(prefix + char))
            others = intersection(RAW_CHARACTERS, complement(tuple((ord(c), ord(c)) for c in following)))
            other = add_fragment(nfa, Chars(others))
            nfa.link(state, other[0])
            nfa.link(other[1], free)
            if prefix not in names:
                nfa.link(state, close_start)
            return state

        opening = self.pattern('"')
        nfa.link(opening[1], node(""))
        return opening[0], end

    def free(self, depth: int) -> Fragment:
        """Any JSON value nested at most `depth` containers deep."""
        scalars = [self.pattern('"' + STRING_CHARACTER + '*"'), self.pattern(NUMBER),
                   self.pattern("(?:true|false|null)")]
        if depth == 0:
            return self.nfa.choice(scalars)
        items = add_repeat(self.nfa, lambda: self.free(depth - 1), 0, None,
                           lambda: add_fragment(self.nfa, self.separator))
        array = self.nfa.chain([self.pattern(r"\["), items, self.pattern(r"\]")])

        def member() -> Fragment:
            return self.nfa.chain([self.pattern('"' + STRING_CHARACTER + '*"'), add_fragment(self.nfa, self.colon),
                                   self.free(depth - 1)])

        members = add_repeat(self.nfa, member, 0, None, lambda: add_fragment(self.nfa, self.separator))
        obj = self.nfa.chain([self.pattern(r"\{"), members, self.pattern(r"\}")])
        return self.nfa.choice(scalars + [array, obj])


def _hex_digit(char: str) -> str:
    """A pattern for one character of a \\u escape, hex letters in either case."""
    return f"[{char.lower()}{char.upper()}]" if char.isalpha() else escape(char)


def _json_depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (without recursion: it may be hostile)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _load(schema: Any) -> Any:
    """The schema as Python values (parsed when it is JSON text), no deeper than MAX_JSON_DEPTH."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError(f"the schema nests deeper than MAX_JSON_DEPTH={MAX_JSON_DEPTH}") from None
    if _json_depth(schema) > MAX_JSON_DEPTH:
        raise ValueError(f"the schema nests objects and lists deeper than MAX_JSON_DEPTH={MAX_JSON_DEPTH}")
    return schema


def schema_to_nfa(schema: Any, whitespace: str = OPTIONAL_SPACE) -> NFA:
    """The NFA of the JSON documents that validate against `schema` (a dict, a boolean, or
    its JSON text). ValueError names the refused keyword or bad value, its place
    ("$.properties.age") and the rule or the limit it breaks."""
    root = _load(schema)
    return _nfa_of(root, root, whitespace)


def _nfa_of(root: Any, schema: Any, whitespace: str) -> NFA:
    compiler = _SchemaCompiler(root, whitespace)
    compiler.nfa.start, compiler.nfa.accept = compiler.value(schema, "$", 0, ())
    return compiler.nfa


def compile_schema_part(root: Any, schema: Any, whitespace: str) -> DFA:
    """The DFA of one sub-schema of `root` (its $refs resolved in root)."""
    return compile_nfa(_nfa_of(root, schema, whitespace))


def compile_schema(schema: Any, whitespace: str = OPTIONAL_SPACE) -> DFA:
    """The trimmed, minimal byte DFA of the JSON documents that validate against `schema`."""
    root = _load(schema)
    return compile_schema_part(root, root, whitespace)
