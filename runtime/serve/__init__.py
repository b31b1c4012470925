"""The serving wing (`zlc serve`): two processes around one bundle, each with its own folder, and
the wire between them here.

    client -- HTTP (api_anthropic, api_openai, api_completions over http) / frames (TCP, UDP; xdp) --> ingress.server
           -- rings (shared memory, C11 atomics in _rings.c) --> engine.loop (one executor, batched) --> client

`ingress/` runs in the `zlc serve` process: `server` owns the event loop, the routes (each
request's API object, `api_anthropic.ANTHROPIC`, `api_openai.OPENAI` or
`api_completions.COMPLETIONS`, picked once) and the drain on SIGTERM; `generate` is the HTTP
generation path (with `prompts`: tokenizing off the loop), `frame_ingress` the binary frames (with
`frame_auth`: their MACs and UDP cookies); `supervisor` keeps each engine alive through
`engine_client`, one spawned engine process; `textstream` turns token ids into text deltas,
`metrics` is /metrics. `engine/` runs in each engine process over `zlc.runtime.loader` (`loop`,
`scheduler`, `sampling`). The two wings share only the wire modules of this package, `protocol`
(the rings' flags and error codes), `rings` (+ `_rings`) and `engine_stats`, and never import each
other (tests/test_architecture.py). docs/serving.md has the design and docs/frames.md the binary
frame format. The wing stands on the runtime and imports no compiler module.
"""
