"""The serving wing (`zlc serve`): ingress and engine around one bundle.

    client -- HTTP (api_anthropic, api_openai, api_completions over http) / frames (TCP, UDP; xdp) --> server (ingress)
           -- rings (shared memory, C11 atomics in _rings.c) --> engine (one executor, FIFO) --> client

`server` owns the event loop, the routes (each request's API object, `api_anthropic.ANTHROPIC`,
`api_openai.OPENAI` or `api_completions.COMPLETIONS`, picked once) and the drain on SIGTERM; `generate` is the HTTP generation path
(with `prompts`: tokenizing off the loop), `frame_ingress` the binary frames (with `frame_auth`:
their MACs and UDP cookies); `supervisor` keeps the engine alive through `engine_client`, one spawned
engine process, and `engine` runs in that process over `zlc.runtime.loader`; the two sides share
`protocol` (the rings' flags and error codes) and never import each other; `textstream` turns token
ids into text deltas, `metrics` is /metrics. docs/serving.md has the design and docs/frames.md the
binary frame format.
The wing stands on the runtime (it loads bundles through `zlc.runtime.loader`) and imports no
compiler module.
"""
