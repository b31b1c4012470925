"""The ingress wing: what runs in the `zlc serve` process itself (the asyncio loop): HTTP and the
APIs, binary frames and XDP, prompts and text, /health and /metrics, the engines' supervision and
the routing between them, the rings' producer side. It meets the engine process only through the
wire at `zlc.runtime.serve` (`protocol`, `rings`, `engine_stats`) and imports nothing of
`zlc.runtime.serve.engine` (tests/test_architecture.py)."""
