"""Prints what the real-engine runs measured (results.jsonl in the work dir) after the tests."""
import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def first_divergence(a, b):
    return [None if x == y else next(i for i, (u, v) in enumerate(zip(x + [None], y + [None]))
                                     if u != v) for x, y in zip(a, b)]


def pytest_terminal_summary(terminalreporter):
    work = pathlib.Path(os.environ.get("HXFER_VLLM_WORK", ROOT / "build" / "vllm-test"))
    path = work / "results.jsonl"
    if not path.exists():
        return
    tr = terminalreporter
    tr.section("vLLM P/D runs")
    tr.write_line(f"{'model':15s} {'mode':16s} {'connector':9s} {'tokens':14s} "
                  f"{'xfers':>5s} {'avg ms':>7s} {'MB/xfer':>7s} {'time s':>7s}  notes")
    for line in path.read_text().splitlines():
        r = json.loads(line)
        div = r.get("divergence")
        if r["mode"] == "single":
            e = r["single"].get("engine", {})
            groups = ", ".join(f"{g['kind'].replace('Spec', '')}:{g['block_size']}"
                               for g in e.get("groups", []))
            isa = sorted({v["isa"] for v in e.get("views", {}).values() if "isa" in v})
            note = f"blocks {groups}; isa {','.join(isa)}; conv {e.get('conv_state_layout')}"
            t = r["single"]["timings"]
            cut = first_divergence(r["single"]["tokens"], r["single"]["split_tokens"])
            if any(d is not None for d in cut):
                note += f"; cut at N-1 moves plain tokens at {cut}"
            tr.write_line(f"{r['model']:15s} {'single':16s} {'-':9s} {'reference':14s} "
                          f"{'':>5s} {'':>7s} {'':>7s} {t['startup_s'] + t['generate_s']:7.1f}  "
                          f"{note}")
            continue
        if r["mode"] == "prefix caching on D":
            tr.write_line(f"{r['model']:15s} {r['mode']:16s} {r['connector']:9s} refused at "
                          f"startup (exit {r.get('rc')})")
            continue
        same = sum(d is None for d in div or [])
        tokens = f"{same}/{len(div or [])} identical"  # to the split reference
        m = r.get("kv_transfer_metrics") or {}
        t = r.get("pair_s") or r.get("ready_s") or ""
        note = ""
        if r["mode"] == "offline":
            e = r.get("engine") or {}
            note = f"conv {e.get('conv_state_layout')}; P blocks {r.get('remote_block_ids')}"
        elif r["mode"] == "served":
            note = f"ready {r.get('ready_s')} s; per request {r.get('requests')}"
        elif r["mode"] == "P gone":  # compared with the plain tokens: D recomputed all N
            note = (f"{m.get('Num failed transfers')} failed loads, recomputed on D; "
                    f"{r.get('failures', [''])[0][:90]}")
        elif r["mode"].startswith("corrupt"):
            note = f"first differing token per prompt {div}"
        if m.get("Avg connect time (ms)") is not None:  # hxfer: setup apart from the xfers
            note = f"connect {m['Avg connect time (ms)']} ms; " + note
        tr.write_line(f"{r['model']:15s} {r['mode']:16s} {r['connector']:9s} {tokens:14s} "
                      f"{str(m.get('Num successful transfers', '')):>5s} "
                      f"{str(m.get('Avg xfer time (ms)', '')):>7s} "
                      f"{str(m.get('Avg MB per transfer', '')):>7s} {str(t):>7s}  {note}")
