"""Policies by name: the built-ins and users' plugins, one registry, one grammar.

A policy is named on the command line (``--policies``), in ``tune``, ``serve`` and every
experiment as ``NAME[:key=value,...]``, where NAME is

* a registered name (``pdd``, ``same-dc``, or a plugin's own ``name`` once its file was
  loaded earlier in the same list);
* ``path/to/file.py:Class`` (a plugin's file) or ``package.module:Class`` (a module on the
  Python path): the class is loaded, registered under its ``name`` and recorded by its file,
  so the router process and a Ray node load the very same file.

``parse_policy`` turns the spelling into a ``PolicySpec`` (protocol/policy.py) once, at the
edge, checking every option against the policy's ``Options`` model; ``make_policy`` builds
the object from a spec (in the router, again checking its options). A bad plugin (no such
file, an import that raises, not a ``Policy``, a name taken, options that do not validate)
is a ``PolicyError`` (exit 2) naming the file and line.

A plugin is user code: when this process is root, a plugin's file and its folder must be
root's and writable by no other account (as ``--topo``), or it is refused; in the emulation
the router imports it only after it has dropped root (``control.router``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from protocol.policy import POLICY_NAME, PolicySpec, spell
from protocol.validation import field_errors
from testbed.errors import InputError
from testbed.policies.base import Policy
from testbed.root_paths import import_file


class PolicyError(InputError):
    """A policy that cannot be named, loaded or configured; the message says where and why."""


_REGISTRY: dict[str, type[Policy]] = {}
_LOADED: dict[str, type[Policy]] = {}  # "FILE.py:Class" -> the class, once per process
_NAME = re.compile(POLICY_NAME)
_CLASS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def register(cls: type[Policy]) -> type[Policy]:
    """Register a policy class under its ``name`` (a decorator; built-ins use it too)."""
    where = _where(cls)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"{where}: {cls!r} is not a Policy subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == Policy.name:
        raise PolicyError(f"{where}: {cls.__name__}.name must be a name of its own "
                          f"(lower case, digits, '-', '_', '.'; got {name!r})")
    opts = cls.Options
    if not (isinstance(opts, type) and issubclass(opts, BaseModel)):
        raise PolicyError(f"{where}: {cls.__name__}.Options must be a pydantic model")
    try:
        opts()
    except ValidationError as e:
        raise PolicyError(f"{where}: {cls.__name__}.Options: every option needs a default "
                          f"({field_errors(e)[0].msg})") from e
    taken = _REGISTRY.get(name)
    if taken is not None and taken is not cls and source_of(taken) is None:
        raise PolicyError(f"{where}: the name {name!r} is taken by {_where(taken)} (built in)")
    _REGISTRY[name] = cls  # a plugin's name: the file loaded last (a spec names its file anyway)
    return cls


def registered() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _where(cls: type) -> str:
    try:
        return f"{Path(sys.modules[cls.__module__].__file__ or '?')}:{cls.__name__}"
    except (KeyError, AttributeError, TypeError):
        return cls.__qualname__


# ------------------------------------------------------------------------ plugins
def load_plugin(ref: str) -> type[Policy]:
    """``FILE.py:Class`` or ``module:Class`` -> the class, loaded once and registered."""
    if ref in _LOADED:  # (the router, no longer root, may not even see the file it loaded as root)
        return _LOADED[ref]
    target, sep, cls_name = ref.rpartition(":")
    if not sep or not target or not _CLASS.fullmatch(cls_name):
        raise PolicyError(f"{ref}: expected FILE.py:Class or module:Class")
    path = _file_of(target)
    key = f"{path}:{cls_name}"
    if key in _LOADED:
        _LOADED[ref] = _LOADED[key]
        return _LOADED[key]
    try:
        module = import_file(path, "_pdd_policy_")
    except InputError as e:
        raise PolicyError(str(e).replace(": importing it failed:", ": importing the policy failed:")) from e
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        found = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Policy) and v.__module__ == module.__name__)
        raise PolicyError(f"{path}: no Policy subclass {cls_name!r} (found: {', '.join(found) or 'none'})")
    register(cls)
    _LOADED[key] = _LOADED[ref] = cls
    return cls


def _file_of(target: str) -> Path:
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise PolicyError(f"{target}: no such file")
        return path
    if not _MODULE.fullmatch(target):
        raise PolicyError(f"{target}: not a file (FILE.py) nor a module name")
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as e:
        raise PolicyError(f"{target}: cannot find the module ({e})") from e
    if found is None or not found.origin or not found.origin.endswith(".py"):
        raise PolicyError(f"{target}: no such module (a policy module is a .py file on the Python path)")
    return Path(found.origin).resolve()


# ------------------------------------------------------------------------ specs
def policy_class(spec: PolicySpec) -> type[Policy]:
    if spec.source is not None:
        cls = load_plugin(spec.source)
        if cls.name != spec.name:
            raise PolicyError(f"{spec.source}: its policy is named {cls.name!r}, not {spec.name!r}")
        return cls
    cls = _REGISTRY.get(spec.name)
    if cls is None:
        raise PolicyError(f"unknown policy {spec.name!r} (known: {', '.join(registered())}; a plugin is "
                          "named FILE.py:Class or module:Class)")
    return cls


def options_of(cls: type[Policy], given: dict[str, Any]) -> BaseModel:
    """``given`` read by the policy's options model; a PolicyError naming the option."""
    fields = cls.Options.model_fields
    for key in given:
        if key not in fields:
            raise PolicyError(f"{cls.name}: unknown option {key!r} (options: {', '.join(fields) or 'none'})")
    try:
        return cls.Options.model_validate(given)
    except ValidationError as e:
        err = field_errors(e)[0]
        key = str(err.loc[0]) if err.loc else "?"
        raise PolicyError(f"{cls.name}: option {key}={given.get(key)!r}: {err.msg}") from e


def make_policy(spec: PolicySpec) -> Policy:
    cls = policy_class(spec)
    return cls(options_of(cls, dict(spec.options)))


def spec_for(cls: type[Policy], options: dict[str, Any], source: str | None = None) -> PolicySpec:
    """The spec of ``cls`` with ``options`` (checked; kept as the model read them)."""
    model = options_of(cls, options)
    typed = {k: getattr(model, k) for k in options}
    return PolicySpec(name=cls.name, source=source, options=typed)


def source_of(cls: type[Policy]) -> str | None:
    """How a spec names ``cls``: None for a class registered in the testbed itself."""
    module = sys.modules.get(cls.__module__)
    if cls.__module__.startswith("testbed.") or module is None or not getattr(module, "__file__", None):
        return None
    return f"{Path(module.__file__ or '').resolve()}:{cls.__name__}"


def describe(spec: PolicySpec) -> str:
    """The name with every option, defaults included."""
    cls = policy_class(spec)
    model = options_of(cls, dict(spec.options))
    shown = ",".join(f"{k}={spell(v)}" for k, v in model.model_dump().items() if v is not None)
    return f"{spec.name}:{shown}" if shown else spec.name


def parse_policy(text: str) -> PolicySpec:
    """``pdd:handoff=catch-up,threshold=32``, ``mine.py:Greedy:k=0.8`` -> a ``PolicySpec``.
    Raises PolicyError naming what is wrong."""
    text = text.strip()
    head, _, rest = text.partition(":")
    source: str | None = None
    if head in _REGISTRY or not rest:
        cls, opts_text = policy_class(PolicySpec.model_construct(name=head, source=None, options={})), rest
    else:  # a plugin: FILE.py:Class[:options] or module:Class[:options]
        cls_name, _, opts_text = rest.partition(":")
        if not _CLASS.fullmatch(cls_name):
            raise PolicyError(f"unknown policy {head!r} (known: {', '.join(registered())}; a plugin is named "
                              "FILE.py:Class or module:Class)")
        cls = load_plugin(f"{head}:{cls_name}")
        source = f"{_file_of(head)}:{cls_name}"
    options: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in opts_text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise PolicyError(f"{cls.name}: option {part!r} must be key=value")
        options[key.strip()] = value.strip()
    return spec_for(cls, options, source)


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
