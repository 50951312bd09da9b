"""Chapter 38: the engine core behind an OpenAI-compatible HTTP API.

    text.py      the tokenizer the server needs (a Protocol), incremental detokenizing,
                 stop strings, the byte tokenizer's fallback chat template
    protocol.py  request bodies -> validated prompts and SamplingParams, OpenAI error
                 objects, response and chunk shapes
    loop.py      EngineLoop: the one thread that owns the EngineCore; AdmissionControl
    app.py       the FastAPI app (routes, server-sent events, metrics) and serve_in_thread
    page.py      the chat page served at /
"""
