"""Chapter 17: Qwen3 end to end (stop ids from both config files, the Pipeline)."""
from . import Mistake

MILESTONE = "tests/test_ch17_qwen3_end_to_end.py"
STOP_IDS = f"{MILESTONE}::test_stop_token_ids_from_both_files"

MISTAKES = [
    Mistake("pipeline.py", "stop_token_ids",
            before="for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):",
            after="for name in (CONFIG_FILE,):",
            rule="the stop ids are the union of config.json's and generation_config.json's eos ids",
            expect="union of both files",
            tests=(STOP_IDS,)),
    Mistake("pipeline.py", "stop_token_ids",
            before="(value if isinstance(value, list) else [value])",
            after="[value]",
            rule="an eos_token_id may be a list of ints",
            expect="may be an int, a list of ints or absent",
            tests=(STOP_IDS,)),
    Mistake("pipeline.py", "stop_token_ids",
            before="tuple(sorted(ids))",
            after="tuple(ids)",
            rule="the stop ids come back sorted",
            expect="union of both files' ids, sorted",
            tests=(STOP_IDS,)),
    Mistake("pipeline.py", "stop_token_ids",
            before="        if value is None:\n            continue\n",
            after="",
            rule="a file without eos_token_id names no stop id",
            expect="may be an int, a list of ints or absent",
            tests=(STOP_IDS,)),
    Mistake("pipeline.py", "Pipeline.complete",
            before="torch.Generator(device=self.device).manual_seed(seed)",
            after="torch.Generator(device=self.device)",
            rule="a seeded completion draws from a generator seeded with that seed",
            expect="seed 1234",
            tests=(f"{MILESTONE}::test_seeded_sampling_is_reproducible",)),
    Mistake("pipeline.py", "Pipeline.complete",
            before="self.tokenizer.decode(shown)",
            after="self.tokenizer.decode(prompt_ids + shown)",
            rule="text is the decode of the new ids on their own",
            expect="new tokens alone",
            tests=(f"{MILESTONE}::test_pipeline_stops_where_transformers_stops",)),
    Mistake("pipeline.py", "Pipeline.complete",
            before="elif len(new) == max_new_tokens:",
            after="elif len(new) <= max_new_tokens:",
            rule='finish_reason is "context" when generate stopped at the context limit',
            expect="fill the 24-token context",
            tests=(f"{MILESTONE}::test_pipeline_reports_the_context_limit",)),
    Mistake("pipeline.py", "Pipeline.complete",
            before="if new and new[-1] in self.stop_ids:",
            after="if new and new[-1] in self.stop_ids and len(new) < max_new_tokens:",
            rule='a stop id on the last allowed step still makes finish_reason "stop"',
            expect="on the last allowed step",
            tests=(f"{MILESTONE}::test_pipeline_stops_where_transformers_stops",)),
    Mistake("pipeline.py", "Pipeline.complete",
            before="stop_token_ids=self.stop_ids,",
            after="stop_token_ids=self.stop_ids[:1],",
            rule="every stop id of both config files ends the answer",
            expect="in generation_config.json",
            tests=(f"{MILESTONE}::test_pipeline_stops_where_transformers_stops",)),
]

DECIDES = {
    "stop_token_ids": "which of a checkpoint's files say when an answer ends, and how to merge answers that "
                      "come in three forms (absent, one id, a list) and disagree between the files",
    "Pipeline.complete": "how to tell from the new ids alone why generation ended (a stop id on the last "
                         "allowed step is still a stop), what part of them is shown as text, and what the clock covers",
}
DESIGN = ("Pipeline.complete",)
