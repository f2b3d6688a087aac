"""Opens what examples/merge wrote, as a Python user would (CTest: example_train_gpt_resume_merge).

    check_merged.py <merged dir (GPT-2 names)> <merged dir (--keep-names)> <corpus file>

(a) safetensors.torch.load_file reads model.safetensors; config.json is there and matches the shapes;
(b) the GPT-2-named tensors, run through GPT-2's forward as transformers writes it (Conv1D: x @ W + b,
    c_attn split into q, k, v), give the same logits as the example's own names run through
    examples/common/gpt.hpp's forward (Linear: x @ W.T + b): the renaming and transposes are right;
(c) the trained model predicts the corpus better than chance (loss < ln 256);
(d) when transformers is installed, GPT2LMHeadModel.from_pretrained loads the directory and agrees.
"""
import json
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore")  # torch without numpy warns on import
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import rounding  # noqa: E402

gpt2_dir, plain_dir, corpus = sys.argv[1:4]
hf = load_file(f"{gpt2_dir}/model.safetensors")
plain = load_file(f"{plain_dir}/model.safetensors")
cfg = json.load(open(f"{gpt2_dir}/config.json"))
C, L, H, V, T = cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["vocab_size"], cfg["n_positions"]
assert hf["transformer.wte.weight"].shape == (V, C), hf["transformer.wte.weight"].shape
assert hf["transformer.h.0.attn.c_attn.weight"].shape == (C, 3 * C)
assert plain["h0.qkv.weight"].shape == (3 * C, C) and plain["tok.weight"].shape == (V, C)
assert len(hf) == len(plain), (len(hf), len(plain))
print(f"safetensors: {len(hf)} tensors, wte {tuple(hf['transformer.wte.weight'].shape)}, config {C}d x {L} layers")


def attention(q, k, v):
    B, _, Tn, _ = q.shape
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    att = att.masked_fill(torch.ones(Tn, Tn, dtype=torch.bool).triu(1), float("-inf"))
    return (att.softmax(-1) @ v).transpose(1, 2).reshape(B, Tn, -1)


def gpt2_forward(w, idx):  # transformers' GPT2LMHeadModel, eval mode
    ln = lambda x, p: F.layer_norm(x, (C,), w[p + ".weight"], w[p + ".bias"], cfg["layer_norm_epsilon"])
    conv1d = lambda x, p: x @ w[p + ".weight"] + w[p + ".bias"]
    B, Tn = idx.shape
    x = w["transformer.wte.weight"][idx] + w["transformer.wpe.weight"][torch.arange(Tn)]
    for i in range(L):
        p = f"transformer.h.{i}."
        q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=2)
        heads = lambda t: t.view(B, Tn, H, C // H).transpose(1, 2)
        x = x + conv1d(attention(heads(q), heads(k), heads(v)), p + "attn.c_proj")
        x = x + conv1d(F.gelu(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return ln(x, "transformer.ln_f") @ w["lm_head.weight"].t()


def example_forward(w, idx):  # examples/common/gpt.hpp
    ln = lambda x, p: F.layer_norm(x, (C,), w[p + ".weight"], w[p + ".bias"])
    lin = lambda x, p: F.linear(x, w[p + ".weight"], w.get(p + ".bias"))
    B, Tn = idx.shape
    x = w["tok.weight"][idx] + w["pos.weight"][torch.arange(Tn)]
    for i in range(L):
        p = f"h{i}."
        qkv = lin(ln(x, p + "ln1"), p + "qkv").view(B, Tn, 3, H, C // H).permute(2, 0, 3, 1, 4)
        x = x + lin(attention(qkv[0], qkv[1], qkv[2]), p + "proj")
        x = x + lin(F.gelu(lin(ln(x, p + "ln2"), p + "fc")), p + "fc2")
    return lin(ln(x, "ln_f"), "head")


data = torch.tensor(list(open(corpus, "rb").read()), dtype=torch.long)
torch.manual_seed(0)
starts = torch.randint(0, data.numel() - T - 1, (4,))
batch = torch.stack([data[s:s + T + 1] for s in starts.tolist()])
x, y = batch[:, :-1], batch[:, 1:]
# Two computations of the same float32 math (the GPT's path, tests/support/rounding.py): their logits agree
# within its rounding bound of the logits' scale.
bound = rounding.relative(*rounding.gpt_path(C, L, V, T))
with torch.no_grad():
    a, b = gpt2_forward(hf, x), example_forward(plain, x)
    diff = ((a - b).abs().max() / b.abs().max()).item()
    loss = F.cross_entropy(a.reshape(-1, V), y.reshape(-1)).item()
print(f"GPT-2 forward vs the example's forward: logits differ by {diff:.2e} of their scale (bound {bound:.2e}); "
      f"loss {loss:.4f} (chance {math.log(V):.4f})")
assert diff <= bound, (diff, bound)
assert loss < math.log(V) - 0.5, loss
try:
    from transformers import GPT2LMHeadModel
except ImportError:
    print("transformers is not installed: from_pretrained not tried")
else:
    model = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    with torch.no_grad():
        d = ((model(x).logits - a).abs().max() / a.abs().max()).item()
    print(f"transformers GPT2LMHeadModel.from_pretrained: logits differ by {d:.2e} of their scale (bound {bound:.2e})")
    assert d <= bound, (d, bound)
print("merged checkpoint OK")
