"""The parallel layer's names that config checks read before torch loads (tpbench.run.compose): kept
apart from the modules that use them, which import torch."""

from __future__ import annotations

FLAVOURS = ("none", "real", "fake")  # launch.emulate (tpbench.parallel.emulation)
EMULATED_KINDS = ("memory",)  # validate and throughput need the job's real collectives
DROPOUT_FAULTS = ("no_seq_offset", "no_head_offset", "no_batch_offset")  # debug.dropout_fault (rng)
