"""What the milestones compare with and check: the oracles (oracles), the reference's
recorded answers for an edition without it (oracle_records), the engine core's invariants
(engine_checks), shared prompts and token-list comparisons (milestone_helpers), the rank
programs of Chapter 41's tests (distributed_runs), the tokenizers library's SmolLM2
tokenizer (bpe_oracle) and Chapter 43's peft adapters and tiny Qwen3-VL
(adapters_and_images). The pytest plugin itself stays at course.pytest_plugin, the name
pytest.ini and every handed-out grading command load."""
