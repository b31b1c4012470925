"""zlc codegen: the raised IR -> the megakernel's task tables, Triton source and cubins.

Data flow (compiler/build.py drives it, once per tiling):
- `program`: the plain data everything below passes around (`Program`, `Task`, `Region`,
  `Tiling`, `Buffer`) and the descriptor codes (norm, activation, RoPE kinds);
- `schedule`: raised decode graph -> `Program`, through `tasks` (fusion, ops split into tasks
  with declared read/write regions) and `pack` (buffers in A, constants in W/P, op descriptors;
  `pack_arenas` fills W and P), then derives and prunes the events;
- `validate`: proves a task table free of races, deadlocks and hangs from the table alone;
- `emit`: renders the kernel from `templates/megakernel.py.jinja` with the op kinds used;
- `aot`: compiles that kernel to PTX and cubin per GPU target, in a child process, without a GPU
  (`toolchain` finds the NVIDIA tools Triton's wheel ships).

`shuffle` reorders tables (and drops waits) for the tests that check the dependencies are real.
docs/megakernel.md describes the kernel and the table format.
"""
