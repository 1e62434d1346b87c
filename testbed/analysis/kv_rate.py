"""How fast a prefill instance makes KV: a model card's bytes over its modeled prefill time.

The question Prefill-as-a-Service (Moonshot AI and Tsinghua, 2026) asks first of a model
before its prefill may live in another datacenter: at 32K-token prefills on one 8 x H200
instance, how many Gbit/s of KV come out? ``kv_rates`` answers it from our cards
(``topologies/models/``) and device profiles, beside the figures that report gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.worker_config import Scales
from testbed.errors import InputError
from testbed.hardware import DeviceProfile, ModelCard
from testbed.scenario_yaml import with_card_files
from workers.device import make_pacer

# Prefill-as-a-Service (arXiv 2604.15039), per-instance KV generation at 32K tokens on 8 x H200,
# Gbit/s, by the file stem of our card of that model (its 1 T hybrid: Ring-2.5-1T's row).
PRFAAS_GBPS = {"minimax-m2.5": 59.93, "qwen3-235b-a22b": 33.35, "qwen3.5-397b-a17b": 8.25, "mimo-v2-flash": 4.66,
               "hybrid-1t": 3.19}


@dataclass(frozen=True)
class KvRate:
    name: str
    card: ModelCard
    kv_bytes: int  # of one prefill of ``tokens`` tokens: per-token KV and the request's state
    prefill_s: float
    reported_gbps: float | None

    @property
    def gbps(self) -> float:
        return self.kv_bytes * 8 / self.prefill_s / 1e9

    @property
    def reported_prefill_s(self) -> float | None:
        """The prefill time the reported rate implies for our card's bytes: where the two
        rates differ, this says whether bytes or time do."""
        return None if not self.reported_gbps else self.kv_bytes * 8 / (self.reported_gbps * 1e9)


def load_cards(paths: list[Path]) -> dict[str, ModelCard]:
    """Cards by file stem, each validated where it is (errors name file:line: field)."""
    data = with_card_files(Path("card"), {"models": {p.stem: str(p.resolve()) for p in paths}}, ModelCard)
    return {name: ModelCard.model_validate(fields) for name, fields in data["models"].items()}


def kv_rates(cards: dict[str, ModelCard], device: DeviceProfile, devices: int, tokens: int) -> list[KvRate]:
    if tokens < 1:
        raise InputError(f"--tokens: must be at least 1, got {tokens}")
    out = []
    for name, card in cards.items():
        pacer = make_pacer(device.spec("dev", devices), card.cost(), Scales())
        out.append(KvRate(name, card, card.kv_bytes_for(tokens), pacer.prefill_emulated(tokens, 0),
                          PRFAAS_GBPS.get(name)))
    return out


def format_kv_rates(rates: list[KvRate], device: str, devices: int, tokens: int) -> str:
    lines = [f"KV made by one prefill instance ({devices} x {device}, {tokens:,}-token prefills, nothing cached)",
             "",
             "| model | KV B/token | state MB | KV of a prefill GB | prefill s | KV Gbit/s | PrfaaS Gbit/s | ratio "
             "| prefill s PrfaaS implies |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rates:
        ref = f"{r.reported_gbps:.2f}" if r.reported_gbps else "-"
        ratio = f"{r.gbps / r.reported_gbps:.2f}" if r.reported_gbps else "-"
        implied = f"{r.reported_prefill_s:.3f}" if r.reported_prefill_s else "-"
        lines.append(f"| {r.name} | {r.card.kv_bytes_per_token:,} | {r.card.state_bytes / 1e6:.1f} | "
                     f"{r.kv_bytes / 1e9:.2f} | {r.prefill_s:.3f} | {r.gbps:.1f} | {ref} | {ratio} | {implied} |")
    return "\n".join(lines)
