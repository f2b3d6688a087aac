"""PyTorch's side of the GPT benchmark: the model of examples/common/gpt.hpp, trained with FSDP2
(fully_shard) or DDP under torchrun. Prints one RESULT line like bench_gpt.

    torchrun --standalone --nproc-per-node=2 benchmarks/fsdp2_gpt.py fsdp2|ddp [steps warmup batch seq dim layers vocab heads]
    torchrun --standalone --nproc-per-node=1 benchmarks/fsdp2_gpt.py fsdp2-cuda|fsdp2-cuda-fused [same]

CPU modes use gloo and float32; fsdp2-cuda uses NCCL and MixedPrecisionPolicy(bf16 params, fp32
reduce), the counterpart of fsdpx's BF16Mixed, and reports tokens/s, peak GPU memory and MFU
(peak: FSDPX_PEAK_TFLOPS, default 989 = H100 SXM dense bf16); -fused steps AdamW with fused=True.
FSDPX_PROFILE=DIR writes a trace of one CUDA step (benchmarks/cuda_profile.py).
"""
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cuda_profile import profile_step  # benchmarks/ is on the path: scripts run as benchmarks/NAME.py


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), -1e9)
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        h = x + self.proj(y)
        return h + self.fc2(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.vocab = vocab
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), targets.reshape(-1))


def main():
    mode = sys.argv[1]
    fused = mode.endswith("-fused")
    mode = mode.removesuffix("-fused")
    defaults = [6, 2, 8, 256, 384, 6, 8192, 6]
    given = [int(a) for a in sys.argv[2:]]
    steps, warmup, batch, seq, dim, layers, vocab, heads = given + defaults[len(given):]
    cuda = mode.endswith("-cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(vocab, seq, dim, heads, layers).to(device)
    params = sum(p.numel() for p in model.parameters())
    if mode.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        run = model
    else:
        run = nn.parallel.DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4,
                            fused=fused or None)
    torch.manual_seed(1)
    tokens = torch.randint(vocab, (batch, seq + 1))
    per = batch // world
    x = tokens[rank * per:(rank + 1) * per, :seq].contiguous().to(device)
    y = tokens[rank * per:(rank + 1) * per, 1:].contiguous().to(device)

    def step():
        opt.zero_grad()
        run(x, y).backward()
        opt.step()

    if cuda:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        profile_step(f"pytorch-{mode}{'-fused' if fused else ''}-gpt" + (f"-rank{rank}" if world > 1 else ""),
                     lambda: (step(), torch.cuda.synchronize()))
        tps = per * seq * steps / seconds
        flops = 6.0 * params + 12.0 * layers * seq * dim
        peak = float(os.environ.get("FSDPX_PEAK_TFLOPS", "989")) * 1e12
        if rank == 0:
            print(f"RESULT contender=pytorch-{mode}{'-fused' if fused else ''} world={world} params={params} "
                  f"batch={batch} seq={seq} step_ms={seconds * 1000 / steps:.1f} tokens_per_s_per_gpu={tps:.0f} "
                  f"peak_gpu_gib={torch.cuda.max_memory_allocated() / 2**30:.2f} mfu={tps * flops / peak:.3f}", flush=True)
        dist.destroy_process_group()
        return

    times = []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        dist.barrier()
        if s >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    stats = torch.tensor([times[len(times) // 2], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"RESULT contender=pytorch-{mode}{'-fused' if fused else ''} world={world} params={params} batch={batch} "
              f"seq={seq} step_ms={stats[0].item():.1f} peak_rss_mib={stats[1].item():.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
