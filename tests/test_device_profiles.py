"""Device profiles: efficiencies and tensor parallelism in the pacer's arithmetic, the shipped
profiles against the published step times they cite, the fit, and bad measurement files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testbed.errors import InputError
from testbed.hardware import DeviceProfile, ModelCard
from testbed.profile.fit import TOLERANCE, check, fit, predict_ms
from testbed.profile.measurements import Measurement, load_measurements
from testbed.scenario import load_scenario
from workers.device import make_pacer

from .conftest import TOPOLOGIES, run_cli, run_cli_output

CARD = ModelCard(layers=28, heads=28, kv_heads=4, head_dim=128, params=7.61e9, dtype_bytes=2)
GPU = DeviceProfile(peak_tflops=989, mem_gbps=3350, link_gbps=450)


def test_efficiencies_and_tensor_parallel_in_the_pacer() -> None:
    ideal = make_pacer(GPU.spec("gpu"), CARD.cost())
    half = make_pacer(GPU.model_copy(update={"compute_efficiency": 0.5}).spec("gpu"), CARD.cost())
    # An 8K-token prefill is compute-bound: half the efficiency, twice the time.
    assert half.prefill_emulated(8192, 0) == pytest.approx(2 * ideal.prefill_emulated(8192, 0))
    # A small decode step is bandwidth-bound: the compute efficiency does not touch it, the
    # decode one only where its GEMMs reach the compute roof.
    assert half.decode_emulated([1000]) == pytest.approx(ideal.decode_emulated([1000]))
    slow_decode = make_pacer(GPU.model_copy(update={"decode_compute_efficiency": 0.05}).spec("gpu"), CARD.cost())
    assert slow_decode.decode_emulated([1000]) == pytest.approx(ideal.decode_emulated([1000]))
    assert slow_decode.decode_emulated([100] * 512) > 2 * ideal.decode_emulated([100] * 512)
    assert slow_decode.prefill_emulated(8192, 0) == pytest.approx(ideal.prefill_emulated(8192, 0))
    bw = make_pacer(GPU.model_copy(update={"bandwidth_efficiency": 0.8}).spec("gpu"), CARD.cost())
    assert bw.decode_emulated([1000]) == pytest.approx(ideal.decode_emulated([1000]) / 0.8)
    # Eight devices: peak and bandwidth x8, and two all-reduces per layer and pass: latency
    # plus the rows' activations over the link, 2 (n-1)/n of them.
    tp = GPU.model_copy(update={"allreduce_us": 15.0})
    eight = make_pacer(tp.spec("gpu", 8), CARD.cost())
    one = make_pacer(tp.spec("gpu"), CARD.cost())
    assert eight.devices == 8 and one.devices == 1
    rows = 64
    wire = rows * 3584 * 2 * 2 * 7 / 8 / 450e9
    flops = 2 * 7.61e9 * rows
    nbytes = 7.61e9 * 2
    base = max(flops / (8 * 989e12), nbytes / (8 * 3350e9))
    assert eight.pass_emulated(flops, nbytes, rows) == pytest.approx(base + 2 * 28 * (15e-6 + wire))
    assert one.pass_emulated(flops, nbytes, rows) == pytest.approx(max(flops / 989e12, nbytes / 3350e9))


def test_scenario_instances_carry_the_profile() -> None:
    sc = load_scenario(TOPOLOGIES / "paper.yaml")
    d = sc.device_spec("prefill-1")
    h100 = sc.devices["h100"]
    assert d.devices == 8 and d.peak_tflops == 8 * h100.peak_tflops and d.mem_gbps == 8 * h100.mem_gbps
    assert (d.compute_efficiency, d.decode_compute_efficiency, d.allreduce_us, d.link_gbps) == (
        h100.compute_efficiency, h100.decode_compute_efficiency, h100.allreduce_us, h100.link_gbps)
    assert h100.compute_efficiency < 0.75  # not the datasheet's peak: the point


@pytest.mark.parametrize("scenario", sorted(TOPOLOGIES.glob("*.yaml")), ids=lambda p: p.name)
def test_fitted_profiles_reproduce_their_published_measurements(scenario: Path) -> None:
    """Every profile that names its measurements reproduces each cited point within 15 %."""
    sc = load_scenario(scenario)
    for name, dev in sc.devices.items():
        if dev.fitted_to is None:
            continue
        rows = load_measurements(scenario.parent / dev.fitted_to.measurements)
        assert all(r.source for r in rows), f"{name}: every measurement cites where it comes from"
        for r in check(dev, sc.models[dev.fitted_to.model], rows):
            assert abs(r.error) <= TOLERANCE, f"{name}, line {r.measurement.line}: {r.error:+.1%}"


def test_the_paper_scenario_cites_both_sources(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli_output(["profile", "check", "--scenario", str(TOPOLOGIES / "paper.yaml")], capsys)
    assert code == 0 and "h100 against" in out and "a100 against" in out and "outside" not in out
    assert "h200 against" in out  # our own measurement (testbed/profile/step_times.py)


def test_the_step_time_script_writes_what_the_fit_reads(tmp_path: Path) -> None:
    """The GPU measurement script, as a miniature on the CPU: a CSV the fit reads, every
    row a pass of the kind it names, timed and cited."""
    script = Path(__file__).resolve().parent.parent / "testbed" / "profile" / "step_times.py"
    out = tmp_path / "cpu.csv"
    done = subprocess.run([sys.executable, str(script), "--cpu-check", "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = load_measurements(out)
    assert [(r.kind, r.tokens, r.context, r.batch) for r in rows] == [
        ("prefill", 16, 0, 1), ("prefill", 8, 16, 1), ("decode", 1, 16, 1), ("decode", 1, 8, 4)]
    assert all(r.ms > 0 and r.dtype_bytes == 2 and "CPU check" in r.source for r in rows)
    assert not list(tmp_path.glob("*.tmp"))  # written whole or not at all
    # Without a GPU and without --cpu-check it refuses, saying why.
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "x.csv")], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and "no CUDA GPU visible" in done.stderr


def test_fit_recovers_the_parameters_that_made_the_measurements() -> None:
    truth = GPU.model_copy(update={"compute_efficiency": 0.6, "decode_compute_efficiency": 0.3,
                                   "bandwidth_efficiency": 0.8, "step_overhead_ms": 3.0, "allreduce_us": 20.0})
    shapes = [("prefill", 512, 0, 1, 1), ("prefill", 4096, 0, 1, 1), ("prefill", 2048, 8192, 1, 1),
              ("decode", 1, 2048, 8, 1), ("decode", 1, 1024, 64, 1), ("decode", 1, 128, 1024, 1),
              ("run", 512, 1024, 32, 1), ("decode", 1, 1024, 16, 4), ("prefill", 2048, 0, 1, 8)]
    rows = [Measurement(k, t, c, b, d, predict_ms(truth, CARD, Measurement(k, t, c, b, d, 1.0)), source="synthetic")
            for k, t, c, b, d in shapes]
    fitted, residuals = fit(GPU, CARD, rows)
    for field in ("compute_efficiency", "decode_compute_efficiency", "bandwidth_efficiency", "step_overhead_ms",
                  "allreduce_us"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=0.02), field
    assert max(abs(r.error) for r in residuals) < 1e-3


def test_a_decode_efficiency_nothing_depends_on_is_left_unset() -> None:
    truth = GPU.model_copy(update={"compute_efficiency": 0.5, "step_overhead_ms": 2.0})
    rows = [Measurement(k, t, c, b, 1, predict_ms(truth, CARD, Measurement(k, t, c, b, 1, 1.0)))
            for k, t, c, b in (("prefill", 1024, 0, 1), ("prefill", 8192, 0, 1), ("decode", 1, 4096, 1),
                               ("decode", 1, 512, 4))]
    fitted, _ = fit(GPU, CARD, rows)
    assert fitted.decode_compute_efficiency is None and fitted.allreduce_us == 0.0
    assert fitted.compute_efficiency == pytest.approx(0.5, rel=0.02)
    with pytest.raises(InputError, match="2 measurements cannot determine 3 parameters"):
        fit(GPU, CARD, rows[:2])


def test_profile_fit_prints_residuals_and_the_yaml_to_paste(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    csv = tmp_path / "mine.csv"
    csv.write_text("# my engine, my GPU\nkind,tokens,context,batch,devices,ms\nprefill,1024,0,1,1,40\n"
                   "prefill,8192,0,1,1,260\ndecode,1,4096,1,1,9\ndecode,1,4096,32,1,24\n")
    code, out, err = run_cli_output(["profile", "fit", str(csv), "--scenario", str(TOPOLOGIES / "paper.yaml"),
                                     "--device", "h20", "--model", "qwen2.5-7b"], capsys)
    assert code == 0, err
    assert "fitted to 4 measurements of qwen2.5-7b" in out and "largest error" in out
    assert "  h20:\n    compute_efficiency: " in out and "fitted_to: {measurements:" in out
    code, err = run_cli(["profile", "fit", str(csv), "--scenario", str(TOPOLOGIES / "paper.yaml"),
                         "--device", "tpu"], capsys)
    assert code == 2 and "no device profile 'tpu' (devices: a100, h100, h20, h200)" in err


@pytest.mark.parametrize(("text", "complaint"), [
    ("", ":1: (file): no header row and no measurements"),
    ("kind,tokens,context,batch,devices\n", ":1: ms: missing column"),
    ("kind,tokens,context,batch,devices,ms,gpu\n", ":1: gpu: unknown column"),
    ("kind,tokens,context,batch,devices,ms\n", ":1: (file): a header and no measurements"),
    ("# c\nkind,tokens,context,batch,devices,ms\nprefill,1,0,1,1,5\nburst,1,0,1,1,5\n",
     ":4: kind: 'burst' is not one of prefill, decode, run"),
    ("kind,tokens,context,batch,devices,ms\nprefill,1.5,0,1,1,5\n", ":2: tokens: '1.5' is not an integer"),
    ("kind,tokens,context,batch,devices,ms\nprefill,1,0,0,1,5\n", ":2: batch: must be >= 1"),
    ("kind,tokens,context,batch,devices,ms\nprefill,1,0,1,1,-5\n", ":2: ms: must be a positive"),
    ("kind,tokens,context,batch,devices,ms\nprefill,1,0,1,1,inf\n", ":2: ms: must be a positive"),
    ("kind,tokens,context,batch,devices,ms\nprefill,1,0,1,1,fast\n", ":2: ms: 'fast' is not a number"),
    ("kind,tokens,context,batch,devices,ms\nprefill,1,0,1\n", ":2: (row): 4 values for 6 columns"),
    ("kind,tokens,context,batch,devices,ms\nrun,1,0,1,1,5\n", ":2: context: a run needs its input length"),
    ("kind,tokens,context,batch,devices,ms,dtype_bytes\nprefill,1,0,1,1,5,16\n", ":2: dtype_bytes: must be <= 8"),
])
def test_bad_measurement_files_name_line_and_column(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "m.csv"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_measurements(path)
    assert str(e.value).startswith(str(path)) and complaint in str(e.value)


def test_a_fitted_profile_must_name_a_known_model(tmp_path: Path) -> None:
    text = (TOPOLOGIES / "paper.yaml").read_text().replace("model: llama-7b}", "model: llama-9b}", 1)
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match="devices.h100.fitted_to.model names unknown model 'llama-9b'"):
        load_scenario(path)
