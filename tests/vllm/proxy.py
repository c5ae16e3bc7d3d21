#!/usr/bin/env python3
"""The P/D proxy of the served test: drives two running vLLM OpenAI servers, P then D.

  proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --model MODEL_DIR
           --served-model-name NAME --out served.json [--wait 300]

Starts nothing. For each prompt of pd.py (the same token ids as the offline runs) it does what
vLLM's toy P/D proxy does: POST /v1/completions to P with max_tokens=1 and
kv_transfer_params {do_remote_decode: true}, then the same prompt to D with the
kv_transfer_params of P's response, under one X-Request-Id. D's tokens come back as token ids
(`return_token_ids`, vLLM 0.32's completion extension). Writes {"tokens", "kv_transfer_params",
"timings"}. Only the standard library: it runs under any python.
"""
import argparse
import json
import pathlib
import sys
import time
import urllib.error
import urllib.request
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import pd  # noqa: E402  (prompts and settings shared with the offline runs)


def post(url, body, request_id, timeout=300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": request_id})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e


def wait_healthy(base, timeout, alive=lambda: True):
    """Polls GET /health until 200; alive() returning False (its process died) stops early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{base}: server process exited before it was healthy")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{base}: not healthy after {timeout} s")


def run(prefill, decode, model_dir, name, max_tokens=pd.MAX_TOKENS, num_prompts=None):
    prompts = pd.prompt_token_ids(model_dir, num_prompts or len(pd.PROMPT_LENGTHS))
    common = {"model": name, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    tokens, params, timings = [], [], []
    for i, ids in enumerate(prompts):
        rid = f"pd-{i}-{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        p = post(prefill + "/v1/completions", dict(
            common, prompt=ids, max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                "remote_engine_id": None, "remote_block_ids": None,
                                "remote_host": None, "remote_port": None}), rid)
        t1 = time.monotonic()
        kv = p.get("kv_transfer_params")
        if not kv:
            raise RuntimeError(f"prompt {i}: P returned no kv_transfer_params: {p}")
        d = post(decode + "/v1/completions",
                 dict(common, prompt=ids, max_tokens=max_tokens, kv_transfer_params=kv), rid)
        t2 = time.monotonic()
        tokens.append(d["choices"][0]["token_ids"])
        params.append(kv)
        timings.append({"prefill_s": round(t1 - t0, 3), "decode_s": round(t2 - t1, 3)})
    return {"mode": "served", "model": str(model_dir), "tokens": tokens,
            "kv_transfer_params": params, "timings": timings}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--model", required=True, help="the model dir (for the prompts)")
    ap.add_argument("--served-model-name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wait", type=float, default=0, help="first wait this long for /health")
    args = ap.parse_args()
    if args.wait:
        wait_healthy(args.prefill, args.wait)
        wait_healthy(args.decode, args.wait)
    result = run(args.prefill, args.decode, args.model, args.served_model_name)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"proxy.py: {len(result['tokens'])} prompts, wrote {args.out}")


if __name__ == "__main__":
    main()
