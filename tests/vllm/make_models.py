#!/usr/bin/env python3
"""Builds the tiny random-weight models the real-engine test runs vLLM on.

usage: make_models.py OUT_DIR [--only NAME ...]

Everything is made here, no model hub: a transformers config, random weights, save_pretrained,
and a byte-level BPE tokenizer trained with `tokenizers` on the source text of the installed
(pinned) transformers package, saved beside each model. Seeded, so the same pins give the
same bytes; each model's files are hashed into OUT_DIR/models.json.

Each model dir also gets fixture.json: the dtype vLLM must be told (its "auto" would run an
fp32 checkpoint in 16 bits) and whether the model carries Mamba/GDN state.

Shapes are those of the feasibility study (shared/notes/vllm-cpu.md), which vLLM CPU 0.32
runs. Qwen3-Next is bf16 with linear head dim 128: CPU GDN asserts bf16 and its kernel takes
head dim 128 only. Jamba (Mamba1) is built so the test can show it still fails on CPU.
"""
import argparse
import hashlib
import json
import os
import pathlib
import sys
import time

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 512
SEED = 0
# Larger than transformers' 0.02 so the greedy logits are further apart: a P/D transfer that
# is a little off must not be hidden by near-ties, and an exact one must not flip on noise.
INIT_STD = 0.15
# The depthwise conv of Mamba/GDN mixes 4 taps; transformers draws it at 0.02, which leaves the
# conv state nearly irrelevant to the next tokens. 0.3 is about PyTorch's own default for a
# 4-tap conv, so a conv state moved wrongly shows in the tokens (the conv negative control).
CONV_STD = 0.3
SPECIALS = ["<|endoftext|>", "<|pad|>"]  # ids 0 and 1


def train_tokenizer(out: pathlib.Path) -> transformers.PreTrainedTokenizerFast:
    # A fixed, sorted slice of the pinned transformers package's own source.
    root = pathlib.Path(transformers.__file__).parent
    files = sorted((root / "models" / "llama").glob("*.py")) + sorted(
        (root / "generation").glob("*.py"))
    text = [f.read_text(encoding="utf-8") for f in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0],
                                                bos_token=SPECIALS[0], pad_token=SPECIALS[1])
    fast.save_pretrained(out)
    return fast


def common(tok):
    return dict(vocab_size=VOCAB, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                max_position_embeddings=2048)


def configs(tok):
    c = common(tok)
    return {
        # Attention only: the control.
        "llama": ("float32", False, transformers.LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, **c)),
        # Mamba2 + attention + MLP, pattern M - * -: one Mamba and one attention layer.
        "nemotron_h": ("float32", True, transformers.NemotronHConfig(
            hidden_size=128, layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
            mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=1, conv_kernel=4,
            expand=2, chunk_size=64, **c)),
        # Mamba2 + attention, dense (shared MLP, no experts): M A M A.
        "granite_hybrid": ("float32", True, transformers.GraniteMoeHybridConfig(
            hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
            num_local_experts=0, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["linear_attention", "full_attention"] * 2, position_embedding_type="rope",
            mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=64, **c)),
        # Gated delta net + attention + MoE: G A G A, 4 experts.
        "qwen3_next": ("bfloat16", True, transformers.Qwen3NextConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            decoder_sparse_step=1, **c)),
        # Mamba1 + attention: vLLM has no CPU kernel for it (selective_scan_fwd).
        "jamba": ("float32", True, transformers.JambaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, **c)),
    }


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Linear, Embedding and expert weights ~ N(0, INIT_STD), conv weights ~ N(0, CONV_STD);
    biases, norms and the A/D/dt parameters are left as transformers built them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, mod in sorted(model.named_modules()):
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                w = torch.empty(mod.weight.shape, dtype=torch.float32)
                w.normal_(0.0, INIT_STD, generator=gen)
                mod.weight.copy_(w)
            elif isinstance(mod, torch.nn.Conv1d):
                w = torch.empty(mod.weight.shape, dtype=torch.float32)
                w.normal_(0.0, CONV_STD, generator=gen)
                mod.weight.copy_(w)
            elif type(mod).__name__.endswith("Experts"):  # fused expert tensors (transformers 5)
                for pname, p in sorted(mod.named_parameters(recurse=False)):
                    if p.dim() >= 2:
                        w = torch.empty(p.shape, dtype=torch.float32)
                        w.normal_(0.0, INIT_STD, generator=gen)
                        p.copy_(w)


def digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--only", nargs="*", help="model names (default: all)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    transformers.utils.logging.disable_progress_bar()

    t0 = time.monotonic()
    tok_dir = out / "_tokenizer"
    tok = train_tokenizer(tok_dir)
    print(f"make_models: tokenizer ({VOCAB} tokens) {time.monotonic() - t0:.1f} s")

    manifest = {"transformers": transformers.__version__, "torch": torch.__version__,
                "init_std": INIT_STD, "conv_std": CONV_STD, "seed": SEED, "models": {}}
    for name, (dtype, stateful, cfg) in configs(tok).items():
        if args.only and name not in args.only:
            continue
        t = time.monotonic()
        torch.manual_seed(SEED)
        cfg.dtype = dtype
        cfg.initializer_range = INIT_STD
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        redraw(model, SEED)
        model = model.to(getattr(torch, dtype)).eval()
        d = out / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        fixture = {"name": name, "dtype": dtype, "stateful": stateful,
                   "architecture": model.config.architectures[0],
                   "params": sum(p.numel() for p in model.parameters())}
        (d / "fixture.json").write_text(json.dumps(fixture, indent=1) + "\n")
        manifest["models"][name] = dict(fixture, sha256=digest(d))
        print(f"make_models: {name:15s} {fixture['architecture']:30s} {dtype:9s} "
              f"{fixture['params']:8d} params {time.monotonic() - t:5.1f} s")
    (out / "models.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"make_models: {len(manifest['models'])} models in {out} {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
