"""tpbench: tensor, sequence and vocab parallelism on a MiniMind decoder, run, measured and recorded.

The code is in layers, and a module imports only from its own layer or from the layers below it
(tests/test_layout.py holds it, with no import cycle either; docs/design.md walks through them). Two
halves have a package each: predict/ (what a step will hold, move and cost, without running it) and
run/ (how a run happens); sizing/ uses both, above them.

    config, results, machine, labels      the data every layer passes around: the typed config and its
                                          ConfigError, result types (RankResult, Status, Outcome),
                                          this node's devices, how a run's layout is named
    models                                the dense model (and model fields from a Hugging Face config)
    parallel                              the plan and collectives that shard it; emulation: one rank
                                          of a job emulated in one process
    predict                               a step modelled without running it: theory/, the GPU table
                                          (hardware), the allocator's model, the matmul rate probe
    experiments                           what each rank runs (validate, memory, throughput)
    run.faults, run.collector             injected failures; the cycle collector paused for imports
    run.compose                           configs from conf/: composed, expanded, checked
    run.launch, run.worker, run.batch,    one run: a torchrun job and its workers; consecutive runs in
    db                                    one job on warm workers; the results database
    run.sweep, run.slurm                  many runs: what is left to run, each run recorded; Slurm jobs
    sizing, diagram                       made from checked configs: a search (fit), a run's time
                                          (estimate), a drawing
    report                                tables and charts from the database
    cli, __main__                         the command line: parsing and printing

A lazy import inside a function (kept for start-up time: `tpbench plan` never loads pandas) obeys the
layers as a module-level one does.
"""

# The layers, lowest first: each entry names modules or packages (a package holds its submodules; a
# module is in the entry that names it most closely: run.compose, else run).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "config_schema", "results", "machine", "labels"),
    ("models",),
    ("parallel",),
    ("predict",),
    ("experiments",),
    ("run.faults", "run.collector"),
    ("run.compose",),
    ("run.launch", "run.worker", "run.batch", "db"),
    ("run.sweep", "run.slurm", "run"),
    ("sizing", "diagram"),
    ("report",),
    ("cli", "__main__"),
)
