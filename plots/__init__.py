"""Figures from benchmark JSON (``python -m plots bench.json --out DIR``); reads JSON only."""
