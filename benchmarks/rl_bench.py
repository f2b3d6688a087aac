"""transformers' side of the RL benchmarks (benchmarks/run_rl_bench.sh), and the model folder both sides load.

    python benchmarks/rl_bench.py make DIR
        a Qwen2-shaped model, random, float32, save_pretrained: vocabulary 32000, hidden 256, 4 layers,
        8 heads over 2 KV heads, intermediate 704, untied head (0.02B parameters)
    python benchmarks/rl_bench.py generate DIR [batch=4 prompt=64 new=64 repeats=3]
        transformers' generate (greedy, KV cache, sdpa, float32) on the prompts bench_rl makes (the same
        seed and lengths, left-padded); prints one RESULT line as bench_rl does, with the same checksum
        of the output tokens when both generate the same.
"""
import statistics
import sys
import time

import torch


def make(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, rope_theta=1e6, use_sliding_window=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


def prompts(batch, length, vocab):
    """As bench_rl's prompts(): the same draws, rows left-padded to lengths 16..length."""
    torch.manual_seed(5)
    ids = torch.randint(1, vocab, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    for r in range(batch):
        pad = (length - 16) * (batch - 1 - r) // (batch - 1) if batch > 1 else 0
        mask[r, :pad] = 0
        ids[r, :pad] = 0
    return ids, mask


def generate(path, batch, length, new, repeats):
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids, mask = prompts(batch, length, model.config.vocab_size)
    config = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                              eos_token_id=None, bos_token_id=None)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, generation_config=config)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, generation_config=config)
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    print(f"RESULT mode=generate contender=transformers world=1 batch={batch} prompt={length} new={new} seconds={s:.3f} "
          f"tokens_per_s={batch * new / s:.1f} checksum={int(out.sum())}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "generate":
        args = [int(a) for a in sys.argv[3:]] + [4, 64, 64, 3][len(sys.argv[3:]):]
        generate(sys.argv[2], *args[:4])
    else:
        sys.exit(f"rl_bench.py: make or generate, not {sys.argv[1]}")
