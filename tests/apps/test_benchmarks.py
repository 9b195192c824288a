"""The benchmark scripts themselves, run on the CPU with a tiny shape: a smoke test, not a
measurement, so that a GPU session does not spend its time on a broken script."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import forked
import pytest
from background_runs import ONE_THREAD, BackgroundRuns, selected_tests

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SMOKE = (
    "--shape",
    "tiny",
    "--device",
    "cpu",
    "--compile-backend",
    "aot_eager",
    "--batch",
    "2",
    "--seq",
    "32",
)
# under delayed scaling hf_fp8.compile's graphs differ in the first step and later: two warm-up steps
TIMING = ("--warmup", "2", "--steps", "2")


def bench(script: str, *args: str, env: dict | None = None) -> str:
    """Run a benchmark script (or ``-m module`` with its arguments) in the benchmarks folder."""
    command = [script, *args] if script == "-m" else [str(BENCHMARKS / script), *args]
    result = forked.run(
        [sys.executable, *command], {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **(env or {})}, BENCHMARKS
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


class Run(NamedTuple):
    test: str  # the test that reads its output
    args: tuple[str, ...]  # bench's: the script (or -m module) and its arguments


COMPARE_ROWS = "bf16,bf16-compile,hf-fp8,hf-fp8-rowwise,torchao,te-fused"
MOE_MODES = "bf16-eager,bf16-grouped,bf16-grouped-compile,hf-fp8"
MOE = (
    "moe_bench.py", "--tiny", "--device", "cpu", "--layers", "1", "--batch", "2", "--seq", "32",
    "--modes", MOE_MODES, "--compile-backend", "aot_eager", *TIMING,
)  # fmt: skip
ARCH_SWEEP = (
    "arch_sweep.py", "--families", "gpt2", "--rows", "bf16-compile,hf-fp8-fastest", "--tiny", "--device",
    "cpu", "--compile-backend", "aot_eager", "--batch", "2", "--seq", "32", *TIMING,
)  # fmt: skip
FSDP = (
    "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "fsdp_bench.py",
    "--device", "cpu", "--shape", "tiny", "--layers", "3", "--batch", "2", "--seq", "32", *TIMING,
)  # fmt: skip
ZERO = (
    "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "zero_bench.py",
    "--device", "cpu", "--shape", "tiny", "--layers", "2", "--batch", "2", "--seq", "32", "--stage", "3",
    "--modes", "bf16,hf-fp8", *TIMING,
)  # fmt: skip
PARALLEL = (
    "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "parallel_bench.py",
    "--layout", "tp", "--device", "cpu", "--shape", "tiny", "--batch", "2", "--seq", "32",
    "--modes", "bf16,hf-fp8", "--resume-check", "1", *TIMING,
)  # fmt: skip
LONG_RUNS = {  # the runs of 5 s and more, by name, in the order they start (the longest first)
    "compare": Run(
        "test_compare_runs_each_row_in_its_own_process_and_prints_one_table",
        ("compare.py", "--rows", COMPARE_ROWS, *SMOKE, *TIMING),
    ),
    "arch_sweep": Run("test_arch_sweep_runs_each_row_in_a_process_and_compares_losses", ARCH_SWEEP),
    "lora": Run(
        "test_lora_bench_runs", ("lora_bench.py", "--modes", "peft-bf16,native-compile", *SMOKE, *TIMING)
    ),
    "fsdp": Run("test_fsdp_bench_runs_on_two_gloo_ranks", FSDP),
    "zero": Run("test_zero_bench_runs_under_zero3_on_two_gloo_ranks_with_one_fp8_state", ZERO),
    "parallel": Run("test_parallel_bench_runs_under_tensor_parallelism_and_resumes_exactly", PARALLEL),
    "moe": Run("test_moe_bench_runs", MOE),
    "compare shapes": Run(
        "test_compare_prints_a_table_for_each_shape_it_is_given",
        ("compare.py", "--rows", "bf16", "--shape", "tiny,tiny", *SMOKE[2:], *TIMING),
    ),
}


@pytest.fixture(scope="module")
def runs(request):
    """The long runs of the selected tests, all started when the first of them asks for one."""
    selected = selected_tests(request)
    calls = {
        name: functools.partial(bench, *run.args, env=ONE_THREAD)
        for name, run in LONG_RUNS.items()
        if run.test in selected
    }
    started = BackgroundRuns(calls)
    yield started
    started.close()


def table_rows(out: str) -> dict[str, list[str]]:
    """The last Markdown table printed, by mode."""
    lines = out.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("| mode |"))
    rows = [line.strip("|").split(" | ") for line in lines[header + 2 :] if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_compare_runs_each_row_in_its_own_process_and_prints_one_table(runs):
    out = runs.output("compare")
    table = table_rows(out)
    assert set(table) == {"bf16", "bf16-compile", "hf-fp8", "hf-fp8-rowwise"}, out
    assert table["bf16"][1] == "1.00x" and table["hf-fp8"][2].endswith("x")  # vs bf16, vs bf16-compile
    assert all("error" not in " ".join(cells) for cells in table.values()), out
    assert "torchao: left out (no --torchao-path given)" in out and "te-fused: left out" in out


def test_compare_prints_a_table_for_each_shape_it_is_given(runs):
    out = runs.output("compare shapes")
    assert out.count("\n## tiny\n") == 2 and out.count("| bf16 | ") == 2 + 2, out  # step_bench's + ours


def test_lora_bench_runs(runs):
    out = runs.output("lora")
    table = table_rows(out)
    assert set(table) == {"peft-bf16", "native-compile"} and "error" not in out, out


def test_moe_bench_runs(runs):
    out = runs.output("moe")
    table = table_rows(out)
    assert set(table) == set(MOE_MODES.split(",")) and "error" not in out, out


def test_arch_sweep_runs_each_row_in_a_process_and_compares_losses(runs):
    out = runs.output("arch_sweep")
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["family"], r["mode"]) for r in results] == [
        ("gpt2", "bf16-compile"),
        ("gpt2", "hf-fp8-fastest"),
    ]
    assert all("error" not in r for r in results), out
    (header,) = [line for line in out.splitlines() if line.startswith("| family |")]
    (row,) = [line for line in out.splitlines() if line.startswith("| gpt2 |")]
    titles, values = ([c.strip() for c in line.strip("|").split("|")] for line in (header, row))
    cells = dict(zip(titles, values, strict=True))
    compile_loss, fp8_loss = results[0]["loss"], results[1]["loss"]
    assert cells["loss fastest"] == f"{fp8_loss:.3f} ({(fp8_loss / compile_loss - 1) * 100:+.1f}%)", row


def test_fsdp_bench_runs_on_two_gloo_ranks(runs):
    out = runs.output("fsdp")
    table = table_rows(out)
    modes = {"bf16", "hf-fp8", "hf-fp8-ag", "hf-fp8-head-backward", "hf-fp8-ag-head-backward"}
    assert set(table) == modes, out
    assert all(json.loads(line)["layers"] == 3 for line in out.splitlines() if line.startswith("{"))
    gathered = {mode: float(cells[4].replace(",", "")) for mode, cells in table.items()}
    assert gathered["hf-fp8-ag"] < gathered["hf-fp8"] == gathered["bf16"] == gathered["hf-fp8-head-backward"]
    assert gathered["hf-fp8-ag-head-backward"] == gathered["hf-fp8-ag"], "a head in BF16 is gathered in BF16"
    assert table["hf-fp8-ag"][5] == table["hf-fp8"][5], "the FP8 all-gather changes no number"


def test_zero_bench_runs_under_zero3_on_two_gloo_ranks_with_one_fp8_state(runs):
    out = runs.output("zero")
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["mode"], r["stage"], r["layers"]) for r in results] == [("bf16", 3, 2), ("hf-fp8", 3, 2)], out
    assert results[1]["same_fp8_state_on_every_rank"]
    assert set(table_rows(out)) == {"bf16", "hf-fp8"}, out


def test_parallel_bench_runs_under_tensor_parallelism_and_resumes_exactly(runs):
    out = runs.output("parallel")
    results = {r["mode"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert set(results) == {"bf16", "hf-fp8"} == set(table_rows(out)), out
    assert results["hf-fp8"]["one_fp8_state"] and results["bf16"]["one_fp8_state"] is None
    assert all(r["resumes_exactly"] for r in results.values())


def test_cpu_bench_times_every_call_and_every_recipe_against_float32():
    out = bench("cpu_bench.py", "--tokens", "32", "--features", "64", "--threads", "1")
    gemms = [line.strip("|").split(" | ") for line in out.splitlines() if line.startswith("| E")]
    assert len(gemms) == 4, out
    for cells in gemms:  # a call this torch has no CPU kernel for says so (torch 2.11: row-wise scales)
        assert all(re.fullmatch(r"[\d.]+ ms \([\d.]+x\)|fails: .+", c.strip()) for c in cells[1:]), cells
        assert cells[-1].strip().endswith("x)"), "hf-fp8's choice always runs"
    steps = [line for line in out.splitlines() if line.startswith("| FP8 ")]
    assert len(steps) == 4 and all(line.endswith("x |") for line in steps), out


def test_phases_adds_up_the_gpus_idle_time_by_the_hosts_phase():
    """``trainer_bench.py --phases`` (a GPU's profile): gaps between kernels over 20 us, by the phase the
    host was in; kernels that overlap count once."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("phases", BENCHMARKS / "phases.py")
    phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases)

    class Event(NamedTuple):
        name: str
        device_type: torch.autograd.DeviceType
        time_range: object

    class Span(NamedTuple):
        start: float
        end: float

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        Event("phase:forward", cpu, Span(0, 100)),
        Event("phase:optimizer", cpu, Span(100, 200)),
        Event("gemm", cuda, Span(0, 60)),
        Event("cast", cuda, Span(50, 90)),  # overlaps the gemm
        Event("adam", cuda, Span(150, 160)),  # a 60 us gap before it: 10 in forward, 50 in optimizer
        Event("tiny", cuda, Span(170, 200)),  # a 10 us gap: not counted
    ]

    class Profile:
        def events(self):
            return events

    result = phases.idle_by_phase(Profile(), steps=1)
    assert result["gpu_idle_ms"] == {"forward": 0.01, "optimizer": 0.05}
    assert result["gpu_busy_ms"] == pytest.approx((90 + 10 + 30) / 1e3)
    assert result["host_ms"] == {"forward": 0.1, "optimizer": 0.1}


def test_host_profile_ranks_functions_by_time_per_step():
    """``--host-profile``: per step, the functions with the most time of their own, and hf_fp8's by the
    time with what they call."""
    import cProfile
    import importlib.util
    import pstats

    spec = importlib.util.spec_from_file_location("host_profile", BENCHMARKS / "host_profile.py")
    host_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_profile)

    def busy(n: int) -> int:
        return sum(i * i for i in range(n))

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2):  # two steps
        busy(200_000)
        busy(10)
    profile.disable()
    rows = host_profile.top_functions(pstats.Stats(profile), steps=2, key="total_ms")
    mine = next(r for r in rows if r["function"].endswith("(busy)"))
    assert mine["calls"] == 2  # four calls over two steps
    assert rows.index(mine) < 3 and mine["total_ms"] > mine["self_ms"] > 0
    own = host_profile.top_functions(pstats.Stats(profile), 2, "total_ms", within="test_benchmarks.py")
    assert own and all("test_benchmarks.py" in r["function"] for r in own)


def _load_benchmark_module(name: str):
    """A benchmark script as a module (imported as its neighbours import it: by name, from the folder)."""
    import importlib

    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module(name)


def test_corpus_splits_by_document_drops_copies_and_is_built_once(tmp_path):
    """``convergence.py``'s corpus: each document whole in one split and ended by the end-of-text
    token, a second copy of a text (a vendored package) and empty texts dropped, and the token ids
    cached: the second build reads them back without tokenizing."""
    import torch

    corpus = _load_benchmark_module("corpus")
    trl_bench = _load_benchmark_module("trl_bench")
    tokenizer = trl_bench.byte_tokenizer()
    texts = [f"def f{i}():\n    return {i}\n" * (i + 1) for i in range(40)]
    documents = [(f"pkg/m{i}.py", t) for i, t in enumerate(texts)]
    documents += [("vendored/pkg/m3.py", texts[3]), ("pkg/empty.py", "  \n")]
    built = corpus.build_corpus(tokenizer, "bytes", tmp_path, documents, held_out_share=0.3)
    held = {n for n, _ in documents[:40] if corpus.is_held_out(n, 0.3)}
    assert 0 < len(held) < 40 and built.files == 40
    eos = tokenizer.eos_token_id
    for split, names in ((built.held_out, held), (built.train, {f"pkg/m{i}.py" for i in range(40)} - held)):
        ids = split.long().tolist()
        assert ids.count(eos) == len(names)  # one end-of-text token a document
        pieces = tokenizer.decode(ids).split(tokenizer.eos_token)[:-1]
        assert pieces == [texts[int(n[5:-3])] for n in sorted(names, key=lambda n: int(n[5:-3]))]

    class Refuses:  # the cached corpus is read, not tokenized again
        eos_token_id = eos

        def __call__(self, texts):
            raise AssertionError("tokenized again")

    again = corpus.build_corpus(Refuses(), "bytes", tmp_path, documents, held_out_share=0.3)
    assert torch.equal(again.train, built.train) and again.digest == built.digest
    other = corpus.build_corpus(tokenizer, "bytes", tmp_path, documents[:-3], held_out_share=0.3)
    assert other.digest != built.digest  # other files: another corpus


def test_convergence_trains_every_run_on_the_same_batches_and_tables_them(tmp_path):
    """``convergence.py`` on the CPU at a tiny size: a BF16 (here float32) run and FP8 ones, each in a
    process of its own, all at once (``--gpus``), their curves, FP8 telemetry per layer and role, the
    table in the order of ``--runs``, and the plots. ``fsdp-fp8`` trains under FSDP2 over one process,
    its weights all-gathered in FP8, and its losses are the default's bit for bit (its long run stands on
    that one)."""
    folder = tmp_path / "runs"
    out = bench(
        "convergence.py", "--folder", str(folder), "--runs", "bf16,default,fsdp-fp8", "--gpus", "0,1,2",
        "--shape", "tiny", "--steps", "40", "--batch", "2", "--seq", "32", "--device", "cpu",
        "--autocast", "none", "--compile", "0", "--tokenizer", "bytes", "--max-files", "30",
        "--held-out-share", "0.2", "--log-every", "10", "--eval-every", "20", "--eval-batches", "2",
        "--telemetry-every", "20", "--lr", "3e-3",
        env={**ONE_THREAD, "HF_FP8_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith(("| bf16 ", "| default "))]
    assert len(rows) == 2 and rows[0].startswith("| bf16 ") and "error" not in out.split("| run |")[-1], out
    assert (folder / "table.md").read_text().startswith("| run |")
    assert all((folder / f"{name}.png").stat().st_size > 0 for name in ("loss", "ratio", "telemetry"))
    curves = _load_benchmark_module("convergence_report")
    bf16, fp8 = (curves.read_curve(folder / f"{run}.jsonl") for run in ("bf16", "default"))
    assert len(bf16["losses"]) == len(fp8["losses"]) == 40
    assert bf16["losses"][0] == pytest.approx(fp8["losses"][0], rel=0.02)  # same weights, same batch
    assert fp8["losses"][-1] < fp8["losses"][0]
    assert [step for step, _ in fp8["held_out"]] == [20, 40]
    layers = [json.loads(line)["layers"] for line in (folder / "default.jsonl").read_text().splitlines()
              if '"layers"' in line]  # fmt: skip
    assert len(layers) == 2
    q_proj = layers[-1]["model.layers.0.self_attn.q_proj"]
    assert set(q_proj) == {"input", "weight", "grad_output"} and q_proj["weight"][0] > 0
    assert all(0 <= fraction <= 1 for scale, *fractions in q_proj.values() for fraction in fractions)
    assert fp8["summary"]["fp8_flop_share"] > 0 and bf16["summary"]["fp8_flop_share"] == 0
    gathered = curves.read_curve(folder / "fsdp-fp8.jsonl")
    assert gathered["summary"]["sharded"] == "FSDP2 over one process" and fp8["summary"]["sharded"] is None
    assert gathered["losses"] == fp8["losses"]
    figure = curves.summary_figure([folder], tmp_path / "figure.png")  # the README's, from these runs
    assert figure.stat().st_size > 0


def test_convergence_table_holds_a_run_to_the_issue_bounds():
    """The table's verdict against BF16 over the same steps: the final loss within 0.5%, the held-out
    perplexity within 1%, and no step whose loss rose 10% over BF16's on the same batch; a run that
    stopped early is compared over the steps it ran and marked incomplete."""
    report = _load_benchmark_module("convergence_report")
    base = [3.0 - 0.001 * i for i in range(200)]

    def curve(losses, held, done=True):
        held_out = [(100, held + 0.1), (200, held)][: len(losses) // 100]
        summary = {"ms_per_step": 1.0} if done else None
        return {"losses": losses, "held_out": held_out, "summary": summary, "args": {"steps": 200}}

    spiky = list(base)
    spiky[150] *= 1.2
    curves = {
        "bf16": curve(base, 1.0),
        "close": curve([x * 1.004 for x in base], 1.009),
        "far": curve([x * 1.006 for x in base], 1.0),
        "spiky": curve(spiky, 1.0),
        "partial": curve([x * 1.001 for x in base[:100]], 1.0, done=False),
    }
    rows = report.table(curves, [*curves, "missing"]).splitlines()[2:]
    cells = {row.split(" | ")[0][2:]: row.split(" | ") for row in rows}
    verdicts = {run: cell[-1] for run, cell in cells.items()}
    assert verdicts == {
        "bf16": "yes |",
        "close": "yes |",
        "far": "**no** |",
        "spiky": "**no** |",
        "partial": "incomplete |",
        "missing": "no curve: the run did not start or crashed early ||||||||",
    }
    assert cells["spiky"][6] == "1 (151)" and cells["partial"][1] == "100 of 200"
    assert cells["close"][3] == "+0.40%" and cells["close"][5] == "+0.90%"
    assert report.spikes_over([1.0, float("nan"), 1.05, 1.2], [1.0] * 4, 0.1) == [2, 4]


def test_convergence_trains_lora_adapters_over_fp8_stored_weights(tmp_path):
    """``convergence.py --lora``: adapters over the frozen base, stored in FP8 under ``lora-fp8``, learn."""
    folder = tmp_path / "lora"
    bench(
        "convergence.py", "--folder", str(folder), "--runs", "lora-fp8", "--lora", "--shape", "tiny",
        "--steps", "20", "--batch", "2", "--seq", "32", "--device", "cpu", "--autocast", "none",
        "--compile", "0", "--tokenizer", "bytes", "--max-files", "10", "--held-out-share", "0.2",
        "--log-every", "10", "--eval-every", "20", "--eval-batches", "2", "--telemetry-every", "20",
        "--lr", "3e-3",
        env={**ONE_THREAD, "HF_FP8_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    fp8 = _load_benchmark_module("convergence_report").read_curve(folder / "lora-fp8.jsonl")
    assert fp8["summary"]["lora"] and fp8["summary"]["fp8_flop_share"] > 0
    assert fp8["losses"][-1] < fp8["losses"][0]


def test_linear_bench_reads_the_shapes_it_is_given_and_names_the_format_of_bad_ones():
    """``--shapes`` (a GPU benchmark: only its argument here) for the narrow layers where FP8 stops paying."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("linear_bench", BENCHMARKS / "linear_bench.py")
    linear_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(linear_bench)
    assert linear_bench.parse_shapes("576x1536,1600x6400") == [(576, 1536), (1600, 6400)]
    for bad in ("576", "576x", "0x16", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError, match="INxOUT"):
            linear_bench.parse_shapes(bad)
