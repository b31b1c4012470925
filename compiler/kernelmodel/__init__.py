"""The megakernel read back from a bundle: the machine code (SASS) of each GPU target's cubins and
the task tables, turned into static facts per kernel and per task and a decode latency prediction
(`zlc inspect BUNDLE --kernel`, bench/kernel_stats.py; docs/kernel-model.md). It reads what codegen
wrote and never generates anything; it runs without a GPU or a CUDA toolkit.

In the order data flows through it (each module imports only those before it):

    sass.py           a cubin's SASS as data: instructions, the CFG and its loops, dataflow helpers
    triton_source.py  the generated kernel.py as a program, and an evaluator of its scalar
                      expressions over the task tables
    sass_map.py       the SASS mapped onto kernel.py: op bodies, source lines, weight loads, loops,
                      polls, which arm of a branch a task takes
    task_path.py      one task's path through that code in issue order: round trips, bytes in flight
    static_facts.py   one kernel's static facts: registers, spills, occupancy, per op body its weight
                      loads and loops
    task_tables.py    the task tables' facts: dependency levels, waits, DRAM bytes per task
    calibration.py    the calibrated terms (calibration.json: the measured figures, the fit) and how
                      they carry to a target's clock and L2 latency
    event_sim.py      a discrete-event simulation of one decode step over the task table
    latency.py        the latency model: task shapes from paths and tables, the parameter ranges, the
                      prediction
    calibrate.py      the fit of the calibrated terms on the measured runs (python -m ...calibrate)
    multirow.py       the prefill kernel's multi-row bodies (prefill, batched steps) priced from their
                      loops' SASS facts over the prefill table's list schedule
    calibrate_multirow.py  the fit of their terms on the measured prefill and batched runs
    designs.py        issue 34's bodies priced by the calibrated model before they exist
    report.py         all of it per GPU target, with the target checks (JSON, rich tables, markdown)
"""
