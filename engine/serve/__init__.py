"""Chapter 31: the engine core.

One request model (a token list plus how many of its tokens have K/V in the pool), one
flattened batch per step, one pool of fixed-size KV blocks shared by every request.

    request.py     Request, Status, SamplingParams, RequestOutput
    config.py      EngineConfig (and the scheduler's slice of it)
    blocks.py      hash_block, BlockManager: ref counts, LRU free queue, prefix cache
    scheduler.py   Scheduler, SchedulerOutput: who computes how many tokens this step
    batch.py       BatchMeta, Batch, build_batch: a step's tokens as one flat sequence
    backends.py    write_kv, gather_context, ReferenceBackend, the backend registry;
                   VectorisedBackend and the Triton backend (Chapter 32)
    flat_model.py  FlatModel: the loaded Qwen3 run on [N, D] rows against the pool
    runner.py      ModelRunner (pools, swaps, one forward per step) and pool sizing
    sampler.py     SimpleSampler: the sampler interface later chapters replace
    engine.py      EngineCore: add, abort, step, generate
    interfaces.py  the Protocols later chapters implement: AttentionBackend, Sampler, Guide, Drafter
    guided.py      GuideFactory, RegexGuide: constrained decoding's token masks (Chapter 35)
"""
