"""zlc runtime: running a compiled bundle. `loader` (`zlc.load`) checks a bundle and opens
sessions; `megakernel` is the host loop (prompt chunks, decode steps, sampling) over an executor:
`interpret` (the kernel in Triton's CPU interpreter), `cuda` (its cubin through the driver API,
`cuda_driver`), `reference_backend` (the bundle's IR on its packed weights); `tokenizer` is the
bundled tokenizer. `serve/` is the serving wing (ingress, APIs, frames, engine, rings) on top.

The runtime reads the bundle format (`zlc.bundle`) and stands on the reference layer
(`zlc.reference`); it never imports codegen, the passes or the frontends.
"""
