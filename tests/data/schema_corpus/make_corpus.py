"""Writes corpus.json: JSON schemas of the kinds clients send (tool parameters, CI workflows,
Kubernetes objects, configuration files, analytics events), each with valid and invalid
instances, for tests/test_guide_schemas.py.

The schemas are written here, not copied: each is assembled from field shapes drawn with a
fixed seed, in the style of its kind (its draft, its annotations, its keywords). Every
instance is labelled by `jsonschema` under the schema's own draft before it is kept, so a
label never rests on this script's logic. Run it from the repository root:

    python tests/data/schema_corpus/make_corpus.py
"""
import json
import pathlib
import random
import string

import jsonschema

SEED = 35
PER_KIND = 60
DRAFT_04 = "http://json-schema.org/draft-04/schema#"
DRAFT_07 = "http://json-schema.org/draft-07/schema#"
DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"
IGLU = "http://iglucentral.com/schemas/com.snowplowanalytics.self-desc/schema/jsonschema/1-0-0#"
WORDS = ("name city unit query limit offset status region owner label color mode level path url email "
         "timeout retries price currency quantity language country zone version image tag branch").split()


class Field:
    """A property's schema with values valid for it and values that are not."""

    def __init__(self, schema, valid, invalid):
        self.schema, self.valid, self.invalid = schema, valid, invalid


def word(rng):
    return rng.choice(WORDS)


def text(rng, low=1, high=12):
    return "".join(rng.choice(string.ascii_letters + " é") for _ in range(rng.randint(low, high)))


def described(rng, schema, draft):
    """Annotations as real schemas carry them (ignored by validators and by the compiler)."""
    if rng.random() < 0.7:
        schema["description"] = f"The {word(rng)} of the {word(rng)}."
    if rng.random() < 0.2:
        schema["title"] = word(rng).title()
    if rng.random() < 0.15 and draft != DRAFT_04:
        schema["examples"] = [rng.choice(WORDS)]
    if rng.random() < 0.1:
        schema["markdownDescription"] = "See **the docs**."
    return schema


def scalar(rng, draft):
    kind = rng.choice(["string", "enum", "pattern", "format", "integer", "number", "boolean", "nullable",
                       "int_or_string", "length"])
    if kind == "string":
        return Field({"type": "string"}, [text(rng), ""], [3, None])
    if kind == "length":
        low, high = rng.randint(1, 3), rng.randint(4, 12)
        return Field({"type": "string", "minLength": low, "maxLength": high}, ["x" * low, "y" * high],
                     ["z" * (high + 1), 5])
    if kind == "enum":
        values = rng.sample(WORDS, rng.randint(2, 5))
        return Field({"type": "string", "enum": values}, values[:2], ["not-" + values[0], 1])
    if kind == "pattern":
        pattern, good, bad = rng.choice([
            ("^[a-z][a-z0-9-]*$", ["web-1", "a"], ["Web", "-x"]),
            ("^\\d{3}-\\d{4}$", ["555-1234"], ["5551234", "55a-1234"]),
            ("^[A-Z]{3}$", ["EUR", "USD"], ["eu", "EURO"]),
            ("^v\\d+\\.\\d+\\.\\d+$", ["v1.2.3"], ["1.2.3", "v1.2"]),
            ("^\\S+$", ["no-space"], ["two words", "nbsp\u00a0inside"]),
            ("^[\\w.-]+$", ["file_name.txt"], ["a b", "x/y"]),
            ("^(\\*|[0-9]{1,2}) (\\*|[0-9]{1,2})$", ["* 5", "10 *"], ["*", "100 1"]),
        ])
        return Field({"type": "string", "pattern": pattern}, good, bad)
    if kind == "format":
        name, good, bad = rng.choice([
            ("date", ["2024-05-01"], ["2024-13-01", "yesterday"]),
            ("date-time", ["2024-05-01T12:30:00Z", "2023-01-31T00:00:00+02:00"], ["2024-05-01 12:30"]),
            ("email", ["ada@example.org"], ["not-an-email"]),
            ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567"]),
            ("ipv4", ["10.0.0.1"], ["300.1.1.1"]),
            ("uri", ["https://example.com/a/b"], [12]),
            ("hostname", ["api.example.com"], [None]),
            ("int64", ["anything"], [7]),
        ])
        return Field({"type": "string", "format": name}, good, bad)
    if kind == "integer":
        low = rng.choice([0, 1, -100, None])
        high = rng.choice([10, 65535, 1000000, None])
        schema = {"type": "integer"}
        valid, invalid = [], [1.5, "3"]
        if low is not None:
            if draft == DRAFT_04 and rng.random() < 0.4:
                schema.update(minimum=low, exclusiveMinimum=True)
                valid.append(low + 1)
                invalid.append(low)
            else:
                schema["minimum"] = low
                valid.append(low)
                invalid.append(low - 1)
        if high is not None:
            schema["maximum"] = high
            valid.append(high)
            invalid.append(high + 1)
        if rng.random() < 0.2:
            step = rng.choice([2, 5, 10])
            schema["multipleOf"] = step
            valid = [v for v in valid if v % step == 0] + [step * 2 if high is None or step * 2 <= high else 0]
            invalid.append(step + 1)
        return Field(schema, valid or [7], invalid)
    if kind == "number":
        low, high = rng.choice([(0, 1), (-90, 90), (-180, 180), (0, 100), (0.5, 2.5), (None, None)])
        schema = {"type": "number"}
        if low is not None:
            schema.update(minimum=low, maximum=high)
            return Field(schema, [low, high, (low + high) / 2, 0.25 if low <= 0.25 <= high else high],
                         [high + 1, low - 0.5, "1"])
        return Field(schema, [3.14, -2, 1e-3], ["3.14", None])
    if kind == "boolean":
        return Field({"type": "boolean"}, [True, False], ["true", 0])
    if kind == "nullable":
        inner = scalar(rng, draft)
        if "type" in inner.schema and isinstance(inner.schema["type"], str) and rng.random() < 0.5:
            schema = dict(inner.schema, type=[inner.schema["type"], "null"])
            if "enum" in schema:
                schema["enum"] = schema["enum"] + [None]
        else:
            schema = {"anyOf": [inner.schema, {"type": "null"}]}
        return Field(schema, inner.valid + [None], [v for v in inner.invalid if v is not None] or [[1]])
    return Field({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ["80", 8080], [True, 1.5])


def field(rng, draft, depth):
    roll = rng.random()
    if depth < 2 and roll < 0.12:
        return obj(rng, draft, depth + 1, rng.randint(1, 4))
    if roll < 0.22:
        items = scalar(rng, draft)
        schema = {"type": "array", "items": items.schema}
        if rng.random() < 0.5:
            schema["minItems"] = 1
        if rng.random() < 0.4:
            schema["maxItems"] = 5
        if "enum" in items.schema and rng.random() < 0.6:
            schema["uniqueItems"] = True          # values in the enum's order: the order the compiler writes
            return Field(schema, [items.valid[:1], items.valid[:2]], [[items.valid[0]] * 2, [items.invalid[0]]])
        return Field(schema, [items.valid[:1], items.valid[:3]], [[items.invalid[0]], "x"] if items.invalid else ["x"])
    if roll < 0.27:
        values = scalar(rng, draft)
        return Field({"type": "object", "additionalProperties": values.schema},
                     [{"app": values.valid[0]}, {}], [{"app": values.invalid[0]}] if values.invalid else [[]])
    return scalar(rng, draft)


def obj(rng, draft, depth, count, closed=None):
    names = rng.sample(WORDS, count)
    fields = {name: field(rng, draft, depth) for name in names}
    required = [name for name in names if rng.random() < 0.5]
    schema = {"type": "object", "properties": {name: described(rng, f.schema, draft) for name, f in fields.items()}}
    if required:
        schema["required"] = required
    if closed if closed is not None else rng.random() < 0.5:
        schema["additionalProperties"] = False
    base = {name: fields[name].valid[0] for name in required}
    valid = [base, {name: f.valid[-1] for name, f in fields.items()}]
    invalid = [{**base, name: f.invalid[0]} for name, f in fields.items() if f.invalid][:3]
    if required:
        invalid.append({k: v for k, v in base.items() if k != required[0]})
    return Field(schema, valid, invalid)


def tool(rng):
    draft = rng.choice([None, DRAFT_07, DRAFT_2020])
    made = obj(rng, draft, 0, rng.randint(1, 6))
    schema = made.schema
    if draft:
        schema = {"$schema": draft, **schema}
    return schema, made.valid, made.invalid


def workflow(rng):
    step = {"type": "object", "properties": {
        "name": {"type": "string"}, "uses": {"type": "string", "pattern": "^[\\w./-]+@[\\w.-]+$"},
        "run": {"type": "string"}, "with": {"type": "object", "additionalProperties": {
            "oneOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}}},
        "additionalProperties": False}
    if rng.random() < 0.5:
        step["dependencies"] = {"with": ["uses"]}
    events = rng.sample(["push", "pull_request", "schedule", "workflow_dispatch", "release"], 3)
    job = {"type": "object", "properties": {
        "runs-on": {"type": "string", "enum": ["ubuntu-latest", "windows-latest", "macos-latest"]},
        "needs": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "timeout-minutes": {"type": "integer", "minimum": 1, "maximum": 360},
        "steps": {"type": "array", "items": {"$ref": "#/definitions/step"}, "minItems": 1}},
        "required": ["runs-on", "steps"], "additionalProperties": False}
    schema = {"$schema": DRAFT_07, "$id": "https://example.com/workflow.json", "$comment": "a CI workflow",
              "definitions": {"step": step, "job": job}, "type": "object",
              "properties": {"name": {"type": "string"},
                             "on": {"oneOf": [{"type": "string", "enum": events},
                                              {"type": "array", "items": {"type": "string", "enum": events},
                                               "uniqueItems": True}]},
                             "jobs": {"type": "object", "patternProperties": {
                                 "^[_a-zA-Z][a-zA-Z0-9_-]*$": {"$ref": "#/definitions/job"}},
                                 "additionalProperties": False, "minProperties": 1}},
              "required": ["on", "jobs"], "additionalProperties": False}
    if rng.random() < 0.5:
        del schema["properties"]["jobs"]["minProperties"]
    ok_step = {"name": "build", "run": "make"}
    job_ok = {"runs-on": "ubuntu-latest", "steps": [ok_step]}
    valid = [{"on": events[0], "jobs": {"build": job_ok}},
             {"name": "ci", "on": events[:2],          # properties in the schema's order
              "jobs": {"test": {"runs-on": "macos-latest", "timeout-minutes": 30, "steps": [ok_step]}}}]
    invalid = [{"on": "nope", "jobs": {"build": job_ok}}, {"on": events[0], "jobs": {"1bad": job_ok}},
               {"on": events[0], "jobs": {"build": {"runs-on": "ubuntu-latest", "steps": []}}},
               {"on": [events[0], events[0]], "jobs": {"b": job_ok}}]
    return schema, valid, invalid


def kubernetes(rng):
    kind = rng.choice(["Deployment", "Service", "ConfigMap", "Pod", "Job"])
    quantity = {"oneOf": [{"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(m|Mi|Gi|Ki)?$"}, {"type": "integer"}]}
    container = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "image": {"type": "string"},
        "imagePullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
        "ports": {"type": "array", "items": {"type": "object", "properties": {
            "containerPort": {"type": "integer", "format": "int32", "minimum": 0, "exclusiveMinimum": True,
                              "maximum": 65535},
            "protocol": {"type": "string", "enum": ["TCP", "UDP", "SCTP"]}}, "required": ["containerPort"]}},
        "resources": {"type": "object", "properties": {
            "limits": {"type": "object", "additionalProperties": quantity},
            "requests": {"type": "object", "additionalProperties": quantity}}}},
        "required": ["name", "image"]}
    schema = {"$schema": DRAFT_04, "id": f"https://kubernetesjsonschema.dev/{kind.lower()}.json",
              "type": "object", "x-kubernetes-group-version-kind": [{"group": "", "kind": kind, "version": "v1"}],
              "definitions": {"container": container},
              "properties": {
                  "apiVersion": {"type": ["string", "null"], "enum": ["v1", "apps/v1", "batch/v1", None]},
                  "kind": {"type": "string", "enum": [kind]},
                  "metadata": {"type": "object", "properties": {
                      "name": {"type": "string"}, "namespace": {"type": "string"},
                      "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
                  "spec": {"type": "object", "properties": {
                      "replicas": {"type": "integer", "format": "int32", "minimum": 0},
                      "containers": {"type": "array", "items": {"$ref": "#/definitions/container"}}}}},
              "required": ["kind", "metadata"]}
    good_container = {"name": "web", "image": "nginx:1.25", "ports": [{"containerPort": 80}],
                      "resources": {"limits": {"cpu": "500m", "memory": 512}}}
    valid = [{"kind": kind, "metadata": {"name": "a"}},
             {"apiVersion": "v1", "kind": kind, "metadata": {"name": "a", "labels": {"app": "web"}},
              "spec": {"replicas": 2, "containers": [good_container]}}]
    invalid = [{"kind": "Other", "metadata": {}}, {"kind": kind},
               {"kind": kind, "metadata": {}, "spec": {"containers": [{"name": "Web", "image": "x"}]}},
               {"kind": kind, "metadata": {}, "spec": {"containers": [{"name": "w", "image": "x",
                                                                        "ports": [{"containerPort": 0}]}]}},
               {"kind": kind, "metadata": {}, "spec": {"replicas": 2.0 if rng.random() < 0.5 else -1}}]
    if rng.random() < 0.5:
        schema["properties"]["metadata"]["properties"]["labels"]["propertyNames"] = {
            "pattern": "^[a-z0-9./-]+$", "maxLength": 63}
        invalid.append({"kind": kind, "metadata": {"labels": {"Bad Key": "x"}}})
    return schema, valid, invalid


def config(rng):
    draft = rng.choice([DRAFT_07, DRAFT_2020])
    rules = {"type": "string", "enum": ["off", "warn", "error"]}
    defs = "definitions" if draft == DRAFT_07 else "$defs"
    schema = {"$schema": draft, "$id": "https://json.schemastore.org/example-tool.json", "type": "object",
              defs: {"level": rules, "rule": {"oneOf": [{"$ref": f"#/{defs}/level"},
                                                      {"type": "array", "minItems": 1,
                                                       "items": [{"$ref": f"#/{defs}/level"}],
                                                       "additionalItems": True}]}},
              "properties": {
                  "root": {"type": "boolean", "default": False},
                  "extends": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                  "rules": {"type": "object", "additionalProperties": {"$ref": f"#/{defs}/rule"}},
                  "plugins": {"type": "array", "items": {"type": "string", "enum": ["react", "import", "jest"]},
                              "uniqueItems": True},
                  "indent": {"type": "integer", "minimum": 0, "maximum": 8, "deprecated": True},
                  "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
              "additionalProperties": False}
    valid = [{}, {"root": True, "rules": {"semi": "error"}, "plugins": ["react", "jest"], "ratio": 0.5}]
    invalid = [{"root": "yes"}, {"rules": {"semi": "loud"}}, {"plugins": ["react", "react"]}, {"ratio": 0},
               {"unknown": 1}]
    if draft == DRAFT_2020:
        schema[defs]["rule"]["oneOf"][1] = {"type": "array", "minItems": 1,
                                            "prefixItems": [{"$ref": f"#/{defs}/level"}]}
        valid.append({"rules": {"quotes": ["error", "double"]}})
    else:
        valid.append({"rules": {"quotes": ["error", {"avoidEscape": True}]}})
    if rng.random() < 0.5:
        schema["if"] = {"properties": {"root": {"const": True}}, "required": ["root"]}
        schema["then"] = {"required": ["rules"]}
        valid.append({"root": True, "rules": {}})
        invalid.append({"root": True})
    if rng.random() < 0.5:
        schema["properties"]["env"] = {"type": "object", "propertyNames": {"enum": ["browser", "node", "es6"]},
                                       "additionalProperties": {"type": "boolean"}}
        valid.append({"env": {"node": True}})
        invalid.append({"env": {"deno": True}})
    return schema, valid, invalid


def event(rng):
    made = obj(rng, None, 1, rng.randint(2, 7), closed=True)
    schema = {"$schema": IGLU, "self": {"vendor": "com.example", "name": f"{word(rng)}_event",
                                        "format": "jsonschema", "version": "1-0-0"},
              "description": "An analytics event.", **made.schema}
    schema["properties"]["event_id"] = {"type": "string", "format": "uuid"}
    schema["properties"]["occurred_at"] = {"type": "string", "format": "date-time"}
    schema["properties"]["count"] = {"type": ["integer", "null"], "minimum": 0, "maximum": 2147483647}
    if rng.random() < 0.5:
        schema["properties"]["amount"] = {"type": "number", "minimum": -9999999.99, "maximum": 9999999.99}
        made.valid.append({**made.valid[0], "amount": 12.5})
        made.invalid.append({**made.valid[0], "amount": 1e8})
    made.valid.append({**made.valid[0], "event_id": "123e4567-e89b-12d3-a456-426614174000", "count": None})
    made.invalid.append({**made.valid[0], "count": -1})
    return schema, made.valid, made.invalid


KINDS = {"function calling": tool, "GitHub workflow": workflow, "Kubernetes": kubernetes, "schema store": config,
         "analytics event": event}


def labelled(schema, instances, valid):
    """The instances jsonschema labels as `valid` under the schema's draft (formats checked)."""
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    kept = []
    for instance in instances:
        if validator.is_valid(instance) == valid and instance not in kept:
            kept.append(instance)
    return kept


def main():
    rng = random.Random(SEED)
    corpus = []
    for kind, make in KINDS.items():
        for k in range(PER_KIND):
            schema, valid, invalid = make(rng)
            corpus.append({"name": f"{kind} {k}", "kind": kind, "schema": schema,
                           "valid": labelled(schema, valid, True), "invalid": labelled(schema, invalid, False)})
    path = pathlib.Path(__file__).with_name("corpus.json")
    path.write_text(json.dumps(corpus, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{len(corpus)} schemas, {sum(len(c['valid']) for c in corpus)} valid and "
          f"{sum(len(c['invalid']) for c in corpus)} invalid instances -> {path}")


if __name__ == "__main__":
    main()
