"""The commands' plumbing that runs without a GPU: where they read and write."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module", ["bench", "compare"])
def test_commands_write_into_the_repository(module):
    """ROOT is the repository root (common/tools/ sits two levels below it), not common/."""
    import importlib

    root = importlib.import_module(f"common.tools.{module}").ROOT
    assert (root / "pyproject.toml").is_file() and (root / "common").is_dir()


# -- the command line: plain help, every option explained, one-line errors ----------------

def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "common", *args], capture_output=True, text=True, timeout=300)


def test_help_is_plain_text_and_every_option_has_help():
    from common.tools.cli import parser

    top = parser()
    assert "``" not in top.format_help()
    commands = next(a for a in top._actions if a.dest == "command")
    assert set(commands.choices) == {"demo", "bench", "tune", "compare"}
    for name, sub in commands.choices.items():
        text = sub.format_help()
        assert "``" not in text, name
        options = [a for a in sub._actions if a.dest != "help"]
        for action in options:
            assert action.help, f"{name} {action.option_strings} has no help text"
        assert text.count("(default:") == len(options), f"{name}: every option shows its default"


def test_help_imports_no_command_and_no_torch():
    """``twin-attention --help`` lists the commands from the CLI's table alone: it imports no command's
    module and neither torch, triton nor ninetoothed (it took 2-3 s when it imported them all)."""
    import subprocess
    import sys

    heavy = ["torch", "triton", "ninetoothed", "common.dispatch", "common.tools.demo", "common.tools.bench",
             "common.tools.tune", "common.tools.compare"]
    code = (
        "import contextlib, io, sys\n"
        "from common.tools.cli import main\n"
        "text = io.StringIO()\n"
        "with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        f"print(text.getvalue())\nprint([m for m in {heavy!r} if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    *help_text, loaded = result.stdout.strip().splitlines()
    assert loaded == "[]"
    help_text = "\n".join(help_text)
    for command in ("demo", "bench", "tune", "compare"):
        assert f"    {command} " in help_text, command
    assert "tests/test_seed.py" in help_text  # "the homework" is said what it is


def test_a_command_loads_only_its_own_module():
    """The command that runs (here ``demo --help``) gets its options and description; the others stay unloaded."""
    import subprocess
    import sys

    code = (
        "import contextlib, io, sys\n"
        "from common.tools.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):\n"
        "    main(['demo', '--help'])\n"
        "tools = sorted(m for m in sys.modules if m.startswith('common.tools.'))\n"
        "print('original assignment' in text.getvalue(), tools)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "True ['common.tools.cli', 'common.tools.demo']"


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{", "not a readable results.json"),
    ('{"rows": 1}', "not a results.json written by bench"),
])
def test_bench_from_json_errors_in_one_line(tmp_path, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    result = _cli("bench", "--from-json", str(path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_bench_writes_the_committed_report_only_with_write():
    """Results and plots go to --out (bench-results/ in the current directory), the report to stdout; --write
    alone names the repository's benchmarks/ and BENCHMARKS.md, and refuses --out or --markdown beside it."""
    import argparse
    import pathlib

    from common.tools import bench, cli

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.destinations(parser.parse_args([])) == (pathlib.Path("bench-results"), "-")
    assert bench.destinations(parser.parse_args(["--markdown", ""])) == (pathlib.Path("bench-results"), None)
    assert bench.destinations(parser.parse_args(["--out", "o", "--markdown", "r.md"])) == (
        pathlib.Path("o"), pathlib.Path("r.md"))
    committed = (bench.ROOT / "benchmarks", bench.ROOT / "BENCHMARKS.md")
    assert bench.destinations(parser.parse_args(["--write"])) == committed
    with pytest.raises(cli.CommandError, match="--write names the committed"):
        bench.destinations(parser.parse_args(["--write", "--out", "elsewhere"]))


def test_bench_from_json_rewrites_no_tracked_file_unless_asked(tmp_path):
    """`bench --from-json` prints the report and writes its results and plots under the current directory;
    --markdown PATH writes the report there, its plots linked relative to it; the committed files stay."""
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("matplotlib")  # the report's plots
    before = _tracked_outputs()
    results = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results.json"
    printed = subprocess.run([sys.executable, "-m", "common", "bench", "--from-json", str(results)],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert printed.stdout.startswith("# Benchmarks") and "](bench-results/throughput_" in printed.stdout
    assert (tmp_path / "bench-results" / "results.json").is_file()
    (tmp_path / "docs").mkdir()
    written = subprocess.run([sys.executable, "-m", "common", "bench", "--from-json", str(results), "--markdown",
                              "docs/B.md", "--out", "docs/runs"], capture_output=True, text=True, cwd=tmp_path,
                             timeout=300)
    assert written.returncode == 0, written.stderr[-2000:]
    assert written.stdout == "" and "](runs/throughput_" in (tmp_path / "docs" / "B.md").read_text()
    assert _tracked_outputs() == before


def test_bench_merges_runs():
    """Results of several runs (one per GPU, forward and backward apart) make one report; a shape
    measured again keeps only the later run's rows (the earlier run's other backends' dropped)."""
    from common.tools.bench import merge_results

    def row(mode, L, backend, ms):
        return dict(section="throughput", mode=mode, dtype="bfloat16", B=1, H=16, H_kv=16, Lq=L, Lk=L, D=128,
                    causal=True, backend=backend, ms=ms)

    fwd = dict(environment=dict(date="fwd-date", gpu="X"), rows=[row("fwd", 1024, "triton", 1.0),
                                                                 row("fwd", 4096, "triton", 2.0),
                                                                 row("fwd", 4096, "sdpa-flash", 2.5)])
    again = dict(environment=dict(date="later"), rows=[row("fwd", 4096, "triton", 3.0)])
    bwd = dict(environment=dict(date="bwd-date"), rows=[row("bwd", 1024, "triton", 4.0)])
    merged = merge_results([fwd, again, bwd])
    assert merged["environment"] == dict(date="fwd-date", gpu="X", date_backward="bwd-date",
                                         later_runs=[dict(date="later", sections=["throughput"])])
    assert sorted((r["mode"], r["Lq"], r["ms"]) for r in merged["rows"]) == [
        ("bwd", 1024, 4.0), ("fwd", 1024, 1.0), ("fwd", 4096, 3.0)]


def test_bench_plans_the_masking_asked_for():
    """--masking picks the throughput section's shapes: causal only, full only, or both (default)."""
    import argparse

    from common.tools.bench import add_arguments, plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--sections", "throughput", "--dtypes", "float16", "--lengths", "1024", "4096"]
    for masking, wanted in ((["causal"], {True}), (["full"], {False}), ([], {False, True})):
        args = parser.parse_args(base + (["--masking", *masking] if masking else []))
        jobs = plan(args)
        assert {job[8] for job in jobs} == wanted, masking  # (section, B, H, H_kv, Lq, Lk, D, dtype, is_causal, ...)
        assert len(jobs) == 2 * 2 * len(wanted)  # head dims x lengths x masking


def test_bench_fp8_section_plans_rates_and_reports():
    """The fp8 section: prefill at L 4k and 16k for each head dim and masking, then decoding from FP8
    keys and values; each FP8 row set against SDPA's bfloat16 row and our own 16-bit row of the shape."""
    import argparse

    from common.tools.bench import FP8, FP8_KV, _add_ratios, add_arguments, markdown, plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    jobs = plan(parser.parse_args(["--sections", "fp8", "--head-dims", "128", "--masking", "causal"]))
    assert [(j[7], j[4], j[5], j[8]) for j in jobs] == [(FP8, 4096, 4096, True), (FP8, 16384, 16384, True),
                                                          (FP8_KV, 1, 16384, False), (FP8_KV, 1, 65536, False)]

    def row(section, dtype, backend, ms, Lq=4096, Lk=4096, B=4, H=16, H_kv=16):
        return dict(section=section, mode="fwd", dtype=dtype, B=B, H=H, H_kv=H_kv, Lq=Lq, Lk=Lk, D=128, causal=False,
                    backend=backend, ms=ms, tflops=1.0, status="ok")

    rows = [row("throughput", "bfloat16", "triton", 3.0), row("throughput", "float16", "triton", 1.0),
            row("fp8", FP8, "triton", 2.0), row("fp8", FP8, "torch", 2.5), row("fp8", FP8, "ninetoothed", 4.0),
            row("decode", "float16", "triton", 0.2, 1, 16384, 8, 32, 8),
            row("fp8", FP8_KV, "triton", 0.1, 1, 16384, 8, 32, 8)]
    _add_ratios(rows)
    fp8_triton, fp8_nt, decode = rows[2], rows[4], rows[6]
    assert fp8_triton["vs_16bit"] == 1.5 and fp8_triton["vs_sdpa"] == 1.25  # (bf16's row, not fp16's)
    assert "vs_16bit" not in fp8_nt and fp8_nt["vs_triton"] == 0.5  # (no 16-bit row of NineToothed's)
    assert decode["vs_16bit"] == 2.0
    text = markdown(rows, dict(gpu="X", torch="t", cuda="c", triton="3", ninetoothed="n", python="3", date="d"),
                    [], "")
    assert "## FP8 (e4m3) inputs, forward" in text and " triton / our 16-bit |" in text


def test_bench_fp8_bound_accepts_the_kernel_and_catches_a_wrong_row(backend):
    """bench's check of an FP8 row (a slice against float64 of the dequantized inputs, the bound of
    tests/test_fp8.py) passes the kernel's output and fails it moved by a little."""
    import torch

    from common import attention, quantize_fp8
    from common.fp8 import dequantize_fp8
    from common.tools.bench import _fp8_bound

    from .conftest import DEVICE

    q, qd = quantize_fp8(torch.randn(1, 2, 40, 32, device=DEVICE) * 2, heads=1)
    (k, kd), (v, vd) = (quantize_fp8(torch.randn(1, 1, 40, 32, device=DEVICE)) for _ in range(2))
    out = attention(q, k, v, is_causal=True, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd,
                    backend=backend)
    real = [dequantize_fp8(x, d) for x, d in ((q, qd), (k, kd), (v, vd))]
    assert _fp8_bound(out, *real, True, True)
    moved = out.clone()
    # (past the bound: on a GPU it allows the FP8 MMAs' sums, about 0.1 for these values at the last row,
    # which sees every key; 0.1 was inside it there)
    moved[0, 1, -1, 3] += 0.5
    assert not _fp8_bound(moved, *real, True, True)


def _speed_results(path):
    """A results.json of one throughput shape, timed forward (three backends) and backward (two)."""
    import json

    rows = [dict(section="throughput", mode=mode, dtype="bfloat16", B=1, H=16, H_kv=16, Lq=4096, Lk=4096, D=128,
                 causal=False, backend=backend, tflops=tflops)
            for mode, backend, tflops in [("fwd", "triton", 400.0), ("fwd", "ninetoothed", 360.0),
                                          ("fwd", "torch", 500.0), ("bwd", "triton", 300.0),
                                          ("bwd", "ninetoothed", 150.0)]]
    path.write_text(json.dumps(dict(environment=dict(gpu="X", date="today"), rows=rows)))
    return path


def test_compare_speed_keeps_forward_and_backward_apart(tmp_path):
    """A shape timed forward and backward is two rows of COMPARISON.md's speed table, each with its own numbers."""
    from common.tools import compare

    text, plot = compare.speed_section(_speed_results(tmp_path / "results.json"))
    assert plot is None and "drawn only when the report goes to a file" in text  # stdout: no plot, and it says so
    assert "| fwd | bfloat16 | 128 | 4096 | no | 400 | 360 | 0.90 | 0.80 |" in text
    assert "| bwd | bfloat16 | 128 | 4096 | no | 300 | 150 | 0.50 | - |" in text
    assert text.index("| fwd |") < text.index("| bwd |")
    assert "fwd: median 0.90" in text and "bwd: median 0.50" in text


def test_compare_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    """Without matplotlib the speed plot is left out with a warning on stderr and a note where it would be."""
    import sys

    from common.tools import compare

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    text, plot = compare.speed_section(_speed_results(tmp_path / "results.json"), tmp_path / "comparison")
    assert plot is None and not (tmp_path / "comparison").exists()
    assert "(No plot of speed by shape: matplotlib is not installed (pip install -e '.[bench]').)" in text
    assert "warning: no plot of speed by shape: matplotlib is not installed" in capsys.readouterr().err


def test_compare_draws_its_plot_beside_a_written_report(tmp_path):
    from common.tools import compare

    pytest.importorskip("matplotlib")
    text, plot = compare.speed_section(_speed_results(tmp_path / "results.json"), tmp_path / "comparison")
    assert plot == tmp_path / "comparison" / "speed_by_shape.png" and plot.stat().st_size > 0
    assert "![speed by shape](comparison/speed_by_shape.png)" in text


def _tracked_outputs():
    """The committed reports and their folders' files, by path: their modification times and bytes."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    paths = [root / "COMPARISON.md", root / "BENCHMARKS.md", *sorted((root / "comparison").iterdir()),
             *sorted((root / "benchmarks").glob("*.*"))]
    return {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in paths if path.is_file()}


def test_compare_rewrites_no_tracked_file_unless_asked(tmp_path):
    """`compare` prints its report on stdout and writes nothing; --output PATH writes PATH and a comparison/
    folder beside it (generated code, plot); neither touches COMPARISON.md or comparison/. Run without a GPU
    (CUDA_VISIBLE_DEVICES=''), so that it measures nothing and reads comparison/gpu.json on any machine."""
    import os
    import subprocess
    import sys

    pytest.importorskip("radon")  # compare's code metrics (the [bench] extra; the GPU machine lacks it)
    before = _tracked_outputs()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    printed = subprocess.run([sys.executable, "-m", "common", "compare"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=600)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert printed.stdout.startswith("# Triton and NineToothed, side by side")
    assert "## Speed" in printed.stdout and "kernel lines:" in printed.stderr
    assert list(tmp_path.iterdir()) == []
    report = tmp_path / "out" / "C.md"
    report.parent.mkdir()
    written = subprocess.run([sys.executable, "-m", "common", "compare", "--output", str(report)],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert written.returncode == 0, written.stderr[-2000:]
    assert report.read_text().startswith("# Triton and NineToothed, side by side")
    assert (tmp_path / "out" / "comparison" / "ninetoothed_generated.py").is_file()
    assert _tracked_outputs() == before


def test_a_missing_extra_is_named(monkeypatch):
    from common.tools import cli

    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(cli.CommandError, match=r"bench needs the package 'matplotlib': pip install -e '\.\[bench\]'"):
        cli.require("matplotlib", "bench", "bench")


def test_gpu_commands_without_a_gpu_say_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for command in ("bench", "tune"):
        result = _cli(command)
        assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr


def _tune_on_a_stand_in_gpu(tmp_path, monkeypatch):
    """``tune.main`` runnable here: a CUDA device said to exist, the table written to a file of
    ``tmp_path`` (returned) instead of the package's."""
    import torch

    from common.configs import ConfigTable

    path = tmp_path / "configs.json"
    monkeypatch.setattr(ConfigTable, "path", staticmethod(lambda package: path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    return path


def test_tune_times_fp8_in_fp8_for_the_forward_only(tmp_path, monkeypatch):
    """--dtypes with float8_e4m3fn: the 16-bit entries timed in float16 as before, the FP8 forward
    timed again in FP8 for its own key; no FP8 backward key (FP8 attention has no backward)."""
    import argparse
    import json

    import torch

    from common.configs import BackwardConfig, Config, key
    from common.tools import tune

    path = _tune_on_a_stand_in_gpu(tmp_path, monkeypatch)
    timed = []

    def tune_one(backend, block_d, dtype, is_causal, bucket, backward=False):
        timed.append((dtype, backward))
        if backward:
            return BackwardConfig(32, 64, 64, 32, 4, 3), {}
        return Config(128, 128 if dtype == torch.float8_e4m3fn else 64, 4, 3), {}
    monkeypatch.setattr(tune, "tune_one", tune_one)
    args = argparse.Namespace(backends=["triton"], passes=["fwd", "bwd"], head_dims=[64], buckets=[1024],
                              dtypes=["bfloat16", "float8_e4m3fn"])
    tune.main(args)
    entries = json.loads(path.read_text())["entries"]
    assert timed == [(torch.float16, False), (torch.float8_e4m3fn, False)] * 2 + [(torch.float16, True)] * 2
    for causal in (False, True):
        assert entries[key(64, torch.bfloat16, causal, 1024)] == [128, 64, 4, 3]
        assert entries[key(64, torch.float8_e4m3fn, causal, 1024)] == [128, 128, 4, 3]
        assert entries[key(64, torch.bfloat16, causal, 1024, True)] == [32, 64, 64, 32, 4, 3]
        assert key(64, torch.float8_e4m3fn, causal, 1024, True) not in entries
    assert set(tune.FP8_CANDIDATES) <= set(tune.CANDIDATES)


@pytest.mark.parametrize("backward", [False, True])
def test_tune_times_the_tl_kernels_with_gluon_off(backward, monkeypatch):
    """tune_one times every candidate of the tl kernels' table with ATTENTION_GLUON=0 (on sm_90 the Gluon forward
    and one-pass backward would otherwise run in their place), and leaves the switch as it found it."""
    import os

    import torch

    from common.tools import timing, tune

    from .conftest import DEVICE

    monkeypatch.setenv("ATTENTION_GLUON", "1")
    monkeypatch.setattr(tune, "_inputs", lambda block_d, bucket, dtype: (
        *(torch.randn(1, 1, 16, block_d, dtype=dtype, device=DEVICE) for _ in range(3)), {}))
    switches = []
    monkeypatch.setattr(timing, "gpu_time_ms", lambda fn: switches.append(os.environ.get("ATTENTION_GLUON")) or 1.0)
    best, times = tune.tune_one("triton", 64, torch.float16, False, 16, backward=backward, verbose=False)
    assert best in times and len(switches) == len(times) > 1 and set(switches) == {"0"}
    assert os.environ["ATTENTION_GLUON"] == "1"


def test_tune_keeps_each_key_as_it_goes(tmp_path, monkeypatch):
    """A tune cut short (the GPU call's time limit) keeps the keys it timed: the table is
    written after every key, each entry for every dtype asked, the rest as committed."""
    import argparse
    import dataclasses
    import json

    import torch

    from common.configs import Config, key
    from common.tools import tune

    path = _tune_on_a_stand_in_gpu(tmp_path, monkeypatch)
    timed = []

    def tune_one(backend, block_d, dtype, is_causal, bucket, backward=False):
        if len(timed) == 2:
            raise KeyboardInterrupt  # the time limit, after two keys
        timed.append((block_d, is_causal, bucket))
        return Config(128, 32 * len(timed), 4, 3), {}
    monkeypatch.setattr(tune, "tune_one", tune_one)
    args = argparse.Namespace(backends=["triton"], passes=["fwd"], head_dims=[64], buckets=[1024, 4096],
                              dtypes=["float16", "bfloat16"])
    with pytest.raises(KeyboardInterrupt):
        tune.main(args)
    entries = json.loads(path.read_text())["entries"]
    assert timed == [(64, False, 1024), (64, False, 4096)]
    for dtype in (torch.float16, torch.bfloat16):
        assert entries[key(64, dtype, False, 1024, False)] == [128, 32, 4, 3]
        assert entries[key(64, dtype, False, 4096, False)] == [128, 64, 4, 3]
    # the keys not reached keep the committed table's entries
    from common.backends import get_backend

    committed = get_backend("triton").configs.entries
    untouched = key(64, torch.float16, True, 1024, False)
    assert entries[untouched] == [x for x in dataclasses.astuple(committed[untouched]) if x is not None]


def test_tune_gluon_pass_writes_the_gluon_section(tmp_path, monkeypatch):
    """``--passes gluon`` times the tl kernel against the Gluon variants per key (the Triton backend on
    sm_90 only; NineToothed has no Gluon kernel) and writes each key's fastest into the table's gluon
    section for every 16-bit dtype asked, keeping the config entries and the section's other keys; off
    sm_90 it times and writes nothing."""
    import argparse
    import json

    import torch

    from common.backends import get_backend
    from common.configs import key
    from common.tools import tune

    path = _tune_on_a_stand_in_gpu(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    timed = []

    def tune_gluon(block_d, dtype, is_causal, bucket):
        timed.append((block_d, dtype, is_causal, bucket))
        return ("pingpong" if is_causal else "tl"), {}
    monkeypatch.setattr(tune, "tune_gluon", tune_gluon)
    args = argparse.Namespace(backends=["triton", "ninetoothed"], passes=["gluon"], head_dims=[32, 256],
                              buckets=[4096], dtypes=["float16", "bfloat16"])
    tune.main(args)
    written = json.loads(path.read_text())
    committed = get_backend("triton").configs
    assert timed == [(256, torch.float16, False, 4096), (256, torch.float16, True, 4096)]  # (no Gluon at D 32)
    for dtype in (torch.float16, torch.bfloat16):
        assert written["gluon"][key(256, dtype, False, 4096)] == "tl"
        assert written["gluon"][key(256, dtype, True, 4096)] == "pingpong"
    untouched = key(128, torch.float16, True, 1024)
    assert written["gluon"][untouched] == committed.gluon[untouched]
    assert len(written["entries"]) == len(committed.entries)

    path.unlink()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    timed.clear()
    tune.main(args)
    assert timed == [] and not path.exists()


def test_gluon_size_guard_counts_the_work_causal_half():
    """``large_enough`` (the default dispatch's guard against host-bound Gluon calls) counts a call's
    FLOPs as the benchmark does, 4·B·H·Lq·Lk·D, half where causal, against MIN_FLOPS."""
    from impl_triton import gluon_attention as ga

    side = int((ga.MIN_FLOPS / (4 * 128)) ** 0.5) + 1  # (one head whose full attention just passes)
    assert ga.large_enough(1, 1, side, side, 128, False)
    assert not ga.large_enough(1, 1, side, side, 128, True)
    assert ga.large_enough(2, 1, side, side, 128, True)
    assert not ga.large_enough(1, 1, side - 1, side - 1, 128, False)


def test_tune_gluon_pass_times_fp8_keys_where_asked(tmp_path, monkeypatch):
    """With float8_e4m3fn among the dtypes the gluon pass times the FP8 keys too, in FP8, at the head dims
    the Gluon forward takes FP8 at (64 and 128, not 256), and writes each to its own key; the 16-bit keys
    are timed in float16 as before."""
    import argparse
    import json

    import torch

    from common.configs import key
    from common.tools import tune

    path = _tune_on_a_stand_in_gpu(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    timed = []

    def tune_gluon(block_d, dtype, is_causal, bucket):
        timed.append((block_d, dtype))
        return ("pingpong" if dtype == torch.float8_e4m3fn else "producer"), {}
    monkeypatch.setattr(tune, "tune_gluon", tune_gluon)
    args = argparse.Namespace(backends=["triton"], passes=["gluon"], head_dims=[128, 256], buckets=[4096],
                              dtypes=["bfloat16", "float8_e4m3fn"])
    tune.main(args)
    gluon = json.loads(path.read_text())["gluon"]
    assert timed == [(128, torch.float16), (128, torch.float8_e4m3fn)] * 2 + [(256, torch.float16)] * 2
    for causal in (False, True):
        assert gluon[key(128, torch.float8_e4m3fn, causal, 4096)] == "pingpong"
        assert gluon[key(128, torch.bfloat16, causal, 4096)] == "producer"
        assert key(256, torch.float8_e4m3fn, causal, 4096) not in gluon


def test_gluon_section_looked_up_by_the_shorter_lengths_bucket(tmp_path, monkeypatch):
    """The gluon section round-trips through a table; a look-up takes the bucket of the length it is given
    (the shorter of query and key: a decode step's one query is bucket 16), answers "tl" where the table
    has no key, and a table naming anything but the tl kernel or a Gluon variant is refused on load."""
    import json

    import torch

    from common.configs import Config, ConfigTable, key

    package = tmp_path / "gluontable"
    package.mkdir()
    (package / "__init__.py").write_text("")
    gluon = {key(128, torch.bfloat16, True, 1024): "pingpong", key(128, torch.bfloat16, True, 16): "tl",
             key(256, torch.float16, False, 16384): "producer"}
    entries = {key(64, torch.float16, True, 1024): Config(128, 64, 4, 3)}
    ConfigTable.write(package / "configs.json", entries, {"how": "test"}, gluon)
    monkeypatch.syspath_prepend(str(tmp_path))
    table = ConfigTable.load("gluontable")
    assert table.gluon == gluon and table.entries == entries
    assert table.lookup_gluon(128, torch.bfloat16, True, 1024) == "pingpong"
    assert table.lookup_gluon(128, torch.bfloat16, True, 300) == "pingpong"  # (bucket 1024 holds 257-1024)
    assert table.lookup_gluon(128, torch.bfloat16, True, 1) == "tl"
    assert table.lookup_gluon(128, torch.bfloat16, False, 1024) == "tl"  # (no key)
    assert table.lookup_gluon(128, torch.float16, True, 1024) == "tl"  # (no key for this dtype)
    assert table.lookup_gluon(256, torch.float16, False, 100000) == "producer"  # (past the last bucket)
    data = json.loads((package / "configs.json").read_text())
    data["gluon"][key(64, torch.float16, True, 1024)] = "gluon"
    (package / "configs.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="gluon section"):
        ConfigTable.load("gluontable")


def test_committed_gluon_section_covers_its_head_dims():
    """The Triton table's gluon section has a key for every head dim the Gluon kernel takes, 16-bit
    dtype, causal mode and length bucket, each naming a kernel that exists, and FP8 keys only where the
    ping-pong variants take FP8 (naming one of them or the tl kernel)."""
    import torch

    from common.backends import get_backend
    from common.configs import GLUON_VARIANTS, LENGTH_BUCKETS, key
    from impl_triton.gluon_attention import FORCED, FP8_HEAD_DIMS, HEAD_DIMS, VARIANTS

    gluon = get_backend("triton").configs.gluon
    expected = {key(d, dtype, causal, bucket) for d in HEAD_DIMS for dtype in (torch.float16, torch.bfloat16)
                for causal in (False, True) for bucket in LENGTH_BUCKETS}
    fp8 = {key(d, torch.float8_e4m3fn, causal, bucket) for d in FP8_HEAD_DIMS for causal in (False, True)
           for bucket in LENGTH_BUCKETS}
    assert expected <= set(gluon) <= expected | fp8  # (FP8 keys where tune timed them)
    assert all(gluon[k] in ("tl", "pingpong", "persistent") for k in set(gluon) & fp8)
    assert set(GLUON_VARIANTS) == {"tl", *VARIANTS} and set(FORCED.values()) <= set(VARIANTS)


def test_a_capped_candidate_round_trips_through_a_table(tmp_path, monkeypatch):
    """A tuned entry may carry a register cap (a candidate's fifth value, ``Config.maxnreg``):
    written by ``tune`` and loaded back it is the same config, cap and all, and entries without
    one stay four values."""
    import json

    import torch

    from common.configs import Config, ConfigTable, key
    from common.tools import tune

    capped = Config(*next(c for c in tune.CANDIDATES[64] if len(c) == 5))
    assert capped.maxnreg is not None
    package = tmp_path / "captable"
    package.mkdir()
    (package / "__init__.py").write_text("")
    entries = {key(64, torch.float16, True, 1024, False): capped,
               key(64, torch.float16, False, 1024, False): Config(128, 64, 4, 3)}
    ConfigTable.write(package / "configs.json", entries, {"how": "test"})
    written = json.loads((package / "configs.json").read_text())["entries"]
    assert sorted(len(v) for v in written.values()) == [4, 5]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ConfigTable.load("captable").entries == entries


def test_quiet_run_names_the_interpreter():
    """The README's `pytest -q` hides pytest's header; the summary line still says where the tests ran."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_tools.py::test_commands_write_into_the_repository"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    assert "attention tests ran on " in result.stdout


# -- NineToothed's generated code: a private directory, atomic writes -----------------------

def test_code_cache_is_private(tmp_path, monkeypatch):
    import os
    import stat

    import ninetoothed.generation as generation

    from common import codecache

    monkeypatch.setenv(codecache.ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(generation, "CACHE_DIR", generation.CACHE_DIR)
    monkeypatch.setattr(generation, "cache_source", generation.cache_source)
    directory = codecache.use_private_cache()
    assert directory == tmp_path / "cache"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    path = generation.cache_source("x = 1\n")
    assert path.parent == directory and path.read_text() == "x = 1\n"
    assert [p.name for p in directory.iterdir()] == [path.name]  # no temporary file left behind

    os.chmod(directory, 0o777)
    with pytest.raises(PermissionError, match="writable by other users .*chmod 700"):
        codecache.use_private_cache()


def test_code_cache_of_another_user_is_refused(tmp_path, monkeypatch):
    import os

    from common import codecache

    if not hasattr(os, "getuid") or os.getuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    monkeypatch.setenv(codecache.ENV_VAR, str(directory))
    with pytest.raises(PermissionError, match="belongs to another user"):
        codecache.ensure_private(codecache.cache_dir())


def _write_source(args):
    import ninetoothed.generation as generation

    from common import codecache

    directory, source = args
    generation.CACHE_DIR = directory
    path = codecache._cache_source(source)
    return path.read_text() == source


def test_code_cache_writes_are_atomic_across_processes(tmp_path):
    """Processes writing the same generated module at once: each reads back the whole file."""
    import multiprocessing

    # (a module of 120 KB: each writer's codecache.simplified parses it, whose time grows with its size)
    source = "# generated\n" + "y = 2\n" * 20_000
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert all(pool.map(_write_source, [(tmp_path, source)] * 8))
    assert len(list(tmp_path.iterdir())) == 1


def test_code_cache_names_a_module_by_its_definitions_not_their_order(tmp_path, monkeypatch):
    """NineToothed appends an application's helper functions in an order that changes from process
    to process: one file per module all the same. Only a reordering of imports and functions counts
    as the same module; any other difference (a body, a duplicate name, a statement) is another file."""
    import ninetoothed.generation as generation

    from common import codecache

    monkeypatch.setattr(generation, "CACHE_DIR", tmp_path)
    kernel = "import triton\n\n\n@triton.jit\ndef kernel(x):\n    return helper(x) + other(x)\n"
    helper, other = "\n\ndef helper(x):\n    return x\n", "\n\n@triton.jit\ndef other(x):\n    return 2 * x\n"
    first = codecache._cache_source(kernel + helper + other)
    assert codecache._cache_source(kernel + other + helper) == first  # the file written first serves both
    assert first.read_text() == kernel + helper + other
    assert len(list(tmp_path.iterdir())) == 1
    others = [
        kernel + helper + other.replace("2 * x", "3 * x"),  # another body
        kernel + helper.replace("\ndef", "\n@triton.jit\ndef") + other.replace("@triton.jit\n", ""),  # decorators moved
        kernel + helper + other + helper.replace("return x", "return -x"),  # a name defined twice: order matters
        kernel + helper + other + "\nSCALE = 2\n",  # not only imports and functions
    ]
    paths = {codecache._cache_source(source) for source in others}
    assert len(paths) == len(others) and first not in paths


def test_a_kernel_made_after_others_is_the_same_file(tmp_path, monkeypatch):
    """NineToothed names a kernel's tensors (and orders its parameters) by a count of every tensor
    the process has made: the same kernel made first or after many others is to be one source, so
    one file here and one entry in Triton's cache of compiled kernels, in every process."""
    import ninetoothed
    import ninetoothed.generation as generation

    from common import codecache
    from impl_ninetoothed import attention as nt
    from impl_ninetoothed.paged_kernels import premake_append

    monkeypatch.setenv(codecache.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(generation, "CACHE_DIR", generation.CACHE_DIR)
    monkeypatch.setattr(generation, "cache_source", generation.cache_source)
    monkeypatch.setattr(nt, "_made", {})
    monkeypatch.setattr(nt, "made_before", lambda key: None)  # each kernel generated, not imported
    first = nt._make(premake_append, 16, 16, num_warps=4, num_stages=1)
    nt._made.clear()
    nt._make(premake_append, 32, 32, num_warps=4, num_stages=1)  # another kernel before it
    monkeypatch.setattr(ninetoothed.Tensor, "num_instances", 987)  # and a process that made many
    again = nt._make(premake_append, 16, 16, num_warps=4, num_stages=1)
    assert again is not first and again._source == first._source
    assert len(list(tmp_path.glob("*.py"))) == 2


def test_a_kernel_made_by_an_earlier_process_is_imported_not_generated(tmp_path, monkeypatch, device):
    """A kernel made is remembered in the code cache under a key of what its code is generated from:
    made again by the next process (here: the process's handles forgotten), its module is imported
    instead of generated, and the kernel works. A kernel whose module is gone, whose entry names
    no module of the cache, or whose sources changed, is generated again."""
    import ninetoothed
    import ninetoothed.generation as generation
    import torch

    from common import append_kv, codecache
    from impl_ninetoothed import attention as nt
    from impl_ninetoothed.paged_kernels import premake_append

    monkeypatch.setenv(codecache.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(generation, "CACHE_DIR", generation.CACHE_DIR)
    monkeypatch.setattr(generation, "cache_source", generation.cache_source)
    monkeypatch.setattr(nt, "_made", {})
    generated, make = [], ninetoothed.make
    monkeypatch.setattr(ninetoothed, "make",
                        lambda *args, **kw: generated.append(kw["kernel_name"]) or make(*args, **kw))

    def remade() -> int:
        nt._made.clear()
        nt._make(premake_append, 16, 16, num_warps=4, num_stages=1)
        return len(generated)

    nt._make(premake_append, 16, 16, num_warps=4, num_stages=1)
    entries = list((tmp_path / "made").iterdir())
    assert len(generated) == 1 and len(entries) == 1
    module = tmp_path / entries[0].read_text().strip()
    assert module.is_file() and module.suffix == ".py"

    nt._made.clear()
    page, lens = 16, [14, 30]
    key_cache = torch.randn(5, page, 2, 16, device=device)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.tensor([[4, 0], [2, 1]], dtype=torch.int32, device=device)
    key, value = torch.randn(2, 2, 2, 16, device=device), torch.randn(2, 2, 2, 16, device=device)
    append_kv(key_cache, value_cache, block_table, torch.tensor(lens, dtype=torch.int32, device=device), key, value,
              backend="ninetoothed")
    assert len(generated) == 1  # imported, and it wrote each new token where it belongs
    for b, n in enumerate(lens):
        for i in range(2):
            slot = block_table[b, (n + i) // page].long(), (n + i) % page
            assert torch.equal(key_cache[slot], key[b, :, i]) and torch.equal(value_cache[slot], value[b, :, i])

    module.unlink()
    assert remade() == 2 and module.is_file()  # the module gone: generated (the same file again)
    entries[0].write_text("../" + module.name + "\n")
    assert remade() == 3  # an entry that names no module of the cache
    assert remade() == 3  # (rewritten by the make before)
    monkeypatch.setattr(codecache, "_package_sources", lambda packages: "other sources")
    assert remade() == 4 and len(list((tmp_path / "made").iterdir())) == 2


def test_no_numpy_warnings_under_the_interpreter(backend, device):
    """A row with no visible key: log(0) = -inf is the intended value, and nothing is printed about it."""
    import warnings

    import torch

    from common import attention

    q = torch.randn(1, 2, 20, 32, dtype=torch.float16, device=device)
    mask = torch.ones(20, 20, dtype=torch.bool, device=device)
    mask[3] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention(q, q, q, attn_mask=mask, backend=backend, return_lse=True)
    assert (lse[:, :, 3] == float("-inf")).all() and (out[:, :, 3] == 0).all()


def _cpu_sass(backend: str, *args: str, out) -> str:
    """tools/cpu_sass.py run on a call (BACKEND B H H_KV LQ LK D, then its options), its files into
    ``out``: its report (stdout), once it has exited cleanly."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "tools" / "cpu_sass.py"), backend, *args, "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("backend", ["triton", "ninetoothed"])
def test_cpu_sass_compiles_a_call_for_hopper_without_a_gpu(backend, tmp_path):
    """tools/cpu_sass.py plans a call, compiles its kernels for sm_90 (no GPU needed, none
    used: the interpreter switch is cleared) and reads what ptxas made of them."""
    import re

    report = _cpu_sass(backend, "1", "2", "2", "16", "256", "64", out=tmp_path)
    found = re.search(r": (\d+) registers, (\d+) bytes of stack \(spills\)", report)
    assert found and 0 < int(found.group(1)) <= 255, report
    resident = re.search(r"(\d+) programs an SM \(sm_90\)", report)  # (occupancy from the above)
    assert resident and 1 <= int(resident.group(1)) <= 32, report
    assert re.search(r"MMAs (not )?serialized", report), report  # ptxas's C7515 note read
    sass = list(tmp_path.glob("*.sass"))
    assert sass and "MMA" in sass[0].read_text()  # tensor-core instructions: compiled for the GPU, not interpreted
    step = re.search(r"loop \.L_x_\d+: (\d+) instructions a step \(", report)  # the key loop's step
    assert step and int(step.group(1)) > 0, report


@pytest.mark.parametrize("backend", ["triton", "ninetoothed"])
@pytest.mark.parametrize("call", [["1", "3", "3", "11", "29", "16", "--fp8", "all"],
                                  ["2", "4", "2", "1", "40", "32", "--fp8", "kv", "--paged", "16"],
                                  ["3", "4", "2", "20", "30", "32", "--fp8", "all", "--varlen", "--causal"]],
                         ids=["fp8_d16", "fp8_paged", "fp8_varlen"])
def test_fp8_kernels_compile_for_hopper(backend, call, tmp_path):
    """FP8 calls compile for sm_90: at D 16 (Triton's e4m3 dot takes K >= 32 only, a check the
    interpreter does not make, and the plan pads the head dim to it), a bfloat16 query over
    FP8 pages with append_kv quantizing into them, and packed sequences with descales per row
    (the interpreter runs a jit function's returns as Python does; the compiler wants one type)."""
    report = _cpu_sass(backend, *call, out=tmp_path)
    assert "registers" in report and any("MMA" in f.read_text() for f in tmp_path.glob("*.sass"))
    if "--paged" in call:
        assert "append" in report  # (the quantizing append compiled too)


@pytest.mark.parametrize("backend", ["triton", "ninetoothed"])
@pytest.mark.parametrize("call", [["2", "2", "2", "50", "70", "64", "--causal"],
                                  ["1", "2", "2", "40", "72", "96", "--causal", "--backward"],
                                  ["1", "1", "1", "9", "33", "256", "--backward"]],
                         ids=["fwd_d64", "bwd_d96", "bwd_d256"])
def test_float32_tiles_keep_their_products_in_registers(backend, call, tmp_path):
    """float32 inputs multiply on the FMA units, a product's operands spread over the threads:
    compiled for sm_90, the calls' default tiles (common.configs.FLOAT32_DEFAULTS and
    FLOAT32_BACKWARD_DEFAULTS) spill nothing to speak of, forward and backward (the 16-bit tiles
    spilled 7-24 KB a thread there and took ptxas minutes)."""
    import re

    report = _cpu_sass(backend, *call, "--dtype", "float32", out=tmp_path)
    stacks = [int(n) for n in re.findall(r": \d+ registers, (\d+) bytes of stack \(spills\)", report)]
    assert len(stacks) == (2 if "--backward" in call else 1) and max(stacks) <= 64, report


@pytest.mark.parametrize("backend", ["triton", "ninetoothed"])
def test_fp8_whole_key_blocks_scale_in_one_fma(backend, tmp_path):
    """Compiled for sm_90, an FP8 forward's loop over the key blocks every row sees whole scales a
    score and subtracts its row maximum in one FMA, the maximum taken from the raw products: no FMUL
    a score (what FMULs remain rescale the output, one per element of Dv <= BLOCK_N). The descales'
    sign is read on the GPU; a second loop, taken where a scale is not positive, scales first."""
    import re

    report = _cpu_sass(backend, "1", "2", "2", "256", "1024", "64", "--fp8", "all", out=tmp_path)
    loops = re.findall(r"loop \.L_x_\d+: \d+ instructions a step \((.*)\)", report)
    counts = [dict((op, int(n)) for n, op in re.findall(r"(\d+) (\w+)", mix)) for mix in loops]
    assert len(counts) >= 2, report
    assert any(c.get("FFMA", 0) >= c["MUFU"] > 0 and c.get("FMUL", 0) <= c["MUFU"] for c in counts), report
    assert any(c.get("FMUL", 0) > c["MUFU"] > 0 for c in counts), report  # (the loop that scales first)


@pytest.mark.parametrize("backend, call", [
    ("ninetoothed", ["2", "8", "2", "1", "300", "64", "--paged", "16", "--paged-join"]),
    ("ninetoothed", ["2", "8", "2", "1", "300", "64", "--paged", "16", "--paged-join", "--fp8", "kv"]),
    ("triton", ["2", "4", "2", "1", "70", "32", "--mask", "bool"]),
    ("ninetoothed", ["2", "4", "2", "1", "70", "32", "--mask", "float"]),
], ids=["nt_joined_pages", "nt_joined_fp8_pages", "triton_mask", "nt_mask"])
def test_kernels_the_interpreter_runs_differently_compile_for_hopper(backend, call, tmp_path):
    """What the interpreter runs but a GPU compiles its own way: NineToothed's paged kernel with a
    step's tiles one softmax update (scores joined, probabilities split back: layouts the
    interpreter does not have), over 16-bit and FP8 caches; a decode step under a mask (transformers'
    static-cache decoding)."""
    report = _cpu_sass(backend, *call, out=tmp_path)
    assert "registers" in report and any("MMA" in f.read_text() for f in tmp_path.glob("*.sass"))


def test_nt_fp8_pages_of_16_joined_before_their_products_compile_to_fewer(tmp_path):
    """NineToothed's paged kernel over FP8 pages of 16 with a step's key and value tiles joined before one product
    each (PAGED_FP8_JOIN_TILES), compiled for sm_90: its key loop issues at most half the tensor-core products and
    fewer FP8 conversions a step than the shipped form (products of 16-key tiles give each warp the whole tile),
    in fewer registers."""
    import re

    found = {}
    for form, extra in (("shipped", []), ("joined", ["--paged-join-tiles"])):
        out = tmp_path / form
        report = _cpu_sass("ninetoothed", "2", "8", "2", "1", "300", "64", "--paged", "16", "--fp8", "kv", *extra,
                           out=out)
        paged = report[report.index("nt_attention_paged"):report.index("nt_attention_append")]
        step, mix = re.search(r"loop \.L_x_\d+: (\d+) instructions a step \((.*)\)", paged).groups()
        found[form] = dict(registers=int(re.search(r": (\d+) registers", paged).group(1)),
                           products=int(re.search(r"(\d+) HMMA", paged).group(1)),  # (the kernel's, all loops)
                           step=int(step), conversions=dict((op, int(n)) for n, op in re.findall(r"(\d+) (\w+)",
                                                                                              mix))["F2FP"])
    shipped, joined = found["shipped"], found["joined"]
    assert 0 < 2 * joined["products"] <= shipped["products"], found
    assert joined["conversions"] < shipped["conversions"] and joined["step"] < shipped["step"], found
    assert joined["registers"] < shipped["registers"], found


def test_cpu_sass_reads_the_loops_of_tensor_core_products():
    """tools/cpu_sass.py's loop report: a label to the last branch back to it, instructions
    counted by opcode (predicates and modifiers dropped); loops without MMAs and forward branches
    are not loops of products."""
    import importlib.util
    import os
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "cpu_sass.py"
    spec = importlib.util.spec_from_file_location("cpu_sass_under_test", path)
    cpu_sass = importlib.util.module_from_spec(spec)
    interpret = os.environ.get("TRITON_INTERPRET")
    spec.loader.exec_module(cpu_sass)
    assert os.environ.get("TRITON_INTERPRET") == interpret  # (only the script clears it: later tests interpret)
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   BRA `(.L_x_9) ;",  # forward: not a loop
        ".L_x_1:",
        "        /*0020*/                   HGMMA.64x64x16.F32 gdesc[UR4], RZ, !UPT ;",
        "        /*0030*/               @P0 FMUL R2, R2, R3 ;",
        "        /*0040*/              @!P1 FMUL.FTZ R4, R4, R3 ;",
        "        /*0050*/                   BRA `(.L_x_1) ;",
        ".L_x_2:",
        "        /*0060*/                   IADD3 R5, R5, 0x1, RZ ;",
        "        /*0070*/                   BRA `(.L_x_2) ;",  # a loop without MMAs
        ".L_x_3:",
        "        /*0072*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT ;",  # (FP8)
        "        /*0074*/                   BRA `(.L_x_3) ;",
        ".L_x_9:",
        "        /*0080*/                   EXIT ;",
    ])
    assert cpu_sass.mma_loops(sass) == [(".L_x_1", 4, [("FMUL", 2), ("HGMMA", 1), ("BRA", 1)]),
                                        (".L_x_3", 2, [("QGMMA", 1), ("BRA", 1)])]
    # both_operands: a step holds S (A in shared memory) and P V (A in registers); a wait loop spanning one
    # product's instructions is not a step
    step = "\n".join([
        ".L_x_4:",
        "        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR44], RZ, !UPT ;",
        ".L_x_5:",
        "        /*0110*/                   HGMMA.64x128x16.F32.BF16 R88, R176, gdesc[UR20].tnspB, R88 ;",
        "        /*0120*/              @!P0 BRA `(.L_x_5) ;",
        "        /*0130*/                   MUFU.EX2 R2, R2 ;",
        "        /*0140*/                   BRA `(.L_x_4) ;",
    ])
    assert [loop[0] for loop in cpu_sass.mma_loops(step)] == [".L_x_4", ".L_x_5"]
    assert cpu_sass.mma_loops(step, both_operands=True) == [(".L_x_4", 5, [("HGMMA", 2), ("BRA", 2), ("MUFU", 1)])]


def test_every_probe_the_docstring_lists_exists():
    """tools/probe.py runs its probes by name: each one its docstring lists is a function of the
    module (an edit that drops one is caught here, not on the GPU)."""
    import ast
    import pathlib
    import re

    source = (pathlib.Path(__file__).resolve().parents[1] / "tools" / "probe.py").read_text()
    tree = ast.parse(source)
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    listed = re.findall(r"^- (\w+):", ast.get_docstring(tree), flags=re.MULTILINE)
    assert len(listed) > 20 and set(listed) <= functions, sorted(set(listed) - functions)


# -- tools/fa_suite: FlashAttention's own tests against our interface ---------------------------

_FA_STYLE_MODULE = '''
import torch
from flash_attn import flash_attn_func
from flash_attn.bert_padding import pad_input, unpad_input
from flash_attn.flash_attn_interface import _get_block_size_n

is_sm90 = torch.cuda.get_device_capability("cuda") == (9, 0)


def test_as_flash_attention_tests_are_written():
    device = "cuda"
    assert is_sm90
    x = torch.randn(2, 5, 3, 4, device=device)
    mask = torch.arange(5, device=device)[None] < torch.tensor([[3], [5]], device=device)
    rows, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask)
    assert rows.shape == (8, 3, 4) and cu_seqlens.tolist() == [0, 3, 8] and max_seqlen == 5
    assert used.tolist() == [3, 5]
    assert torch.equal(pad_input(rows, indices, 2, 5), x * mask[..., None, None])
    q = torch.randn(1, 4, 2, 16, device=device)
    out, lse, S_dmask = flash_attn_func(q, q, q, 0.5, return_attn_probs=True)
    assert S_dmask.shape == (1, 2, 128, 128) and _get_block_size_n(q.device, 16, True, False) >= 128
'''


def test_fa_suite_runs_a_module_written_as_flash_attentions_tests(tmp_path):
    """tools/fa_suite/run.py: ``flash_attn`` resolves to our functions and the torch helpers beside them;
    with --cpu (no sm_90 GPU here) the module's "cuda" devices become "cpu" and its device query answers
    sm_90. (On an sm_90 GPU the module runs there: the interpreter of Triton 3.6, which GPU machines carry,
    turns a loop bound into a Python int by ``int()`` of a 1-element array, which NumPy 2.4 refuses.)"""
    import pathlib
    import subprocess
    import sys

    import torch

    module = tmp_path / "test_style.py"
    module.write_text(_FA_STYLE_MODULE)
    root = pathlib.Path(__file__).resolve().parents[1]
    on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    where = [] if on_sm90 else ["--cpu"]
    result = subprocess.run([sys.executable, "tools/fa_suite/run.py", str(module), *where, "-q"], cwd=root,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout


@pytest.mark.parametrize("interleaved", [True, False])
def test_fa_suite_rotary_reference_is_our_rotary(interleaved):
    """The suite's apply_rotary_emb (FlashAttention's tests rotate their references with it) against
    common.rotary's torch path: positions offset per sequence, a rotary dim short of the head dim."""
    import importlib.util
    import pathlib

    import torch

    from common.backends import resolve
    from common.rotary import apply_rotary

    path = pathlib.Path(__file__).resolve().parents[1] / "tools/fa_suite/flash_attn/layers/rotary.py"
    spec = importlib.util.spec_from_file_location("fa_suite_rotary", path)
    rotary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rotary)
    x = torch.randn(2, 5, 3, 32)
    angle = torch.rand(12, 8) * 6.3
    cos, sin = torch.cos(angle), torch.sin(angle)
    starts = torch.tensor([0, 4], dtype=torch.int32)
    got = rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=starts)
    expected = apply_rotary(resolve("torch"), x, cos, sin, starts, per_row=True, interleaved=interleaved)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., 16:], x[..., 16:])


def test_ncu_targets_are_the_benchmarks_shapes():
    """tools/ncu_targets.py (Nsight Compute's cases, GPU only): each case is a benchmark shape (B·L = 16k
    tokens, H·D = 2048) with a known call, every SDPA case pairs one of ours, the paged FP8 decode's cases
    are distinct (page size, backend) pairs, and --list names them all."""
    import importlib.util
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("ncu_targets", root / "tools" / "ncu_targets.py")
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    for name, (B, H, L, D, causal, what) in targets.CASES.items():
        assert B * L == 16384 and H * D == 2048, name
        assert what in ("fwd", "fwd-tl", "fwd-nt", "fp8", "bwd", "bwd-nt", "sdpa", "sdpa-bwd"), name
        if what.startswith("sdpa"):
            ours = name.replace("-sdpa", "")
            assert targets.CASES[ours][:5] == (B, H, L, D, causal), name
    listed = subprocess.run([sys.executable, "tools/ncu_targets.py", "--list"], cwd=root, capture_output=True,
                            text=True, timeout=120).stdout.splitlines()
    cases = list(targets.PAGED_FP8_CASES.values())
    assert cases and len(set(cases)) == len(cases)
    assert all(page % 16 == 0 and backend in ("triton", "ninetoothed") and type(columns) is bool
               for page, backend, columns in cases)
    assert not set(targets.PAGED_FP8_CASES) & set(targets.CASES)
    assert [line.split(":")[0] for line in listed] == [*targets.CASES, *targets.PAGED_FP8_CASES]


def test_ncu_stalls_reads_the_samples_per_kernel_reason_and_line(tmp_path):
    """tools/ncu_stalls.py reads ncu's per-SASS-line CSV: each kernel's samples by reason and by opcode (its
    predicate and modifiers stripped), and its lines ranked by samples, kernel by kernel."""
    import importlib.util
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
              '"Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"')
    text = "\n".join([
        '"Kernel Name","first",', header,
        '"0x10","      NOP","30","30","2","30","0","0","30"',
        '"0x20","@!P0  BRA 0x40","50","50","100","0","45","5","0"',
        '"0x30","      WARPGROUP.DEPBAR.LE gsb0, 0x0","20","18","100","15","0","5","15"',
        '"Kernel Name","second",', header,
        '"0x40","      MUFU.EX2 R2, R3","4","4","8","0","0","4","0"',
    ]) + "\n"
    path = tmp_path / "report.sass.csv"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("ncu_stalls", root / "tools" / "ncu_stalls.py")
    stalls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stalls)
    import csv

    sections = stalls.kernels(list(csv.reader(path.open(newline=""))))
    assert [name for name, _, lines in sections] == ["first", "second"]
    assert [len(lines) for _, _, lines in sections] == [3, 1]
    first = stalls.summary(sections[0][1], sections[0][2], top=2)
    assert first["total"] == 100
    assert first["reasons"] == {"long_sb": 0.45, "barrier": 0.45, "wait": 0.10}
    assert first["opcodes"]["BRA"] == [0.5, 100] and first["opcodes"]["WARPGROUP"] == [0.2, 100]
    assert [(address, share) for address, _, share, _ in first["top"]] == [("0x20", 0.5), ("0x10", 0.3)]
    assert first["top"][0][3][:2] == [("long_sb", 45), ("wait", 5)]
    out = subprocess.run([sys.executable, "tools/ncu_stalls.py", str(path), "--top", "1"], cwd=root,
                         capture_output=True, text=True, timeout=120).stdout
    assert "=== first: 3 SASS lines, 100 samples" in out and "=== second: 1 SASS lines, 4 samples" in out


def test_two_widths_kernel_matches_torch_under_the_interpreter():
    """tools/two_widths.py's small kernel (the two-width fault's class, for the GPU) computes what its
    reference does where nothing goes wrong, so that on a GPU a WRONG is the compiler's: a misaligned case of
    each MMA kind, under the interpreter on the CPU (on a GPU run the tool itself)."""
    import importlib.util
    import pathlib

    from .conftest import DEVICE

    if DEVICE == "cuda":
        pytest.skip("on a GPU the tool runs as a probe (tools/h200.sh layouts), not as a test")
    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("two_widths", root / "tools" / "two_widths.py")
    two_widths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(two_widths)
    cases = [i for i, case in enumerate(two_widths.CASES) if case[2] == "misaligned" and case[0] != case[1]]
    assert {two_widths.CASES[i][3] for i in cases} == {16, 64}  # (both MMA kinds among them)
    for index in (cases[0], cases[-1]):
        assert two_widths.run_case(index) == 0, two_widths.CASES[index]


def _tool(name):
    """tools/<name>.py imported as a module (tools/ is not a package)."""
    import importlib.util
    import pathlib
    import sys

    tools = pathlib.Path(__file__).resolve().parents[1] / "tools"
    sys.path.insert(0, str(tools))  # (its own imports of tools/ modules, e.g. cpu_sass)
    try:
        spec = importlib.util.spec_from_file_location(name, tools / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(tools))
    return module


def _sass(lines):
    """A disassembly's text of ``lines`` (labels as "name:" lines), as nvdisasm prints it."""
    out, address = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/                   {line} ;")
            address += 16
    return "\n".join(out)


def test_sass_model_issues_in_order_and_waits_for_sources():
    """tools/sass_model.py's warp: a chain of dependent maxima waits a latency a link, independent ones only for
    their pipe's interval, and the special-function unit takes 8 cycles an instruction."""
    model = _tool("sass_model")
    chain = model.cycles(["FMNMX R1, R0, R2, !PT", "FMNMX R3, R1, R4, !PT", "FMNMX R5, R3, R6, !PT"])
    apart = model.cycles(["FMNMX R1, R0, R2, !PT", "FMNMX R3, R7, R4, !PT", "FMNMX R5, R8, R6, !PT"])
    assert chain == 2 * model.LATENCY["alu"] + 1 and apart == 2 * model.INTERVAL["alu"] + 1
    exps = model.cycles(["MUFU.EX2 R1, R0", "MUFU.EX2 R2, R3", "MUFU.EX2 R4, R5"])
    assert exps == 2 * model.INTERVAL["mufu"] + 1


def test_sass_model_reads_the_key_loop_from_the_wait_for_s():
    """The key loop (both products inside) is found, its forward branch's code left out, and its cycles counted
    from the wait for S: a mask's skipped selects cost nothing, a spill's load is counted as a local access."""
    model = _tool("sass_model")
    body = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0",
            "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8].tnspB, R88, gsb0",
            "FADD R9, R9, 1",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1",
            "@P0 BRA `(.L_x_2)",
            "FSEL R24, R24, -INF , P1", "FSEL R25, R25, -INF , P1",
            ".L_x_2:",
            "LDL R7, [R1]",
            "FMNMX R1, R24, R25, !PT",
            "MUFU.EX2 R2, R1"]
    sass = _sass(["MOV R0, R1", ".L_x_1:", *body, "@P2 BRA `(.L_x_1)", "EXIT"])
    [(steps, local, cycles)] = model.key_loops(sass)
    assert steps == len([x for x in body if not x.endswith(":")]) + 1 and local == 1
    # from the wait: the wait, the spill's load, the maximum (waits for nothing loaded), the exponential after it
    assert cycles == 3 + model.LATENCY["alu"]


def test_ab_summary_puts_each_trees_run_side_by_side(tmp_path, capsys):
    """tools/ab_summary.py: a line per Triton throughput or FP8 shape, each tree's time, ratio and error beside
    the others' (an FP8 row's time alone: it has neither); SDPA's rows and failed shapes left out."""
    import json

    def row(backend, ms, ratio, causal=False, status="ok"):
        return dict(section="throughput", mode="fwd", backend=backend, dtype="bfloat16", B=4, H=32, H_kv=32,
                    Lq=4096, Lk=4096, D=64, causal=causal, max_error=1e-3, status=status, ms=ms, tflops=1.0,
                    vs_sdpa=ratio)

    main = tmp_path / "results_main.json"
    main.write_text(json.dumps({"environment": {}, "rows": [row("triton", 1.25, 0.9), row("torch", 1.1, 1.0),
                                                            row("triton", 9.0, 0.5, causal=True, status="WRONG")]}))
    other = tmp_path / "results_gluon-p16.json"
    fp8 = dict(section="fp8", mode="fwd", backend="triton", dtype="float8_e4m3fn", B=1, H=8, H_kv=8, Lq=1,
               Lk=16384, D=128, causal=False, status="ok", ms=0.5, tflops=1.0)
    other.write_text(json.dumps({"environment": {}, "rows": [row("triton", 1.0, 1.1), fp8]}))
    assert _tool("ab_summary").main([str(main), str(other)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "main: ms" in lines[0] and "gluon-p16: ms" in lines[0] and len(lines) == 4
    assert lines[2] == ("| fwd | bfloat16 | 64 | 4096 | 4096 | False | 1.250 (0.900x), 1.0e-03 | "
                        "1.000 (1.100x), 1.0e-03 |")
    assert lines[3] == "| fwd | float8_e4m3fn | 128 | 1 | 16384 | False | - | 0.500 |"


def test_ab_patches_apply_to_this_checkout(tmp_path):
    """Every prepared A/B patch (tools/ab/, timed on a GPU before it is merged) still applies to the code it
    was made against: a change to those files since then has to carry the patches along."""
    import pathlib
    import shutil
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    patches = sorted((root / "tools" / "ab").glob("*.patch"))
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    for patch in patches:
        result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (patch.name, result.stderr)
