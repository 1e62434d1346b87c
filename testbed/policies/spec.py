"""The policy grammar, parsed once: ``name[:key=value,...]`` -> a typed ``PolicySpec``.

Each policy states its options once, as a model with defaults and ranges (``PddOptions``);
``parse_policy`` turns the command-line spelling into a spec or raises ``PolicyError`` (exit
2) naming the option and what it accepts. The spec, not the string, is what the router
process receives (inside ``RouterConfig``), and ``make_policy`` builds the policy object
from it. ``label`` is the canonical spelling: the name plus the options that were given.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from protocol.validation import field_errors
from testbed.errors import InputError


class PolicyError(InputError):
    """A policy spelling that cannot be parsed; the message names the option."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @property
    def label(self) -> str:
        opts = getattr(self, "options", None)
        given = [] if opts is None else [k for k in type(opts).model_fields if k in opts.model_fields_set]
        shown = ",".join(f"{k}={_spell(getattr(opts, k))}" for k in given)
        return f"{self.name}:{shown}" if shown else self.name  # type: ignore[attr-defined]

    def describe(self) -> str:
        """The name with every option, defaults included."""
        opts = getattr(self, "options", None)
        if opts is None:
            return self.name  # type: ignore[attr-defined]
        return f"{self.name}:" + ",".join(  # type: ignore[attr-defined]
            f"{k}={_spell(v)}" for k, v in opts.model_dump().items() if v is not None)


def _spell(v: object) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


class SameDcSpec(_Spec):
    """Prefill and decode in the prefill's datacenter. No options."""

    name: Literal["same-dc"] = "same-dc"


class CrossDcSpec(_Spec):
    """Decode in the other datacenter, after the whole KV crossed the WAN. No options."""

    name: Literal["cross-dc"] = "cross-dc"


class PddOptions(BaseModel):
    """PDD's options (``testbed/policies/pdd.py`` says what each one does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    handoff: Literal["one-shot", "catch-up", "adaptive"] = "adaptive"
    threshold: int = Field(default=64, ge=1, description="catch-up batch, tokens")
    load: int = Field(default=4, ge=1, description="adaptive: one-shot at this many relay requests")
    relay_s: float = Field(default=0.5, ge=0, description="relay when the WAN wait exceeds this")
    drc: Literal["on", "off"] = "on"
    filter: Literal["off", "predict"] = "off"
    low_hit: float = Field(default=0.5, ge=0, le=1, description="share of the prompt computed = low hit")
    cutoff: Literal["all", "anomalous", "off"] = "anomalous"
    eager: int | None = Field(default=None, ge=0, description="hand over after exactly this many tokens")


class PddSpec(_Spec):
    name: Literal["pdd"] = "pdd"
    options: PddOptions = PddOptions()


class OffloadOptions(BaseModel):
    """Prefill offload's options (``testbed/policies/offload.py`` says what each one does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: int = Field(default=19456, ge=0, description="offload from this many uncached emulated tokens")
    wan_s: float = Field(default=2.0, ge=0, description="offload only while the line carries the KV within this")


class OffloadSpec(_Spec):
    name: Literal["prefill-offload"] = "prefill-offload"
    options: OffloadOptions = OffloadOptions()


PolicySpec = Annotated[SameDcSpec | CrossDcSpec | PddSpec | OffloadSpec, Field(discriminator="name")]
_SPECS: dict[str, type[_Spec]] = {"same-dc": SameDcSpec, "cross-dc": CrossDcSpec, "pdd": PddSpec,
                                  "prefill-offload": OffloadSpec}
POLICY_NAMES = tuple(_SPECS)
_ADAPTER: TypeAdapter[PolicySpec] = TypeAdapter(PolicySpec)


def spec_from_json(data: str | bytes) -> PolicySpec:
    return _ADAPTER.validate_json(data)


def parse_policy(text: str) -> PolicySpec:
    """``pdd:handoff=catch-up,threshold=32`` -> ``PddSpec``. Raises PolicyError."""
    name, _, rest = text.strip().partition(":")
    cls = _SPECS.get(name)
    if cls is None:
        raise PolicyError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    options: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise PolicyError(f"{name}: option {part!r} must be key=value")
        options[key.strip()] = value.strip()
    opts_field = cls.model_fields.get("options")
    opts_cls: type[BaseModel] | None = opts_field.annotation if opts_field else None  # type: ignore[assignment]
    fields = opts_cls.model_fields if opts_cls is not None else {}
    for key in options:
        if key not in fields:
            known = ", ".join(fields) if fields else "none"
            raise PolicyError(f"{name}: unknown option {key!r} (options: {known})")
    if opts_cls is None:
        return cls()  # type: ignore[return-value]
    try:
        return cls(options=opts_cls.model_validate(options))  # type: ignore[return-value]
    except ValidationError as e:
        err = field_errors(e)[0]
        key = str(err.loc[0]) if err.loc else "?"
        raise PolicyError(f"{name}: option {key}={options.get(key)!r}: {err.msg}") from e


def parse_policy_list(text: str, option: str = "--policies") -> list[PolicySpec]:
    """``same-dc,pdd:handoff=one-shot,threshold=8,cross-dc``: options use commas too, so a
    ``key=value`` part without a ``:`` belongs to the policy before it."""
    merged: list[str] = []
    for p in filter(None, (x.strip() for x in text.split(","))):
        if "=" in p and ":" not in p and merged:
            merged[-1] += "," + p
        else:
            merged.append(p)
    if not merged:
        raise PolicyError(f"{option}: no policy given")
    specs = []
    for p in merged:
        try:
            specs.append(parse_policy(p))
        except PolicyError as e:
            raise PolicyError(f"{option}: {e}") from e
    return specs
