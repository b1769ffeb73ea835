"""Which consecutive validate runs share one dense side (the dense model, its reference, the batches,
the AdamW steps): read from their configs alone, so that the CLI groups a sweep's runs without
importing what validates them (tpbench.experiments.validate imports DTensor, FSDP2 and the
optimizers: about a second of a process that only launches)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

from tpbench.config import RunConfig, public_config


def dense_key(cfg: RunConfig) -> str | None:
    """What a validation's dense side (the dense model, its reference, the batches, the AdamW steps)
    depends on: the config but the parallel model's own settings (parallel.* but tp and dp, debug.*).
    Consecutive runs of a batch with the same key are validated beside one dense side
    (tpbench.run.worker), up to launch.share_dense of them; None (another kind, launch.share_dense=1,
    an emulated rank): the run is validated alone."""
    if cfg.kind != "validate" or cfg.launch.share_dense < 2 or cfg.launch.emulate != "none":
        return None
    data = public_config(cfg)
    data["parallel"] = {"tp": cfg.parallel.tp, "dp": cfg.parallel.dp}
    del data["debug"]
    return json.dumps(data, sort_keys=True)


def count_beside(configs: Sequence[RunConfig], index: int) -> int:
    """How many configs from `index` on are validated as one (at least 1): consecutive ones with the
    same dense key, up to launch.share_dense of them."""
    key, count = dense_key(configs[index]), 1
    most = min(len(configs) - index, configs[index].launch.share_dense)
    while key is not None and count < most and dense_key(configs[index + count]) == key:
        count += 1
    return count


def groups_beside(configs: Sequence[RunConfig]) -> Iterator[tuple[int, int]]:
    """(first index, count) of each group of `configs` validated as one (`count_beside`), in order;
    every run that is not a validate run sharing a dense side is a group of one."""
    index = 0
    while index < len(configs):
        count = count_beside(configs, index)
        yield index, count
        index += count
