"""A context rank in a process of its own, driven by test_processes.py over stdin/stdout.

Prints one JSON line {"address", "backend", "routing"} once its Sender listens, then answers
one JSON line per command line:
  {"op": "ready", "id", "blocks", "slot", "aux"}  fills the pages with pages.pattern(seed, id,
                                                  rank) and marks them ready -> {"bytes"}
  {"op": "released", "id"}                        waits for on_released(id) -> {"released",
                                                  "holds", "metrics"}
  {"op": "quit"}                                  shuts the Sender down and exits 0
Errors come back as {"error": str}.
"""

import argparse
import json
import sys

import hxfer
from pages import Released, fill, numpy_pools, tiny_layout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="trtllm-v2")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--pools", choices=["numpy", "shared"], default="numpy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    lay = tiny_layout(args.engine, tp=args.tp, tp_rank=args.rank)
    if args.pools == "shared":
        bufs = {p["name"]: hxfer.SharedBuffer(p["bytes"], p["name"]) for p in lay.pools()}
    else:
        bufs = numpy_pools(lay)
    released = Released()
    ucx = {"TLS": "tcp"} if args.backend == "ucx" else None
    tx = hxfer.Sender(lay, hxfer.Memory(lay, bufs), listen="127.0.0.1:0", backend=args.backend,
                      ucx_options=ucx, on_released=released, instance="ctx")

    def say(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    say({"address": tx.address, "backend": tx.backend, "routing": tx.routing})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "ready":
                sent = fill(lay, bufs, cmd["blocks"], cmd["slot"], args.seed, cmd["id"],
                            args.rank)
                tx.mark_ready(cmd["id"], cmd["blocks"], cmd["slot"],
                              aux=cmd.get("aux", "").encode())
                say({"bytes": len(sent)})
            elif cmd["op"] == "released":
                ok = released.wait_for(cmd["id"], timeout=10.0)
                say({"released": ok, "holds": tx.holds(cmd["id"]), "metrics": tx.metrics()})
            elif cmd["op"] == "quit":
                break
        except hxfer.Error as e:
            say({"error": str(e)})
    tx.shutdown()


if __name__ == "__main__":
    main()
