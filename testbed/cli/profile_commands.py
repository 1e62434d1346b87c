"""``testbed profile fit|check|kv-rate``: device profiles against measured step times (``docs/devices.md``),
and the KV a prefill instance makes per model card (``docs/models.md``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from testbed.analysis.kv_rate import format_kv_rates, kv_rates, load_cards
from testbed.errors import InputError
from testbed.hardware import DeviceProfile, ModelCard
from testbed.profile.fit import TOLERANCE, check, fit, table
from testbed.profile.measurements import load_measurements
from testbed.scenario import Scenario, load_scenario

FITTED = ("compute_efficiency", "decode_compute_efficiency", "bandwidth_efficiency", "step_overhead_ms",
          "allreduce_us")


def add_profile_parser(sub: Any) -> None:
    profile = sub.add_parser("profile", help="device profiles: fit one to measured step times, check fitted ones")
    psub = profile.add_subparsers(dest="profile_cmd", required=True)
    p = psub.add_parser("fit", help="fit a device's efficiencies and overhead to MEASUREMENTS.csv (columns: kind, "
                                    "tokens, context, batch, devices, ms[, dtype_bytes, source]); print the residuals")
    p.add_argument("measurements", type=Path, metavar="MEASUREMENTS.csv")
    p.add_argument("--scenario", type=Path, default=Path("topologies/paper.yaml"),
                   help="where the device profile and model card are (default topologies/paper.yaml)")
    p.add_argument("--device", required=True, help="a key of the scenario's devices: its datasheet peak and bandwidth")
    p.add_argument("--model", help="a key of the scenario's models: what the measurements ran "
                                   "(default: the profile's fitted_to model, else the emulated model)")
    p.set_defaults(command="profile fit")
    p = psub.add_parser("check", help="every fitted profile of a scenario against its measurements (within 15 %%)")
    p.add_argument("--scenario", type=Path, default=Path("topologies/paper.yaml"))
    p.set_defaults(command="profile check")
    p = psub.add_parser("kv-rate", help="the KV one prefill instance makes per second, per model card "
                                        "(docs/models.md), beside Prefill-as-a-Service's figures")
    p.add_argument("cards", type=Path, nargs="*", metavar="CARD.yaml",
                   help="model cards (default: every file of topologies/models/)")
    p.add_argument("--scenario", type=Path, default=Path("topologies/paper.yaml"),
                   help="where the device profile is (default topologies/paper.yaml)")
    p.add_argument("--device", default="h200", help="a key of the scenario's devices (default h200)")
    p.add_argument("--devices", type=int, default=8, help="accelerators of the instance (default 8)")
    p.add_argument("--tokens", type=int, default=32768, help="prompt tokens of a prefill (default 32,768)")
    p.set_defaults(command="profile kv-rate")


def _device(sc: Scenario, name: str) -> DeviceProfile:
    if name not in sc.devices:
        known = ", ".join(sorted(sc.devices)) or "none"
        raise InputError(f"{sc.source}: no device profile {name!r} (devices: {known})")
    return sc.devices[name]


def _model(sc: Scenario, dev: DeviceProfile, name: str | None) -> tuple[str, ModelCard]:
    key = name or (dev.fitted_to.model if dev.fitted_to else None) or (sc.emulation.model if sc.emulation else None)
    if key is None or key not in sc.models:
        known = ", ".join(sorted(sc.models)) or "none"
        raise InputError(f"{sc.source}: no model {key!r} to price the measurements with (models: {known}); "
                         "name one with --model")
    return key, sc.models[key]


def cmd_profile_fit(args: argparse.Namespace) -> int:
    sc = load_scenario(args.scenario)
    dev = _device(sc, args.device)
    key, card = _model(sc, dev, args.model)
    rows = load_measurements(args.measurements)
    fitted, residuals = fit(dev, card, rows)
    print(f"{args.device} (peak {dev.peak_tflops:g} TFLOP/s, {dev.mem_gbps:g} GB/s) fitted to {len(rows)} "
          f"measurements of {key} in {args.measurements}:\n")
    print(table(residuals))
    worst = max(abs(r.error) for r in residuals)
    print(f"\nlargest error {worst:.1%}" + ("" if worst <= TOLERANCE else f" (outside +-{TOLERANCE:.0%})"))
    print(f"\n# under devices: in {args.scenario}\n  {args.device}:")
    for field in FITTED:  # what the fit set (an all-reduce latency needs a tensor-parallel measurement)
        value = getattr(fitted, field)
        if value is not None and (value != getattr(dev, field) or field.endswith("efficiency")):
            print(f"    {field}: {value:.3g}")
    print(f"    fitted_to: {{measurements: <path from the scenario's folder to {args.measurements.name}>, "
          f"model: {key}}}")
    return 0


def cmd_profile_check(args: argparse.Namespace) -> int:
    """Every profile with ``fitted_to`` must reproduce its measurements within TOLERANCE."""
    sc = load_scenario(args.scenario)
    assert sc.source is not None
    checked = failed = 0
    for name, dev in sorted(sc.devices.items()):
        if dev.fitted_to is None:
            continue
        path = sc.source.parent / dev.fitted_to.measurements
        residuals = check(dev, sc.models[dev.fitted_to.model], load_measurements(path))
        bad = [r for r in residuals if abs(r.error) > TOLERANCE]
        checked += 1
        failed += bool(bad)
        print(f"{name} against {path} ({dev.fitted_to.model}): " + ("ok" if not bad else f"{len(bad)} outside "
                                                                     f"+-{TOLERANCE:.0%}"))
        print(table(residuals) + "\n")
    if not checked:
        print(f"{args.scenario}: no device profile names the measurements it was fitted to (fitted_to)")
    return 1 if failed else 0


def cmd_profile_kv_rate(args: argparse.Namespace) -> int:
    sc = load_scenario(args.scenario)
    dev = _device(sc, args.device)
    if args.devices < 1:
        raise InputError(f"--devices: must be at least 1, got {args.devices}")
    paths = args.cards or sorted(Path("topologies/models").glob("*.yaml"))
    if not paths:
        raise InputError("no model card given, and none in topologies/models/")
    rates = kv_rates(load_cards(paths), dev, args.devices, args.tokens)
    print(format_kv_rates(rates, args.device, args.devices, args.tokens))
    return 0
