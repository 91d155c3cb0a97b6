"""Attention transfer: :func:`calibrate` a model's random features to its softmax attention.

A pretrained softmax model converted to random features keeps the estimator's variance: with
sharp attention (large query and key norms) the output error of M = 256 features is large,
unbiased or not. :func:`calibrate` trains a few feature-side parameters per layer, the model's own
weights frozen, so that each layer's random-feature output matches its softmax output on the
user's data (attention transfer, as Hedgehog and LoLCATs do for learned feature maps):

* ``"map"``: a learnable per-head linear map of q and of k before the features
  (:meth:`rfattn.RandomFeatures.add_head_maps`), initialised at the identity, so calibration
  starts from the plain estimator;
* ``"stats"``: the data statistics of oprf/saderf/poisrf/geomrf fixed from the calibration data
  (``stats="running"``, the running moments set to their exact average over the batches);
* ``"weights"``: the learnable weight matrices (``weights="fastfoodl"``);
* ``"projection"``: W itself as a parameter (:meth:`rfattn.RandomFeatures.learn_weight`);
* ``"A"``: GERF's A, one per key/value head (:meth:`rfattn.RandomFeatures.learn_gerf_A`;
  ``feature="gerf"`` with a real A), starting from the feature's option.

How a layer is trained: every :func:`rfattn.rf_attention` call made by the model during a
calibration forward computes the exact softmax attention of the same q, k, v (masks and scale
included) and the random-feature attention; the loss is the sum over layers of the relative
squared error ``sum |o_rf - o_softmax|^2 / sum |o_softmax|^2`` over the valid (non-padded)
query rows; the call returns the softmax output, so every layer sees the inputs the softmax
model gives it (teacher forcing) and no gradient runs through the model.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rfattn.call import intercept_calls

__all__ = ["calibrate", "attention_errors", "CalibrationReport", "CALIBRATION_PARAMS"]

#: what :func:`calibrate` can train or fix
CALIBRATION_PARAMS = ("map", "stats", "weights", "projection", "A")

def softmax_target(q, k, v, causal: bool, key_padding_mask, scale: float) -> torch.Tensor:
    """Exact softmax attention ``[B, H, Tq, E]`` of :func:`rf_attention`'s inputs (grouped
    key/value heads repeated, a query with no valid key 0), in float32 or wider."""
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    live = allowed.any(dim=-1, keepdim=True)
    probs = torch.where(live, torch.softmax(scores.masked_fill(~live, 0.0), dim=-1), 0.0)
    return probs @ v


class _Call(NamedTuple):
    """One recorded ``rf_attention`` call of a layer: its inputs and the softmax output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    key_padding_mask: torch.Tensor | None
    scale: float
    backend: str
    query_padding_mask: torch.Tensor | None
    target: torch.Tensor
    window: int = 0
    sinks: int = 0

    def error_terms(self, rf) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum |o_rf - o|^2, sum |o|^2)`` over the valid query rows, o_rf by ``rf`` now."""
        out = rf_output(self, rf)
        rows = torch.ones(self.q.shape[0], 1, self.q.shape[2], 1, dtype=torch.bool,
                          device=self.q.device)  # fmt: skip
        if self.query_padding_mask is not None:
            rows = ~self.query_padding_mask[:, None, :, None]
        diff = torch.where(rows, (out.to(self.target.dtype) - self.target) ** 2, 0.0).sum()
        return diff, torch.where(rows, self.target**2, 0.0).sum()


def rf_output(call: _Call, rf) -> torch.Tensor:
    """The random-feature output of a recorded call with ``rf`` as it is now (a calibration
    step's forward; tests count the tokens it runs)."""
    from rfattn.attention import rf_attention

    return rf_attention(call.q, call.k, call.v, rf, causal=call.causal,
                        key_padding_mask=call.key_padding_mask, scale=call.scale,
                        backend=call.backend, query_padding_mask=call.query_padding_mask,
                        window=call.window, sinks=call.sinks)  # fmt: skip


class _Recorder:
    """What a forward of the model does in its layers: every ``rf_attention`` call on a layer's
    features (``names``: id of its RandomFeatures -> layer name) is recorded as a :class:`_Call`
    (inputs detached, with the exact softmax output) and returns that softmax output, so each
    layer sees the inputs the softmax model gives it; a packed call (``cu_seqlens``) as one call
    per sequence; calls on other features run as usual."""

    def __init__(self, names: dict):
        self.names = names
        self.calls: dict[str, list[_Call]] = {}

    def __call__(self, call, run):
        """The interception of one ``rf_attention`` call (:func:`rfattn.call.intercept_calls`):
        ``call`` its record, ``run(call)`` what it would return."""
        name = self.names.get(id(call.rf))
        if name is None:  # not a layer of the model being calibrated
            return run(call)
        if call.packed is not None:  # packed sequences: each recorded as the call it runs as
            return torch.cat([self(seq, run) for seq in call.sequences()], dim=2)
        if call.initial_state is not None or call.return_state or call.group is not None:
            raise RuntimeError(
                "rfattn.calibrate runs whole sequences on one process: a calibration forward "
                "may not pass initial_state, return_state or group (use_cache=False for "
                "decoders)"
            )
        q, k, v = call.q.detach(), call.k.detach(), call.v.detach()
        kpm, qpm = call.key_padding_mask, call.query_padding_mask
        target = softmax_target(q, k, v, call.causal, kpm, call.scale)
        self.calls.setdefault(name, []).append(
            _Call(q, k, v, call.causal, kpm, call.scale, call.backend, qpm, target,
                  call.window, call.sinks)  # fmt: skip
        )
        return target.to(q.dtype)


def _errors(layers: dict, captured: dict, batches=None) -> dict[str, torch.Tensor]:
    """Relative squared error per layer (``layers``: name -> RandomFeatures) over its recorded
    calls (``captured``: name -> one list of calls per forward; ``batches``: the forwards to use,
    default all), with the features as they are now."""
    out = {}
    for name, rf in layers.items():
        per = captured.get(name, [])
        calls = [c for i in (range(len(per)) if batches is None else batches) for c in per[i]]
        if not calls:
            continue
        terms = [c.error_terms(rf) for c in calls]
        diff = torch.stack([d for d, _ in terms]).sum()
        ref = torch.stack([r for _, r in terms]).sum()
        out[name] = diff / ref.clamp_min(torch.finfo(ref.dtype).tiny)
    return out


def _valid_runs(mask: torch.Tensor) -> list[tuple[int, int]] | None:
    """``(start, length)`` of each row's valid positions in a padding mask ``[B, T]`` (True =
    padded); None when a row's valid positions are not one run."""
    valid = ~mask
    lengths = valid.sum(-1)
    starts = torch.where(lengths > 0, valid.to(torch.int8).argmax(-1), 0)
    pos = torch.arange(mask.shape[1], device=mask.device)
    if not torch.equal((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None]), valid):
        return None
    return list(zip(starts.tolist(), lengths.tolist(), strict=True))


def _packed(calls: list[_Call], rows: list[tuple[int, int, int, int]]) -> _Call:
    """One call of the valid runs ``rows`` (``(length, batch, row, start)``) of ``calls``,
    right-padded to the longest (with zeros, masked)."""
    longest = max(n for n, *_ in rows)

    def take(name):
        parts = [getattr(calls[i], name)[r, :, s : s + n] for n, i, r, s in rows]
        return torch.stack([torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[1]))
                            for x in parts])  # fmt: skip

    first = calls[0]
    lengths = torch.tensor([n for n, *_ in rows], device=first.q.device)
    mask = torch.arange(longest, device=first.q.device) >= lengths[:, None]
    return first._replace(q=take("q"), k=take("k"), v=take("v"), target=take("target"),
                          key_padding_mask=mask, query_padding_mask=mask)  # fmt: skip


def _regrouped(per: list[list[_Call]], order: list[int]) -> list[list[_Call]] | None:
    """A layer's recordings (one list of calls per batch) without their padding: every batch
    row's valid tokens taken out, the rows sorted by length and packed into as many groups as
    there were batches (as many rows each as can be), each padded to its longest row only, the
    groups in ``order``. Self-attention rows are independent, so the loss over all the groups is
    the loss over all the batches, while a step on a group costs about its valid tokens rather
    than a batch's padded length (half of the calibration time on padded sentences). None (keep
    the batches) unless every batch made one self-attention call (Tq == Tk, the padded queries
    those of the keys, each row's valid tokens one run) with the same settings, and some
    position is padded."""
    if any(len(calls) != 1 for calls in per):
        return None
    calls = [calls[0] for calls in per]

    def settings(c):
        return (c.causal, c.scale, c.backend, c.q.dtype, c.q.shape[1], c.k.shape[1],
                c.q.shape[3], c.v.shape[3], c.window, c.sinks)  # fmt: skip

    rows, padded = [], False
    for i, c in enumerate(calls):
        kpm, qpm = c.key_padding_mask, c.query_padding_mask
        if settings(c) != settings(calls[0]) or c.q.shape[2] != c.k.shape[2] or kpm is None:
            return None
        if (qpm is None and bool(kpm.any())) or (qpm is not None and not torch.equal(qpm, kpm)):
            return None  # padded queries in the loss (or a query mask of their own)
        runs = _valid_runs(kpm)
        if runs is None:
            return None
        padded = padded or bool(kpm.any())
        rows += [(n, i, r, s) for r, (s, n) in enumerate(runs) if n > 0]  # no valid row: no loss
    if not padded or len(rows) < len(calls):
        return None
    rows.sort()
    groups = [[_packed(calls, part)] for part in _parts(rows, len(calls))]
    return [groups[j] for j in order]


def _parts(items: list, n: int) -> list[list]:
    """``items`` cut into ``n`` consecutive parts whose lengths differ by at most one."""
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass
class CalibrationReport:
    """What :func:`calibrate` did: per layer the relative squared error of the attention output
    (``sum |o_rf - o_softmax|^2 / sum |o_softmax|^2`` over the calibration batches' valid
    query rows) before and after, the loss per step and the time taken."""

    before: dict[str, float]
    after: dict[str, float]
    params: tuple[str, ...]
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)

    def improvement(self) -> dict[str, float]:
        """``before / after`` per layer (how many times the error went down)."""
        return {n: self.before[n] / max(self.after[n], 1e-300) for n in self.before}

    def __str__(self) -> str:
        lines = [f"rfattn.calibrate: params={list(self.params)}, {self.steps} steps, "
                 f"{self.seconds:.1f} s"]  # fmt: skip
        width = max(len(n) for n in self.before) if self.before else 5
        lines.append(f"{'layer':<{width}}  {'before':>9}  {'after':>9}  {'x':>6}")
        for n, ratio in self.improvement().items():
            lines.append(f"{n:<{width}}  {self.before[n]:9.4f}  {self.after[n]:9.4f}  {ratio:6.1f}")
        return "\n".join(lines)


def _layers(model: torch.nn.Module) -> dict:
    """name -> RandomFeatures of every feature map in ``model``."""
    from rfattn.modules import RandomFeatures

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, RandomFeatures)}
    if not layers:
        raise ValueError(
            "calibrate: the model has no RandomFeatures; attach them first (for transformers "
            "models rfattn.hf.attach_random_features(model, ...) and "
            "model.set_attn_implementation('rfattn'))"
        )
    return layers


def _batch_list(batches) -> list:
    """The batches of :func:`calibrate` and :func:`attention_errors` as a list, each checked to
    be a batch: a Mapping of keyword arguments (a dict, a tokenizer's ``BatchEncoding``), a tuple
    or list of positional ones, or one input (a tensor)."""
    if isinstance(batches, (torch.Tensor, Mapping, str, bytes)):
        raise ValueError(
            f"batches must be an iterable of batches (e.g. [input_ids] or [dict(input_ids=...)]), "
            f"got one {type(batches).__name__}: wrap a single batch in a list"
        )
    try:
        out = list(batches)
    except TypeError:
        raise TypeError(
            f"batches must be an iterable of batches (a list, a DataLoader, ...), got "
            f"{type(batches).__name__}"
        ) from None
    if not out:
        raise ValueError("batches is empty: calibrate needs at least one batch of model inputs")
    for i, batch in enumerate(out):
        if batch is None or isinstance(batch, (str, bytes)):
            raise TypeError(
                f"batches[{i}] is {type(batch).__name__}, not model inputs: a batch is a Mapping "
                "of keyword arguments (e.g. a tokenizer's output, tok(texts, padding=True, "
                "return_tensors='pt')), a tuple of positional ones or a tensor"
            )
    return out


def _forward(model, batch) -> None:
    if isinstance(batch, Mapping):  # a dict, a tokenizer's BatchEncoding, ...
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def _capture(model, batches: list, layers: dict) -> dict[str, list[list[_Call]]]:
    """One softmax forward per batch, without autograd and without a generation cache (a
    decoder's ``config.use_cache`` off meanwhile: whole sequences, no state), recording every
    layer's calls: name -> one list of :class:`_Call` per batch."""
    names = {id(m): n for n, m in layers.items()}
    captured: dict[str, list[list[_Call]]] = {n: [] for n in layers}
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache is not None:
        config.use_cache = False
    try:
        with torch.no_grad():
            for batch in batches:
                rec = _Recorder(names)
                with intercept_calls(rec):
                    _forward(model, batch)
                for n in layers:
                    captured[n].append(rec.calls.get(n, []))
    finally:
        if use_cache is not None:
            config.use_cache = use_cache
    captured = {n: per for n, per in captured.items() if any(per)}
    if not captured:
        raise RuntimeError(
            "calibrate: the model made no rf_attention call; a transformers model must run "
            "attn_implementation='rfattn' (model.set_attn_implementation('rfattn'))"
        )
    return captured


def _floats(errs: dict) -> dict[str, float]:
    return {n: float(e) for n, e in errs.items()}


def attention_errors(model: torch.nn.Module, batches) -> dict[str, float]:
    """Per layer, the relative squared error of the random-feature attention output to the
    softmax one on ``batches`` (inputs as :func:`calibrate` takes them; each layer on the inputs
    the softmax model gives it), without training anything. The model runs in eval mode."""
    layers = _layers(model)
    batches = _batch_list(batches)
    training = model.training
    model.eval()
    try:
        captured = _capture(model, batches, layers)
        with torch.no_grad():
            return _floats(_errors(layers, captured))
    finally:
        model.train(training)


def _fix_statistics(model, layers: dict, captured: dict) -> None:
    """``stats="running"`` with the running moments averaged exactly over the recorded calls."""
    from rfattn.features.base import StatsFeature

    maps = {n: rf.feature_map for n, rf in layers.items() if n in captured}
    maps = {n: fm for n, fm in maps.items() if isinstance(fm, StatsFeature)}
    for name, fm in maps.items():
        momentum, training = fm.momentum, fm.training
        fm.stats = "running"
        fm.num_batches_tracked.zero_()
        fm.train()
        try:
            with torch.no_grad():
                calls = [c for per in captured[name] for c in per]
                for i, call in enumerate(calls):
                    fm.momentum = 1.0 / (i + 1)  # the running value is the exact mean so far
                    rf_output(call, layers[name])
        finally:
            fm.momentum = momentum
            fm.train(training)
    if maps:
        _note_in_config(model, stats="running")


def _note_in_config(model, **options) -> None:
    """Record rfattn options in a transformers model's ``config.rfattn`` (so that it saves and
    loads calibrated); nothing for other modules."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "rfattn", None), dict):
        config.rfattn = {**config.rfattn, **options}


def _first_call(captured: dict, name: str):
    """The first recorded call of layer ``name`` (its q and k give the layer's head counts)."""
    return next(c for per in captured[name] for c in per)


def _trainable(model, layers: dict, params: tuple, captured: dict) -> list:
    """The parameters to train (head maps made where missing, at the identity)."""
    out = []
    rfs = {n: rf for n, rf in layers.items() if n in captured}
    if "map" in params:
        for name, rf in rfs.items():
            call = _first_call(captured, name)
            rf.add_head_maps(call.q.shape[1], call.k.shape[1])
            out += [rf.query_map.requires_grad_(True), rf.key_map.requires_grad_(True)]
        _note_in_config(model, head_maps=True)
    if "weights" in params:
        learned = [p for rf in rfs.values() if rf.learner is not None
                   for p in rf.learner.parameters()]  # fmt: skip
        if not learned:
            raise ValueError(
                "params='weights' trains learnable weight matrices, and no layer has one "
                "(weights='fastfoodl')"
            )
        out += [p.requires_grad_(True) for p in learned]
    if "projection" in params:
        out += [rf.learn_weight().requires_grad_(True) for rf in rfs.values()]
    if "A" in params:
        for name, rf in rfs.items():
            out.append(rf.learn_gerf_A(_first_call(captured, name).k.shape[1]).requires_grad_(True))
        _note_in_config(model, gerf_A=True)
    return out


def _progress(step: int, steps: int, loss: float, t0: float) -> None:
    done = int(30 * step / steps)
    sys.stderr.write(
        f"\rcalibrate [{'#' * done}{'.' * (30 - done)}] {step}/{steps} "
        f"loss {loss:.4f} {time.perf_counter() - t0:.0f} s"
    )
    if step == steps:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _check_params(params) -> tuple[str, ...]:
    """``params`` of :func:`calibrate` as a tuple (a str for one)."""
    if isinstance(params, str):
        return (params,)
    if not isinstance(params, (tuple, list, set, frozenset)):
        raise TypeError(
            f"params must be a str or a tuple of them from {CALIBRATION_PARAMS}, got "
            f"{type(params).__name__}"
        )
    params = tuple(params)
    if not params or any(p not in CALIBRATION_PARAMS for p in params):
        raise ValueError(f"params must be a non-empty subset of {CALIBRATION_PARAMS}, got {params}")
    return params


def _check_int(name: str, value, low: int, high: int | None = None, bound: str = "") -> int:
    """``value`` as an int in ``[low, high)`` (``bound``: that range in words); bools, floats
    and strings are refused."""
    bound = bound or (f">= {low}" if high is None else f"in [{low}, {high})")
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
            or (high is not None and value >= high)):  # fmt: skip
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return int(value)


def calibrate(
    model: torch.nn.Module,
    batches,
    steps: int = 200,
    lr: float = 0.02,
    params=("map", "projection"),
    seed: int = 0,
    progress: bool = True,
) -> CalibrationReport:
    """Calibrate the random features of ``model`` to its softmax attention (see the module
    docstring); the model's own weights stay frozen and unchanged.

    The model runs once per batch (softmax attention, no autograd) to record each layer's q, k,
    v, masks and softmax output; training then runs only the layers' random-feature attention
    on those, so a step costs a fraction of a model forward. The recordings stay in memory
    (about ``4 (2 D + 2 E)`` bytes per token, head and layer in float32).

    Args:
        model: a transformers model with rfattn attached and running
            (:func:`rfattn.hf.attach_random_features`, ``attn_implementation="rfattn"``), or any
            module whose attention calls :func:`rfattn.rf_attention` with its
            :class:`~rfattn.RandomFeatures` submodules (rfattn's layers).
        batches: an iterable of batches (a list, a ``torch.utils.data.DataLoader``, ...), read
            once; a batch is a Mapping of keyword arguments (a dict or a tokenizer's own
            ``BatchEncoding``: ``input_ids``, ``attention_mask``, ...), a tuple or list of
            positional ones, or one tensor. Padding is respected: padded keys take no part,
            padded queries no part in the loss.
        steps: optimiser steps (Adam), each on one batch's recordings of every layer, cycling
            through the batches (for self-attention, through as many groups of the batches'
            rows, regrouped by length without their padding); 0 (or only ``"stats"``) trains
            nothing.
        lr: Adam's learning rate at the first step; it decays to 0 along a cosine.
        params: what is calibrated, a subset of :data:`CALIBRATION_PARAMS` (a str for one).
            The defaults (head maps and W, 200 steps at lr 0.02) take all-MiniLM-L6-v2 with
            posrf at M = 256 from a mean embedding cosine to softmax of 0.72 to 0.96 on held-out
            text, calibrated on 256 paragraphs in about two minutes on 2 CPU cores (``python -m
            bench.calibrate``; oprf 0.95, saderf just under); the head maps alone reached 0.95,
            150 steps 0.95, 300 steps 0.96-0.97.
        seed: an int, seeds torch's generator for the call (restored afterwards): the same
            model, batches and seed give the same calibrated parameters.
        progress: a progress bar on stderr (a bool).

    Returns:
        A :class:`CalibrationReport` (per-layer error on the batches before and after).

    Raises:
        TypeError, ValueError: an argument of the wrong type or value (naming it), a batch that
            is no model input (a str: tokenize first), a single batch not wrapped in a list.

    The head maps, GERF's A and the fixed statistics become part of each layer's RandomFeatures
    (its ``state_dict``) and, for a transformers model, of ``config.rfattn`` (``head_maps``,
    ``gerf_A``, ``stats``): the model saves and loads (``save_pretrained`` / ``from_pretrained(...,
    attn_implementation="rfattn")``) like any other.
    """
    params = _check_params(params)
    steps = _check_int("steps", steps, 0)
    if not (isinstance(lr, numbers.Real) and not isinstance(lr, bool) and math.isfinite(lr)
            and lr > 0):  # fmt: skip
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    seed = _check_int("seed", seed, -(2**63), 2**64, "in [-2**63, 2**64) (torch.manual_seed's)")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")
    batches = _batch_list(batches)
    layers = _layers(model)
    if "stats" in params:
        from rfattn.features.base import StatsFeature

        plain = [n for n, rf in layers.items() if not isinstance(rf.feature_map, StatsFeature)]
        if plain:
            raise ValueError(
                "params='stats' fixes the data statistics of oprf/saderf/poisrf/geomrf; layer "
                f"{plain[0]!r} has feature={layers[plain[0]].feature!r}, which has none"
            )
    if "A" in params:
        plain = [n for n, rf in layers.items()
                 if rf.feature != "gerf" or rf.feature_map.complex_form]  # fmt: skip
        if plain:
            raise ValueError(
                "params='A' calibrates GERF's A, which needs feature='gerf' with a real A and s=1; "
                f"layer {plain[0]!r} has feature={layers[plain[0]].feature!r}"
            )

    t0 = time.perf_counter()
    grads = {p: p.requires_grad for p in model.parameters()}
    training = model.training
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    losses: list[float] = []
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            captured = _capture(model, batches, layers)
            with torch.no_grad():
                before = _floats(_errors(layers, captured))
            if "stats" in params:
                _fix_statistics(model, layers, captured)
            # the steps run on the batches' rows without their padding (see _regrouped),
            # each layer's recordings replaced in turn to keep one copy in memory
            order = torch.randperm(len(batches)).tolist()
            for name, per in captured.items():
                captured[name] = _regrouped(per, order) or per
            trainable = _trainable(model, layers, params, captured)
            opt = torch.optim.Adam(trainable, lr=lr) if trainable else None
            # cosine decay to 0: large steps first, then settle (one batch per step is noisy)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR
            sched = cosine(opt, steps) if opt is not None and steps else None
            for step in range(steps if trainable else 0):
                errs = _errors(layers, captured, [step % len(batches)])
                loss = torch.stack(list(errs.values())).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                losses.append(float(loss.detach()))
                if progress and (step + 1 == steps or step % 10 == 0):
                    _progress(step + 1, steps, losses[-1], t0)
            with torch.no_grad():
                after = _floats(_errors(layers, captured))
    finally:
        for p, g in grads.items():
            p.requires_grad_(g)
        model.train(training)
    return CalibrationReport(before, after, params, len(losses), time.perf_counter() - t0, losses)
