"""A tiny hybrid LM computed for real in numpy, and the glue that puts its cache into an
engine's pools through hxfer.Layout.records(): the proof on a real computation
(test_model_proof.py).

  hybrid.py   the model: config.json in, seeded weights, tensor-parallel forward the way
              serving engines shard it, greedy decoding; a full-sequence reference form.
  records.py  a rank's cache <-> its bytes in an engine layout's pools, element by element.
  proof.py    context and generation instances around real Senders and Receivers.
"""
