"""Chapter 11: loading a Hugging Face Qwen3 checkpoint directory."""
from . import Mistake

MILESTONE = "tests/test_ch11_checkpoints.py"
RULES = f"{MILESTONE}::test_match_names_rules"

MISTAKES = [
    Mistake("checkpoint.py", "tensor_locations",
            before="""            if not file.is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is in shard {shard}, which is not in {root}")
""",
            after="",
            rule="a shard the index names must be in the directory, else CheckpointError naming the shard",
            expect="a shard the index names must be in the directory",
            tests=(f"{MILESTONE}::test_error_missing_shard",)),
    Mistake("checkpoint.py", "tensor_locations",
            before="if not isinstance(weight_map, dict) or not weight_map:",
            after="if not isinstance(weight_map, dict):",
            rule="an index whose weight_map is empty is an error naming the index",
            expect="non-empty) weight_map", tests=(f"{MILESTONE}::test_error_empty_weight_map",)),
    Mistake("checkpoint.py", "tensor_locations",
            before="file = root / shard",
            after="file = Path(shard)",
            rule="the index's shard names are files in the checkpoint's directory",
            expect="shard names are files in the checkpoint's directory",
            tests=(f"{MILESTONE}::test_sharded_checkpoint",)),
    Mistake("checkpoint.py", "tensor_locations",
            before="""    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found (the directory holds {present})")""",
            after="""    return {}""",
            rule="a directory with neither model.safetensors nor an index is an error naming the file looked for",
            expect="naming the file it looked for", tests=(f"{MILESTONE}::test_error_no_weights_or_config",)),
    Mistake("checkpoint.py", "match_names",
            before='ours = name if name in wanted else f"model.{name}"',
            after="ours = name",
            rule="names saved without the 'model.' prefix get it",
            expect="without the 'model.' prefix get it", tests=(RULES,)),
    Mistake("checkpoint.py", "match_names",
            before=' or (tied and name == "lm_head.weight")',
            after="",
            rule="with tied embeddings a stored lm_head.weight is skipped",
            expect="stored lm_head.weight is skipped", tests=(RULES,)),
    Mistake("checkpoint.py", "match_names",
            before="name.endswith(IGNORED_SUFFIXES) or ",
            after="",
            rule="names ending in IGNORED_SUFFIXES (rotary inv_freq buffers) are skipped",
            expect="IGNORED_SUFFIXES are skipped", tests=(RULES,)),
    Mistake("checkpoint.py", "match_names",
            before="    if missing:\n",
            after="    if missing and False:\n",
            rule="a parameter that no file provides is a CheckpointError naming it",
            expect="no file provides", tests=(RULES,)),
    Mistake("checkpoint.py", "match_names",
            before="if ours in pairs.values():",
            after="if False:",
            rule="two file tensors that map onto one parameter are an error",
            expect="map onto one parameter", tests=(RULES,)),
    Mistake("checkpoint.py", "load_checkpoint",
            before="""    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
""",
            after="",
            rule="with tied embeddings lm_head.weight IS the loaded embedding tensor",
            expect="lm_head must be the embedding tensor itself",
            tests=(f"{MILESTONE}::test_single_file_checkpoint[tied]",)),
    Mistake("checkpoint.py", "load_checkpoint",
            before="handle.get_tensor(name).to(dtype=dtype)",
            after="handle.get_tensor(name)",
            rule="every parameter is cast to the requested dtype",
            expect="cast to the requested dtype", tests=(f"{MILESTONE}::test_dtype_cast",)),
    Mistake("checkpoint.py", "load_checkpoint",
            before="""                if shape != expected[ours]:
                    raise""",
            after="""                if shape != expected[ours] and False:
                    raise""",
            rule="a tensor whose shape differs from the parameter's is a CheckpointError giving both shapes",
            expect="shape differs from the parameter's", tests=(f"{MILESTONE}::test_error_shape_mismatch",)),
    Mistake("checkpoint.py", "load_checkpoint",
            before="return model.eval()",
            after="return model",
            rule="the loaded model is in eval mode",
            expect="eval mode", tests=(f"{MILESTONE}::test_single_file_checkpoint[untied]",)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "tensor_locations": (
        "how to tell a sharded checkpoint from a single file and map every tensor name to the "
        "file that holds it from headers alone, and which broken indexes to refuse"
    ),
    "match_names": (
        "how checkpoint names (from a whole model or a bare Qwen3Model) pair with our parameter "
        "names, what a tied LM head means for the file, and which leftovers on either side are "
        "errors"
    ),
    "load_checkpoint": (
        "how to build the model without allocating or initialising its weights, then fill every "
        "parameter from its file (each file opened once) in the asked dtype and device, with a "
        "tied head staying one tensor"
    ),
}
DESIGN = ("load_checkpoint",)
