"""Every measurement of 21 fake-emulated memory runs, as JSON: run it on two commits and compare the
files (`cmp`) to check that a change to the emulation leaves every byte as it was.
Run: OMP_NUM_THREADS=1 python benchmarks/emulated_bytes.py > bytes.json"""

import json
import sys

from tpbench.experiments import memory
from tpbench.run.compose import expand

SMALL = "model=minimind hidden=256 heads=8 kv_heads=4 layers=2 vocab=510 seq=64 dtype=bfloat16"
CONFIGS = {
    **{
        f"{device}-{mode}-t{tp}": f"{SMALL} mode={mode} tp={tp} launch.device={device}"
        for device in ("cpu", "cuda")
        for mode in ("tp", "tp_sp", "tp_vp", "tp_sp_vp")
        for tp in (2, 4)
    },
    **{f"{device}-ddp-dp4": f"{SMALL} mode=ddp dp=4 launch.device={device}" for device in ("cpu", "cuda")},
    "seed-l2-selective": "model=seed_memory layers=2 mode=tp_sp_vp recompute=selective launch.device=cuda",
    "seed-l2-full-mixed": "model=seed_memory layers=2 mode=tp_sp recompute=full precision=mixed "
    "launch.device=cuda",
    "tron-l2-tp_sp": "+preset=tron_memory layers=2 mode=tp_sp",
}

out = {}
for name, overrides in CONFIGS.items():
    cfg = expand([*overrides.split(), "launch.emulate=fake", "kind=memory"], single=True)[0]
    result = memory.measure_in_process(cfg)
    measured = {m.name: m.value for m in result.measurements}
    out[name] = {"measurements": measured, "comm": [str(row) for row in result.comm]}
json.dump(out, sys.stdout, indent=1, sort_keys=True)
