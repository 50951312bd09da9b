"""Chapter 35: a JSON schema compiled to a byte automaton (Chapter 35's regex engine).

    compile_schema(schema, whitespace=OPTIONAL_SPACE, strict=True) -> a minimal DFA (regex_dfa.DFA)
    schema_to_nfa(schema, whitespace=OPTIONAL_SPACE, strict=True)  -> its NFA, before determinising

Every string the automaton accepts is a JSON document that validates against the schema
under the draft its "$schema" names (sound); most documents that validate are accepted when
they are written compactly or the way json.dumps writes them (the rules below say exactly
which are not). The schema is compiled to NFA fragments wired together directly, not to
regex text: a sub-schema is built once and the fragments that use it share it through
loops, so nested arrays or optional properties grow the automaton linearly. Where two
languages must be intersected or subtracted (a pattern with a length, "not" around listed
values, patternProperties keys), their DFAs are combined (regex_dfa.combine) and joined to
the NFA as a fragment.

Drafts: draft-04, -06, -07, 2019-09 and 2020-12, by "$schema" (none, or a meta-schema that
is not a draft: 2020-12, as validators read it; draft-03 is refused). Their old forms are
read as such: draft-04's boolean exclusiveMinimum/Maximum, array "items" with
"additionalItems" before 2020-12, "dependencies", "definitions", and a "$ref"'s siblings
ignored up to draft-07 (applied beside it after). A keyword a draft does not define is an
annotation in it (KEYWORD_DRAFTS: "const" under draft-04, "prefixItems" before 2020-12).

What is honoured (a keyword this module does not know is an annotation, as in JSON Schema;
a known one it cannot compile is refused with a ValueError naming it, its place
"$.properties.age" and the reason, never ignored):
- "type" (one or a list), "enum" and "const" (JSON equality: 1 and 1.0 are one value, true
  is not 1; the values are filtered by every keyword beside them), "anyOf", "oneOf" (each
  option written where no other holds: as it is where shown apart from the others, by type,
  listed values, a property one requires and the other forbids, never writes or gives a
  schema apart from the first's, or for scalars by their automata; else with "not" around
  the others), "allOf" (parts merged keyword by keyword: the stricter bound, both schemas
  of one property, a part's additionalProperties/items given to the names/positions another
  part lists), "not" (around a type, scalar enum/const values, "required", or an object
  schema, by its properties and required), "if"/"then"/"else" (the
  union of the branches that compile: if+then, not-if+else, then+else), local "$ref" ("#",
  "#/$defs/...", "#/definitions/...", or the root's own $id followed by one of those).
- integers: "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum" (digit-range
  automata), "multipleOf" (an integer up to MAX_MULTIPLE); written without fraction or
  exponent (9, never 9.0, which draft-04 does not count as an integer).
- numbers with bounds: written without exponent, at most FRACTION_DIGITS digits after the
  point (-0 and -0.0 are 0); a bound with more digits than that after the point, or one of 1e8 or more with a
  fraction, is refused. "multipleOf" only with an integer step (then the number is an
  integer).
- strings: "minLength"/"maxLength" (characters, as JSON Schema counts them; past
  LONG_STRING characters written raw or with a short escape, never \\u), "pattern"
  (a search, through regex_dfa with ecma=True: its classes cut to the characters ECMA-262
  and Python's re agree on; the matched part is written with unescaped characters only),
  "format" in FORMATS (another format JSON Schema defines is refused; one it does not, an
  annotation).
- arrays: "items" (a schema, true, or false), "prefixItems", "minItems", "maxItems",
  "uniqueItems" (items that list their values: each written at most once, in the listed
  order), "contains" (with "minContains" 0 or 1).
- objects: "properties" (written in the order listed; a property not in "required" may be
  left out), "required" (a name without a schema gets additionalProperties' schema, or any value),
  "additionalProperties", "patternProperties" (extra keys after the listed ones, written
  with unescaped characters, never equal to a listed name; a key gets the schema of the
  one pattern it matches; keys matching two are not written), "propertyNames",
  "minProperties"/"maxProperties" (without extra keys; "minProperties": 1 with them),
  "dependentRequired"/"dependentSchemas" (one object schema per choice of which named
  properties are present, at most MAX_VARIANTS).
A missing "additionalProperties" forbids keys the object does not list when it lists
properties (strict=True, the default: OpenAI's strict mode); strict=False follows JSON
Schema, where it allows any extra key.
Limits, stated: a "$ref" inside its own expansion is followed MAX_REF_DEPTH times, deeper
values of it cannot be written; a free-form value (the schema true, or {}; an array without
"items"; extra properties under "additionalProperties": true) nests at most FREE_DEPTH
containers deep; the schema's JSON nests at most MAX_JSON_DEPTH levels and its schemas at
most regex_dfa.MAX_NESTING; the automaton's size is bounded by regex_dfa.MAX_NFA_STATES and
MAX_DFA_STATES.
Whitespace: none anywhere except `whitespace` after every "," and ":" (by default at most
one space, so both compact output and json.dumps's ", "/": " are accepted; indented output
is not). Bounded on purpose: an unbounded rule lets a model write spaces until max_tokens.
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from decimal import Decimal
from functools import lru_cache, partial
from typing import Any
from urllib.parse import unquote

import numpy as np

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
    add_dfa,
    add_fragment,
    add_repeat,
    collector_paused,
    combine,
    compile_nfa,
    compile_regex,
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
# One character of a string whose length bound is above LONG_STRING characters: raw or a
# short escape, a \\u escape only for a control character (which has no raw form, so that
# every string still has a spelling here, the one other automata of strings also write:
# oneOf's options are told apart on that). The automaton keeps a copy of one character's
# states per character of the bound, and every \\u escape (surrogate pairs) doubles them.
COUNTED_CHARACTER = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])'
LONG_STRING = 32
RAW_CHARACTERS: CharSet = complement(((0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))))
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
FRACTION_DIGITS = 6                  # digits after the point of a number with bounds
_DATE = (r"[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")        # February 29 left out: every date written exists
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# RFC 3986's URI: scheme ":" hier-part ["?" query] ["#" fragment], hier-part being "//"
# authority and a path, or a path alone ("urn:isbn:0451450523", "mailto:a@b.org"). Its
# grammar is regular; left out: a host in brackets (IPv6 or IPvFuture literals).
_PCHAR_NO_COLON = r"(?:[a-zA-Z0-9._~!$&'()*+,;=@-]|%[0-9a-fA-F]{2})"
_PCHAR = r"(?:[a-zA-Z0-9._~!$&'()*+,;=:@-]|%[0-9a-fA-F]{2})"
_SEGMENTS = "(?:/" + _PCHAR + "*)*"                 # a path-abempty: "/"-led segments, maybe empty ones
_AUTHORITY = (r"(?:(?:[a-zA-Z0-9._~!$&'()*+,;=:-]|%[0-9a-fA-F]{2})*@)?"     # userinfo@
              r"(?:[a-zA-Z0-9._~!$&'()*+,;=-]|%[0-9a-fA-F]{2})*(?::[0-9]*)?")  # host (a name, IPv4), :port
_QUERY_FRAGMENT = r"(?:\?(?:" + _PCHAR + r"|[/?])*)?(?:#(?:" + _PCHAR + r"|[/?])*)?"
_URI_SCHEME = r"[a-zA-Z][a-zA-Z0-9+.-]*"
_URI_REST = ("(?://" + _AUTHORITY + _SEGMENTS + "|/(?:" + _PCHAR + "+" + _SEGMENTS + ")?|" + _PCHAR + "+" +
             _SEGMENTS + ")?" + _QUERY_FRAGMENT)
# A relative reference: no scheme, and no ":" in its first segment (else it reads as one).
_RELATIVE_REFERENCE = ("(?://" + _AUTHORITY + _SEGMENTS + "|/(?:" + _PCHAR + "+" + _SEGMENTS + ")?|" +
                       _PCHAR_NO_COLON + "+" + _SEGMENTS + ")?" + _QUERY_FRAGMENT)
FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": _DATE + "T" + _TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)+",
    "ipv4": _OCTET + r"(?:\." + _OCTET + "){3}",
    "hostname": r"(?:[a-z0-9](?:[a-z0-9-]{0,18}[a-z0-9])?\.){0,3}[a-z](?:[a-z0-9-]{0,18}[a-z0-9])?",
    "uri": _URI_SCHEME + ":" + _URI_REST,
    "uri-reference": "(?:" + _URI_SCHEME + ":" + _URI_REST + "|" + _RELATIVE_REFERENCE + ")",
    "json-pointer": r"(?:/(?:[^~/\x00-\x1f\\\"]|~[01])*)*",
}
# The formats JSON Schema defines: one outside FORMATS is refused; a format outside this set
# (int64, color, ...) is an annotation, as validators read it.
SPEC_FORMATS = {"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4",
                "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
                "relative-json-pointer", "regex"}
DRAFTS = {"draft-04": 4, "draft-06": 6, "draft-07": 7, "2019-09": 2019, "2020-12": 2020}
LATEST_DRAFT = 2020                  # a schema without a known "$schema" is read as 2020-12 (as validators do)
# Keywords that assert something and are not compiled: refused with the reason, never ignored.
WHY_REFUSED = {
    "unevaluatedProperties": "unevaluated* keywords depend on what the other keywords evaluated",
    "unevaluatedItems": "unevaluated* keywords depend on what the other keywords evaluated",
    "$dynamicRef": "only local $ref is followed", "$recursiveRef": "only local $ref is followed",
    "maxContains": "counting the matching items is not compiled",
    "extends": "draft-03 is not supported", "disallow": "draft-03 is not supported",
    "divisibleBy": "draft-03 is not supported",
}
# The drafts that define a keyword the compiler reads, (first, last), where not all of them
# do. In a schema of another draft the keyword is unknown there, so an annotation, and is
# ignored, as validators read it ("const" under draft-04 asserts nothing). "dependencies" is
# still read under 2019-09 and 2020-12 (which split it in two; validators differ on whether
# the old name still asserts): honouring it there can only refuse more.
KEYWORD_DRAFTS = {
    "const": (6, LATEST_DRAFT), "contains": (6, LATEST_DRAFT), "propertyNames": (6, LATEST_DRAFT),
    "if": (7, LATEST_DRAFT), "then": (7, LATEST_DRAFT), "else": (7, LATEST_DRAFT),
    "dependentRequired": (2019, LATEST_DRAFT), "dependentSchemas": (2019, LATEST_DRAFT),
    "minContains": (2019, LATEST_DRAFT), "maxContains": (2019, LATEST_DRAFT),
    "unevaluatedProperties": (2019, LATEST_DRAFT), "unevaluatedItems": (2019, LATEST_DRAFT),
    "$recursiveRef": (2019, 2019), "prefixItems": (2020, LATEST_DRAFT), "$dynamicRef": (2020, LATEST_DRAFT),
}
# Every keyword the compiler reads; any other keyword (title, description, id, examples,
# x-kubernetes-..., markdownDescription...) is an annotation, as JSON Schema reads unknown
# keywords, and is ignored.
KEYWORDS_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "boolean": set(), "null": set(),
    "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains"},
    "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties",
               "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas"},
}
TYPES = tuple(KEYWORDS_BY_TYPE)
COMBINATORS = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "not", "if", "then", "else"}
ASSERTIONS = COMBINATORS | set().union(*KEYWORDS_BY_TYPE.values()) | set(WHY_REFUSED)
MAX_VARIANTS = 16                    # objects written per dependency combination, at most
MAX_MULTIPLE = 1000                  # the largest integer multipleOf (its automaton counts remainders)
def canonical_json(value: Any) -> str:
    """`value` as the compact JSON text this compiler writes: integral numbers without a
    fraction (9, never 9.0: draft-04 does not count 9.0 as an integer), raw characters."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return "[" + ",".join(canonical_json(item) for item in value) + "]"
    if isinstance(value, dict):
        members = (json.dumps(k, ensure_ascii=False) + ":" + canonical_json(v) for k, v in value.items())
        return "{" + ",".join(members) + "}"
    return json.dumps(value, ensure_ascii=False)


def _shown(value: Any, width: int = 60) -> str:
    """A value as JSON, cut to `width` characters, for an error message."""
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[:width] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _listed(kind: Any) -> list[Any]:
    return kind if isinstance(kind, list) else [kind]


# Two parts of an allOf that bound the same thing: the stricter bound holds.
TIGHTEST: dict[str, Callable[[Any, Any], Any]] = {
    **{name: max for name in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")},
    **{name: min for name in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")},
}


def every_spelling(value: Any, where: str) -> str:
    """A pattern for every JSON text of a scalar `value` (and, for a number, more: any text
    with an exponent, and any fraction after its integer digits), so that what it leaves
    out of another automaton is never a spelling of `value`."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if _is_number(value):
        digits = str(int(abs(value)))
        sign = "-?" if int(value) == 0 else ("-" if value < 0 else "")
        return (sign + digits + r"(?:\.[0-9]+)?" + "|" + r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?[eE][+-]?[0-9]+")
    if isinstance(value, str):
        return '"' + "".join(_every_spelling_of_character(char) for char in value) + '"'
    raise ValueError(f"schema at {where}: 'not' around an enum or const is supported for scalar values only, "
                     f"got {_shown(value)}")


def _every_spelling_of_character(char: str) -> str:
    """A pattern for every way JSON writes `char` inside a string: raw (where allowed), its
    short escape, and \\u escapes (a surrogate pair past U+FFFF) in either case."""
    short = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    options = []
    if char not in '"\\' and ord(char) >= 0x20:
        options.append(escape(char))
    if char in short:
        options.append(escape(short[char]))
    units = char.encode("utf-16-be")
    hexes = [units[k:k + 2].hex() for k in range(0, len(units), 2)]
    options.append("".join(r"\\u" + "".join(_hex_digit(h) for h in unit) for unit in hexes))
    return "(?:" + "|".join(options) + ")"


def multiples_of(step: int) -> DFA:
    """The integers (JSON text, no fraction) divisible by `step`: states count remainders."""
    start, minus, zero, first = 0, 1, 2, 3
    table = np.full((first + step, 256), -1, dtype=np.int32)
    digits = [ord(str(d)) for d in range(10)]
    table[start, ord("0")] = zero
    table[start, ord("-")] = minus
    for d in range(1, 10):
        table[start, digits[d]] = table[minus, digits[d]] = first + d % step
    for remainder in range(step):
        for d in range(10):
            table[first + remainder, digits[d]] = first + (remainder * 10 + d) % step
    accepting = np.zeros(first + step, dtype=bool)
    accepting[[zero, first]] = True
    return DFA(table, accepting, start)


NumberBound = tuple[Decimal, bool]        # a bound's value, exclusive
Bound = tuple[str, bool]                  # fraction digits (no trailing zeros; "" for 0), exclusive


def _zero_allowed(lower: Bound | None, upper: Bound | None) -> bool:
    """Is the fraction 0 (no digits written) within the bounds?"""
    return (lower is None or (lower[0] == "" and not lower[1])) and (upper is None or not (upper[0] == ""
                                                                                           and upper[1]))


def _fractions(lower: Bound | None, upper: Bound | None, room: int) -> str | None:
    """A pattern for the non-empty digit strings F of at most `room` digits with 0.F within
    the bounds (None: no bound on that side); None when there is none. Digit by digit: a
    first digit above the lower bound's (below the upper's) frees the rest."""
    if room == 0:
        return None
    free, options = [], []
    for d in range(10):
        next_lower = next_upper = None
        if lower is not None:
            first = int(lower[0][0]) if lower[0] else 0
            if d < first:
                continue
            if d == first:
                next_lower = (lower[0][1:], lower[1])
                if next_lower == ("", False):
                    next_lower = None
        if upper is not None:
            first = int(upper[0][0]) if upper[0] else 0
            if d > first:
                continue
            if d == first:
                next_upper = (upper[0][1:], upper[1])
        if next_lower is None and next_upper is None:
            free.append(d)
            continue
        tail = _fractions(next_lower, next_upper, room - 1)
        tails = ([tail] if tail is not None else []) + ([""] if _zero_allowed(next_lower, next_upper) else [])
        if tails:
            options.append(f"{d}(?:{'|'.join(tails)})")
    if free:
        options.append(f"[{free[0]}-{free[-1]}][0-9]{{0,{room - 1}}}" if free == list(range(free[0], free[-1] + 1))
                       else "[" + "".join(map(str, free)) + f"][0-9]{{0,{room - 1}}}")
    return "(?:" + "|".join(options) + ")" if options else None


def _split(bound: Decimal) -> tuple[int, str]:
    """A non-negative bound as (integer part, fraction digits without trailing zeros)."""
    whole = int(bound)
    return whole, format(bound - whole, "f").partition(".")[2].rstrip("0")


def magnitudes(lower: tuple[Decimal, bool], upper: tuple[Decimal, bool] | None) -> str | None:
    """A pattern for the numbers from lower to upper (each (value >= 0, exclusive); upper
    None: unbounded), written I or I.F without sign or exponent, at most FRACTION_DIGITS
    digits after the point; None when there is none."""
    low_whole, low_fraction = _split(lower[0])
    if upper is not None and (lower[0] > upper[0] or (lower[0] == upper[0] and (lower[1] or upper[1]))):
        return None
    parts = []

    def with_fraction(whole: int, low: Bound | None, high: Bound | None) -> None:
        if low == ("", False):
            low = None
        fraction = _fractions(low, high, FRACTION_DIGITS)
        bare = _zero_allowed(low, high)
        if fraction is not None:
            parts.append(f"{whole}\\.{fraction}" if not bare else f"{whole}(?:\\.{fraction})?")
        elif bare:
            parts.append(str(whole))

    if upper is not None and int(upper[0]) == low_whole:
        with_fraction(low_whole, (low_fraction, lower[1]), (_split(upper[0])[1], upper[1]))
        return "(?:" + "|".join(parts) + ")" if parts else None
    with_fraction(low_whole, (low_fraction, lower[1]), None)
    high_whole = None if upper is None else int(upper[0])
    if high_whole is None or high_whole - 1 >= low_whole + 1:
        middle = _naturals_between(low_whole + 1, None if high_whole is None else high_whole - 1)
        parts.append("(?:" + "|".join(middle) + f")(?:\\.[0-9]{{1,{FRACTION_DIGITS}}})?")
    if upper is not None and high_whole is not None:
        with_fraction(high_whole, None, (_split(upper[0])[1], upper[1]))
    return "(?:" + "|".join(parts) + ")" if parts else None


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

    def __init__(self, root: Any, whitespace: str, strict: bool, draft: int,
                 pieces: dict[tuple[Any, ...], DFA | None] | None = None, written: set[int] | None = None) -> None:
        self.root = root
        self.whitespace = whitespace
        self.strict = strict
        self.draft = draft
        # The objects of the schema as written (by identity): only those are read under their
        # draft's keywords. A schema this compiler rewrote or built (draft-04's "dependencies"
        # as dependentRequired, a tuple "items" as prefixItems) is in 2020-12's words already.
        self.written = _objects_in(root) if written is None else written
        self.nfa = NFA()
        # Automata built apart, by what they depend on: shared with the compilers built apart
        # from this one, so a piece met again (oneOf compares each option with every other; a
        # $ref'd definition repeats its patterns and strings) is compiled once per schema.
        self.pieces: dict[tuple[Any, ...], DFA | None] = {} if pieces is None else pieces
        self.separator = parse_regex("," + whitespace)
        self.colon = parse_regex(":" + whitespace)
        self.resources = 0              # sub-schemas with their own $id around the one being built

    # --- small pieces ---
    def pattern(self, text: str) -> Fragment:
        """A fragment for a regex: its minimal DFA's states (compiled once per text, and far
        fewer than the Thompson construction's, which keeps determinising the whole fast)."""
        return add_dfa(self.nfa, _pattern_automaton(text))

    def nothing(self) -> Fragment:
        """A fragment that accepts no string: the place of a value that cannot be written."""
        return self.nfa.choice([])

    def sub_dfa(self, schema: Any, where: str, depth: int, refs: tuple[str, ...]) -> DFA | None:
        """The DFA of a sub-schema built apart (to combine it with another automaton, or to
        test a value on it), under this compiler's limits; None when no value is written."""
        return self.piece(("value", canonical_json(schema), id(schema) in self.written, refs, self.resources),
                          lambda: self.apart(lambda compiler: compiler.value(schema, where, depth, refs)))

    def piece(self, key: tuple[Any, ...], make: Callable[[], DFA | None]) -> DFA | None:
        """make()'s automaton, kept under `key` for the rest of this schema's compilation (a
        refusal is not kept: its message names the place where it was met)."""
        if key not in self.pieces:
            self.pieces[key] = make()
        return self.pieces[key]

    def literal(self, value: Any, depth: int = 0) -> Fragment:
        """One JSON value, every spelling of it this compiler writes: keys in the value's
        order, integral numbers without a fraction, non-ASCII characters raw or escaped."""
        if depth > MAX_NESTING:
            raise ValueError(f"an enum or const value nested more than MAX_NESTING={MAX_NESTING} levels")
        if isinstance(value, dict):
            members = [self.nfa.chain([self.literal(key), self.pattern(":" + self.whitespace),
                                       self.literal(item, depth + 1)]) for key, item in value.items()]
            return self.joined("{", members, "}")
        if isinstance(value, list):
            return self.joined("[", [self.literal(item, depth + 1) for item in value], "]")
        if isinstance(value, str):
            if json.dumps(value) != json.dumps(value, ensure_ascii=False):    # characters with two spellings
                return self.pattern('"' + "".join(self.spellings(char) for char in value) + '"')
            return self.text(json.dumps(value))
        return self.text(canonical_json(value))

    def text(self, data: str) -> Fragment:
        """A fragment that reads exactly `data`, a byte per state: a literal (a property's
        name, most often) needs no subset construction and minimisation of its own."""
        nfa = self.nfa
        start = here = nfa.new_state()
        for byte in data.encode("utf-8"):
            following = nfa.new_state()
            nfa.edges[here].append((byte, byte, following))
            here = following
        return start, here

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
    def clean(self, schema: Any, where: str) -> Any:
        """The keywords of `schema` that assert something, in 2020-12's forms: annotations
        and unknown keywords dropped, older drafts' spellings rewritten, refused keywords
        refused. A boolean schema is returned as it is."""
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            raise ValueError(f"schema at {where}: a schema is an object or a boolean, got {_shown(schema)}")
        written = id(schema) in self.written
        if written:                                 # keywords its draft does not define are annotations
            schema = {k: v for k, v in schema.items()
                      if KEYWORD_DRAFTS.get(k, (0, 0))[0] <= self.draft <= KEYWORD_DRAFTS.get(k, (0, LATEST_DRAFT))[1]}
        for keyword in schema:
            if keyword in WHY_REFUSED:
                raise ValueError(f"schema at {where}: keyword {keyword!r} is not supported: {WHY_REFUSED[keyword]}")
        rest = {k: v for k, v in schema.items() if k in ASSERTIONS}
        if "dependencies" in schema:                # draft-07 and before: both kinds under one name
            dependencies = schema["dependencies"]
            if not isinstance(dependencies, dict):
                raise ValueError(f"schema at {where}: dependencies must be an object")
            for name, needed in dependencies.items():
                kind = "dependentRequired" if isinstance(needed, list) else "dependentSchemas"
                rest[kind] = {**rest.get(kind, {}), name: needed}
        if isinstance(schema.get("items"), list):   # the tuple form of 2019-09 and before
            if self.draft >= 2020:
                raise ValueError(f"schema at {where}: items as a list is the tuple form of draft 2019-09 and "
                                 f"before (name the draft in $schema, or write prefixItems)")
            rest["prefixItems"] = schema["items"]
            rest["items"] = schema.get("additionalItems", True)
        for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if written and self.draft == 4 and exclusive in rest and not isinstance(rest[exclusive], bool):
                raise ValueError(f"schema at {where}: draft-04's {exclusive} is a boolean (true makes {bound} "
                                 f"exclusive), got {_shown(rest[exclusive])}")
            if isinstance(rest.get(exclusive), bool):
                if self.draft != 4:
                    raise ValueError(f"schema at {where}: {exclusive} true/false is draft-04's form; name that "
                                     f"draft in $schema (\"http://json-schema.org/draft-04/schema#\")")
                if rest.pop(exclusive) and bound in rest:
                    rest[exclusive] = rest.pop(bound)
        if "if" not in rest or not {"then", "else"} & set(rest):    # then/else without if: no effect
            for keyword in ("if", "then", "else"):
                rest.pop(keyword, None)
        if "$ref" in rest and len(rest) > 1:
            if self.draft <= 7:                     # up to draft-07 a $ref's siblings are ignored
                rest = {"$ref": rest["$ref"]}
            else:
                ref = rest.pop("$ref")
                others = rest.get("allOf", [])
                rest["allOf"] = [{"$ref": ref}] + (others if isinstance(others, list) else [others])
        return rest

    def value(self, schema: Any, where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """The fragment of the JSON values that validate against `schema`."""
        if depth > MAX_NESTING:
            raise ValueError(f"schema at {where}: nested more than MAX_NESTING={MAX_NESTING} levels")
        if schema is True:
            return add_dfa(self.nfa, self.free_automaton())
        if schema is False:
            return self.nothing()
        identifier = schema.get("$id", schema.get("id") if self.draft == 4 else None) if isinstance(schema,
                                                                                                  dict) else None
        resource = schema is not self.root and isinstance(identifier, str) and not identifier.startswith("#")
        self.resources += resource
        try:
            return self.asserted(self.clean(schema, where), where, depth, refs)
        finally:
            self.resources -= resource

    def asserted(self, rest: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        if "$ref" in rest:
            return self.reference(rest["$ref"], where, depth, refs)
        for combinator in ("anyOf", "oneOf"):      # before allOf: they distribute over it
            if combinator in rest:
                return self.options(combinator, rest, where, depth, refs)
        if "if" in rest:                           # before allOf too: it may bring a second if
            return self.conditional(rest, where, depth, refs)
        if "allOf" in rest:
            return self.value(self.merged(rest, where), f"{where}.allOf", depth + 1, refs)
        if "not" in rest:
            return self.negation(rest, where, depth, refs)
        if "enum" in rest or "const" in rest:
            return self.choices(rest, where, depth, refs)
        types = self.types_of(rest, where)
        return self.nfa.choice([self.typed(kind, rest, where, depth, refs) for kind in types])

    def types_of(self, schema: dict[str, Any], where: str) -> list[str]:
        kind = schema.get("type", list(TYPES))
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"schema at {where}: type must be a type name or a list of them, got {_shown(kind)}")
        for k in kinds:
            if k not in KEYWORDS_BY_TYPE:
                raise ValueError(f"schema at {where}: type {k!r} is not a JSON Schema type (known: {', '.join(TYPES)})")
        if "integer" in kinds and "number" in kinds:
            # number writes every integer too, unless multipleOf asks for integers only.
            kinds = [k for k in kinds if k != ("number" if "multipleOf" in schema else "integer")]
        return kinds

    def reference(self, ref: Any, where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        target = self.resolve(ref, where)
        if refs.count(ref) >= MAX_REF_DEPTH:
            return self.nothing()                  # recursion bounded: deeper values cannot be written
        return self.value(target, ref, depth + 1, refs + (ref,))

    def resolve(self, ref: Any, where: str) -> Any:
        """The sub-schema a local $ref ("#", "#/$defs/a", "#/definitions/a", or the root's
        own $id followed by one of those) points at."""
        base = self.root.get("$id", self.root.get("id")) if isinstance(self.root, dict) else None
        if isinstance(ref, str) and isinstance(base, str) and ref.startswith(base.split("#")[0] + "#"):
            ref = ref[len(base.split("#")[0]):]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"schema at {where}: only local references ('#/$defs/...') are followed, got {ref!r}")
        if self.resources:
            raise ValueError(f"schema at {where}: $ref {ref!r} sits in a sub-schema with its own $id, against "
                             f"which it would resolve; only references against the root are followed")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise ValueError(f"schema at {where}: $ref {ref!r} points at nothing")
        return target

    def merged(self, schema: dict[str, Any], where: str) -> Any:
        """allOf's options and the schema around them as one schema: the same keyword in
        two parts becomes the stricter of the two (or both, under a new allOf); ValueError
        where that is not possible."""
        options = schema["allOf"]
        if not isinstance(options, list) or not options:
            raise ValueError(f"schema at {where}: allOf must be a non-empty list")
        result = {k: v for k, v in schema.items() if k != "allOf"}
        parts = [result]
        for i, option in enumerate(options):
            option = self.clean(option, f"{where}.allOf[{i}]")
            for _ in range(MAX_NESTING):
                if not (isinstance(option, dict) and set(option) == {"$ref"}):
                    break
                option = self.clean(self.resolve(option["$ref"], f"{where}.allOf[{i}]"), option["$ref"])
            else:
                raise ValueError(f"schema at {where}.allOf[{i}]: $ref leads to $ref more than MAX_NESTING times")
            if option is False:
                return False
            if option is not True:
                parts.append(option)
        # additionalProperties (items) sees only the properties (prefixItems) beside it: merged
        # with another part's, it would wrongly stop applying to them. So each part first lists
        # the names (positions) the others list, with its additionalProperties (items) as their
        # schema, which says the same; then the parts merge name by name (position by position).
        # Beside patternProperties (which a name may or may not match) that is refused.
        if any("patternProperties" in part for part in parts):
            owners = {i for i, part in enumerate(parts) if {"properties", "patternProperties",
                                                            "additionalProperties"} & set(part)}
            if len(owners) > 1 and any("additionalProperties" in parts[i] for i in owners):
                raise ValueError(f"schema at {where}: allOf parts with additionalProperties and another part's "
                                 f"properties or patternProperties do not merge into one schema")
        else:
            parts = [_listing_others(part, parts, "properties", "additionalProperties") for part in parts]
        parts = [_listing_others(part, parts, "prefixItems", "items") for part in parts]
        result = parts[0]
        later: list[Any] = []                      # conditionals of a second part, merged on the next pass
        for i, option in enumerate(parts[1:]):
            conditional: dict[str, Any] = {k: option[k] for k in ("if", "then", "else") if k in option}
            if conditional and {"if", "then", "else"} & set(result):
                later.append(conditional)
            else:
                result.update(conditional)
            for key, item in option.items():
                if key in ("if", "then", "else"):
                    continue
                if key not in result or json_equal(result[key], item):
                    result[key] = item
                elif key in ("properties", "patternProperties", "dependentSchemas") and isinstance(item, dict):
                    both = dict(result[key])
                    for name, sub in item.items():
                        both[name] = {"allOf": [both[name], sub]} if name in both else sub
                    result[key] = both
                elif key == "prefixItems" and isinstance(item, list) and isinstance(result[key], list):
                    result[key] = [{"allOf": [mine, theirs]} for mine, theirs in zip(result[key], item)]
                elif key in ("required",) and isinstance(item, list) and isinstance(result[key], list):
                    result[key] = result[key] + [name for name in item if name not in result[key]]
                elif key in TIGHTEST and _is_number(item) and _is_number(result[key]):
                    result[key] = TIGHTEST[key](result[key], item)
                elif key == "type":
                    kinds = [k for k in _listed(item) if k in _listed(result[key]) or
                             (k == "integer" and "number" in _listed(result[key]))]
                    kinds += [k for k in _listed(result[key]) if k == "integer" and "number" in _listed(item)]
                    result[key] = kinds
                elif key in ("items", "additionalProperties", "propertyNames"):
                    result[key] = {"allOf": [result[key], item]}
                elif key in ("anyOf", "oneOf"):      # the first is distributed before the second is read
                    later.append({key: item})
                elif key == "not":
                    result[key] = {"anyOf": [result[key], item]}
                elif key in ("enum", "const"):
                    mine = result.pop("enum", None) if key == "enum" else [result.pop("const")]
                    theirs = item if key == "enum" else [item]
                    if not isinstance(mine, list) or not isinstance(theirs, list):
                        raise ValueError(f"schema at {where}.allOf[{i}]: enum must be a list")
                    result["enum"] = [v for v in mine if any(json_equal(v, w) for w in theirs)]
                    if not result["enum"]:
                        return False
                else:
                    raise ValueError(f"schema at {where}.allOf[{i}]: {key!r} disagrees with another option "
                                     f"(only options that merge are supported)")
        if later:
            result["allOf"] = later
        return result

    def conditional(self, rest: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """if/then/else as the union of the schemas that each imply it, those that compile:
        the rest with if and then, with "not if" and else, and with then and else (which
        holds whichever way if goes). Without else, then alone contains if-and-then."""
        others = {k: v for k, v in rest.items() if k not in ("if", "then", "else")}
        condition, then, otherwise = rest.get("if", True), rest.get("then", True), rest.get("else", True)
        if isinstance(condition, bool):                # decided without a value
            branches = [[then if condition else otherwise]]
        elif otherwise is True:
            branches = [[then], [{"not": condition}]]
        else:
            branches = [[condition, then], [{"not": condition}, otherwise], [then, otherwise]]
        fragments, errors = [], []
        for parts in branches:
            parts = [part for part in parts if part is not True]
            try:
                both = {**others, "allOf": list(others.get("allOf", [])) + parts} if parts else others
                fragments.append(self.value(both, f"{where}.if", depth + 1, refs))
            except ValueError as error:
                errors.append(error)
        if not fragments:
            raise errors[0]
        return self.nfa.choice(fragments)

    def options(self, combinator: str, schema: dict[str, Any], where: str, depth: int,
                refs: tuple[str, ...]) -> Fragment:
        options = schema[combinator]
        if not isinstance(options, list) or not options:
            raise ValueError(f"schema at {where}: {combinator} must be a non-empty list")
        siblings = {k: v for k, v in schema.items() if k != combinator}
        if siblings:                        # the keywords beside it hold in every option
            options = [{"allOf": [siblings, option]} for option in options]
        if combinator == "oneOf":                 # exactly one option: never two at once
            return self.one_of(schema[combinator], options, where, depth, refs)
        return self.nfa.choice([self.value(option, f"{where}.{combinator}[{i}]", depth + 1, refs)
                                for i, option in enumerate(options)])

    def one_of(self, raw: list[Any], options: list[Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """oneOf's options (`options`: the `raw` ones with their siblings), each written only
        where no other holds: an option shown apart from another is written as it is; where
        that is not shown, it is written with "not" around the other (when that compiles)."""
        overlapping: list[list[int]] = [[] for _ in options]
        for i in range(len(options)):
            for j in range(i):
                if not self.apart_options(options[i], options[j], where, depth, refs):
                    overlapping[i].append(j)
                    overlapping[j].append(i)
        fragments = []
        for i, option in enumerate(options):
            others = [{"not": raw[j]} for j in overlapping[i]]
            try:
                fragments.append(self.value({"allOf": [option, *others]} if others else option,
                                            f"{where}.oneOf[{i}]", depth + 1, refs))
            except ValueError as error:
                if not others:
                    raise
                raise ValueError(f"schema at {where}: oneOf options {i} and {overlapping[i][0]} may overlap (a value "
                                 f"valid for both is invalid for oneOf), and option {i} without the others does not "
                                 f"compile ({error}); supported: options told apart by type, by listed values, by "
                                 f"required or forbidden properties, or whose others' complement compiles") from None
        return self.nfa.choice(fragments)

    def kinds(self, schema: Any, depth: int = 0) -> set[str]:
        """The types of the values `schema` allows, as far as its type, enum, const, $ref
        and combinators tell (every type when they do not)."""
        schema = self.clean(schema, "$")
        if schema is True or depth > MAX_NESTING:
            return set(TYPES)
        if schema is False:
            return set()
        if "$ref" in schema:
            return self.kinds(self.resolve(schema["$ref"], "$"), depth + 1)
        kinds = set(TYPES)
        if "type" in schema:
            kinds = set(_listed(schema["type"])) | ({"integer"} if "number" in _listed(schema["type"]) else set())
        if "const" in schema:
            kinds &= json_type_of(schema["const"])
        if isinstance(schema.get("enum"), list):
            kinds &= set().union(*[json_type_of(v) for v in schema["enum"]])
        for part in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
            kinds &= self.kinds(part, depth + 1)
        for combinator in ("anyOf", "oneOf"):
            if isinstance(schema.get(combinator), list):
                kinds &= set().union(*[self.kinds(option, depth + 1) for option in schema[combinator]])
        return kinds

    def values_of(self, schema: Any) -> list[Any] | None:
        """The values of a schema that lists them (enum or const, after $refs); else None."""
        for _ in range(MAX_NESTING):
            schema = self.clean(schema, "$")
            if not (isinstance(schema, dict) and set(schema) == {"$ref"}):
                break
            schema = self.resolve(schema["$ref"], "$")
        if not isinstance(schema, dict):
            return None
        if "const" in schema:
            return [schema["const"]]
        return schema["enum"] if isinstance(schema.get("enum"), list) else None

    def apart_options(self, a: Any, b: Any, where: str, depth: int, refs: tuple[str, ...]) -> bool:
        """Can no value be valid for both schemas? True only when shown: their types differ,
        their listed values differ, a property both require has listed values that differ,
        or, for scalars alone, their automata (which spell each scalar value the same way)
        share no string."""
        common = self.kinds(a) & self.kinds(b)
        if not common:
            return True
        values_a, values_b = self.values_of(a), self.values_of(b)
        if values_a is not None and values_b is not None:
            return not any(json_equal(x, y) for x in values_a for y in values_b)
        if common <= {"string", "number", "integer", "boolean", "null"}:
            automaton_a = self.sub_dfa(a, where, depth + 1, refs)
            automaton_b = self.sub_dfa(b, where, depth + 1, refs)
            return automaton_a is None or automaton_b is None or _disjoint(automaton_a, automaton_b)
        if common <= {"object"}:
            merged_a, merged_b = (self.merged({"allOf": [x]}, where) for x in (a, b))
            if not isinstance(merged_a, dict) or not isinstance(merged_b, dict):
                return True
            return (self.excluded_object(merged_a, merged_b, where, depth, refs)
                    and self.excluded_object(merged_b, merged_a, where, depth, refs))
        return False

    def excluded_object(self, a: dict[str, Any], b: dict[str, Any], where: str, depth: int,
                        refs: tuple[str, ...]) -> bool:
        """Is every object written for `a` invalid for `b` (both merged object schemas)? Shown
        by one name: `a` requires it and `b` forbids it, or gives it a schema that no value of
        `a`'s schema for it meets; or `b` requires it and `a` never writes it."""
        if depth > MAX_NESTING:
            return False
        properties_a, properties_b = a.get("properties", {}), b.get("properties", {})
        required_a, required_b = a.get("required", []), b.get("required", [])
        if not all(isinstance(x, dict) for x in (properties_a, properties_b)) or not all(
                isinstance(x, list) for x in (required_a, required_b)):
            return False
        # b's schema for a name it does not list: its additionalProperties (JSON Schema's default, true)
        b_extra = True if "patternProperties" in b else b.get("additionalProperties", True)
        for name in required_a:
            schema_b = properties_b.get(name, b_extra)
            if schema_b is False:
                return True
            if name in properties_a and schema_b is not True and self.apart_options(
                    properties_a[name], schema_b, where, depth + 1, refs):
                return True
        # a writes only its listed names when nothing else in it can bring more
        growing = {"anyOf", "oneOf", "allOf", "if", "not", "$ref", "patternProperties", "propertyNames",
                   "dependentRequired", "dependentSchemas"}
        a_closed = not growing & set(a) and a.get("additionalProperties",
                                                   not (self.strict and properties_a)) is False
        return a_closed and any(properties_a.get(name, False) is False and name not in required_a
                                for name in required_b)

    def negation(self, rest: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """"not" where its complement is known: a type, enum or const values (scalars), or
        required names (then absent)."""
        negated = self.clean(rest["not"], f"{where}.not")
        for _ in range(MAX_NESTING):               # the schema a lone $ref or allOf stands for
            if isinstance(negated, dict) and set(negated) == {"$ref"}:
                negated = self.clean(self.resolve(negated["$ref"], f"{where}.not"), negated["$ref"])
            elif isinstance(negated, dict) and "allOf" in negated:
                negated = self.clean(self.merged(negated, f"{where}.not"), f"{where}.not")
            else:
                break
        others = {k: v for k, v in rest.items() if k != "not"}
        if negated is True or negated == {}:
            return self.nothing()
        if negated is False:
            return self.value(others, where, depth + 1, refs)
        if set(negated) == {"anyOf"} and isinstance(negated["anyOf"], list) and negated["anyOf"]:
            first, remaining = negated["anyOf"][0], negated["anyOf"][1:]   # not (a or b): not a, and not b
            if remaining:
                others = {**others, "allOf": list(others.get("allOf", [])) + [{"not": {"anyOf": remaining}}]}
            return self.negation({**others, "not": first}, where, depth + 1, refs)
        if set(negated) == {"type"}:
            removed = set(self.types_of(negated, f"{where}.not")) | set(_listed(negated["type"]))
            kinds = [k for k in self.types_of(others, where) if k not in removed]
            if "integer" in removed and "number" in kinds:
                raise ValueError(f"schema at {where}: not integer beside number (numbers with a fraction) is not "
                                 f"supported")
            return self.value({**others, "type": kinds}, where, depth + 1, refs) if kinds else self.nothing()
        if set(negated) == {"required"} and isinstance(negated["required"], list) and negated["required"]:
            properties = others.get("properties", {})
            if not isinstance(properties, dict):
                raise ValueError(f"schema at {where}: properties must be an object of schemas")
            # not all of the names present: one of them absent (listed with the schema false)
            others = self.kept_open(others)
            return self.nfa.choice([self.value({**others, "properties": {**properties, name: False}},
                                               where, depth + 1, refs) for name in negated["required"]])
        if {"properties", "required"} & set(negated) and "object" in _listed(negated.get("type", "object")):
            return self.not_object(negated, others, where, depth, refs)
        if set(negated) <= {"enum", "const"}:
            values = list(negated.get("enum", [])) + ([negated["const"]] if "const" in negated else [])
            kept = self.sub_dfa(others, where, depth + 1, refs)
            if kept is None:
                return self.nothing()
            excluded = compile_regex("|".join(f"(?:{every_spelling(v, where)})" for v in values))
            difference = combine(kept, excluded, lambda keep, drop: keep and not drop)
            return add_dfa(self.nfa, difference) if difference is not None else self.nothing()
        raise ValueError(f"schema at {where}: keyword 'not' is supported around type, enum, const or required "
                         f"only (the complement of {sorted(negated)[0]!r} is not computed)")

    def kept_open(self, schema: dict[str, Any]) -> dict[str, Any]:
        """`schema` with its extra keys allowed in so many words where the strict rule allows
        them only because it lists no property (so that listing one does not forbid them)."""
        if self.strict and not schema.get("properties") and not {"patternProperties",
                                                                 "additionalProperties"} & set(schema):
            return {**schema, "additionalProperties": True}
        return schema

    def not_object(self, negated: dict[str, Any], others: dict[str, Any], where: str, depth: int,
                   refs: tuple[str, ...]) -> Fragment:
        """Objects that fail an object schema by its properties and required (its other
        keywords only add ways to fail, left unwritten): one required name absent, or one
        property present with a value its schema refuses (each way that compiles and that
        `others` lets be written; a non-object may satisfy the schema, so none is written)."""
        properties, required = negated.get("properties", {}), negated.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise ValueError(f"schema at {where}.not: properties must be an object and required a list")
        own = others.get("properties", {})
        if not isinstance(own, dict):
            raise ValueError(f"schema at {where}: properties must be an object of schemas")
        # The schema `others` gives an unlisted name: its additionalProperties (a missing one
        # is false under the strict rule); with patternProperties, such names are not written.
        default_extra = False if self.strict and (own or "patternProperties" in others) else True
        extra = False if "patternProperties" in others else others.get("additionalProperties", default_extra)
        others = self.kept_open(others)
        ways = [{**others, "type": "object", "not": {"required": [name]}} for name in required
                if name not in others.get("required", [])]
        ways += [{**others, "type": "object", "required": list(others.get("required", [])) + [name],
                  "properties": {**own, name: {"allOf": [own.get(name, extra), {"not": sub}]}}}
                 for name, sub in properties.items() if own.get(name, extra) is not False]
        fragments, errors = [], []
        for way in ways:
            try:
                fragments.append(self.value(way, where, depth + 1, refs))
            except ValueError as error:
                errors.append(error)
        if not fragments:
            raise errors[0] if errors else ValueError(f"schema at {where}: no object fails the schema under 'not'")
        return self.nfa.choice(fragments)

    def choices(self, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
            raise ValueError(f"schema at {where}: enum must be a non-empty list, got {_shown(schema['enum'])}")
        values = list(schema["enum"]) if "enum" in schema else [schema["const"]]
        if "const" in schema:
            values = [v for v in values if json_equal(v, schema["const"])]
        if "type" in schema:
            kinds = set(self.types_of(schema, where)) | ({"integer"} if "number" in self.types_of(schema, where)
                                                         else set())
            values = [v for v in values if json_type_of(v) & kinds]
        beside = {k: v for k, v in schema.items() if k not in ("enum", "const")}
        if set(beside) - {"type"}:          # the values the other keywords allow (as this compiler writes them)
            allowed = self.sub_dfa(beside, where, depth + 1, refs)
            values = [v for v in values if allowed is not None
                      and allowed.fullmatch(canonical_json(v).encode("utf-8"))]
        return self.nfa.choice([self.literal(v) for v in values])

    def typed(self, kind: str, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """The values of one type that satisfy that type's keywords in `schema`."""
        if kind == "null":
            return self.pattern("null")
        if kind == "boolean":
            return self.pattern("(?:true|false)")
        if kind == "number":
            step = schema.get("multipleOf")
            if step is not None and _is_number(step) and float(step).is_integer():
                return self.integer(schema, where)   # a multiple of an integer is an integer
            if step is not None:
                raise ValueError(f"schema at {where}: multipleOf {_shown(step)} on a number is not supported "
                                 f"(only integer steps; validators round fractions differently)")
            if set(schema) & KEYWORDS_BY_TYPE["number"]:
                return self.pattern(self.number_pattern(schema, where))
            return self.pattern(NUMBER)
        if kind == "integer":
            return self.integer(schema, where)
        if kind == "string":
            return self.string(schema, where)
        if kind == "array":
            return self.array(schema, where, depth, refs)
        return self.object(schema, where, depth, refs)

    def bounds(self, schema: dict[str, Any], where: str) -> tuple[list[NumberBound], list[NumberBound]]:
        """(lower bounds, upper bounds) as (value, exclusive)."""
        lows: list[NumberBound] = []
        highs: list[NumberBound] = []
        for name in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if name in schema:
                bound = schema[name]
                if not _is_number(bound) or not math.isfinite(bound):
                    raise ValueError(f"schema at {where}: {name} must be a finite number, got {_shown(bound)}")
                (lows if "Min" in name or name == "minimum" else highs).append(
                    (Decimal(repr(bound)) if isinstance(bound, float) else Decimal(bound), name.startswith("excl")))
        return lows, highs

    def integer(self, schema: dict[str, Any], where: str) -> Fragment:
        text = self.integer_pattern(schema, where)
        step = schema.get("multipleOf")
        if step is None:
            return self.pattern(text)
        if not _is_number(step) or step <= 0 or not float(step).is_integer() or step > MAX_MULTIPLE:
            raise ValueError(f"schema at {where}: multipleOf {_shown(step)} is not supported on integers (only "
                             f"integer steps up to MAX_MULTIPLE={MAX_MULTIPLE})")
        both = combine(compile_regex(text), multiples_of(int(step)), lambda a, b: a and b)
        if both is None:
            raise ValueError(f"schema at {where}: no multiple of {step} lies within the bounds")
        return add_dfa(self.nfa, both)

    def integer_pattern(self, schema: dict[str, Any], where: str) -> str:
        lows, highs = self.bounds(schema, where)
        low = max((math.floor(b) + 1 if exclusive else math.ceil(b)) for b, exclusive in lows) if lows else None
        high = min((math.ceil(b) - 1 if exclusive else math.floor(b)) for b, exclusive in highs) if highs else None
        if low is not None and high is not None and low > high:
            raise ValueError(f"schema at {where}: no integer lies between minimum {low} and maximum {high}")
        return integer_range(low, high)

    def number_pattern(self, schema: dict[str, Any], where: str) -> str:
        """Numbers within the bounds, written without exponent and with at most
        FRACTION_DIGITS digits after the point (so that a validator reading them as binary
        floats orders them against the bounds exactly as decimals)."""
        lows, highs = self.bounds(schema, where)
        low = max(lows, key=lambda b: (b[0], b[1])) if lows else None
        high = min(highs, key=lambda b: (b[0], not b[1])) if highs else None
        for bound in (low, high):
            if bound is not None and (abs(bound[0]) >= 10 ** 8 and bound[0] != int(bound[0])
                                      or -int(bound[0].as_tuple().exponent) > FRACTION_DIGITS):
                raise ValueError(f"schema at {where}: number bound {bound[0]} is not supported (at most "
                                 f"{FRACTION_DIGITS} digits after the point, and below 1e8 when it has any)")
        parts = []
        zero = (Decimal(0), False)
        if high is None or high[0] > 0 or (high[0] == 0 and not high[1]):      # zero and the positives
            lower = zero if low is None or low[0] < 0 else low
            body = magnitudes(lower, high)
            if body:
                parts.append(body)
        if low is None or low[0] < 0:                                           # the negatives, by magnitude
            upper = None if low is None else (-low[0], low[1])
            lower = (Decimal(0), True) if high is None or high[0] >= 0 else (-high[0], high[1])
            body = magnitudes(lower, upper)
            if body:
                parts.append("-" + body)
        if ((low is None or low[0] < 0 or low == zero) and (high is None or high[0] > 0 or high == zero)):
            parts.append(f"-0(?:\\.0{{1,{FRACTION_DIGITS}}})?")     # negative zero (-0.0 from a float) equals 0
        if not parts:
            raise ValueError(f"schema at {where}: no number lies within the bounds")
        return "(?:" + "|".join(parts) + ")"

    def apart(self, build: Callable[[_SchemaCompiler], Fragment]) -> DFA | None:
        """The DFA of a fragment that `build` makes in a compiler of its own (None: empty)."""
        compiler = _SchemaCompiler(self.root, self.whitespace, self.strict, self.draft, self.pieces, self.written)
        compiler.resources = self.resources
        compiler.nfa.start, compiler.nfa.accept = build(compiler)
        try:
            return compile_nfa(compiler.nfa)
        except ValueError as error:
            if "matches no string" in str(error):
                return None
            raise

    def intersected(self, automata: list[DFA | None]) -> Fragment:
        """The strings every automaton accepts, as a fragment."""
        both = _product(automata)
        return self.nothing() if both is None else add_dfa(self.nfa, both)

    def count(self, schema: dict[str, Any], name: str, where: str) -> int | None:
        value = schema.get(name)
        if value is not None and (isinstance(value, bool) or not _is_number(value) or value < 0
                                  or not float(value).is_integer()):
            raise ValueError(f"schema at {where}: {name} must be a non-negative integer, got {_shown(value)}")
        return None if value is None else int(value)

    def string(self, schema: dict[str, Any], where: str) -> Fragment:
        low = self.count(schema, "minLength", where) or 0
        high = self.count(schema, "maxLength", where)
        if high is not None and high < low:
            raise ValueError(f"schema at {where}: maxLength {high} is below minLength {low}")
        name = schema.get("format")
        if name is not None and (not isinstance(name, str) or (name not in FORMATS and name in SPEC_FORMATS)):
            raise ValueError(f"schema at {where}: format {_shown(name)} is not supported (supported: "
                             f"{', '.join(FORMATS)}; formats outside the specification are annotations)")
        shapes: list[dict[str, Any]] = []
        if name in FORMATS:
            shapes.append({"format": name})
        if "pattern" in schema:
            shapes.append({"pattern": schema["pattern"]})
        character = STRING_CHARACTER if max(low, high or 0) <= LONG_STRING else COUNTED_CHARACTER
        if not shapes:
            return add_dfa(self.nfa, _string_automaton(low, high, character))
        bounded = "minLength" in schema or "maxLength" in schema
        if len(shapes) > 1 or bounded:    # each keyword's strings apart, then the strings all accept
            automaton = self.piece(("string", canonical_json(shapes), low, high, bounded),
                                   lambda: self.bounded_string(shapes, low, high, character if bounded else None,
                                                               where))
            return self.nothing() if automaton is None else add_dfa(self.nfa, automaton)
        body = self.pattern(FORMATS[str(name)]) if name in FORMATS else self.search(schema["pattern"], where)
        return self.nfa.chain([self.pattern('"'), body, self.pattern('"')])

    def bounded_string(self, shapes: list[dict[str, Any]], low: int, high: int | None, character: str | None,
                       where: str) -> DFA | None:
        """The strings that each of `shapes` (a format, a pattern) accepts, also low..high
        characters long (each one `character`) unless `character` is None: each keyword's
        automaton apart, then their product (None: no such string)."""
        automata = [self.apart(partial(_SchemaCompiler.string, schema=shape, where=where)) for shape in shapes]
        if character is not None:
            automata.append(_string_automaton(low, high, character))
        return _product(automata)

    def search(self, pattern: Any, where: str, raw_only: bool = False) -> Fragment:
        """A string body containing a match of `pattern`, read as ECMA-262 reads it (JSON
        Schema's patterns are searches, anchored only by ^ and $ at its ends); the matched
        part uses unescaped characters (all of the body when raw_only)."""
        if not isinstance(pattern, str):
            raise ValueError(f"schema at {where}: pattern must be a string, got {_shown(pattern)}")
        alternatives = _top_level_alternatives(pattern)
        if len(alternatives) > 1:                  # a match of any one, each with its own anchors
            return self.nfa.choice([self.search(option, where, raw_only) for option in alternatives])
        anchored_start = pattern.startswith("^")
        trailing_backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
        anchored_end = pattern.endswith("$") and trailing_backslashes % 2 == 0 and len(pattern) > anchored_start
        body = pattern[int(anchored_start):len(pattern) - int(anchored_end)]
        try:
            tree = parse_regex(body, ecma=True)
        except ValueError as error:
            raise ValueError(f"schema at {where}: pattern: {error}") from None
        around = "[^\"\\\\\\x00-\\x1f]*" if raw_only else STRING_CHARACTER + "*"
        pieces = [] if anchored_start else [self.pattern(around)]
        pieces.append(add_fragment(self.nfa, _restrict(tree, RAW_CHARACTERS)))
        if not anchored_end:
            pieces.append(self.pattern(around))
        return self.nfa.chain(pieces)

    def items_of(self, schema: dict[str, Any], where: str) -> list[Any] | None:
        """The values an items schema allows when it lists them (enum, const, boolean,
        null), distinct under JSON equality; None otherwise."""
        items = self.clean(schema.get("items", True), f"{where}.items")
        for _ in range(MAX_NESTING):
            if not (isinstance(items, dict) and set(items) == {"$ref"}):
                break
            items = self.clean(self.resolve(items["$ref"], where), items["$ref"])
        if not isinstance(items, dict):
            return None
        if items in ({"type": "boolean"}, {"type": "null"}):
            return [False, True] if items["type"] == "boolean" else [None]
        if not ({"enum", "const"} & set(items)) or set(items) - {"enum", "const", "type"}:
            return None
        values = list(items.get("enum", [])) if isinstance(items.get("enum", []), list) else []
        if "const" in items:
            values = [v for v in values if json_equal(v, items["const"])] if "enum" in items else [items["const"]]
        if "type" in items:
            kinds = set(self.types_of(items, where)) | ({"integer"} if "number" in self.types_of(items, where)
                                                        else set())
            values = [v for v in values if json_type_of(v) & kinds]
        distinct: list[Any] = []
        for v in values:
            if not any(json_equal(v, w) for w in distinct):
                distinct.append(v)
        return distinct

    def array(self, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        high = self.count(schema, "maxItems", where)
        unique = schema.get("uniqueItems") is True and (high is None or high > 1)
        at_least = self.count(schema, "minContains", where)
        contains = "contains" in schema and at_least != 0
        if unique or contains:
            plain = {k: v for k, v in schema.items() if k not in ("uniqueItems", "contains", "minContains")}
            automata = [self.sub_dfa({**plain, "type": "array"}, where, depth, refs)]
            if unique:
                values = self.items_of(schema, where)
                if values is None or schema.get("prefixItems"):
                    raise ValueError(f"schema at {where}: uniqueItems is supported for items that list their "
                                     f"values (enum, const, boolean) only: other items would need the automaton "
                                     f"to remember every item written")
                automata.append(self.apart(lambda c: c.unique_array(values)))
            if contains:
                if at_least not in (None, 1):
                    raise ValueError(f"schema at {where}: minContains {at_least} is not supported (only 0 or 1)")
                matching = {"allOf": [schema.get("items", True), schema["contains"]]}
                automata.append(self.apart(lambda c: c.containing(schema.get("items", True), matching, where,
                                                                 depth, refs)))
            return self.intersected(automata)
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True)
        if not isinstance(prefix, list):
            raise ValueError(f"schema at {where}: prefixItems must be a list of schemas")
        low = self.count(schema, "minItems", where) or 0
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

    def unique_array(self, values: list[Any]) -> Fragment:
        """Arrays of distinct `values`, each written in the order of the list (so that no
        value can come twice, and the automaton stays linear in the number of values)."""
        nfa = self.nfa
        opening, closing = self.pattern(r"\["), self.pattern(r"\]")
        first = [nfa.new_state() for _ in range(len(values) + 1)]   # before value i, nothing written yet
        later = [nfa.new_state() for _ in range(len(values) + 1)]   # before value i, after a comma
        nfa.link(opening[1], first[0])
        nfa.link(first[-1], closing[0])
        for i, value in enumerate(values):
            written = self.literal(value)
            after = nfa.new_state()
            for state in (first[i], later[i]):
                nfa.link(state, written[0])
            nfa.link(first[i], first[i + 1])
            nfa.link(later[i], later[i + 1])
            nfa.link(written[1], after)
            nfa.link(after, closing[0])
            comma = add_fragment(nfa, self.separator)
            nfa.link(after, comma[0])
            nfa.link(comma[1], later[i + 1])
        return opening[0], closing[1]

    def containing(self, items: Any, matching: Any, where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """Arrays of `items` with at least one item valid for `matching`."""
        nfa = self.nfa

        def item() -> Fragment:
            return self.value(items, f"{where}.items", depth + 1, refs)

        before = add_repeat(nfa, lambda: nfa.chain([item(), add_fragment(nfa, self.separator)]), 0, None)
        after = add_repeat(nfa, lambda: nfa.chain([add_fragment(nfa, self.separator), item()]), 0, None)
        return nfa.chain([self.pattern(r"\["), before, self.value(matching, f"{where}.contains", depth + 1, refs),
                          after, self.pattern(r"\]")])

    def object(self, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        if schema.get("dependentRequired") or schema.get("dependentSchemas"):
            return self.dependent(schema, where, depth, refs)
        properties = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        for name, mapping in (("properties", properties), ("patternProperties", patterns)):
            if not isinstance(mapping, dict):
                raise ValueError(f"schema at {where}: {name} must be an object of schemas")
        properties = dict(properties)
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise ValueError(f"schema at {where}: required must be a list of property names, got {_shown(required)}")
        # A missing additionalProperties: extra keys are written only under JSON Schema's
        # rule (strict=False), or when the schema lists no property at all.
        open_by_default = not self.strict or not (properties or patterns)
        extra = schema.get("additionalProperties", True if open_by_default else False)
        keys = {pattern: self.piece(("key", pattern), partial(self.apart, partial(_SchemaCompiler.key,
                                                                                    pattern=pattern, where=where)))
                for pattern in patterns}
        for name in [n for n in required if n not in properties]:
            if extra is False and "additionalProperties" in schema and not any(
                    _is_key(keys[p], name, unknown=False) for p in patterns):
                raise ValueError(f"schema at {where}: required property {name!r} has no schema in properties, and "
                                 f"additionalProperties false forbids it")
            # (the strict default forbids only keys the schema does not name; required names one)
            properties[name] = extra if extra is not False else True
        for name in properties:                      # a listed name that a pattern matches obeys both
            matched = [patterns[p] for p in patterns if _is_key(keys[p], name)]
            if matched:
                properties[name] = {"allOf": [properties[name], *matched]}
        names = schema.get("propertyNames", True)
        names_dfa = None
        if names is not True:
            names_dfa = self.sub_dfa({"allOf": [{"type": "string"}, names]}, f"{where}.propertyNames", depth + 1,
                                     refs)
            for name in list(properties):
                if names_dfa is None or not names_dfa.fullmatch(json.dumps(name, ensure_ascii=False).encode()):
                    if name in required:
                        raise ValueError(f"schema at {where}: required property {name!r} is refused by propertyNames")
                    properties[name] = False
        # Extra members: (key automaton, value schema); keys are written with raw characters,
        # differ from every listed name and match exactly the patterns whose schema they get.
        groups: list[tuple[DFA | None, Any]] = []  # (None: any key but the listed names, value schema)
        if patterns or names is not True:
            # An object schema met again (a $ref'd definition) gets its keys from the first time.
            context = (tuple(patterns), tuple(properties),
                       *((canonical_json(names), refs, self.resources) if names is not True else ()))
            for pattern, sub in [*patterns.items(), *([(None, extra)] if extra is not False else [])]:
                key = self.piece(("extra key", pattern, *context),
                                 partial(_extra_key, pattern, keys, list(properties), names is not True, names_dfa))
                if key is not None:
                    groups.append((key, sub))
        elif extra is not False:
            groups.append((None, extra))
        low = self.count(schema, "minProperties", where) or 0
        high = self.count(schema, "maxProperties", where)
        counted = "minProperties" in schema or "maxProperties" in schema
        if counted and groups:
            if high is not None or low > 1:
                raise ValueError(f"schema at {where}: minProperties above 1 or maxProperties with extra keys are "
                                 f"not supported (list the properties and set additionalProperties false)")
            if low == 1:                          # at least one member: any object but {}
                uncounted = {k: v for k, v in schema.items() if k not in ("minProperties", "maxProperties")}
                whole = self.sub_dfa(uncounted, where, depth, refs)
                empty = compile_regex(r"\{\}")
                left = None if whole is None else combine(whole, empty, lambda a, b: a and not b)
                return self.nothing() if left is None else add_dfa(self.nfa, left)
            counted = False
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
        for key, sub in groups:
            written = self.key_other_than(list(properties)) if key is None else add_dfa(nfa, key)
            value = self.value(sub, f"{where}.additionalProperties", depth + 1, refs)
            member = nfa.chain([written, add_fragment(nfa, self.colon), value])
            nfa.link(states[0], member[0])
            comma = add_fragment(nfa, self.separator)
            nfa.link(states[1], comma[0])
            nfa.link(comma[1], member[0])
            nfa.link(member[1], states[1])
        for k, state in enumerate(states):
            if not counted or low <= k:
                nfa.link(state, closing[0])
        return opening[0], closing[1]

    def key(self, pattern: str, where: str) -> Fragment:
        """A key (quotes included) of raw characters that contains a match of `pattern`."""
        return self.nfa.chain([self.pattern('"'), self.search(pattern, f"{where}.patternProperties", raw_only=True),
                               self.pattern('"')])

    def dependent(self, schema: dict[str, Any], where: str, depth: int, refs: tuple[str, ...]) -> Fragment:
        """dependentRequired/dependentSchemas as one object schema per choice of which of
        the named properties are present (at most MAX_VARIANTS)."""
        needs, implies = schema.get("dependentRequired", {}), schema.get("dependentSchemas", {})
        if not isinstance(needs, dict) or not isinstance(implies, dict):
            raise ValueError(f"schema at {where}: dependentRequired/dependentSchemas must be objects")
        base = {k: v for k, v in schema.items() if k not in ("dependentRequired", "dependentSchemas")}
        base["type"] = "object"
        names = list(dict.fromkeys([*needs, *implies]))
        if 2 ** len(names) > MAX_VARIANTS:
            raise ValueError(f"schema at {where}: dependencies on {len(names)} properties need more than "
                             f"MAX_VARIANTS={MAX_VARIANTS} object schemas")
        fragments, errors = [], []
        for present in itertools.product((False, True), repeat=len(names)):
            properties = dict(base.get("properties", {}))
            required = list(base.get("required", []))
            parts = []
            for name, here in zip(names, present):
                if here:
                    wanted = needs.get(name, [])
                    if not isinstance(wanted, list):
                        raise ValueError(f"schema at {where}: dependentRequired.{name} must be a list of names")
                    required += [n for n in [name, *wanted] if n not in required]
                    if name in implies:
                        parts.append(implies[name])
                else:
                    properties[name] = False
            if any(name in required and properties.get(name) is False for name in names):
                continue                              # a property both required and absent: no such object
            variant = {**base, "properties": properties, "required": required}
            try:
                both = {**variant, "allOf": list(variant.get("allOf", [])) + parts} if parts else variant
                fragments.append(self.value(both, where, depth + 1, refs))
            except ValueError as error:
                errors.append(error)
        if not fragments:
            raise errors[0] if errors else ValueError(f"schema at {where}: no object satisfies the dependencies")
        return self.nfa.choice(fragments)

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

    def free_automaton(self) -> DFA:
        """The minimal DFA of free(FREE_DEPTH), built once per whitespace rule."""
        automaton = _FREE_AUTOMATA.get(self.whitespace)
        if automaton is None:
            compiler = _SchemaCompiler(True, self.whitespace, self.strict, self.draft)
            compiler.nfa.start, compiler.nfa.accept = compiler.free(FREE_DEPTH)
            automaton = _FREE_AUTOMATA[self.whitespace] = compile_nfa(compiler.nfa)
        return automaton

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


_FREE_AUTOMATA: dict[str, DFA] = {}


@lru_cache(maxsize=4096)
def _pattern_automaton(text: str) -> DFA:
    return compile_regex(text)


@lru_cache(maxsize=256)
def _string_automaton(low: int, high: int | None, character_pattern: str = STRING_CHARACTER) -> DFA:
    """The minimal DFA of a JSON string of low..high characters (high None: no bound), each
    one `character_pattern` (a complete character, at most one end state after it), quotes
    included, built straight from the automaton of one character: a copy of its
    states per count of characters read, the count moving on when a character ends.
    (Subset construction and minimisation of the repeat took a second for maxLength 255.)
    ValueError past MAX_DFA_STATES: every one of its states would be a state of the DFA it
    joins, so that would be refused anyway, after seconds of subset construction."""
    character = _pattern_automaton(character_pattern)
    table = character.transitions
    ends = np.flatnonzero(character.accepting)          # one end state, with no moves out of it
    inner = np.flatnonzero(~character.accepting)
    inner = np.concatenate([[character.start], inner[inner != character.start]])   # the start first
    width = len(inner)
    local = np.full(character.num_states, -1, dtype=np.int64)
    local[inner] = np.arange(width)
    # template[i, b]: where byte b leads from inner state i: another inner state (0..width-1),
    # -2 when it ends a character, -1 nowhere.
    moved = table[inner]
    template = np.where(moved < 0, -1, np.where(np.isin(moved, ends), -2, local[np.maximum(moved, 0)]))
    looping = high is None and low == 0                 # any count: one copy that loops
    full_counts = 1 if looping else high if high is not None else low    # counts with a copy of every state
    # States: the opening, the closing (accepting), the copies, then (unless looping) the
    # count after them: `high` characters read (only the quote may follow), or, without a
    # bound, `low` or more read (a character started there continues in the last copy).
    size = 2 + full_counts * width + (not looping)
    if size > MAX_DFA_STATES:
        raise ValueError(f"the automaton needs more than MAX_DFA_STATES={MAX_DFA_STATES} states "
                         f"(a string length of {high if high is not None else low} characters)")
    opening, closing, last = 0, 1, size - 1
    rows = np.full((size, 256), -1, dtype=np.int64)
    rows[opening, ord('"')] = 2
    for count in range(full_counts):
        first = 2 + count * width
        after = first if looping else first + width
        rows[first:first + width] = np.where(template >= 0, first + template, np.where(template == -2, after, -1))
        if count >= low:
            rows[first, ord('"')] = closing
    if not looping:
        if high is None:
            copy = 2 + (full_counts - 1) * width
            rows[last] = np.where(template[0] >= 0, copy + template[0], np.where(template[0] == -2, last, -1))
        rows[last, ord('"')] = closing
    accepting = np.zeros(size, dtype=bool)
    accepting[closing] = True
    return DFA(rows.astype(np.int32), accepting, opening)


def _product(automata: list[DFA | None]) -> DFA | None:
    """The automaton of the strings every one of `automata` accepts (None: no string)."""
    both: DFA | None = automata[0]
    for other in automata[1:]:
        both = None if both is None or other is None else combine(both, other, lambda a, b: a and b)
    return both


def _top_level_alternatives(pattern: str) -> list[str]:
    """`pattern` cut at each | outside groups and classes (escapes skipped)."""
    cuts, depth, in_class, k = [], 0, False, 0
    while k < len(pattern):
        char = pattern[k]
        if char == "\\":
            k += 1
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char in "()":
            depth += 1 if char == "(" else -1
        elif char == "|" and depth == 0:
            cuts.append(k)
        k += 1
    bounds = [-1, *cuts, len(pattern)]
    return [pattern[a + 1:b] for a, b in zip(bounds, bounds[1:])]


def _listing_others(part: Any, parts: list[Any], listed: str, rest: str) -> Any:
    """An allOf part that also lists, under `listed` (properties or prefixItems), the names
    or positions the other parts list, each with the part's own `rest` schema
    (additionalProperties or items), which is what that part asks of them: the same schema."""
    if not isinstance(part, dict) or not (listed in part or rest in part):
        return part
    own = part.get(listed, {} if listed == "properties" else [])
    others = [other.get(listed) for other in parts if isinstance(other, dict) and other is not part]
    if listed == "properties":
        if not isinstance(own, dict) or rest not in part:
            return part
        names = [name for other in others if isinstance(other, dict) for name in other if name not in own]
        return {**part, listed: {**own, **{name: part[rest] for name in names}}} if names else part
    if not isinstance(own, list):
        return part
    length = max([len(own)] + [len(other) for other in others if isinstance(other, list)])
    return {**part, listed: own + [part.get(rest, True)] * (length - len(own))} if length > len(own) else part


def _extra_key(pattern: str | None, keys: dict[str, DFA | None], listed: list[str], named: bool,
               names: DFA | None) -> DFA | None:
    """The keys of the extra members whose value `pattern`'s schema governs (pattern None:
    additionalProperties'), given every pattern's key automaton: the keys it matches (any
    key of raw characters for None) that no other pattern matches, no listed name spells and,
    when `named`, propertyNames accepts (`names`: its automaton, None when it accepts no name).
    None when there is no such key."""
    key = keys[pattern] if pattern is not None else compile_regex('"[^"\\\\\\x00-\\x1f]*"')
    others = [keys[other] for other in keys if other != pattern]
    others.append(compile_regex("|".join('"' + escape(name) + '"' for name in listed)) if listed else None)
    for other in others:
        if key is not None and other is not None:
            key = combine(key, other, lambda a, b: a and not b)
    if named:
        key = None if key is None or names is None else combine(key, names, lambda a, b: a and b)
    return key


def _is_key(key: DFA | None, name: str, unknown: bool = True) -> bool:
    """Does a patternProperties key automaton (raw characters) take the property `name`?
    For a name it cannot spell raw, `unknown`: True where counting it as matched only takes
    values away (its pattern's schema then applies too), False where it would allow more."""
    if any(ord(char) < 0x20 or char in '"\\' for char in name):
        return unknown
    return key is not None and key.fullmatch(('"' + name + '"').encode("utf-8"))


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


def _objects_in(value: Any) -> set[int]:
    """The identities of the objects (dicts) anywhere inside `value`, a JSON value."""
    found: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            found.add(id(item))
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return found


def draft_of(schema: Any) -> int:
    """The draft a schema names in "$schema" (4, 6, 7, 2019, 2020); LATEST_DRAFT when it
    names none, or a meta-schema that is not a draft (Snowplow's, say), as validators read
    it. ValueError for draft-03."""
    name = schema.get("$schema") if isinstance(schema, dict) else None
    if name is None:
        return LATEST_DRAFT
    if isinstance(name, str) and "draft-03" in name:
        raise ValueError("the schema is draft-03, which is not supported")
    for marker, draft in DRAFTS.items():
        if isinstance(name, str) and marker in name:
            return draft
    return LATEST_DRAFT


def schema_to_nfa(schema: Any, whitespace: str = OPTIONAL_SPACE, strict: bool = True) -> NFA:
    """The NFA of the JSON documents that validate against `schema` (a dict, a boolean, or
    its JSON text) under the draft it names. strict: a missing additionalProperties
    forbids unlisted keys (strict=False: JSON Schema's rule, they are allowed). ValueError
    names the refused keyword or bad value, its place ("$.properties.age") and the rule or
    the limit it breaks."""
    root = _load(schema)
    compiler = _SchemaCompiler(root, whitespace, strict, draft_of(root))
    compiler.nfa.start, compiler.nfa.accept = compiler.value(root, "$", 0, ())
    return compiler.nfa


def compile_schema(schema: Any, whitespace: str = OPTIONAL_SPACE, strict: bool = True) -> DFA:
    """The trimmed byte DFA (minimal up to regex_dfa.MINIMIZE_LIMIT states) of the JSON
    documents that validate against `schema`
    (arguments as schema_to_nfa's)."""
    with collector_paused():
        return compile_nfa(schema_to_nfa(schema, whitespace, strict))
