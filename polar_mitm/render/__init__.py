"""Token-in/token-out: the gateway renders prompts itself and bridges turns of one lineage.

    renderer.Renderer      the model's chat template + tokenizer: chat request -> prompt text/ids, as vLLM renders it
    parsers.parse_output   sampled text -> content, reasoning, tool calls (Hermes, Qwen3-Coder XML, <think>)
    bridge.Lineages        earlier exchanges of a session; a new request that extends one is bridged
    token_engine           the token-in engine call (vLLM /v1/completions, SGLang /generate)
    serve.TokenPath        all of the above for one gateway exchange (`--render tokens`)
"""
