"""Proof on a real computation. A tiny hybrid LM (Mamba2 + attention from a NemotronH
config.json, gated delta net + attention from a Qwen3-Next one) is prefilled at one TP/PP and
engine layout, its cache moved by hxfer into another instance's pools at another TP/PP and
layout, and decoded there: the tokens must be those of one unsharded run.

The byte oracle of the other suites proves hxfer moved what its layout says each rank holds;
this proves that is what a rank of a real model holds. The model and the glue are in model/
(hybrid.py, records.py, proof.py).

Run: PYTHONPATH=build/python /usr/bin/python3 -m pytest -q python/tests/test_model_proof.py
"""

import numpy as np
import pytest

from model.hybrid import (Model, TensorParallel, forward_sequence, nemotron_h_config,
                          qwen3_next_config, write_config)
from model.proof import Case, Instance, Side, flat_conv, make_layout, swap_b_and_c
from model.records import RankPages

hxfer = pytest.importorskip("hxfer")

MODELS = {"nemotron-h": nemotron_h_config, "qwen3-next": qwen3_next_config}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """name -> (config dict, path of its config.json) for hxfer's model=."""
    d = tmp_path_factory.mktemp("models")
    return {name: (make(), write_config(make(), d, name)) for name, make in MODELS.items()}


def report(capsys, line):
    with capsys.disabled():
        print("\n  " + line, end="")


# ---- The model is right --------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_tp_sharded_forward_gives_the_logits_of_tp1(name, capsys):
    model = Model(MODELS[name](), seed=1)
    prompt = model.prompt(24, 5)
    runs = {}
    for tp in (1, 2, 4):
        run = TensorParallel(model, tp)
        cache = run.new_cache(len(prompt) + 8)
        prefill = np.array(run.prefill(cache, prompt))
        tokens, logits = run.decode(cache, int(np.argmax(prefill[-1])), len(prompt), 8)
        runs[tp] = (np.concatenate([prefill, logits]), tokens)
    for tp in (2, 4):
        diff = float(np.abs(runs[tp][0].astype(np.float64) - runs[1][0]).max())
        report(capsys, f"{name} tp{tp} vs tp1: tokens {runs[tp][1] == runs[1][1]}, max logit "
                       f"diff {diff:.3g} over {runs[1][0].shape[0]} positions")
        assert runs[tp][1] == runs[1][1]
        np.testing.assert_allclose(runs[tp][0], runs[1][0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_prefill_then_decode_matches_recomputing_the_whole_sequence(name, capsys):
    """The cache-carrying step (prefill, then decode from the cache) against the whole
    sequence at once: masked attention, full causal conv, Mamba2 in its quadratic form."""
    model = Model(MODELS[name](), seed=2)
    prompt = model.prompt(30, 6)
    run = TensorParallel(model, 2)
    cache = run.new_cache(len(prompt) + 10)
    prefill = np.array(run.prefill(cache, prompt))
    tokens, logits = run.decode(cache, int(np.argmax(prefill[-1])), len(prompt), 10)
    full = forward_sequence(model, prompt + tokens[:-1])
    step = np.concatenate([prefill, logits])
    diff = float(np.abs(full - step).max())
    report(capsys, f"{name}: prefill+decode vs whole sequence, max logit diff {diff:.3g} "
                   f"(logits up to {np.abs(full).max():.3g})")
    np.testing.assert_allclose(step, full, rtol=0, atol=1e-4)
    assert [int(t) for t in np.argmax(full[len(prompt) - 1:], axis=1)] == tokens


ENGINES = [Side("hxfer"), Side("hxfer", options={"state_layout": "layer-major"}),
           Side("trtllm-v1"), Side("trtllm-v2"), Side("trtllm-v2", options={"kv_layout": "nhd"}),
           Side("vllm", tokens_per_block=32),
           Side("vllm", tokens_per_block=32, options={"kv_layout": "hnd", "conv_layout": "ds"}),
           Side("sglang")]


@pytest.mark.parametrize("name", MODELS)
def test_hxfer_records_hold_what_the_engines_tp_rank_holds(name, configs):
    """For every engine layout, tp 1, 2, 4 and pp 1, 2, each rank's records name exactly the
    units (kv heads, x heads, B/C groups replicated at tp 4, Q/K key heads, V value heads,
    ssm heads) that the model's TP rank computes, and writing a rank's cache touches no byte
    twice. RankPages raises LayoutMismatch naming layout, layer, role and section otherwise."""
    hf, path = configs[name]
    model = Model(hf, seed=0)
    checked = 0
    for engine in ENGINES:
        for tp in (1, 2, 4):
            for pp in (1, 2):
                side = Side(engine.engine, tp, pp, engine.tokens_per_block, engine.options)
                run = TensorParallel(model, tp)
                caches = run.new_cache(40)
                for c in caches:
                    for a in list(c.kv.values()) + list(c.conv.values()) + list(c.ssm.values()):
                        a[:] = np.random.default_rng(checked).standard_normal(a.shape)
                inst = Instance(model.cfg, path, side, fill=0)
                blocks = list(range(1, 4))
                written = inst.write(caches, blocks, 2, (0, 40))
                back = inst.read(blocks, 2, (0, 40), 40)
                for a, b in zip(caches, back):
                    for i in a.kv:
                        assert np.array_equal(a.kv[i][:, :, :40], b.kv[i][:, :, :40])
                    for i in a.conv:
                        assert np.array_equal(a.conv[i], b.conv[i])
                        assert np.array_equal(a.ssm[i], b.ssm[i])
                assert written > 0
                checked += 1
    assert checked == len(ENGINES) * 6


# ---- The proof -------------------------------------------------------------------------------

NH, QN = "nemotron-h", "qwen3-next"
CASES = [
    # name, model, context, generation, options
    ("nemotron-h tp2->tp1 hxfer->hxfer", NH, Side("hxfer", 2), Side("hxfer", 1), {}),
    ("nemotron-h tp1->tp2 trtllm-v1->trtllm-v2(nhd)", NH, Side("trtllm-v1", 1),
     Side("trtllm-v2", 2, options={"kv_layout": "nhd"}), {}),
    ("nemotron-h tp4->tp2 vllm T32->trtllm-v2 T16", NH, Side("vllm", 4, tokens_per_block=32),
     Side("trtllm-v2", 2), {}),
    ("nemotron-h tp2 pp2->tp1 pp1 sglang->hxfer", NH, Side("sglang", 2, 2), Side("hxfer", 1), {}),
    ("nemotron-h tp1->tp4 pp2 hxfer(layer-major)->vllm(hnd,ds)", NH,
     Side("hxfer", 1, options={"state_layout": "layer-major"}),
     Side("vllm", 4, 2, 32, {"kv_layout": "hnd", "conv_layout": "ds"}), {}),
    ("nemotron-h tp2->tp4 trtllm-v2->vllm, 1 prefix block held by generation", NH,
     Side("trtllm-v2", 2, tokens_per_block=32), Side("vllm", 4, tokens_per_block=32),
     {"prefix_blocks": 1}),
    ("qwen3-next tp2->tp1 vllm(hnd,ds)->trtllm-v2", QN,
     Side("vllm", 2, options={"kv_layout": "hnd", "conv_layout": "ds"}), Side("trtllm-v2", 1),
     {}),
    ("qwen3-next tp1->tp4 sglang->hxfer", QN, Side("sglang", 1), Side("hxfer", 4), {}),
    ("qwen3-next tp4 pp2->tp2 trtllm-v2->vllm(sd)", QN, Side("trtllm-v2", 4, 2),
     Side("vllm", 2, tokens_per_block=16), {}),
    ("qwen3-next tp2->tp2 sglang T8->vllm T16, 2 prefix blocks held by generation", QN,
     Side("sglang", 2, tokens_per_block=8), Side("vllm", 2, tokens_per_block=16),
     {"prefix_blocks": 2}),
]


def check(out):
    assert not out.cache_diffs, (f"{len(out.cache_diffs)} cache units differ from the model's "
                                 f"re-cut: {out.cache_diffs[:6]}")
    assert out.bit_identical_same_arith, "same caches, different logits"
    assert out.tokens == out.ref_tokens, (out.tokens, out.ref_tokens)
    np.testing.assert_allclose(out.logits, out.ref_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name,model,ctx,gen,opts", CASES, ids=[c[0] for c in CASES])
def test_decode_after_hxfer_moved_the_cache_gives_the_unsharded_tokens(name, model, ctx, gen,
                                                                      opts, configs, capsys):
    hf, path = configs[model]
    out = Case(name, hf, path, ctx, gen, **opts).run()
    report(capsys, out.line())
    check(out)


def test_context_ranks_in_spawned_processes_over_ucx(configs, capsys):
    """The context ranks are processes of their own (multiprocessing spawn): each computes the
    instance's prefill, writes its rank's cache into vLLM pools and serves it over UCX (tcp);
    the generation instance (SGLang, tp 1) reads from both."""
    hf, path = configs[NH]
    out = Case("nemotron-h tp2->tp1 vllm->sglang, context ranks in spawned processes, ucx", hf,
               path, Side("vllm", 2, tokens_per_block=32), Side("sglang", 1, tokens_per_block=32),
               processes=True, backend="ucx").run()
    report(capsys, out.line())
    check(out)


# ---- Negative controls: the comparison catches a wrong mover ---------------------------------

NEGATIVE = [
    ("nemotron-h tp2->tp1 conv moved as one flat range", NH, flat_conv, {"x", "B", "C"}),
    ("nemotron-h tp2->tp1 B and C swapped", NH, swap_b_and_c, {"B", "C"}),
    ("qwen3-next tp2->tp1 conv moved as one flat range", QN, flat_conv, {"Q", "K", "V"}),
]


@pytest.mark.parametrize("name,model,corrupt,sections", NEGATIVE, ids=[n[0] for n in NEGATIVE])
def test_a_mover_with_a_known_bug_fails_the_comparison(name, model, corrupt, sections, configs,
                                                       capsys):
    hf, path = configs[model]
    case = Case(name, hf, path, Side("hxfer", 2), Side("trtllm-v2", 1))
    out = case.run_corrupted(corrupt)
    report(capsys, f"negative control {out.line()}")
    named = {d.split(" section ")[1].split()[0] for d in out.cache_diffs}
    assert out.cache_diffs and all(" conv " in d for d in out.cache_diffs), out.cache_diffs
    assert named == sections, named
    with pytest.raises(AssertionError):
        check(out)
    assert out.max_diff > 1e-2, "the decode did not notice the corrupted conv state"


def test_the_prefix_the_generation_holds_is_poisoned_on_the_context_side(configs, capsys):
    """Control for the prefix cases: the context's copy of the prefix is NaN, so a generation
    rank that asks hxfer for it (prefix_tokens=0) decodes garbage; declaring the prefix, as the
    proof cases do, keeps its own pages and the tokens."""
    hf, path = configs[NH]
    case = Case("nemotron-h tp2->tp4 trtllm-v2->vllm, prefix held but not declared", hf, path,
                Side("trtllm-v2", 2, tokens_per_block=32), Side("vllm", 4, tokens_per_block=32),
                prefix_blocks=1, declare_prefix=False)
    with np.errstate(invalid="ignore"):  # NaN through the model is the point
        out = case.run()
    report(capsys, f"control {out.line()}")
    assert out.cache_diffs and all(" kv " in d for d in out.cache_diffs), out.cache_diffs
    assert np.isnan(out.logits).any()
    with pytest.raises(AssertionError):
        check(out)
