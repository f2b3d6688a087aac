"""PyTorch's side of the decoder benchmark (benchmarks/run_decoder_bench.sh), the model folder both sides
load, and the table.

    python benchmarks/decoder_bench.py make DIR [--shape qwen2-1.5b|tiny] [--device cuda|cpu]
        a random Qwen2-shaped folder, bfloat16 files (save_pretrained). qwen2-1.5b is Qwen2-1.5B's shape
        (hidden 1536, 28 layers, 12 heads over 2 KV heads, intermediate 8960, vocabulary 151936, tied
        head: 1.54B parameters); tiny is a CPU smoke test's.
    torchrun --standalone --nproc-per-node=N benchmarks/decoder_bench.py fsdp2 DIR TOKENS STEPS WARMUP CONFIG...
            [--device cuda|cpu]
        transformers' model from DIR (sdpa attention), each decoder layer and the root fully_shard-ed with
        MixedPrecisionPolicy(bfloat16 parameters, float32 reductions) over float32 weights (fsdpx's
        BF16Mixed), one sample of TOKENS tokens per rank. Each CONFIG in turn on the one loaded model:
        plain or ckpt (gradient_checkpointing_enable), with PyTorch's default AdamW for the device or,
        suffixed -fused, AdamW(fused=True); one RESULT line each, as bench_decoder.
    python benchmarks/decoder_bench.py table DIR LOG
        the markdown table of the RESULT lines in LOG: tokens/s per rank, MFU, peak memory.

MFU counts model FLOPs as torchtitan does: 6 per matmul parameter per token (every parameter but the
input embedding; the head counts once, tied or not) plus attention's 12 x layers x heads x head_dim x
sequence, recomputation not counted; peak FLOP/s from FSDPX_PEAK_TFLOPS (default 989, an H100 SXM's
dense bfloat16).
"""
import argparse
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from cuda_profile import profile_step  # benchmarks/ is on the path: scripts run as benchmarks/NAME.py

SHAPES = {
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),
}


def make(path, shape, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    print(f"wrote {path}: {shape}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, bfloat16")


def flops_per_token(config, seq):
    """Training FLOPs per token, as torchtitan counts them (see the module's docstring)."""
    h, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config["num_key_value_heads"] * head_dim
    attn = h * heads * head_dim + 2 * h * kv + heads * head_dim * h
    mlp = 3 * h * config["intermediate_size"]
    matmul_params = layers * (attn + mlp) + config["vocab_size"] * h
    return 6 * matmul_params + 12 * layers * heads * head_dim * seq


def fsdp2(path, tokens, steps, warmup, configs, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.train()
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    torch.manual_seed(1 + rank)
    ids = torch.randint(model.config.vocab_size, (1, tokens), device=device)
    for config in configs:
        fused = config.endswith("-fused")
        if config.startswith("ckpt"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-5, fused=fused or None)

        def step():
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()

        def timed():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            return dt.item()

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            step()
        seconds = statistics.median(timed() for _ in range(steps))
        profile_step(f"fsdp2-{config}" + (f"-rank{rank}" if world > 1 else ""), step)
        if cuda:
            peak = torch.cuda.max_memory_allocated() / 2**30
        else:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        peak = torch.tensor([peak], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"RESULT contender=fsdp2-{config} device={device.type} world={world} seq={tokens} "
                  f"step_ms={seconds * 1000:.1f} tokens_per_s_per_rank={tokens / seconds:.0f} peak_gib={peak.item():.2f}",
                  flush=True)
        del opt
    dist.destroy_process_group()


def table(path, log):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(log) if line.startswith("RESULT")]
    peak = float(os.environ.get("FSDPX_PEAK_TFLOPS", "989")) * 1e12
    order = [f"{side}-{c}{o}" for o in ("", "-fused") for c in ("plain", "ckpt", "chunked") for side in ("fsdpx", "fsdp2")]
    by = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    fsdp2 = {c: statistics.median(float(r["tokens_per_s_per_rank"]) for r in by[c]) for c in by if c.startswith("fsdp2")}
    print("\n| contender | runs | tokens/s per rank | MFU | peak memory (GiB) | vs FSDP2 + transformers (same checkpointing and AdamW) |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in sorted(by, key=lambda c: order.index(c) if c in order else len(order)):
        tps = [float(r["tokens_per_s_per_rank"]) for r in by[c]]
        mfu = [t * flops_per_token(config, int(r["seq"])) / peak for t, r in zip(tps, by[c])]
        mem = [float(r["peak_gib"]) for r in by[c]]
        span = lambda xs, fmt: fmt.format(min(xs)) if min(xs) == max(xs) else (fmt + "-" + fmt).format(min(xs), max(xs))
        checkpointed = "-ckpt" in c or "-chunked" in c
        base = fsdp2.get(("fsdp2-ckpt" if checkpointed else "fsdp2-plain") + ("-fused" if c.endswith("-fused") else ""))
        vs = span([t / base for t in tps], "{:.2f}x") if base and not c.startswith("fsdp2") else ""
        print(f"| {c} | {len(tps)} | {span(tps, '{:,.0f}')} | {span(mfu, '{:.3f}')} | {span(mem, '{:.2f}')} | {vs} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b")
    m.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    f = sub.add_parser("fsdp2")
    f.add_argument("dir")
    f.add_argument("tokens", type=int)
    f.add_argument("steps", type=int)
    f.add_argument("warmup", type=int)
    f.add_argument("configs", nargs="+", choices=["plain", "ckpt", "plain-fused", "ckpt-fused"])
    f.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    t = sub.add_parser("table")
    t.add_argument("dir")
    t.add_argument("log")
    a = parser.parse_args()
    if a.command == "make":
        make(a.dir, a.shape, a.device)
    elif a.command == "fsdp2":
        fsdp2(a.dir, a.tokens, a.steps, a.warmup, a.configs, a.device)
    else:
        table(a.dir, a.log)


if __name__ == "__main__":
    sys.exit(main())
