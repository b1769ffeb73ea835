"""minimind-tron's TP step on CPU over gloo, timed as tpbench times its own (a barrier before and after
each step, the median of the measured steps): the anchor of docs/results/speed.md's table.

Needs a checkout of ANKer661/minimind's tp_demo branch (its model/ folder) and `transformers`, which
tpbench does not depend on; run it from a venv of its own:
  git clone -b tp_demo https://github.com/ANKer661/minimind /tmp/tron
  python -m venv /tmp/tron/venv && /tmp/tron/venv/bin/pip install torch transformers
  OMP_NUM_THREADS=1 /tmp/tron/venv/bin/torchrun --nproc-per-node 2 benchmarks/tron_step.py --tron /tmp/tron
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

a = argparse.ArgumentParser()
a.add_argument("--tron", required=True, help="a checkout of ANKer661/minimind, branch tp_demo")
for k, v in dict(
    hidden=768,
    layers=4,
    seq=512,
    batch=2,
    heads=8,
    kv=4,
    vocab=6400,
    warmup=2,
    steps=5,
    sp=0,
    async_comm=0,
    seed=0,
).items():
    a.add_argument("--" + k.replace("_", "-"), type=int, default=v)
args = a.parse_args()
sys.path.insert(0, args.tron)
from model.model_minimind import MiniMindConfig  # noqa: E402
from model.model_tp import TPContext, TPMiniMindForCausalLM  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed)
cfg = MiniMindConfig(
    hidden_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=args.heads,
    num_key_value_heads=args.kv,
    vocab_size=args.vocab,
    max_position_embeddings=max(args.seq, 32),
    dropout=0.0,
    flash_attn=True,
    use_moe=False,
)
ctx = TPContext(
    group=dist.group.WORLD,
    world_size=world,
    rank=rank,
    sequence_parallel=bool(args.sp),
    async_communication=bool(args.async_comm),
)
model = TPMiniMindForCausalLM(ctx, cfg).float()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, args.vocab, (args.batch, args.seq))
dist.broadcast(ids, 0)
times = []
for i in range(args.warmup + args.steps):
    dist.barrier()
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    opt.step()
    dist.barrier()
    if i >= args.warmup:
        times.append(time.perf_counter() - t)
t = torch.tensor([statistics.median(times)], dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
if rank == 0:
    print(
        "TRON_STEP="
        + json.dumps({"sp": args.sp, "async": args.async_comm, "median_s": t.item(), "steps": times})
    )
dist.destroy_process_group()
