"""The oracle: reference kernels per IR op (`kernels`), the graph executor (`executor`), node
evaluation for passes (`evaluate`), generation over prefill/decode graphs (`session`) and the one
sampling function every executor shares (`sampling`). It imports only `zlc.ir` and `zlc.errors`,
so passes, codegen, verification and the runtime may all stand on it."""
