"""A Hugging Face model, fine-tuned sharded by fsdpx and exported, loaded back by transformers.

    python export_test.py <fsdpx_hf_train_export> <fixtures dir> <work dir> <mpiexec> [mpiexec flags...]

For each source model: 5 AdamW steps at 2 ranks (the program checks them against an unsharded run),
save_pretrained, then here: transformers' from_pretrained reports no missing, unexpected or mismatched
tensors, its logits equal fsdpx's within the bound the rounding model gives (the program writes it beside
them; tests/support/rounding.py must reproduce it), and the tokenizer and generation files came
along byte for byte. The program also saves the trained weights as PyTorch Distributed Checkpoint
(fsdpx::dcp::save_model with models::dcp_save_options: transformers' in-memory names, a tied head under both
names, a mixture's experts stacked as transformers 5 holds them): torch's dcp.load, with no process group, reads
them strictly into a fresh transformers model of the config, whose logits equal fsdpx's too.
"""
import filecmp
import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import rounding  # noqa: E402


def expert_in_stack(saved, key):
    """An expert's projection (the hub's per-expert name) as a view of transformers 5's stacked tensor of its layer
    in `saved` (models::stacked_expert_place: each expert's gate rows then its up rows, and its down_proj), or
    None for any other name."""
    layer, sep, rest = key.partition(".mlp.experts.")
    expert, _, proj = rest.partition(".")
    if not sep or not expert.isdigit() or proj not in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        return None
    e = int(expert)
    if proj == "down_proj.weight":
        return saved[f"{layer}.mlp.experts.down_proj"][e]
    gate_up = saved[f"{layer}.mlp.experts.gate_up_proj"][e]
    inner = gate_up.shape[0] // 2
    return gate_up[:inner] if proj == "gate_proj.weight" else gate_up[inner:]


def check_dcp_save(name, out, config, files, ref):
    """The DCP save holds fsdpx's float32 masters as transformers names them in memory: the export's tensors,
    unrounded (a mixture's experts stacked per layer, as transformers 5 holds them, where the export has the
    hub's per-expert tensors), and transformers' own whole state dict, which dcp.load fills strictly (its
    logits then equal fsdpx's)."""
    md = FileSystemReader(out + ".dcp").read_metadata()
    saved = {k: torch.empty(list(e.size), dtype=e.properties.dtype) for k, e in md.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_load(saved, checkpoint_id=out + ".dcp", no_dist=True)
    exported = {}
    for f in files:
        exported.update(load_file(os.path.join(out, f)))
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    assert tied <= set(saved), f"{name}: the DCP save lacks the tied head's name"
    for k, t in exported.items():
        got = saved[k] if k in saved else expert_in_stack(saved, k)
        assert got is not None, f"{name}: the DCP save lacks '{k}'"
        assert torch.equal(got.to(t.dtype), t), f"{name}: '{k}' differs between the DCP save and the export"
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    state = fresh.state_dict()
    assert set(state) <= set(saved), f"{name}: the DCP save lacks {sorted(set(state) - set(saved))}"
    # the whole state dict, strictly (a tied head is saved under both its names, as torch's state dicts hold it)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_load(state, checkpoint_id=out + ".dcp", no_dist=True)
    with torch.no_grad():
        dcp_logits = fresh.eval()(ref["input_ids"]).logits
    dcp_err = ((dcp_logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    dcp_bound = rounding.logits_bound(config, ref["input_ids"].shape[1], "float32")
    print(f"{name}: transformers after dcp.load of fsdpx's DCP save vs fsdpx: relative error {dcp_err:.2e} "
          f"(bound {dcp_bound:.2e})")
    assert dcp_err <= dcp_bound, f"{name}: logits from the DCP save differ by {dcp_err:.2e} (bound {dcp_bound:.2e})"


def check(program, fixtures, work, mpiexec, name, max_shard_bytes):
    source = os.path.join(fixtures, name)
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".dcp", ignore_errors=True)
    cmd = [mpiexec[0], "-n", "2", *mpiexec[1:], program, source, out, str(max_shard_bytes)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"{name}: transformers reports {key}: {info[key]}"
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    print(f"{name}: {files} loaded with no missing, unexpected or mismatched tensors")
    if max_shard_bytes < 100_000:
        assert len(files) > 1 and os.path.exists(os.path.join(out, "model.safetensors.index.json")), files
    ref = load_file(out + ".logits.safetensors")
    with torch.no_grad():
        logits = model.eval()(ref["input_ids"]).logits
    err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    # The bound the C++ program derived (tests/models/decoder_path.hpp), which this side's mirror of the
    # rounding model must reproduce: the export's weights as they are (float32), or rounded to bfloat16
    # where transformers computes with them and fsdpx with its float32 masters.
    bound = ref["logits_bound"].item()
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    mirrored = rounding.logits_bound(config, ref["input_ids"].shape[1], config["dtype"])
    assert math.isclose(bound, mirrored, rel_tol=1e-12), f"{name}: rounding.py gives {mirrored}, decoder_path.hpp {bound}"
    print(f"{name}: transformers on the export vs fsdpx: relative error {err:.2e} (bound {bound:.2e})")
    assert err <= bound, f"{name}: logits differ by {err:.2e} of their scale (bound {bound:.2e})"
    check_dcp_save(name, out, config, files, ref)
    with open(os.path.join(source, "config.json")) as f:
        source_config = json.load(f)
    assert config["dtype"] == source_config["dtype"], (config["dtype"], source_config["dtype"])
    for k in ("model_type", "architectures", "num_hidden_layers", "tie_word_embeddings"):
        assert config[k] == source_config[k], k
    for f in os.listdir(source):
        if f.endswith(".json") and f not in ("config.json", "model.safetensors.index.json"):
            assert filecmp.cmp(os.path.join(source, f), os.path.join(out, f), shallow=False), f"{f} was not copied as it is"
    if os.path.exists(os.path.join(source, "tokenizer.json")):
        tok = AutoTokenizer.from_pretrained(out)
        assert tok("w5 w7")["input_ids"] == [5, 7], tok("w5 w7")


def main():
    program, fixtures, work, *mpiexec = sys.argv[1:]
    os.makedirs(work, exist_ok=True)
    check(program, fixtures, work, mpiexec, "llama_gqa", 20_000)          # untied, an index and several files
    check(program, fixtures, work, mpiexec, "qwen2_tied", 5_000_000_000)  # tied head, biases, a sliding layer
    # Mixtures of experts: the experts written with the hub's per-expert names, which transformers 5 stacks as
    # it loads; from the hub's layout and from transformers' own stacked layout
    check(program, fixtures, work, mpiexec, "qwen3_moe", 5_000_000_000)
    check(program, fixtures, work, mpiexec, "qwen3_moe_stacked", 5_000_000_000)
    check(program, fixtures, work, mpiexec, "qwen2_moe", 5_000_000_000)  # a shared expert, a tied head
    # Written back in bfloat16, as it came: transformers computes with the weights rounded to bfloat16 and
    # fsdpx with its float32 masters, so they agree to the rounding of the weights (2^-8 per product).
    check(program, fixtures, work, mpiexec, "qwen3_qknorm_bf16", 5_000_000_000)
    dtypes = {t.dtype for t in load_file(os.path.join(work, "qwen3_qknorm_bf16", "model.safetensors")).values()}
    assert dtypes == {torch.bfloat16}, dtypes
    print("PASSED")


if __name__ == "__main__":
    main()
