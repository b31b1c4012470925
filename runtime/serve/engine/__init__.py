"""The engine wing: what runs in the engine process (`python -m zlc.runtime.serve.engine.loop`, one per
device, started by the ingress's supervisor). `loop` drains the request ring and runs steps,
`scheduler` batches them (continuous batching over `zlc.runtime.batch`'s backends and
`zlc.runtime.kv_manager`'s pages), `sampling` picks each row's token. It meets the ingress only
through the wire at `zlc.runtime.serve` (`protocol`, `rings`, `engine_stats`) and imports nothing
of `zlc.runtime.serve.ingress` (tests/test_architecture.py)."""
