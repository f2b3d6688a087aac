"""Tiny random Hugging Face models for the `hf` tests, made locally with transformers (no download),
and transformers' own outputs on them, which the C++ tests compare against.

    python make_hf_models.py OUT_DIR [--big]

OUT_DIR/<name>/              a model folder as save_pretrained writes it (config.json, safetensors)
OUT_DIR/<name>.ref.safetensors
    (qwen3_moe, qwen2_moe: mixtures of experts; qwen3_moe_stacked: qwen3_moe's weights with the experts
    stacked, as save_pretrained(save_original_format=False) writes them)
    input_ids [2, 12], attention_mask [2, 12] (row 1 right-padded), attention_mask_left (row 0
    left-padded), and transformers' logits: logits (float32 compute), logits_masked and logits_left
    (with those masks), logits_bf16 (bfloat16 compute, for bfloat16 files), inv_freq (the rotary
    inverse frequencies); its causal-LM loss: loss (labels = input_ids), loss_masked (padding labelled
    -100); and RL's per-token values of the next tokens: log_probs and entropy [2, 11] (float32);
    packed samples: packed_ids and packed_position_ids [2, 12] (samples of 5, 3, 4 and 7, 5 tokens,
    positions restarting at 0) and packed_logits, each sample's logits run alone;
    generation: gen_prompt [2, 9] with gen_prompt_mask (row 0 left-padded to 5 tokens), gen_greedy
    (generate, do_sample=False, 8 new tokens, no EOS) and gen_logits [2, 8, vocab] (each step's raw logits), gen_eos (a token row 0 generates third) and
    gen_greedy_eos (the same with that EOS, pad 0); mixtures of experts: aux_loss (the load-balancing loss,
    output_router_logits=True), aux_loss_masked (with attention_mask), loss_aux (loss with labels = input_ids
    and the aux loss added, router_aux_loss_coef x aux_loss)
--big: also OUT_DIR/llama_big, ~97M parameters in bfloat16 (the loading-memory test).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=112, max_position_embeddings=128)

MODELS = {
    # GQA (8 heads over 2), Llama 3.1's RoPE scaling, MLP biases, an untied head; 3+ files with an index.
    "llama_gqa": (LlamaForCausalLM, LlamaConfig(
        **{**SMALL, "max_position_embeddings": 256}, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, mlp_bias=True, pad_token_id=0,
        # head_dim 8: wavelengths 6.3, 63, 628, 6283 against 128/4 and 128/1: one frequency in each of
        # llama3's three bands (kept, smoothed, divided)
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128}, tie_word_embeddings=False), torch.float32, "40KB"),
    # q/k/v biases, a tied head, rope_theta 1e6, a sliding-window layer (window 4).
    "qwen2_tied": (Qwen2ForCausalLM, Qwen2Config(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=1e6, use_sliding_window=True, sliding_window=4, max_window_layers=1), torch.float32, None),
    # per-head q/k RMSNorm, head_dim 24 (not hidden/heads = 16), attention biases on q/k/v/o, linear RoPE scaling.
    "qwen3_qknorm": (Qwen3ForCausalLM, Qwen3Config(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, tie_word_embeddings=False),
        torch.float32, None),
    # mixtures of experts: 4 experts, top-2 renormalized, layer 1 dense (mlp_only_layers); written with the
    # hub's per-expert names (save_pretrained's default)
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **SMALL, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False), torch.float32, None),
    # a shared expert with its sigmoid gate, top-2 not renormalized, layer 0 dense, a tied head, q/k/v biases
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **SMALL, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[0],
        tie_word_embeddings=True), torch.float32, None),
    # bfloat16 files
    "llama_gqa_bf16": (LlamaForCausalLM, None, torch.bfloat16, "40KB"),
    "qwen3_qknorm_bf16": (Qwen3ForCausalLM, None, torch.bfloat16, None),
}
BIG = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)


MOE = ("qwen3_moe", "qwen2_moe")


def make(out, name, cls, config, dtype, shard_size):
    torch.manual_seed(sum(map(ord, name)))
    model = cls(config)
    with torch.no_grad():  # norms and biases away from their 1 / 0 initial values, so a swap would show
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            # Routers far from uniform (transformers initializes them near it): a near tie between two
            # experts would flip on float32 rounding, and a test comparing two ways of computing the same
            # steps would see a different expert, not a different rounding.
            if pname.endswith("mlp.gate.weight"):
                p.mul_(50)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(os.path.join(out, name), **kwargs)
    if name == "qwen3_moe":  # the same weights in transformers' in-memory layout: experts stacked
        model.save_pretrained(os.path.join(out, name + "_stacked"), save_original_format=False)
    return model


def add_tokenizer(path, vocab_size):
    """A real (tiny) tokenizer, so an export's copy of it can be loaded with AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>").save_pretrained(path)


def reference(out, name, bf16):
    path = os.path.join(out, name)
    torch.manual_seed(7)
    input_ids = torch.randint(1, 96, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    left = torch.ones(2, 12, dtype=torch.long)
    left[0, :4] = 0  # left padding: the first queries see no token at all
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = {"input_ids": input_ids, "attention_mask": mask, "attention_mask_left": left}
    with torch.no_grad():
        ref["logits"] = model(input_ids).logits.contiguous()
        ref["logits_masked"] = model(input_ids, attention_mask=mask).logits.contiguous()
        ref["logits_left"] = model(input_ids, attention_mask=left).logits.contiguous()
        ref["inv_freq"] = model.model.rotary_emb.inv_freq.float().contiguous()
        ref["loss"] = model(input_ids, labels=input_ids).loss.reshape(1)
        ref["loss_masked"] = model(input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100)).loss.reshape(1)
        logp = torch.log_softmax(ref["logits"][:, :-1].float(), dim=-1)
        ref["log_probs"] = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1).contiguous()
        ref["entropy"] = -(logp.exp() * logp).sum(-1).contiguous()
        packed(model, ref)
        generation(model, ref)
        if name in MOE:  # the load-balancing loss, as transformers adds it with output_router_logits
            moe = model(input_ids, labels=input_ids, output_router_logits=True)
            ref["aux_loss"] = moe.aux_loss.reshape(1)
            ref["loss_aux"] = moe.loss.reshape(1)
            ref["aux_loss_masked"] = model(input_ids, attention_mask=mask, output_router_logits=True).aux_loss.reshape(1)
        if bf16:
            m16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
            ref["logits_bf16"] = m16(input_ids).logits.float().contiguous()
    save_file(ref, os.path.join(out, name + ".ref.safetensors"))


PACKED_ROWS = [[5, 3, 4], [7, 5]]


def packed(model, ref):
    """Samples packed into rows, and each sample's logits run alone: what a packed forward must equal."""
    g = torch.Generator().manual_seed(11)
    ids, positions, logits = [], [], []
    for lengths in PACKED_ROWS:
        samples = [torch.randint(1, 96, (n,), generator=g) for n in lengths]
        ids.append(torch.cat(samples))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        logits.append(torch.cat([model(s.unsqueeze(0)).logits[0] for s in samples]))
    ref["packed_ids"] = torch.stack(ids).contiguous()
    ref["packed_position_ids"] = torch.stack(positions).contiguous()
    ref["packed_logits"] = torch.stack(logits).contiguous()


def generation(model, ref):
    """transformers' greedy generate on left-padded prompts of 5 and 9 tokens, without and with an EOS."""
    from transformers import GenerationConfig
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(1, 96, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    prompt[0, :4] = 0
    config = dict(do_sample=False, max_new_tokens=8, pad_token_id=0, bos_token_id=None)
    out = model.generate(prompt, attention_mask=mask, generation_config=GenerationConfig(
        **config, eos_token_id=None, return_dict_in_generate=True, output_logits=True))
    greedy = out.sequences
    ref["gen_logits"] = torch.stack(out.logits, 1).float().contiguous()
    eos = int(greedy[0, 9 + 2])
    with_eos = model.generate(prompt, attention_mask=mask, generation_config=GenerationConfig(**config, eos_token_id=eos))
    ref.update(gen_prompt=prompt, gen_prompt_mask=mask, gen_greedy=greedy.contiguous(), gen_eos=torch.tensor([eos]),
               gen_greedy_eos=with_eos.contiguous())


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    configs = {}
    for name, (cls, config, dtype, shard_size) in MODELS.items():
        config = config or configs[name.replace("_bf16", "")]
        configs[name] = config
        make(out, name, cls, config, dtype, shard_size)
        if name == "llama_gqa":
            add_tokenizer(os.path.join(out, name), config.vocab_size)
        reference(out, name, dtype == torch.bfloat16)
    files = [f for f in os.listdir(os.path.join(out, "llama_gqa")) if f.endswith(".safetensors")]
    assert len(files) >= 3, f"llama_gqa should be sharded into 3+ files, has {files}"
    if "--big" in sys.argv:
        make(out, "llama_big", LlamaForCausalLM, BIG, torch.bfloat16, "60MB")
    with open(os.path.join(out, "READY"), "w") as f:
        json.dump({"models": sorted(configs)}, f)


if __name__ == "__main__":
    main()
