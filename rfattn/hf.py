"""Hugging Face ``transformers`` integration: ``attn_implementation="rfattn"``.

Importing this module registers :func:`rfattn_attention_forward` in transformers'
``AttentionInterface`` and a matching mask builder in ``AttentionMaskInterface`` under the name
``"rfattn"`` (:func:`register` does it again, idempotently). Every model whose attention layers
dispatch through that interface (Llama-style decoders, BERT-style encoders, ...) then runs
random-feature attention::

    import rfattn.hf
    model = transformers.LlamaForCausalLM(config)          # or from_pretrained(...)
    rfattn.hf.attach_random_features(model, num_features=128, feature="posrf")
    model.set_attn_implementation("rfattn")                # or attn_implementation= at load

:func:`attach_random_features` gives every attention layer its own :class:`RandomFeatures`
(submodule ``rfattn_features``, seeded with :func:`rfattn.layer_seed` of ``seed`` and the layer
index, saved in ``state_dict``, in the layer's train/eval mode and following the model's later)
and records the options in ``config.rfattn``; a layer reached without one builds it lazily from
``config.rfattn`` (defaults: 256 posrf/orf features, seed 0), likewise.

Masks: the causal structure comes from the layer's ``is_causal`` and padding from the 2-D
attention mask; the mask builder hands the attention function the key-padding mask as a
stride-0 ``[B, 1, Tq, Tk]`` view (no quadratic tensor). Padding-free batches (one row of packed
sequences, ``DataCollatorWithFlattening``) run each sequence on its own (:func:`rf_attention`'s
``cu_seqlens``), from flash-attention's ``cu_seq_lens_q/k`` or, without them, from the
``position_ids`` where transformers' mask keeps the sequences apart. Other patterns (custom 4-D
masks) are checked against "causal/bidirectional + key padding" and raise NotImplementedError
when they differ. Attention dropout acts on the attention output (no weight
matrix exists) and ``output_attentions`` returns None weights, with a warning (once), as sdpa.

Hybrid layers: ``attach_random_features(model, window=64, sinks=4, ...)`` makes each layer
attend exactly to its first 4 tokens and last 64 positions and through the random features to
the rest, in one normaliser (:mod:`rfattn.hybrid`); its generation cache keeps those keys and
values beside the random-feature state, still of constant size. A model's own sliding window
(Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, the ``"sliding_attention"`` layers
of ``layer_types``) is the exact part of such a hybrid on its layers (the mask builder hands on
key padding, the attention function reads the layer's ``sliding_window``), on every path
(context-parallel shards included) but a cache that dropped the older keys (a DynamicCache
filled under another attention, refused as soon as it has). Chunked attention
(``attention_chunk_size``) is refused as soon as a query would see a key outside its chunk.

Caches: every attention layer with features gets a forward pre-hook (public ``torch.nn``
hooks; registered by :func:`attach_random_features`, by ``post_init`` for a model built with
``attn_implementation="rfattn"``, and by a layer's first forward where it draws its features
lazily) that gives the empty ``DynamicCache`` it is handed (the one transformers makes for
``model(ids, use_cache=True)`` or ``generate()``, or the caller's) :class:`RFCacheLayer`
layers, one fixed-size state each, before the layer would write keys there
(:func:`use_state_layers`); in eval mode on one process (training and context-parallel forwards
run on the whole sequence and keep transformers' cache). ``crop`` rolls the states back after
``activate_past_recording`` (assisted decoding). The one private transformers function this
module replaces is ``GenerationMixin._prepare_cache_for_generation``, so that the cache of
``generate()`` has its states, and records, before its first forward.

Save/load: a model saved after :func:`attach_random_features` carries ``config.rfattn``; importing
this module hooks ``PreTrainedModel.post_init`` so that such a model builds its layers' features
when it is constructed, and ``from_pretrained(path, attn_implementation="rfattn")`` loads the
saved ones (trained fastfoodl parameters, running statistics) instead of dropping them as
unexpected keys; features the checkpoint lacks are drawn again from ``config.rfattn``.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from rfattn.attention import RFState, rf_attention
from rfattn.distributed import runs_causal
from rfattn.hybrid import HybridState, check_local
from rfattn.modules import RandomFeatures, layer_seed

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.cache_utils import (
        Cache,
        CacheLayerMixin,
        DynamicCache,
        DynamicLayer,
        DynamicSlidingWindowLayer,
    )
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rfattn.hf needs transformers>=5 (pip install 'rfattn[hf]'): " + str(exc)
    ) from exc

__all__ = [
    "NAME",
    "CACHE_KWARG",
    "register",
    "rfattn_attention_forward",
    "rfattn_mask",
    "attach_random_features",
    "set_context_parallel_group",
    "random_features_from_config",
    "RFCache",
    "RFCacheLayer",
    "use_state_layers",
    "cache_nbytes",
]

#: the ``attn_implementation`` name
NAME = "rfattn"
#: defaults of ``config.rfattn``
DEFAULT_OPTIONS = {"num_features": 256, "feature": "posrf", "weights": "orf", "seed": 0}
#: what :func:`rfattn.calibrate` notes in ``config.rfattn`` besides feature options
CALIBRATION_NOTES = ("head_maps", "gerf_A")
#: ``config.rfattn`` options of the layers' attention, not of their features: exact sinks and a
#: sliding window inside the random-feature attention (:mod:`rfattn.hybrid`), 0 = none
LOCAL_OPTIONS = ("window", "sinks")


def local_attention(config) -> tuple[int, int]:
    """``(window, sinks)`` of a model's layers from ``config.rfattn`` ((0, 0): plain random
    features)."""
    opts = _options(config)
    return int(opts.get("window", 0)), int(opts.get("sinks", 0))


def _options(config) -> dict:
    opts = dict(DEFAULT_OPTIONS)
    opts.update(getattr(config, "rfattn", None) or {})
    return opts


def random_features_from_config(config, layer_idx: int, head_dim: int) -> RandomFeatures:
    """The :class:`RandomFeatures` of layer ``layer_idx`` from ``config.rfattn`` options.

    Args:
        config: a transformers ``PretrainedConfig``; ``config.rfattn`` (a dict, optional) holds
            ``num_features``, ``feature``, ``weights``, ``seed``, feature options, the layers'
            ``window`` and ``sinks`` (not the features': see :func:`attach_random_features`),
            ``head_maps`` (True after :func:`rfattn.calibrate`: maps for the config's heads)
            and ``gerf_A`` (True after calibrating GERF's A: one learnable A per key/value
            head).
        layer_idx: the layer index (its seed is ``layer_seed(seed, layer_idx)``).
        head_dim: the attention head dimension.
    """
    opts = _options(config)
    seed = opts.pop("seed")
    learn_a = opts.pop("gerf_A", False)
    for key in LOCAL_OPTIONS:
        opts.pop(key, None)
    # calibrated (rfattn.calibrate): maps and A sized by the model's head counts
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if opts.get("head_maps") is True:
        opts["head_maps"] = (heads, kv_heads)
    elif not opts.get("head_maps"):
        opts.pop("head_maps", None)
    rf = RandomFeatures(head_dim, seed=layer_seed(int(seed), int(layer_idx)), **opts)
    if learn_a:
        rf.learn_gerf_A(kv_heads)
    return rf


def _attention_layers(model: torch.nn.Module):
    """(module, head_dim) for every attention layer that dispatches through the interface."""
    for mod in model.modules():
        if not hasattr(mod, "is_causal") or not hasattr(mod, "config"):
            continue
        head_dim = getattr(mod, "head_dim", None) or getattr(mod, "attention_head_size", None)
        if isinstance(head_dim, int):
            yield mod, head_dim


def attach_random_features(model: torch.nn.Module, **options) -> int:
    """Give every attention layer of ``model`` its own :class:`RandomFeatures`.

    Args:
        model: a transformers model.
        **options: ``num_features``, ``feature``, ``weights``, ``seed`` and feature options
            (stored in ``model.config.rfattn``); ``window=W, sinks=S`` (ints >= 0, default 0)
            make every layer a hybrid (:mod:`rfattn.hybrid`): each query attends exactly to the
            first S tokens and the last W positions, and through the random features to the
            rest, in one normaliser (causal layers only; ``window`` past the sequence is
            softmax attention). What converts a pretrained decoder: random features alone are
            too far from its sharp attention. Unspecified ones keep their current values,
            except that a new ``feature`` starts without the previous feature's own options,
            and the calibration notes of :func:`rfattn.calibrate` (``head_maps``, ``gerf_A``)
            go unless given: the layers' features are drawn afresh, without what it trained.

    Returns:
        The number of layers equipped. Layers without a ``layer_idx`` are numbered in module
        order. The features follow the model's device and mode: each layer's start in its
        layer's mode (on an eval model, oprf/saderf running statistics stay as they are, so
        the same input gives the same output), and as submodules ``.to``, ``.train()`` and
        ``.eval()`` reach them later.

    Raises:
        ValueError, TypeError: options :class:`RandomFeatures` rejects; the model and its
            ``config.rfattn`` are then left as they were.

    The model is first given a config object of its own (a copy, set on every submodule that
    held the old one): a config a caller built several models from is left as it was, so the
    other models, and models built from it later, keep their own attention.
    """
    check_local(*(options.get(key, 0) for key in LOCAL_OPTIONS))
    config = _own_config(model)
    before = getattr(config, "rfattn", None)
    current = _options(config)
    if "feature" in options and options["feature"] != current["feature"]:
        current = {key: current[key] for key in DEFAULT_OPTIONS}
    for key in CALIBRATION_NOTES:
        current.pop(key, None)
    config.rfattn = {**current, **options}
    ref = next(model.parameters(), None)
    try:
        return _attach(model, None if ref is None else ref.device)
    except Exception:
        if before is None:
            delattr(config, "rfattn")
        else:
            config.rfattn = before
        raise


def _own_config(model: torch.nn.Module):
    """``model.config``, first replaced by a copy on the model and every submodule holding it
    unless this module made it already."""
    config = model.config
    if _OWN_CONFIG.get(model) is not config:
        shared, config = config, copy.deepcopy(config)
        for mod in model.modules():
            if getattr(mod, "config", None) is shared:
                mod.config = config
        _OWN_CONFIG[model] = config
    return config


#: model -> the config object :func:`_own_config` gave it
_OWN_CONFIG = WeakIdKeyDictionary()


def set_context_parallel_group(model: torch.nn.Module, group) -> int:
    """Split each forward's sequence over ``group`` (a ``torch.distributed`` process group; for a
    ``DeviceMesh``, ``mesh.get_group("cp")``; None: one process again): every rank feeds its
    contiguous shard of ``input_ids``, in rank order, with the shard's global ``position_ids``
    (rotary embeddings) and its slice of the 2-D ``attention_mask``; each attention layer then
    runs :func:`rfattn.rf_attention` with ``group`` (:mod:`rfattn.distributed`). Training and
    full-sequence forwards only (a generation cache holds one process's state). Returns the
    number of attention layers set."""
    layers = [module for module, _ in _attention_layers(model)]
    for module in layers:
        module.rfattn_group = group
    # the mask builder's sliding-window check looks at the whole sequence (every rank alike)
    global _CONTEXT_PARALLEL_HELD
    config = _own_config(model)
    if group is None:
        _CONTEXT_PARALLEL.pop(config, None)
    else:
        _CONTEXT_PARALLEL[config] = group
    _CONTEXT_PARALLEL_HELD = len(_CONTEXT_PARALLEL)
    return len(layers)


#: config of a model set by :func:`set_context_parallel_group` -> its process group
_CONTEXT_PARALLEL = WeakIdKeyDictionary()
#: its length when last set (a model dropped since stays counted): the mask builder looks there
#: only while it is not 0, so a traced forward of a process that never set a group asks the weak
#: dictionary nothing, which dynamo cannot trace
_CONTEXT_PARALLEL_HELD = 0


def _group_of(config):
    """The process group of the model with ``config`` (a mask builder's), or None."""
    if config is None or not _CONTEXT_PARALLEL_HELD:
        return None
    return _CONTEXT_PARALLEL.get(config)


def _attach(model: torch.nn.Module, device) -> int:
    """Layer features from ``model.config.rfattn`` on ``device`` (None: where they are drawn);
    every layer's are built before any layer gets them."""
    built, count = [], 0
    for mod, head_dim in _attention_layers(model):
        idx = getattr(mod, "layer_idx", None)
        idx = count if idx is None else idx
        rf = _new_features(mod, model.config, idx, head_dim, device)
        rf._rfattn_layer = (idx, head_dim)  # to redraw the same features (_init_weights hook)
        built.append((mod, rf))
        count += 1
    for mod, rf in built:
        mod.rfattn_features = rf
        _hook_cache(mod)
    return count


def _new_features(module, config, idx: int, head_dim: int, device) -> RandomFeatures:
    """The features of attention layer ``module`` from ``config.rfattn`` on ``device`` (None:
    where they are drawn), in the layer's mode (an eval model's running statistics stay put; as
    a submodule they follow ``model.train()`` / ``model.eval()`` later), and normal tensors even
    when the call runs under ``torch.inference_mode()`` (the first forward of a model switched
    without :func:`attach_random_features`, say): the model stays trainable."""
    with torch.inference_mode(False):
        rf = random_features_from_config(config, idx, head_dim).train(module.training)
        return rf if device is None else rf.to(device)


def _layer_features(module: torch.nn.Module, head_dim: int, device) -> RandomFeatures:
    rf = getattr(module, "rfattn_features", None)
    if rf is None:
        idx = getattr(module, "layer_idx", None) or 0
        rf = _new_features(module, module.config, idx, head_dim, device)
        module.rfattn_features = rf
        _hook_cache(module)  # the caches of later forwards (this one's is made already)
    return rf


def rfattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    device="cpu",
    **kwargs,
) -> torch.Tensor | None:
    """Mask builder of ``"rfattn"`` (``AttentionMaskInterface``).

    Plain causal or bidirectional masks become the key-padding mask as a stride-0
    ``[B, 1, Tq, Tk]`` bool view (True = attend), or None without padding. Other patterns are
    materialised by ``sdpa_mask`` and become that view too where they equal causal or
    bidirectional attention plus key padding for every query that is not padding; otherwise
    they are handed on, and the attention function raises.

    A sliding window (``local_size``, a model's ``sliding_window``) becomes the key-padding view
    too: the attention function runs the hybrid with the layer's window exact. Refused as soon
    as a query would attend to a key at least the window behind it where that key is gone (a
    cache dropped it), and for chunked attention (``attention_chunk_size``), which has no
    form.

    Raises:
        NotImplementedError: a preallocated cache; a sliding window that matters.
    """
    if mask_function is causal_mask_function and kv_offset + kv_length > q_offset + q_length:
        # keys past the last query: a preallocated cache (transformers' StaticCache); the
        # attention function takes the queries to be the last of the keys' positions
        raise NotImplementedError(
            "rfattn: preallocated caches (cache_implementation='static', StaticCache) are not "
            "supported; use the default cache (rfattn.hf.RFCache, a fixed-size state) or "
            "DynamicCache"
        )
    n = max(kv_offset + kv_length, q_offset + q_length)
    valid = prepare_padding_mask(attention_mask, n, 0)  # [B, n] True = a token, or None
    if valid is not None:
        valid = valid[:, :n].to(device=device, dtype=torch.bool)
    keep = None if valid is None else valid[:, kv_offset : kv_offset + kv_length]
    if mask_function in (causal_mask_function, bidirectional_mask_function) and local_size is None:
        return _padding_view(keep, batch_size, q_length)
    if valid is None:
        valid = torch.ones(batch_size, n, dtype=torch.bool, device=device)
    span, window = -1, None
    if local_size is not None:
        config = kwargs.get("config")
        # a sliding window is the hybrid's exact part (the attention function reads the
        # layer's sliding_window); chunked attention has no form, judged on a sharded
        # sequence's whole span (every rank alike). Keys a sliding-window cache dropped
        # (a DynamicCache filled under another attention) are gone for the features too:
        # none can be where no key precedes the mask's (kv_offset 0), which a traced forward
        # takes as the answer, reading nothing on the host
        chunked = _window_name(local_size, config) != "sliding_window"
        window = None if chunked else local_size
        if chunked or kv_offset != 0 or not torch.compiler.is_compiling() or \
                _group_of(config) is not None:  # fmt: skip
            span, dropped = _window_span(valid, q_offset, q_length, kv_offset, config)
            if dropped or (span >= local_size and chunked):
                raise _window_error(local_size, span, config)
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    mask = sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        local_size,
        device=device,
        **kwargs,
    )
    if not torch.compiler.is_compiling() and \
            _plain_where_it_counts(mask, valid, q_offset, q_length, kv_offset, kv_length, window):
        return _padding_view(keep, batch_size, q_length)
    # another pattern (packed sequences, whose offsets the attention function reads, with or
    # without the window; a custom mask, which it refuses), or any pattern under tracing (which
    # cannot ask the host which one it is: the attention function checks it on the device,
    # :func:`_require`): handed on
    return mask


def _padding_view(keep: torch.Tensor | None, batch_size: int, q_length: int):
    """The key-padding mask ``keep [B, Tk]`` (True = a token) as a stride-0 ``[B, 1, Tq, Tk]``
    view, or None when every key is a token. Whether every key is one is read on the host in
    eager mode only (as transformers' own SDPA mask skips its check under tracing): a compiled
    forward keeps the view, and the attention takes it as padding of no key, with no host read
    and no graph break."""
    if keep is None or not torch.compiler.is_compiling() and bool(keep.all()):
        return None
    return keep[:, None, None, :].expand(batch_size, 1, q_length, keep.shape[1])


def _plain_where_it_counts(mask, valid, q_offset, q_length, kv_offset, kv_length,
                           window: int | None = None) -> bool:  # fmt: skip
    """Whether the materialised ``mask [B, 1, Tq, Tk]`` is causal or bidirectional attention
    plus key padding on the rows of queries that are tokens (``valid [B, n]``, positions
    ``0..n-1``; a padded query's output is never read), within a sliding ``window`` if given
    (transformers' causal ``j > i - window``, bidirectional ``|i - j| <= window``)."""
    q_pos = torch.arange(q_offset, q_offset + q_length, device=mask.device)
    k_pos = torch.arange(kv_offset, kv_offset + kv_length, device=mask.device)
    keys = valid[:, None, None, kv_offset : kv_offset + kv_length]
    rows = valid[:, None, q_offset : q_offset + q_length, None]
    causal, both = keys & (k_pos <= q_pos[:, None]), keys
    if window is not None:
        causal = causal & (k_pos > q_pos[:, None] - window)
        both = both & ((k_pos - q_pos[:, None]).abs() <= window)
    for expected in (causal, both):
        if bool(((mask == expected) | ~rows).all()):
            return True
    return False


def _window_span(valid, q_offset, q_length, kv_offset, config) -> tuple[int, bool]:
    """``(span, dropped)``: how far the farthest query that is a token lies behind the first
    token of its sequence (the largest over the batch; -1 when there is none), and whether such
    a token lies before ``kv_offset`` (a key a sliding-window cache dropped). On a model split
    over a process group (:func:`set_context_parallel_group`), the span of the whole sequence,
    the same on every rank (one ``all_gather`` of ``2 B + 1`` numbers)."""
    n = valid.shape[1]
    pos = torch.arange(n, device=valid.device)
    first = torch.where(valid, pos, n).amin(-1)  # [B]
    queries = slice(q_offset, q_offset + q_length)
    last = torch.where(valid[:, queries], pos[queries], -1).amax(-1)
    group = _group_of(config)
    if group is not None:
        first, last = _global_first_last(first, last, n, group)
    rows = last >= first
    span = int(torch.where(rows, last - first, -1).amax()) if len(rows) else -1
    return span, bool((rows & (first < kv_offset)).any())


def _global_first_last(first, last, n: int, group):
    """Per row, the first token and the last query of a sequence whose shards, ``n`` positions
    here, lie in rank order over ``group``, from each shard's (local positions; none: ``n``
    and -1)."""
    local = torch.cat((first.new_tensor([n]), first, last))
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    table = torch.stack(parts)  # [P, 1 + 2B]
    lengths, b = table[:, :1], first.shape[0]
    start = lengths.cumsum(0) - lengths
    firsts, lasts = table[:, 1 : 1 + b], table[:, 1 + b :]
    first = torch.where(firsts < lengths, start + firsts, lengths.sum()).amin(0)
    last = torch.where(lasts >= 0, start + lasts, -1).amax(0)
    return first, last


def _window_name(local_size: int, config) -> str:
    """``"sliding_window"``, or ``"attention_chunk_size"`` where ``local_size`` is that."""
    if getattr(config, "sliding_window", None) != local_size and \
            getattr(config, "attention_chunk_size", None) == local_size:  # fmt: skip
        return "attention_chunk_size"
    return "sliding_window"


def _window_error(local_size: int, span: int, config) -> NotImplementedError:
    name = _window_name(local_size, config)
    if name == "sliding_window":  # the hybrid's exact part, except where keys are gone
        return NotImplementedError(
            f"rfattn: sliding_window={local_size} is the exact part of rfattn's hybrid, whose "
            f"random features read every older key, and a query would see a key {span} "
            f"positions before it that this cache dropped (a DynamicCache filled under another "
            f"attention); use rfattn.hf.RFCache or an empty cache (transformers' own becomes "
            f"one under attn_implementation='rfattn')"
        )
    return NotImplementedError(
        f"rfattn: {name}={local_size} matters here: a query would see a key {span} "
        f"positions before it, outside the window, and random-feature attention has no "
        f"chunked form (it attends to every key). A model with {name} runs under "
        f"attn_implementation='rfattn' only while each sequence so far (prompt and generated "
        f"tokens, padding aside) has at most {local_size} tokens; beyond that use a softmax "
        f"attn_implementation ('sdpa', 'eager'), or set config.{name} = None for full attention"
    )


def _require(ok: torch.Tensor, message: str, error: type[Exception] = NotImplementedError):
    """Raise ``error(message)`` unless the bool tensor ``ok`` holds, read on the host; under
    tracing (``torch.compile``) checked on the device instead (``torch._assert_async``: no host
    read, no graph break; a failure raises RuntimeError when the step runs, on the GPU
    asynchronously)."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, f"rfattn: {message}")
    elif not bool(ok):
        raise error(f"rfattn: {message}")


def _keep(mask: torch.Tensor) -> torch.Tensor:
    """True = attend, from a bool mask or an additive float one (0 keep, very negative block)."""
    if mask.dtype == torch.bool:
        return mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    _require(((mask == 0) | blocked).all(), "additive attention biases have no random-feature form")
    return ~blocked


def _split_mask(mask: torch.Tensor, causal: bool, tq: int, tk: int, sliding: int | None = None):
    """(key_padding_mask [B, Tk] True = padding, causal) from a 4-D mask, or raise. Under
    tracing the mask is checked on the device against the layer's own pattern, within its
    ``sliding`` window where it has one (transformers' causal ``j > i - W``, bidirectional
    ``|i - j| <= W``; eager mode gets such masks as rfattn_mask's key-padding view)."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (tq, tk):
        raise NotImplementedError(
            f"rfattn: attention masks must be [B, 1, Tq, Tk], got {mask.shape}"
        )
    keep = _keep(mask)
    if keep.shape[1] > 1:
        _require((keep == keep[:, :1]).all(), "per-head attention masks are not supported")
    keep = keep[:, 0]
    pad = ~keep[:, -1, :]  # the last query sees every non-padded key in both forms
    # rfattn_mask's key-padding view (rows identical by construction), or one query, whose one
    # row is its key padding whatever the pattern: nothing to compare (a decode step reads
    # nothing on the host)
    if keep.stride(-2) == 0 or tq == 1:
        return pad, causal
    i = torch.arange(tq, device=keep.device)[:, None] + (tk - tq)
    tri = torch.arange(tk, device=keep.device)[None, :] <= i
    refused = ("this attention-mask pattern (sliding window, packed sequences or a custom mask) "
               "is not causal/bidirectional plus key padding, so it has no linear-attention "
               "form")  # fmt: skip
    if torch.compiler.is_compiling():  # the layer's own pattern, checked on the device
        if sliding is not None:  # the last query's row holds its window's keys only: each key's
            if tq != tk:  # own row (the diagonal) says whether it is one
                raise NotImplementedError(
                    "rfattn: under torch.compile a sliding-window layer's mask over keys before "
                    "its queries (a key/value cache) has no form; use rfattn's state cache")
            pad = ~keep.diagonal(dim1=-2, dim2=-1)
            j = torch.arange(tk, device=keep.device)[None, :]
            tri = tri & ((j > i - sliding) if causal else ((i - j).abs() <= sliding))
        expected = ~pad[:, None, :] & (tri if causal else torch.ones_like(tri))
        _require((expected == keep).all(), refused + " (under torch.compile packed sequences "
                 "need flash-attention's offsets: DataCollatorWithFlattening("
                 "return_flash_attn_kwargs=True))")  # fmt: skip
        return pad, causal
    for c in (causal, not causal):
        expected = ~pad[:, None, :] & (tri if c else torch.ones_like(tri))
        if bool((expected == keep).all()):
            return pad, c
    raise NotImplementedError(f"rfattn: {refused}")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def rfattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface``) running :func:`rf_attention`.

    Args:
        module: the calling attention layer (gives ``is_causal``, ``config``, ``layer_idx``
            and holds its ``rfattn_features``).
        query: ``[B, H, Tq, D]``; key, value: ``[B, Hkv, Tk, D]`` (grouped-query models: Hkv
            divides H; :func:`rf_attention` shares each key/value head with its group without
            repeating it).
        attention_mask: None or a 4-D mask (see the module docstring).
        dropout: dropout probability, applied to the attention output in training.
        scaling: softmax temperature (default ``D ** -0.5``).
        is_causal: overrides ``module.is_causal``.

    Returns:
        ``(out [B, Tq, H, D], None)``.
    """
    if kwargs.get("output_attentions", False):
        _warn_once(
            "rfattn: random-feature attention has no attention-weight matrix, so "
            "output_attentions=True returns None weights; use attn_implementation='eager' to "
            "inspect softmax weights"
        )
    layer = kwargs.pop(_LAYER_KWARG, None)  # the RFCacheLayer these keys went to, or None
    if layer is None and _PENDING_HELD:
        layer = _pending_layer(key)
    rf = _layer_features(module, query.shape[-1], query.device)
    sliding = kwargs.get("sliding_window")  # the layer's own window: the hybrid's exact part
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    group = getattr(module, "rfattn_group", None)
    if group is None:
        packed = _packing(query, key, attention_mask, bool(causal), kwargs, layer is not None,
                          sliding)  # fmt: skip
    else:
        packed = _sharded_packing(query, key, attention_mask, bool(causal), kwargs, sliding,
                                  group)  # fmt: skip
    if packed is not None:
        if layer is not None:  # an eval forward's cache: its states could not be per sequence
            layer.refuse_further_tokens()
        out = _packed_attention(module, rf, query, key, value, bool(causal), scaling, sliding,
                                *packed)  # fmt: skip
    elif layer is not None:
        layer.config = module.config
        out = _cached_attention(layer, rf, query, key, value, attention_mask, scaling, sliding)
    else:
        out = _mask_attention(module, rf, query, key, value, attention_mask, scaling, is_causal,
                              sliding)  # fmt: skip
    if dropout > 0 and module.training:
        out = torch.nn.functional.dropout(out, dropout, training=True)
    return out.transpose(1, 2).contiguous(), None


def _packing(query, key, attention_mask, causal: bool, kwargs: dict, cached: bool,
             sliding: int | None = None):  # fmt: skip
    """``(cu_q, cu_k, max_seqlen)``: the offsets of a padding-free batch (one row of
    concatenated sequences) and, under tracing, a bound on its sequences' lengths (None in
    eager mode, which reads the offsets); or None for any other batch.

    From flash-attention's keyword arguments ``cu_seq_lens_q`` / ``cu_seq_lens_k``
    (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``); else from ``position_ids``
    of one row where they restart (the collator's default output), but only where transformers
    took them as packed too: without a cache (``cached``: with one, transformers attends over
    the whole row, and so does this; nothing is looked for, so a decode step reads nothing on
    the host) and where its mask keeps each sequence apart. A mask given beside the offsets must
    be theirs (within the layer's ``sliding`` window, where it has one), else
    NotImplementedError. Reads the offsets on the host in eager mode.

    Under tracing (``torch.compile``) nothing is read on the host: the offsets and the mask are
    checked on the device (:func:`_require`), the bound is transformers' ``max_length_q/k``
    (the whole row where it gives none) and ``position_ids`` alone are not looked into (where
    they restart, the layer's plain mask check fails on the device, naming the offsets)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    tracing = torch.compiler.is_compiling()
    if cu_q is None and cu_k is None:
        pos = kwargs.get("position_ids")
        if cached or attention_mask is None or pos is None or query.shape[0] != 1 or \
                pos.shape[-1] != query.shape[2] or query.shape[2] != key.shape[2] or \
                tracing:  # fmt: skip
            return None
        pos = pos.reshape(-1)
        starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
        if starts.numel() == 0:  # one sequence: a mask of its own (padding) applies
            return None
        cu_q = cu_k = torch.cat((starts.new_zeros(1), starts, starts.new_full((1,), pos.numel())))
        if not bool(_keeps_sequences_apart(attention_mask, cu_q, cu_k, causal, sliding)):
            return None
    elif cu_q is None or cu_k is None:
        raise ValueError("rfattn: cu_seq_lens_q and cu_seq_lens_k go together")
    elif attention_mask is not None:
        _require(_keeps_sequences_apart(attention_mask, cu_q, cu_k, causal, sliding),
                 "cu_seq_lens_q/k with an attention mask that is not their sequences'")
    if not tracing:
        return cu_q, cu_k, None
    bound = (kwargs.get("max_length_q"), kwargs.get("max_length_k"))
    return cu_q, cu_k, max(bound) if None not in bound else max(query.shape[2], key.shape[2])


def _sharded_packing(query, key, attention_mask, causal: bool, kwargs: dict, sliding, group):
    """:func:`_packing` of a rank's shard of a sequence split over ``group``: ``(cu_q, cu_k,
    None)``, the whole row's offsets from flash-attention's keyword arguments (the same on every
    rank; :func:`rf_attention` checks that over the ranks), or None. What one rank could refuse
    from what only it sees raises on every rank together
    (:func:`rfattn.distributed.raise_together`), before the attention's own collectives: offsets
    on one side only; with offsets, a mask that is not their pieces of this shard (found from
    one all_gather of the shards' lengths); without, a mask that is not the layer's plain
    pattern plus key padding (a batch packed by ``position_ids`` alone: a shard cannot tell
    where the row's sequences lie from its own). One all_gather more per layer than the
    attention's own."""
    from rfattn import distributed

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    tq, tk = query.shape[2], key.shape[2]
    error = None
    try:
        if (cu_q is None) != (cu_k is None):
            raise ValueError("rfattn: cu_seq_lens_q and cu_seq_lens_k go together")
        if cu_q is None and attention_mask is not None and attention_mask.stride(-2) != 0:
            _split_mask(attention_mask, causal, tq, tk)  # (a packing pattern fails it)
    except Exception as exc:  # raised on every rank together
        error = exc
    distributed.raise_together(group, error)
    if cu_q is None:
        return None
    if attention_mask is not None:
        pieces = distributed.shard_offsets(group, (tq, tk), (cu_q, cu_k))
        ok = bool(_keeps_sequences_apart(attention_mask, *pieces, causal, sliding))
        distributed.raise_together(group, None if ok else NotImplementedError(
            "rfattn: cu_seq_lens_q/k with an attention mask that is not their sequences' "
            "(over a process group: the whole row's offsets, the mask of this rank's shard)"))
    return cu_q, cu_k, None


def _keeps_sequences_apart(mask: torch.Tensor, cu_q, cu_k, causal: bool,
                          sliding: int | None = None) -> bool:  # fmt: skip
    """Whether the 4-D mask transformers built is exactly that of the packed sequences (a bool
    tensor, for the host or the device to read): each query attends to the keys of its own
    sequence (causally where ``causal``; within the layer's ``sliding`` window where it has
    one: transformers' causal ``j > i - W``, bidirectional ``|i - j| <= W``)."""
    tq, tk = mask.shape[-2:]
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.stride(-2) == 0:
        # (a stride-0 view: rfattn_mask's key padding, rows alike)
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    ends = (cu_q[-1] == tq) & (cu_k[-1] == tk)
    keep = _keep(mask)[0]  # [heads or 1, Tq, Tk]
    seq_q = torch.bucketize(torch.arange(tq, device=mask.device), cu_q.to(mask.device)[1:],
                            right=True)  # fmt: skip
    seq_k = torch.bucketize(torch.arange(tk, device=mask.device), cu_k.to(mask.device)[1:],
                            right=True)  # fmt: skip
    expected = seq_q[:, None] == seq_k[None, :]
    if causal:
        expected &= torch.ones(tq, tk, dtype=torch.bool, device=mask.device).tril(tk - tq)
    if sliding is not None:
        i = torch.arange(tq, device=mask.device)[:, None] + (tk - tq)
        j = torch.arange(tk, device=mask.device)[None, :]
        expected &= (j > i - sliding) if causal else ((i - j).abs() <= sliding)
    return ends.to(mask.device) & (keep == expected).all()


def _packed_attention(module, rf, query, key, value, causal: bool, scaling, sliding, cu_q,
                      cu_k, max_seqlen):  # fmt: skip
    """The attention ``[1, H, T, E]`` of a padding-free batch: each packed sequence on its own
    (:func:`rf_attention`'s ``cu_seqlens``, and ``max_seqlen`` where not None: no host read),
    causal with one set of offsets for q and k."""
    group = getattr(module, "rfattn_group", None)
    window, sinks = local_attention_of(module.config, sliding, causal)
    # a hybrid layer: exact sinks and window; a process group: this rank's shard of the row
    local = dict(window=window, sinks=sinks, max_seqlen=max_seqlen, group=group)
    if not causal:
        return rf_attention(query, key, value, rf, scale=scaling, cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_k, **local)  # fmt: skip
    if cu_q is not cu_k:
        same = "causal packed sequences need cu_seq_lens_q == cu_seq_lens_k"
        if cu_q.shape != cu_k.shape:
            raise ValueError(f"rfattn: {same}")
        _require((cu_q == cu_k.to(cu_q.device)).all(), same, ValueError)
    return rf_attention(query, key, value, rf, causal=True, scale=scaling, cu_seqlens=cu_q,
                        **local)  # fmt: skip


def local_attention_of(config, sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """``(window, sinks)`` of a layer: :func:`local_attention`'s, the window replaced by the
    layer's own ``sliding_window`` where it has one (transformers' causal ``j > i - W`` is the
    hybrid's window W; bidirectional ``|i - j| <= W`` its window W + 1)."""
    window, sinks = local_attention(config)
    if sliding_window is not None:
        window = int(sliding_window) + (0 if causal else 1)
    return window, sinks


def _mask_attention(module, rf, query, key, value, attention_mask, scaling, is_causal,
                    sliding=None):  # fmt: skip
    """The attention ``[B, H, Tq, E]`` of queries on keys/values (``Hkv`` heads) with the
    causal structure and padding read from the layer and the 4-D mask; a layer with its own
    ``sliding`` window runs the hybrid with that window exact."""
    tq, tk = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    pad = None
    if attention_mask is not None:
        pad, causal = _split_mask(attention_mask, bool(causal), tq, tk, sliding)
    group = getattr(module, "rfattn_group", None)
    window, sinks = local_attention_of(module.config, sliding, bool(causal))
    if window or sinks:
        return _hybrid(rf, query, key, value, pad, causal, group, window, sinks, scaling)
    # a single query (decoding) sees every cached key; a sharded sequence's one-token shard
    # stays causal (its ranks' collectives must match)
    causal = runs_causal(causal, tq, group)
    if causal and tq != tk:
        # queries are the last Tq of Tk positions (a cache): run causal over Tk, keep the tail
        front = query.new_zeros(*query.shape[:2], tk - tq, query.shape[-1])
        return rf_attention(
            torch.cat((front, query), dim=2),
            key,
            value,
            rf,
            causal=True,
            key_padding_mask=pad,
            scale=scaling,
        )[:, :, tk - tq :]
    # self-attention: padded queries stay out of the statistics too (cross-attention's mask is
    # the keys' alone)
    cross = getattr(module, "is_cross_attention", False) or "cross" in type(module).__name__.lower()
    qpad = pad if pad is not None and tq == tk and not cross else None
    return rf_attention(query, key, value, rf, causal=causal, key_padding_mask=pad,
                        scale=scaling, query_padding_mask=qpad, group=group)  # fmt: skip


def _hybrid(rf, query, key, value, pad, causal, group, window, sinks, scaling):
    """The hybrid (:mod:`rfattn.hybrid`) of the layer's queries, the last Tq of Tk positions (a
    key/value cache before them), or refuse what it has no form for."""
    tq, tk = query.shape[2], key.shape[2]
    if not causal and tq != tk:
        raise NotImplementedError("rfattn: window/sinks need self-attention (Tq == Tk)")
    if group is not None:  # a shard of a causal self-attention (rfattn.distributed)
        if not causal:
            raise NotImplementedError("rfattn: window/sinks over a process group need causal "
                                      "attention")  # fmt: skip
        return rf_attention(query, key, value, rf, causal=True, key_padding_mask=pad,
                            scale=scaling, window=window, sinks=sinks, group=group)  # fmt: skip
    front = query.new_zeros(*query.shape[:2], tk - tq, query.shape[-1])
    out = rf_attention(torch.cat((front, query), dim=2) if tk > tq else query, key, value, rf,
                       causal=causal, key_padding_mask=pad, scale=scaling, window=window,
                       sinks=sinks)  # fmt: skip
    return out[:, :, tk - tq :]


# ------------------------------------------------------------------------------------------------
# generation on a fixed-size state


#: the keyword argument by which RFCacheLayer.update hands itself to the attention function: it
#: writes it into the attention layer's own keyword arguments, which transformers (5.24 on) gives
#: ``update`` as ``kwargs=`` and then passes on to the attention function (a dict local to one
#: attention forward: traceable, nothing left behind)
_LAYER_KWARG = "rfattn_cache_layer"
#: where an attention layer gives ``update`` no such dict (older transformers): keys returned by
#: RFCacheLayer.update -> the layer, read (and dropped) by the attention function
_PENDING = WeakIdKeyDictionary()
#: _PENDING's length when last written or read (an entry whose keys died unread stays counted
#: until the next read): the attention function looks there only while it is not 0, so a
#: forward without such a hand-over asks the weak dictionary nothing, which dynamo cannot trace
_PENDING_HELD = 0


def _pending_layer(key: torch.Tensor):
    """The :class:`RFCacheLayer` that ``key`` went to through :data:`_PENDING`, or None."""
    global _PENDING_HELD
    layer = _PENDING.pop(key, None)
    _PENDING_HELD = len(_PENDING)
    return layer


class _Recorded(NamedTuple):
    """One forward of a recording :class:`RFCacheLayer`: the state before it (None: no token
    yet) at ``seen`` tokens, and what advances that state over a prefix of its tokens."""

    seen: int
    state: RFState | HybridState | None
    key: torch.Tensor  # [B, Hkv, T, D]
    value: torch.Tensor  # [B, Hkv, T, E]
    pad: torch.Tensor | None  # [B, T] True = padding
    rf: RandomFeatures
    scale: float | None
    local: tuple[int, int]  # (window, sinks)
    heads: int  # query heads (calibrated head maps are sized by them)


class RFCacheLayer(CacheLayerMixin):
    """One decoder layer's generation state: the causal :class:`rfattn.RFState` of every token
    so far (``S [B, Hkv, F, E]``, ``z``, ``offset``; one per key/value head) and their count,
    instead of keys and values; for a hybrid layer (``window``/``sinks`` in ``config.rfattn``)
    the :class:`rfattn.hybrid.HybridState`, which adds the last ``window`` positions' keys and
    values and the sinks (constant size too).

    :meth:`update` keeps nothing: it hands the new keys and values to the attention function,
    which runs them on the state and stores the new one (:func:`rfattn_attention_forward`).

    Rollback (assisted decoding, transformers' ``crop``): after :meth:`activate_past_recording`
    the layer also keeps, for every forward until the next :meth:`crop`, the state before it and
    its keys and values; ``crop(-n)`` then puts back the state of ``n`` tokens earlier, the kept
    one where that is the start of a forward, else that state advanced over the forward's first
    tokens (the same sums in another order: equal to rounding). Without recording, ``crop(-n)``
    raises: a sum cannot forget its last terms.

    Fixed addresses (as transformers' linear-attention layers keep theirs): once it holds a
    state the layer copies every later state into the same tensors, marked static for
    ``torch.compile`` (:meth:`keep`), so a compiled decode step reads and writes the same memory
    each position, as CUDA graphs need. While recording for :meth:`crop` it holds each new state
    as given instead (the recorded forwards keep the earlier ones) and is not compileable.
    """

    def __init__(self, **kwargs):
        super().__init__()
        self.state: RFState | HybridState | None = None
        self.seen = 0
        self.config = None  # the model's, set by the attention function
        self.record_past = False
        self.packed = False  # handed a packed batch: no state (refuse_further_tokens)
        self.past: list[_Recorded] = []  # the forwards since recording began or the last crop

    @property
    def is_compileable(self) -> bool:
        """Whether a compiled step may run on this layer: its state keeps its address (it does
        unless recording for :meth:`crop`). ``generate()`` compiles its decoding steps by itself
        on such a cache where transformers compiles (a GPU, or ``compile_config`` asking)."""
        return not self.record_past

    def keep(self, state: RFState | HybridState | None) -> None:
        """Hold ``state`` as this layer's state: copied into the tensors the layer holds where
        they have its fields' shapes, dtypes and devices (the addresses stay), else held as
        given and, outside tracing, marked static for ``torch.compile``. While recording (see
        :meth:`crop`) always held as given: the recorded forwards keep the earlier states."""
        old = self.state
        if (not self.record_past and state is not None and type(old) is type(state)
                and all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                        for a, b in zip(old, state, strict=True))):  # fmt: skip
            for a, b in zip(old, state, strict=True):
                a.copy_(b)
            return
        self.state = state
        if state is not None and not self.record_past and not torch.compiler.is_compiling():
            for x in state:
                torch._dynamo.mark_static_address(x)

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can undo the forwards since the last one (it records them)."""
        return self.record_past

    def activate_past_recording(self) -> None:
        """Keep what :meth:`crop` needs to undo the forwards from now on (until the next crop)."""
        self.record_past = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def refuse_further_tokens(self) -> None:
        """Mark a fresh layer handed a padding-free (packed) batch: the forward attends each
        sequence on its own and keeps no state, so any later :meth:`update` raises (its states
        would be one per row, not per sequence). A layer that holds tokens raises now."""
        if self.seen or self.state is not None:
            raise ValueError("rfattn: a padding-free (packed) batch cannot continue a cache; "
                             "pass use_cache=False or a fresh cache")  # fmt: skip
        self.packed = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.packed:
            raise ValueError("rfattn: this cache was handed a padding-free (packed) batch and "
                             "keeps no state for it; decode with a fresh cache, or pass "
                             "use_cache=False to the packed forward")  # fmt: skip
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        shared = kwargs.get("kwargs")
        if isinstance(shared, dict):
            shared[_LAYER_KWARG] = self
        else:
            global _PENDING_HELD
            _PENDING[key_states] = self
            _PENDING_HELD = len(_PENDING)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held by the state (recorded forwards apart)."""
        state = () if self.state is None else self.state
        return sum(x.numel() * x.element_size() for x in state)

    def _map(self, fn) -> None:
        def each(x):  # a tensor, a state or None
            if x is None or isinstance(x, torch.Tensor):
                return x if x is None else fn(x)
            return type(x)(*(fn(t) for t in x))

        self.keep(each(self.state))
        self.past = [step._replace(state=each(step.state), key=fn(step.key), value=fn(step.value),
                                   pad=each(step.pad)) for step in self.past]  # fmt: skip

    def reset(self) -> None:
        self.state, self.seen, self.past, self.packed = None, 0, [], False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda x: x[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a negative
        count; 0 keeps every token), and what was recorded to undo them.

        Raises:
            ValueError: a positive count, or more tokens than were recorded.
            RuntimeError: tokens to remove without :meth:`activate_past_recording` before them.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"RFCache.crop takes minus the number of tokens to remove, got "
                             f"{tokens_to_remove}")  # fmt: skip
        n, past = -tokens_to_remove, self.past
        if n == 0:
            self.past = []
            return
        if not self.record_past:
            raise RuntimeError(
                "RFCache cannot crop: its state is a sum over every token seen, and a sum cannot "
                "forget its last terms unless it kept them; call cache.activate_past_recording() "
                "before the forwards to undo (generate does for assisted decoding)"
            )
        target = self.seen - n
        step = next((s for s in reversed(past) if s.seen <= target), None)
        if step is None:
            raise ValueError(f"RFCache cannot crop {n} tokens: it recorded the last "
                             f"{self.seen - past[0].seen if past else 0}")  # fmt: skip
        if target > step.seen:
            count = target - step.seen
            q = step.key.new_zeros(step.key.shape[0], step.heads, count, step.key.shape[-1])
            pad = None if step.pad is None else step.pad[:, :count]
            _, self.state = _run_on_state(step.rf, q, step.key[:, :, :count],
                                          step.value[:, :, :count], pad, step.state, step.scale,
                                          *step.local)  # fmt: skip
        else:
            self.state = step.state
        self.seen, self.past = target, []

    def offload(self) -> None:
        self._map(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self._map(lambda x: x.to(self.device, non_blocking=True))


class RFCache(Cache):
    """A transformers ``Cache`` for ``attn_implementation="rfattn"``: one fixed-size causal state
    per layer (:class:`RFCacheLayer`), so each generated token costs the same whatever the context
    and memory does not grow (``O(H F E)`` numbers per layer, not ``O(T H D)``).

    A model with ``attn_implementation="rfattn"`` keeps such states without being given one:
    the ``DynamicCache`` transformers makes for a forward with ``use_cache=True``, for
    ``generate()`` or a hand-written decoding loop gets :class:`RFCacheLayer` layers in place of
    its empty key/value layers (see :func:`use_state_layers`). Pass one explicitly to reuse or
    inspect it, as ``cache=`` (transformers >= 5.24) or ``past_key_values=`` (before; deprecated
    from 5.24)::

        cache = rfattn.hf.RFCache()
        out = model.generate(ids, cache=cache, max_new_tokens=64)
        cache.nbytes()                     # constant in the context length

    The prompt runs the chunked causal path with ``return_state=True``; each new token one
    decode step on the state. ``crop`` (assisted decoding) works after
    :meth:`activate_past_recording` (see :class:`RFCacheLayer`). Grouped-query models keep one
    state per key/value head, ``[B, Hkv, F, E]``: the group factor less than repeating the heads
    would.
    """

    def __init__(self, num_layers: int | None = None, **kwargs):
        self._record_past = False  # for the layers added later
        if num_layers is None:
            super().__init__(layer_class_to_replicate=self._new_layer)
        else:
            super().__init__(layers=[RFCacheLayer() for _ in range(num_layers)])

    def _new_layer(self) -> RFCacheLayer:
        layer = RFCacheLayer()
        layer.record_past = self._record_past
        return layer

    @property
    def is_compileable(self) -> bool:
        """Whether every layer, and every layer it adds later, keeps its state's address (see
        :class:`RFCacheLayer`): true unless recording for :meth:`crop`. ``generate()`` decides
        before its first forward whether to compile its decoding steps, so this holds for a
        cache whose layers do not exist yet."""
        return not self._record_past and all(layer.is_compileable for layer in self.layers)

    def activate_past_recording(self) -> None:
        """Let :meth:`crop` undo the forwards from now on, in this cache's layers and those it
        adds later."""
        self._record_past = True
        super().activate_past_recording()

    def to(self, *args, **kwargs) -> RFCache:
        """Move (or cast) every state like ``Tensor.to``; returns self."""
        for layer in self.layers:
            layer._map(lambda x: x.to(*args, **kwargs))
            if layer.state is not None:
                layer.device = layer.state.s.device
        return self

    def nbytes(self) -> int:
        """Bytes held by the states of every layer."""
        return cache_nbytes(self)

    def state_dict(self) -> dict:
        """The states and token counts as a dict of tensors (``torch.save`` it): copies, as
        decoding on goes on writing into the layers' own."""
        out = {}
        for i, layer in enumerate(self.layers):
            out[f"{i}.seen"] = torch.tensor(layer.seen)
            if layer.state is not None:
                fields = zip(type(layer.state)._fields, layer.state, strict=True)
                out.update({f"{i}.{name}": x.clone() for name, x in fields})
        return out

    @classmethod
    def from_state_dict(cls, state: dict) -> RFCache:
        """The cache saved by :meth:`state_dict` (its tensors copied: decoding writes into the
        cache's states)."""
        n = 1 + max((int(k.split(".")[0]) for k in state), default=-1)
        cache = cls(num_layers=n)
        for i, layer in enumerate(cache.layers):
            layer.seen = int(state[f"{i}.seen"])
            if f"{i}.s" in state:
                kind = HybridState if f"{i}.kinds" in state else RFState
                layer.keep(kind(*(state[f"{i}.{n}"].clone() for n in kind._fields)))
                layer.dtype, layer.device = layer.state.s.dtype, layer.state.s.device
                layer.is_initialized = True
        return cache


def cache_nbytes(cache: Cache) -> int:
    """Bytes of the tensors a transformers cache holds: the states of its :class:`RFCacheLayer`
    layers, the keys and values of the others."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, RFCacheLayer):
            total += layer.nbytes()
        else:
            tensors = (getattr(layer, "keys", None), getattr(layer, "values", None))
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


#: the key/value layers of transformers' DynamicCache that :func:`use_state_layers` replaces
_KV_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def use_state_layers(cache, record_past: bool = False) -> bool:
    """Give a transformers ``DynamicCache`` :class:`RFCacheLayer` layers in place of its empty
    key/value layers (and for the layers it adds later), in place: the object a caller holds
    (the cache of ``out = model(ids, use_cache=True)``, of ``generate()``, one of its own) then
    keeps fixed-size states. Layers that hold keys already (filled under another attention)
    stay as they are, and so does any other kind of cache (``RFCache``, ``StaticCache``,
    quantized, encoder-decoder).

    Args:
        cache: any object; only a ``DynamicCache`` (exactly that class) changes.
        record_past: have the new layers record for :meth:`RFCacheLayer.crop`; they do anyway
            where a layer they replace recorded (a sliding-window one can).

    Returns:
        Whether a layer was replaced or will be added as a state.
    """
    if type(cache) is not DynamicCache:
        return False
    record_past = record_past or any(getattr(x, "record_past", False) for x in cache.layers)
    changed = cache.layer_class_to_replicate is DynamicLayer
    if changed:
        cache.layer_class_to_replicate = RFCacheLayer
    for i, layer in enumerate(cache.layers):
        if type(layer) in _KV_LAYERS and not layer.is_initialized:
            cache.layers[i] = RFCacheLayer()
            cache.layers[i].record_past = record_past
            changed = True
    return changed


def _cache_pre_hook(module, args, kwargs):
    """Forward pre-hook of an attention layer (:func:`_hook_cache`): the cache it is handed,
    before the layer writes its keys there, keeps states (:func:`use_state_layers`) while the
    model runs ``"rfattn"`` in eval mode on one process (training and context-parallel forwards
    keep transformers' cache: their attention runs on the whole sequence)."""
    if (getattr(module.config, "_attn_implementation", None) == NAME and not module.training
            and getattr(module, "rfattn_group", None) is None):  # fmt: skip
        use_state_layers(kwargs.get("cache", kwargs.get("past_key_values")))


def _hook_cache(module: torch.nn.Module) -> None:
    """Register :func:`_cache_pre_hook` on attention layer ``module`` (once)."""
    if getattr(module, "_rfattn_cache_hook", None) is None:
        module._rfattn_cache_hook = module.register_forward_pre_hook(_cache_pre_hook,
                                                                     with_kwargs=True)


def _run_on_state(rf, query, key, value, pad, state, scale, window, sinks):
    """``(out, state)``: causal :func:`rf_attention` of new tokens continuing from ``state``."""
    return rf_attention(query, key, value, rf, causal=True, key_padding_mask=pad, scale=scale,
                        initial_state=state, return_state=True, window=window,
                        sinks=sinks)  # fmt: skip


def _cached_attention(layer, rf, query, key, value, attention_mask, scaling, sliding=None):
    """The attention ``[B, H, Tq, E]`` of the new tokens (``Hkv`` key/value heads) on an
    :class:`RFCacheLayer`'s state, which it advances (recording the forward where asked)."""
    tq = query.shape[2]
    pad = None
    if attention_mask is not None:  # [B, 1, Tq, seen + Tq]: the new tokens' columns
        pad, _ = _split_mask(attention_mask[..., -tq:], True, tq, tq)
    local = local_attention_of(layer.config, sliding, True)
    if layer.record_past:
        layer.past.append(_Recorded(layer.seen, layer.state, key, value, pad, rf, scaling, local,
                                    query.shape[1]))  # fmt: skip
    out, state = _run_on_state(rf, query, key, value, pad, layer.state, scaling, *local)
    layer.keep(state)
    layer.seen += tq
    return out


def _version(v: str) -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", v)[:2])
    return major, minor


#: the keyword under which this transformers' ``generate()`` and model forwards take a cache
#: (``model.generate(ids, **{rfattn.hf.CACHE_KWARG: rfattn.hf.RFCache()})``), and the name of
#: the attribute of ``generate()``'s output that holds it: ``"cache"`` from transformers 5.24
#: on (which deprecates ``past_key_values``), ``"past_key_values"`` before
CACHE_KWARG = "cache" if _version(transformers.__version__) >= (5, 24) else "past_key_values"


def _prepare_cache_with_states(original):
    """``GenerationMixin._prepare_cache_for_generation`` (the only private transformers function
    this module replaces; checked against transformers 5.24) that gives the cache ``generate()``
    makes or is given :class:`RFCacheLayer` layers (:func:`use_state_layers`) as soon as it
    exists. The attention layers' forward pre-hook would at the prompt's forward, but after
    ``generate`` asked the cache's layers to record for rollback (assisted decoding; a draft
    model's cache as soon as it is made), which key/value layers without a sliding window
    ignore."""

    def prepare(self, generation_config, model_kwargs, *args, **kwargs):
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        if (
            getattr(self.config, "_attn_implementation", None) == NAME
            and not self.training
            and not self.config.is_encoder_decoder
        ):
            use_state_layers(model_kwargs.get(CACHE_KWARG),
                             bool(getattr(generation_config, "is_assistant", False)))  # fmt: skip
        return result

    prepare._rfattn_original = original
    return prepare


def _attach_on_init(model) -> None:
    """``PreTrainedModel.post_init`` hook: a model whose config carries ``rfattn`` options (one
    saved after :func:`attach_random_features`) gets its layers' :class:`RandomFeatures` when it
    is built, before ``from_pretrained`` loads the checkpoint, so the saved ``rfattn_features``
    (trained fastfoodl parameters, running statistics, redrawn W) load into them instead of being
    dropped as unexpected keys. They are drawn on the CPU even inside transformers' meta-device
    construction: a checkpoint without them keeps these draws (transformers' own initialisation
    does not know them). Its attention layers get the cache hook (:func:`_hook_cache`), as do
    those of a model built with ``attn_implementation="rfattn"`` and no options (features drawn
    lazily)."""
    if not isinstance(getattr(model.config, "rfattn", None), dict):
        if getattr(model.config, "_attn_implementation", None) == NAME:  # features drawn lazily
            for mod, _ in _attention_layers(model):
                _hook_cache(mod)
        return
    if any(hasattr(mod, "rfattn_features") for mod, _ in _attention_layers(model)):
        return
    with torch.device("cpu"):
        _attach(model, None)
    # features the checkpoint lacks come back from transformers as uninitialised memory, and
    # its _init_weights does not know them: draw them again, as attach_random_features did
    init_weights = model._init_weights

    def _init_weights(module):
        layer = getattr(module, "_rfattn_layer", None)
        if layer is None:
            return init_weights(module)
        with torch.device("cpu"):
            fresh = random_features_from_config(model.config, *layer).state_dict()
        with torch.no_grad():  # only what the checkpoint did not hold
            for name, t in module.state_dict(keep_vars=True).items():
                if not getattr(t, "_is_hf_initialized", False):
                    t.copy_(fresh[name])

    model._init_weights = _init_weights


def _post_init_with_rfattn(original):
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _attach_on_init(self)
        return result

    post_init._rfattn_original = original
    return post_init


def register() -> None:
    """Register ``"rfattn"`` in transformers' attention and mask interfaces and the
    ``post_init`` hook that builds saved random features before a checkpoint loads
    (idempotent)."""
    AttentionInterface.register(NAME, rfattn_attention_forward)
    AttentionMaskInterface.register(NAME, rfattn_mask)
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel.post_init, "_rfattn_original"):
        PreTrainedModel.post_init = _post_init_with_rfattn(PreTrainedModel.post_init)
    from transformers.generation.utils import GenerationMixin

    if not hasattr(GenerationMixin._prepare_cache_for_generation, "_rfattn_original"):
        GenerationMixin._prepare_cache_for_generation = _prepare_cache_with_states(
            GenerationMixin._prepare_cache_for_generation
        )


register()
