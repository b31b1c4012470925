"""zlc codegen: the task-graph scheduler, the Triton megakernel emitter and AOT compilation per
target (see DESIGN.md). Not built yet -- the megakernel issue adds it; this package exists so the
`zlc.codegen` namespace declared in pyproject.toml is installable today."""
