"""Benchmarks of rfattn against softmax attention (the main job, ``make demo``).

``python -m bench`` sweeps the sequence length on the best device present and writes one JSON
file; ``python -m plots`` turns that file into PNG figures. Measuring and plotting are separate.
"""
