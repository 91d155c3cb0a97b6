"""The benchmark and plotting code itself (not timings): CLI end to end on tiny sizes, JSON
schema, finite numbers, crossover arithmetic, figures from a synthetic JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, plots/ live at the root

from bench import summary  # noqa: E402
from bench.__main__ import _build_rfs  # noqa: E402
from bench.__main__ import main as bench_main  # noqa: E402
from plots.__main__ import loglog_slope  # noqa: E402
from plots.__main__ import main as plots_main  # noqa: E402

PNGS = ("time_vs_T.png", "memory_vs_T.png", "speedup_vs_T.png", "error_vs_M.png")
ROW_KEYS = {
    "provider", "feature", "causal", "mode", "B", "H", "T", "D", "E", "M", "dtype", "ms_p50",
    "ms_p20", "ms_p80", "tokens_per_s", "peak_bytes", "flops", "flop_per_s", "bytes",
    "roofline_fraction",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One end-to-end CPU run on tiny sizes: (exit code, JSON document, output folder)."""

    out = tmp_path_factory.mktemp("bench")
    argv = [
        "--device", "cpu", "--T", "32", "64", "--B", "1", "--H", "2", "--D", "8", "--E", "8",
        "--M", "8", "--features", "posrf", "--providers", "rfattn", "sdpa-math",
        "--min-reps", "2", "--max-reps", "2", "--ceiling-n", "64", "--ceiling-mib", "1",
        "--acc-T", "32", "--error-M", "4", "8", "--seeds", "2", "--out", str(out),
        "--jsonl", str(out / "rows.jsonl"),
    ]  # fmt: skip
    code = bench_main(argv)
    doc = json.loads((out / "bench.json").read_text())
    return code, doc, out


def test_cli_writes_valid_json(tiny_run):
    code, doc, _ = tiny_run
    assert code == 0
    assert doc["schema"] == "rfattn-bench/1"
    for key in ("device", "torch", "triton", "git_commit", "date"):
        assert key in doc["env"]
    assert doc["ceilings"]["matmul_flop_per_s"] > 0 and doc["ceilings"]["copy_bytes_per_s"] > 0
    assert doc["methods"]["memory"] and doc["methods"]["timing"]
    ran = {(r["provider"], r["feature"], r["causal"], r["mode"], r["T"]) for r in doc["results"]}
    for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            for t in (32, 64):
                assert ("rfattn", "posrf", causal, mode, t) in ran
                assert ("sdpa-math", None, causal, mode, t) in ran


def test_jsonl_has_every_row_as_measured(tiny_run):
    """--jsonl: each row (and failure) appended as it is measured, the same as in bench.json."""
    _, doc, out = tiny_run
    lines = [json.loads(ln) for ln in (out / "rows.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in d.items() if k != "kind"} for d in lines if d["kind"] == "row"]
    key = ("provider", "feature", "causal", "mode", "T", "ms_p50")
    assert sorted(tuple(r[k] for k in key) for r in rows) == sorted(
        tuple(r[k] for k in key) for r in doc["results"]
    )
    assert sum(d["kind"] == "failure" for d in lines) == sum("T" in f for f in doc["failures"])


def test_every_result_is_finite(tiny_run):
    _, doc, _ = tiny_run
    assert doc["results"]
    for r in doc["results"]:
        assert ROW_KEYS <= r.keys()
        for key in ("ms_p50", "ms_p20", "ms_p80", "tokens_per_s", "flop_per_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert 0 < r["roofline_fraction"]
        assert r["peak_bytes"] is None or r["peak_bytes"] >= 0
        assert r["check_ok"] is True, r


def test_accuracy_and_error_vs_m(tiny_run):
    _, doc, _ = tiny_run
    acc = {(a["provider"], a["feature"], a["causal"]): a["rel_err"] for a in doc["accuracy"]}
    assert acc[("sdpa-math", None, False)] < 1e-5  # exact up to rounding
    assert 0 < acc[("rfattn", "posrf", False)] < 10
    ms = sorted({r["M"] for r in doc["error_vs_M"] if r["feature"] == "posrf"})
    assert ms == [4, 8]
    for r in doc["error_vs_M"]:
        assert r["rel_err_min"] <= r["rel_err_mean"] <= r["rel_err_max"]


def test_plots_from_cli_json(tiny_run, tmp_path):
    _, _, out = tiny_run
    assert plots_main([str(out / "bench.json"), "--out", str(tmp_path)]) == 0
    for name in PNGS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_build_rfs_skips_unimplemented(monkeypatch):
    import rfattn

    real = rfattn.RandomFeatures

    def fake(head_dim, num_features, feature="posrf", **kw):
        if feature == "notyet":
            raise NotImplementedError("feature='notyet' is planned but not implemented yet")
        return real(head_dim, num_features, feature=feature, **kw)

    monkeypatch.setattr(rfattn, "RandomFeatures", fake)
    rfs, used, skipped = _build_rfs(["posrf", "notyet"], "orf", 8, 4, "cpu")
    assert list(rfs) == ["posrf"] and used == {"posrf": "orf"}
    assert skipped["notyet"].startswith("NotImplementedError: feature='notyet'")


def _row(provider, feature, t, ms, causal=False, mode="fwd", peak=None):
    return dict(provider=provider, feature=feature, causal=causal, mode=mode, T=t, ms_p50=ms,
                ms_p20=ms * 0.9, ms_p80=ms * 1.1, peak_bytes=peak)  # fmt: skip


def synthetic_doc() -> dict:
    """rfattn linear in T, softmax quadratic: they cross between T=512 and T=1024."""
    results = []
    for t in (256, 512, 1024, 2048):
        results.append(_row("rfattn", "posrf", t, t / 400, peak=1000 * t))
        results.append(_row("sdpa-math", None, t, (t / 600) ** 2, peak=t * t))
        results.append(_row("sdpa-flash", None, t, (t / 700) ** 2 * 1.5, peak=500 * t))
    return dict(
        env=dict(device="test device", torch="x", git_commit="0123456789"),
        config=dict(dtype="float32", B=1, H=8, D=64, E=64, M=256),
        results=results,
        summary=summary.summarize(results),
        error_vs_M=[
            dict(
                feature="posrf",
                weights="orf",
                causal=c,
                T=256,
                M=m,
                std=0.5,
                seeds=3,
                rel_err_mean=m**-0.5,
                rel_err_min=0.8 * m**-0.5,
                rel_err_max=1.2 * m**-0.5,
            )
            for c in (False, True)
            for m in (16, 64, 256)
        ],  # fmt: skip
    )


def test_crossover_and_ratio():
    doc = synthetic_doc()
    (entry,) = doc["summary"]
    assert entry["crossover_T"] == 1024
    assert entry["max_T"] == 2048
    best = min((2048 / 600) ** 2, (2048 / 700) ** 2 * 1.5)
    assert entry["ratio_at_max_T"] == pytest.approx(best / 5.12)
    assert entry["baseline"]["256"] == "sdpa-math"
    assert "crossover T=1024" in summary.describe(entry)


@pytest.mark.parametrize(
    "points, expected",
    [
        ([], None),
        ([(1, 0.5), (2, 0.9)], None),
        ([(1, 2.0), (2, 3.0)], 1),
        ([(1, 0.5), (2, 1.5), (4, 0.8), (8, 1.2), (16, 2.0)], 8),  # must stay ahead
        ([(4, 1.5), (1, 0.5), (2, 1.0)], 4),  # equal is not faster; order-independent
    ],
)
def test_crossover_cases(points, expected):
    assert summary.crossover(points) == expected


def test_loglog_slope():
    assert loglog_slope([(t, 3.0 * t * t) for t in (256, 512, 1024, 2048)]) == pytest.approx(2.0)
    assert loglog_slope([(t, 5.0 * t) for t in (256, 512, 1024)]) == pytest.approx(1.0)
    assert loglog_slope([(256, 1.0)]) is None


def test_plots_from_synthetic_json(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(synthetic_doc()))
    assert plots_main([str(path)]) == 0
    for name in PNGS:
        assert (tmp_path / name).stat().st_size > 1000


def test_allocator_worker_and_plot(monkeypatch, tmp_path):
    """bench.allocator's worker measures every case and provider (time and page faults), and
    its plot draws them (tiny T; the real run compares two worker environments)."""
    from bench import allocator

    monkeypatch.setattr(allocator, "CASES", [(True, "fwd", 64), (False, "fwd+bwd", 64)])
    rows = allocator.worker(reps=1)
    assert [(r["provider"], r["causal"], r["mode"]) for r in rows] == [
        (p, c, m) for c, m, _ in allocator.CASES for p in allocator.PROVIDERS
    ]
    assert all(r["ms_p50"] > 0 and r["faults_per_call"] >= 0 for r in rows)
    doc = dict(
        title="t",
        environments=allocator.ENVIRONMENTS,
        results=[dict(allocator=a, **r) for a in allocator.ENVIRONMENTS for r in rows],
    )
    allocator.plot(doc, tmp_path / "allocator.png")
    assert (tmp_path / "allocator.png").stat().st_size > 0


def test_time_cpu_rounds_alternates_and_pairs():
    """Rounds call each function once, first in the given order and then reversed, until the
    round count is reached; ``paired_ratio`` divides round by round."""
    from bench.timing import paired_ratio, time_cpu_rounds

    order = []
    times = time_cpu_rounds(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")},
        min_rounds=3,
        max_rounds=3,
        budget_s=0.0,
    )
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert [len(t) for t in times.values()] == [3, 3] and all(x >= 0 for x in times["a"])
    p50, p20, p80 = paired_ratio([2.0, 6.0, 3.0, 8.0], [1.0, 2.0, 3.0, 2.0])
    # ratios 1, 2, 3, 4: numpy's linear quantiles
    assert (p50, p20, p80) == pytest.approx((2.5, 1.6, 3.4), rel=1e-12)


@pytest.mark.slow  # ~10 s: a side-by-side run
def test_cpu_backend_side_by_side(monkeypatch, tmp_path):
    """bench.cpu_backend end to end on a tiny T (compiled providers replaced by an eager one,
    no memory worker): every row timed, the side-by-side ones with their ratio to rfattn's, a
    provider that fails to build recorded with its error, and the plot drawn."""
    from bench import cpu_backend

    monkeypatch.setattr(cpu_backend, "COMPILED", ("rfattn-previous", "no-such-provider"))
    args = argparse.Namespace(
        T=[64, 128], reps=2, previous_max_T=64, compile_T=64, no_memory=True, notes=""
    )
    doc = cpu_backend.run(args)
    rows = doc["results"]
    assert {(r["provider"], r["T"]) for r in rows if r["causal"] and r["mode"] == "fwd"} == {
        ("rfattn", 64), ("sdpa-flash", 64), ("rfattn-previous", 64),
        ("rfattn", 128), ("sdpa-flash", 128),
    }  # fmt: skip
    for r in rows:
        assert r["ms_p50"] > 0 and r["n"] >= 2
        assert ("over_rfattn" in r) == (r["provider"] == "sdpa-flash")
    ratio = next(r for r in rows if r["provider"] == "sdpa-flash")["over_rfattn"]
    assert ratio["p20"] <= ratio["p50"] <= ratio["p80"] and ratio["p50"] > 0
    compiled = {(r["provider"], r["causal"], r["mode"]): r for r in doc["compiled"]}
    assert len(compiled) == 3 * 4
    for (provider, _, _), r in compiled.items():
        if provider == "no-such-provider":
            assert "error" in r and "ms_p50" not in r
        else:
            assert r["ms_p50"] > 0 and ("over_rfattn" in r) == (provider != "rfattn")
    assert [c["provider"] for c in doc["contention"]] == ["rfattn", "sdpa-flash"]
    assert [r["result"] for r in doc["exp_paths"]] == [n for n, _ in cpu_backend.EXP_ARGUMENTS]
    assert all(r["exp_ms"] > 0 and r["exp2_form_ms"] > 0 for r in doc["exp_paths"])
    cpu_backend.plot(doc, tmp_path / "cpu_backend.png")
    assert (tmp_path / "cpu_backend.png").stat().st_size > 0


def test_plots_refuses_other_json(tmp_path, capsys):
    """A JSON of another benchmark is named, not plotted as nothing (before: exit 0 and no
    output, or a KeyError)."""
    for doc in (dict(device="cpu", rows=[], ratio_last_first=1.0), dict(results=[])):
        path = tmp_path / "other.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(SystemExit) as exc:
            plots_main([str(path), "--out", str(tmp_path)])
        assert exc.value.code == 2
        assert "not a JSON of python -m bench" in capsys.readouterr().err


def fake_gpu_problem() -> str | None:
    """Why ``python -m bench.host`` cannot run here, or None."""
    import importlib.util
    import os
    import shutil

    import torch

    if torch.cuda.is_available():
        return "a real GPU is present (the fake one is for machines without)"
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return "this Triton has no CUDA backend"
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        return "no C compiler for Triton's launcher module"
    return None


@pytest.mark.skipif(fake_gpu_problem() is not None, reason=str(fake_gpu_problem()))
@pytest.mark.slow  # ~8 s: compiles for the fake H100
def test_host_quick_run(tmp_path):
    """python -m bench.host --quick (posrf, non-causal forward, small shape, 20 calls) runs
    Triton's real launch path against the fake H100 in a fresh process with the interpreter off,
    and writes its JSON: times, launches that reached the fake cuLaunchKernelEx (in the counted
    call and in every timed one), GPU-side ops by name, no host copy and no sync. About 12 s
    with an empty Triton cache (compiles the three kernels for sm_90), 6 s with a warm one."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "bench.host", "--quick", "--out", str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "host.json").read_text())
    assert doc["schema"] == "rfattn-bench-host/1"
    assert doc["fake_device"]["device_properties"]["max_shared_mem"] == 232448
    for key in ("torch", "triton", "git_commit", "loadavg_before", "loadavg_after"):
        assert key in doc["env"]
    (row,) = doc["results"]
    assert (row["feature"], row["case"], row["shape"]) == ("posrf", "noncausal fwd", "small")
    assert 0 < row["host_us"]["p10"] <= row["host_us"]["p50"] <= row["host_us"]["p90"]
    # timed in rounds (2 for --quick): p50 is the quietest round's median
    assert row["rounds"] == 2 and len(row["host_us_round_p50"]) == 2 and row["reps"] == 20
    assert row["host_us"]["p50"] == min(row["host_us_round_p50"])
    assert row["triton_launches"] >= 1
    assert row["triton_launches_timed"] == row["triton_launches"]
    assert sum(row["launched_kernels"].values()) == row["triton_launches"]
    assert row["gpu_operations"] == row["triton_launches"] + row["gpu_ops"]
    assert row["gpu_ops"] == sum(row["gpu_ops_by_name"].values())
    assert row["host_copies"] == {} and row["syncs"] == {}
    floor = doc["torch_floor_us"]["small"]  # torch's own cost of a differentiable call
    assert 0 < floor["fwd"] < floor["fwd+bwd"]
    assert any(t["what"].endswith("host copies + syncs") and t["met"] for t in doc["targets"])


def test_generate_loop_keeps_rfattn_cache_bytes_flat(tmp_path):
    """bench.generate --loop at a tiny size: the JSON has every provider at both contexts, and
    rfattn's cache bytes (the hybrid's too, window and sinks included) are the same after either
    context and after decoding while sdpa's grow
    (what the committed result reports, measured rather than assumed)."""
    from bench import generate

    assert generate.main(["--loop", "--device", "cpu", "--contexts", "8", "24", "--steps", "2",
                          "--num-features", "16", "--out", str(tmp_path)]) == 0  # fmt: skip
    doc = json.loads((tmp_path / "generate_loop.json").read_text())
    rf, sd = doc["results"]["rfattn"]["contexts"], doc["results"]["sdpa"]["contexts"]
    assert set(rf) == set(sd) == {"8", "24"}
    sizes = {r[k] for r in rf.values() for k in ("cache_bytes_after_context",
                                                   "cache_bytes_after_decoding")}  # fmt: skip
    assert len(sizes) == 1 and sizes.pop() > 0
    hy = doc["results"]["rfattn-hybrid"]["contexts"]  # the state keeps the window and sinks too
    hybrid_sizes = {r[k] for r in hy.values() for k in ("cache_bytes_after_context",
                                                         "cache_bytes_after_decoding")}  # fmt: skip
    assert len(hybrid_sizes) == 1 and hybrid_sizes.pop() > rf["8"]["cache_bytes_after_context"]
    assert sd["8"]["cache_bytes_after_context"] < sd["24"]["cache_bytes_after_context"] < \
        sd["24"]["cache_bytes_after_decoding"]  # fmt: skip
    assert all(r["ms_median"] > 0 for r in (*rf.values(), *sd.values()))


PACKED_ARGS = ["--device", "cpu", "--total", "24", "--max-len", "12", "--median", "4",
               "--short", "3", "--uniform-n", "3", "--many-n", "6", "--heads", "1", "--dim", "4",
               "--num-features", "4", "--rounds", "2", "--budget-s", "0"]  # fmt: skip


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny calls on a busy 2-core host otherwise wait on each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_packed_cli(tmp_path, one_thread):
    """python -m bench.packed on tiny sizes: the JSON has every mix's facts and, per mix,
    causality and mode, the two ways' times, the padded / packed ratio and the relative RMS
    errors of the check (packed and padded equal on the valid positions) run before timing."""
    from bench.packed import main as packed_main

    assert packed_main([*PACKED_ARGS, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "packed.json").read_text())
    assert doc["checked_equal"] is True
    assert {"device", "machine", "threads", "torch", "env", "config", "method"} <= set(doc)
    assert len(doc["loadavg_before"]) == len(doc["loadavg_after"]) == 3
    assert set(doc["mixes"]) == {"longtail", "onelong", "uniform", "manyshort"}
    tail, uniform = doc["mixes"]["longtail"], doc["mixes"]["uniform"]
    assert tail["total"] == sum(tail["lengths"]) == 24 and tail["max_len"] <= 12
    assert uniform["N"] == 3 and 0 <= uniform["padding_fraction"] < tail["padding_fraction"]
    assert doc["mixes"]["onelong"]["lengths"] == [12] + [3] * 7
    assert doc["mixes"]["manyshort"]["N"] == 6
    assert {(r["mix"], r["causal"], r["mode"]) for r in doc["results"]} == {
        (m, c, mode) for m in doc["mixes"] for c in (False, True)
        for mode in ("fwd", "fwd+bwd")
    }  # fmt: skip
    for r in doc["results"]:
        assert set(r["check_rel_rms"]) == {"out", "dq", "dk", "dv"}
        assert all(0 <= e <= 1e-5 for e in r["check_rel_rms"].values())
        assert r["rounds"] == 2 and r["ratio_p20"] <= r["ratio_p50"] <= r["ratio_p80"]
        for way in ("packed", "padded"):
            assert 0 < r[f"{way}_ms_p10"] <= r[f"{way}_ms_p50"]


def test_packed_check_catches_a_wrong_padded_batch(one_thread):
    """The check before timing fails when the padded batch does not hold the packed data."""
    import torch

    import rfattn
    from bench.packed import Case

    rf = rfattn.RandomFeatures(4, 4, "posrf", seed=0)
    case = Case([5, 2, 7], 1, 4, rf, torch.device("cpu"))
    case.check(causal=True)
    case.padded[2][1, :, 0] += 1.0  # v of the second document's first token
    with pytest.raises(AssertionError, match="padded"):
        case.check(causal=True)
