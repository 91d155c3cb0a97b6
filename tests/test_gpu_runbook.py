"""bench.gpu, the GPU runbook: its harness, tested without a GPU (the smoke stage runs under the
Triton interpreter at tiny shapes; the CUDA-only stages are recorded as skipped)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu

REPO = Path(__file__).resolve().parent.parent


def _run(*argv, timeout=300):
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - t0


def test_dry_run_prints_the_plan():
    proc, _ = _run("--dry-run", "--profile", "--budget-s", "300")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("  ")]
    assert [ln.split()[0] for ln in lines] == [s.name for s in gpu.STAGES]
    boxes = [float(ln.split()[2]) for ln in lines]
    assert sum(boxes) == pytest.approx(300, abs=len(boxes) / 2)  # each printed to the second


def test_plan_shares_the_budget_and_skips_cuda_stages_without_cuda():
    steps = gpu.plan(["env", "smoke", "bench"], 150, cuda=False)
    assert sum(s["box_s"] for s in steps) == pytest.approx(150, abs=0.2)
    shares = {s.name: s.box_s for s in gpu.STAGES}
    total = shares["env"] + shares["smoke"] + shares["bench"]
    assert steps[0]["box_s"] == pytest.approx(150 * shares["env"] / total, abs=0.1)
    assert [s["runs"] for s in steps] == [True, True, False]


@pytest.mark.slow
def test_smoke_stage_report_with_a_failing_case(tmp_path):
    """Two real cases pass against float64; a broken one is recorded, not fatal; the CUDA-only
    stage after it is still reached (skipped); the report is written and well formed."""
    bad = json.dumps({"path": "parallel", "form": "gerf", "feature": "nosuch", "dtype": "float32"})
    proc, _ = _run(
        "--stages",
        "smoke",
        "pytest",
        "--out",
        str(tmp_path),
        "--smoke-cases",
        "parallel/posrf/",
        "decode/rmf/",
        "--smoke-extra",
        bad,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # not every stage ok
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["schema"] == gpu.SCHEMA
    assert [s["name"] for s in report["stages"]] == ["smoke", "pytest"]
    for s in report["stages"]:
        assert s["status"] in gpu.STATUSES
        assert s["seconds"] <= s["box_s"] + 5
    smoke, pytest_stage = report["stages"]
    assert pytest_stage["status"] == "skipped"
    rows = {r["case"]: r for r in smoke["rows"]}
    assert set(rows) == {"parallel/posrf/float32", "decode/rmf/float32", "parallel/nosuch/float32"}
    assert rows["parallel/nosuch/float32"]["verdict"] == "error"
    assert "nosuch" in rows["parallel/nosuch/float32"]["error"]
    for case in ("parallel/posrf/float32", "decode/rmf/float32"):
        r = rows[case]
        assert r["verdict"] == "ok" and r["finite"], r
        assert all(r["errors"][n] <= r["limits"][n] for n in r["errors"])
    assert set(rows["parallel/posrf/float32"]["errors"]) == {"out", "dq", "dk", "dv"}
    assert smoke["status"] == "failed" and "nosuch" in smoke["summary"]
    md = (tmp_path / "gpu_report.md").read_text()
    assert "| smoke | failed |" in md and "| pytest | skipped |" in md
    assert md.splitlines()[-1] in proc.stdout  # the table is printed last


@pytest.mark.slow
def test_time_box_stops_a_stage_and_the_next_runs(tmp_path):
    """A stage over its box is killed at the box and marked timeout; the run goes on."""
    proc, wall = _run("--stages", "smoke", "pytest", "--box", "smoke=4", "--out", str(tmp_path))
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    smoke, nxt = report["stages"]
    assert smoke["status"] == "timeout", smoke
    assert 4 <= smoke["seconds"] < 4 + 10
    assert nxt["name"] == "pytest" and nxt["status"] == "skipped"
    assert wall < 60
    assert proc.returncode == 1


def _row(provider, T, ms, causal=False, mode="fwd", feature="posrf", peak=None, roof=None):
    return dict(
        provider=provider,
        feature=None if provider.startswith("sdpa") else feature,
        causal=causal,
        mode=mode,
        T=T,
        ms_p50=ms,
        peak_bytes=peak,
        roofline_fraction=roof,
    )


def test_targets_from_rows():
    rows = [
        _row("sdpa-cudnn", 1024, 1.0),
        _row("rfattn", 1024, 0.5, roof=0.2),
        _row("sdpa-cudnn", 8192, 9.0),
        _row("rfattn", 8192, 2.0, peak=100, roof=0.6),
        _row("rfattn-torch", 8192, 8.0, peak=500),
        _row("rfattn-compiled", 8192, 3.0),
        _row("sdpa-cudnn", 16384, 30.0),
        _row("rfattn", 16384, 4.0),
    ]
    stages = {
        "decode": {"decode": {"ratio_last_first": 1.05}},
        "compile": {"rows": [{"graph_breaks": 0}, {"graph_breaks": 2}]},
    }
    got = {t["target"]: t for t in gpu.targets(rows, stages)}
    t = got["crossover T <= 1024, non-causal fwd"]
    assert (t["measured"], t["met"]) == (1024, True)
    t = got[">= 10x faster than the best SDPA at T=16384, non-causal fwd"]
    assert (t["measured"], t["met"]) == (7.5, False)
    t = got[">= 3x faster than the unfused path, non-causal fwd, T=8192"]
    assert (t["measured"], t["met"]) == (4.0, True)
    t = got[">= 2x faster than the compiled unfused path, non-causal fwd, T=8192"]
    assert (t["measured"], t["met"]) == (1.5, False)
    t = got[">= 4x less peak memory than the unfused path, non-causal fwd, T=8192"]
    assert (t["measured"], t["met"]) == (5.0, True)
    assert got[">= 50 % of the roofline floor (best rfattn row)"]["measured"] == 0.6
    assert got["decode time per token flat in position (last/first <= 1.2)"]["met"] is True
    t = got["zero graph breaks under torch.compile"]
    assert (t["measured"], t["met"]) == (2, False)
    t = got["crossover T <= 2048, causal fwd"]  # no causal rows
    assert (t["measured"], t["met"]) == (None, None)


def test_junit_and_ncu_parsers(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="t.a" name="ok"/>'
        '<testcase classname="t.a" name="bad"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="t.b" name="skip"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts, failures = gpu._junit(xml)
    assert counts == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert failures == [{"test": "t.a::bad", "message": "assert 1 == 2"}]
    csv_text = (
        "==PROF== noise\n"
        '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
        '"0","_fwd_kv_kernel","GPU Speed Of Light Throughput","DRAM Throughput","%","41.2"\n'
        '"0","_fwd_kv_kernel","Launch Statistics","Registers Per Thread",'
        '"register/thread","168"\n'
        '"0","_fwd_kv_kernel","Launch Statistics","Waves Per SM","","3"\n'
        '"1","_fwd_q_kernel","GPU Speed Of Light Throughput","Duration","us","812.5"\n'
    )
    rows = gpu._ncu_rows(csv_text)
    assert rows == [
        {
            "kernel": "_fwd_kv_kernel",
            "id": "0",
            "DRAM Throughput [%]": "41.2",
            "Registers Per Thread [register/thread]": "168",
        },
        {"kernel": "_fwd_q_kernel", "id": "1", "Duration [us]": "812.5"},
    ]


def _feature_docs(folder, features=(("posrf", 1.0), ("rmf", 2.0))):
    """Per-feature bench.json files as ``stage_bench`` leaves them in ``folder``."""
    for f, ms in features:
        (folder / f).mkdir(parents=True)
        doc = {
            "schema": "rfattn-bench/1",
            "env": {"device": f},
            "config": {"features": [f], "features_run": [f]},
            "results": [_row("rfattn", 64, ms, feature=f)],
            "summary": [{"feature": f}],
            "accuracy": [],
            "error_vs_M": [],
            "failures": [],
            "skipped": [],
        }
        (folder / f / "bench.json").write_text(json.dumps(doc))


def test_merge_bench_concatenates_the_feature_runs(tmp_path):
    _feature_docs(tmp_path)
    gpu._merge_bench(tmp_path, ["posrf", "oprf", "rmf"])  # oprf never finished
    merged = json.loads((tmp_path / "bench.json").read_text())
    assert [r["feature"] for r in merged["results"]] == ["posrf", "rmf"]
    assert merged["config"]["features_run"] == ["posrf", "rmf"]
    assert merged["env"] == {"device": "posrf"}


def test_a_cut_off_benchmark_keeps_its_finished_features_and_streamed_rows(tmp_path):
    """The bench stage killed at its box (an H100 run, 2026-11-27) left no merged bench.json and
    reported 0 rows while 105 had streamed to the JSONL: collect merges the features that
    finished and the report counts the streamed rows."""
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    _feature_docs(work / "bench", (("posrf", 1.0), ("oprf", 2.0)))  # rmf was running
    rows = [_row("rfattn", 64, 1.0), _row("rfattn", 64, 3.0, feature="rmf")]
    with open(work / "bench_rows.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"kind": "row", **r}) + "\n")
    doc = gpu.collect(work, out)
    assert [r["ms_p50"] for r in doc["bench_rows"]] == [1.0, 3.0]
    merged = json.loads((out / "bench.json").read_text())
    assert merged["config"]["features_run"] == ["posrf", "oprf"]
    assert gpu.STREAMED_ROWS["bench"] == "bench_rows.jsonl"
    assert len(gpu._bench_rows(work / gpu.STREAMED_ROWS["bench"])[0]) == 2


def test_sync_stage_is_planned_and_cuda_only():
    (sync,) = [st for st in gpu.plan(gpu.DEFAULT_STAGES, 540, cuda=False) if st["name"] == "sync"]
    assert not sync["runs"]
    assert gpu.DEFAULT_STAGES.index("sync") == gpu.DEFAULT_STAGES.index("smoke") + 1


def test_runbook_refuses_clearly_without_the_installed_kernels(monkeypatch):
    """Where ``rfattn.kernels`` does not import (an H100 session's first call, after a bare
    ``pip install -e .``: every stage failed on it), the runbook says how to install the package
    instead of failing every stage."""
    import builtins

    real = builtins.__import__

    def no_kernels(name, *a, **kw):
        if name == "rfattn.kernels":
            raise ModuleNotFoundError("No module named 'rfattn.kernels'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_kernels)
    assert gpu.main(["--dry-run"]) == 2
    why = gpu._not_importable()
    assert "rfattn.kernels" in why and "-m pip install" in why


def test_packed_stage_merges_the_mixes_it_finished(tmp_path):
    """The packed stage runs one mix at a time: a run cut off keeps the mixes done, merged in
    ``bench.packed.MIXES`` order, and the summary gives padded / packed per mix."""
    for mix, ratio in (("uniform", 1.1), ("longtail", 3.4)):
        doc = {"title": mix, "mixes": {mix: {"N": 8}}, "seconds": 2.0,
               "results": [{"mix": mix, "causal": c, "mode": "fwd", "ratio_p50": ratio + c}
                           for c in (0, 1)]}  # fmt: skip
        (tmp_path / "packed" / mix).mkdir(parents=True)
        (tmp_path / "packed" / mix / "packed.json").write_text(json.dumps(doc))
    merged = gpu.merge_packed(tmp_path / "packed")
    assert [r["mix"] for r in merged["results"]] == ["longtail"] * 2 + ["uniform"] * 2
    assert set(merged["mixes"]) == {"longtail", "uniform"} and merged["seconds"] == 4.0
    assert gpu._packed_summary(merged["results"]) == (
        "padded / packed: longtail 3.40-4.40x, uniform 1.10-2.10x"
    )
    assert gpu.merge_packed(tmp_path / "nothing") is None
    out = tmp_path / "out"
    out.mkdir()
    gpu.collect(tmp_path, out)
    assert json.loads((out / "packed.json").read_text())["results"] == merged["results"]


@pytest.mark.slow  # eight fused calls under the interpreter: ~40 s
def test_rmf_probe_runs_every_precision_on_the_same_inputs():
    """bench.probe_rmf (for the next GPU session): under the interpreter every precision of both
    fused paths errs as the torch path does (the emulation's answer; the H100's was 0.27)."""
    from bench.probe_rmf import PRECISIONS, probe

    rows = probe(B=1, H=1, T=20, D=8, M=8, device=torch.device("cpu"))
    for path in ("parallel", "chunk"):
        got = {r["precision"]: r["error"] for r in rows if r["path"] == path}
        assert set(got) == {"torch path", *PRECISIONS}
        assert all(e is not None and e <= 2 * got["torch path"] + 1e-6 for e in got.values())


def test_probe_stage_fails_only_where_the_default_precision_errs(tmp_path, monkeypatch):
    import bench.probe_rmf

    def rows(errs):
        return [dict(path="parallel", precision=p, error=e) for p, e in errs.items()]

    for tf32x3, status in ((0.03, "ok"), (0.2, "failed")):
        errs = {"torch path": 0.027, "half": 0.27, "tf32x3": tf32x3, "ieee": 0.02}
        monkeypatch.setattr(bench.probe_rmf, "probe", lambda errs=errs: rows(errs))
        rec = gpu.Recorder(tmp_path / "stage-probe.json")
        gpu.stage_probe(rec, tmp_path, None)
        assert rec.doc["status"] == status and len(rec.doc["rows"]) == 4
        assert "parallel half 2.70e-01" in rec.doc["summary"]
