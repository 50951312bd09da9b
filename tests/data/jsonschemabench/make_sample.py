"""Writes sample.json: a fixed sample of JSONSchemaBench's schemas, PER_SUBSET from each of its
ten subsets, for tests/test_guide_schemas.py (licence and attribution in README.md here).

The sample is drawn by a seeded rule from a checkout of the data (the guidance-ai/jsonschemabench
repository's data/<subset>/<name>.json files, the same schemas as the Hugging Face dataset
epfl-dlab/JSONSchemaBench): the file names of each subset sorted, then
random.Random(f"{SEED}:{subset}").sample(names, PER_SUBSET). Run it from the repository root:

    python tests/data/jsonschemabench/make_sample.py PATH/TO/jsonschemabench/data
"""
import json
import pathlib
import random
import sys

SEED = 35
PER_SUBSET = 30
SUBSETS = ("Github_easy", "Github_hard", "Github_medium", "Github_trivial", "Github_ultra", "Glaiveai2K",
           "JsonSchemaStore", "Kubernetes", "Snowplow", "WashingtonPost")


def main(data: pathlib.Path) -> None:
    sample = []
    for subset in SUBSETS:
        names = sorted(path.name for path in (data / subset).glob("*.json"))
        for name in random.Random(f"{SEED}:{subset}").sample(names, PER_SUBSET):
            schema = json.loads((data / subset / name).read_text(encoding="utf-8"))
            sample.append({"subset": subset, "name": name.removesuffix(".json"), "schema": schema})
    out = pathlib.Path(__file__).parent / "sample.json"
    out.write_text(json.dumps(sample, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{len(sample)} schemas written to {out}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
