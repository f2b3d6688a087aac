"""How far apart two floating-point computations of the same math may be, for the Python tests: the model
of tests/support/rounding.hpp (its comments have the derivation; docs/numerics.md the measured margins),
and the Hugging Face decoder's path of tests/models/decoder_path.hpp. tests/models/export_test.py checks
that this mirror and the C++ one agree."""
import math

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
CONFIDENCE = 6


def spread(length, depth, storage="float32", averaged=1):
    """The standard deviation of the difference of two computations along a path of `depth` sums of at
    most `length` terms each, relative to the value's scale (rounding.hpp, spread())."""
    ua, us = UNIT_ROUNDOFF["float32"], UNIT_ROUNDOFF[storage]
    coarse = storage not in ("float32", "float64")

    def stage(n):
        return 2 * (ua * ua * n / 3 + (us * us / 3 if coarse else 0.0))

    along = depth * stage(length)
    if averaged <= 1:
        return math.sqrt(along)
    return math.sqrt(along / averaged + stage(averaged))


def relative(length, depth, storage="float32", averaged=1):
    return CONFIDENCE * spread(length, depth, storage, averaged)


def gpt_path(dim, layers, vocab, positions):
    """(length, depth) of the examples' GPT (tests/core/models.hpp, gpt_path())."""
    return max(4 * dim, vocab, positions), 11 * layers + 4


def decoder_path(config, positions):
    """(length, depth) of a Hugging Face decoder's config.json (a dict) over `positions` positions."""
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe")
    experts = config.get("num_experts", 0)
    sparse = [False] * layers
    if experts:
        step = config.get("decoder_sparse_step", 1)
        only = set(config.get("mlp_only_layers", []))
        sparse = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    depth = 3 + sum(7 + (1 if qk_norm else 0) + (6 if s else 2) for s in sparse)
    length = max(config["hidden_size"], config.get("intermediate_size", 0), config.get("moe_intermediate_size", 0),
                 config.get("shared_expert_intermediate_size", 0), experts, heads * head_dim, config["vocab_size"],
                 positions)
    return length, depth


def logits_bound(config, positions, storage="float32"):
    length, depth = decoder_path(config, positions)
    return relative(length, depth, storage)


def loss_bound(config, positions, tokens):
    length, depth = decoder_path(config, positions)
    return relative(length, depth, averaged=tokens)
