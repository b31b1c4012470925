"""Test support that is not part of zlc's public API: the model zoo (`zoo`: tiny random-weight
Hugging Face models exported the ways real users export them, cached on disk), used by the tests,
the examples and the benchmarks."""
