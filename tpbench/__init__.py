"""tpbench: tensor, sequence and vocab parallelism on a MiniMind decoder, run, measured and recorded.

The code is in layers, and a module imports only from its own layer or from the layers below it
(tests/test_layout.py holds it, with no import cycle either; docs/design.md walks through them):

    config, results, hardware, machine    the data every layer passes around: the typed config,
                                          result types (RankResult, Status, Outcome), GPU figures
    models, parallel                      the dense model, and the plan and collectives that shard it
    allocator, theory, emulation,         a run modelled without running it, and one rank of a job
    hf_config                             emulated in one process
    experiments, faults                   what each rank runs (validate, memory, throughput)
    compose                               configs from conf/: composed, expanded, checked
    fit, diagram, estimate                made from checked configs: a search, a drawing, a run's time
    launch, worker, batch, db             one run: a torchrun job and its workers; consecutive runs in
                                          one job on warm workers; the results database
    sweep, slurm                          many runs: what is left to run, each run recorded; Slurm jobs
    report                                tables and charts from the database
    cli, __main__                         the command line: parsing and printing

A lazy import inside a function (kept for start-up time: `tpbench plan` never loads pandas) obeys the
layers as a module-level one does.
"""

# The layers, lowest first: each entry names modules or packages (a package holds its submodules).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "results", "hardware", "machine"),
    ("models", "parallel"),
    ("allocator", "theory", "emulation", "hf_config"),
    ("experiments", "faults"),
    ("compose",),
    ("fit", "diagram", "estimate"),
    ("launch", "worker", "batch", "db"),
    ("sweep", "slurm"),
    ("report",),
    ("cli", "__main__"),
)
