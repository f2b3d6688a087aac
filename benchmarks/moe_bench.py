"""The model folder of the mixture-of-experts benchmark (benchmarks/run_moe_bench.sh).

    python benchmarks/moe_bench.py make DIR
        a Qwen3-MoE model, random, float32, save_pretrained (the hub's per-expert layout): vocabulary 32000,
        hidden 256, 4 layers, 8 heads over 2 KV heads, 16 experts of intermediate 256, top-4 renormalized,
        every layer sparse, untied head (0.03B parameters, 0.01B of them active per token)
"""
import sys

import torch


def make(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                            max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=1e6)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "make":
        sys.exit("usage: moe_bench.py make DIR")
    make(sys.argv[2])
