"""Model code the learner and generator share: building and loading Qwen2.5-VL, and its packed forward.

Building: presets.py (the model shapes), builder.py, tokenizer.py; loading: loading.py, compat.py;
the training forward: packing.py, mrope.py, forward.py, recompute.py, compile.py; synthetic.py makes
random inputs for benches and tests.
"""
