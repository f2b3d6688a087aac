"""PyTorch's side of the long-sequence benchmark (benchmarks/run_long_seq.sh), and the model folder both
sides load.

    python benchmarks/long_seq.py make DIR
        a Qwen2-shaped model with Qwen2's real vocabulary (152064), random, float32, save_pretrained:
        hidden 512, 4 layers, 8 heads over 2 KV heads, intermediate 1408, untied head (0.17B parameters)
    torchrun --standalone --nproc-per-node=2 benchmarks/long_seq.py fsdp2 DIR SEQ [steps=2 warmup=1 ckpt=1]
        transformers' Qwen2ForCausalLM from DIR, each decoder layer and the root fully_shard-ed (FSDP2,
        gloo, float32), gradient_checkpointing_enable() when ckpt=1, one sample of SEQ tokens per rank,
        AdamW; prints one RESULT line as bench_long_seq does.
"""
import os
import resource
import sys
import time

import torch
import torch.distributed as dist


def make(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=152064, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=False, rope_theta=1e6, use_sliding_window=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in Qwen2ForCausalLM(config).parameters()) / 1e6:.0f}M parameters")


def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def fsdp2(path, seq, steps, warmup, ckpt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-5)
    torch.manual_seed(1 + rank)
    ids = torch.randint(model.config.vocab_size, (1, seq))

    def step():
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    def timed():
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item()

    for _ in range(warmup):
        timed()
    base = rss_mib()
    times = sorted(timed() for _ in range(steps))
    mem = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, base], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    seconds = times[len(times) // 2]
    params = sum(p.numel() for p in model.parameters())  # DTensors: their global sizes
    if rank == 0:
        name = "fsdp2-ckpt" if ckpt else "fsdp2"
        print(f"RESULT contender=pytorch-{name} world={world} params={params} seq={seq} step_ms={seconds * 1000:.0f} "
              f"tokens_per_s={seq * world / seconds:.0f} peak_rss_mib={mem[0].item():.0f} base_rss_mib={mem[1].item():.0f}",
              flush=True)
    dist.destroy_process_group()


def main():
    if sys.argv[1] == "make":
        make(sys.argv[2])
        return
    args = [int(a) for a in sys.argv[4:]]
    steps, warmup, ckpt = args + [2, 1, 1][len(args):]
    fsdp2(sys.argv[2], int(sys.argv[3]), steps, warmup, ckpt)


if __name__ == "__main__":
    main()
