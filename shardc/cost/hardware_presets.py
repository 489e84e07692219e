"""Hardware presets: data files ``shardc/cost/hardware/<name>.toml`` -> :class:`Hardware`.

``load_hardware("h100")`` reads a preset; ``load_hardware("my.toml")`` reads a user file that
may name a preset to start from (``base = "h100"``) and override any field of it. A value is
a file when it ends in ``.toml`` or contains a path separator, otherwise a preset name (a file
or folder called ``h100`` in the working directory does not shadow the preset; write
``./h100`` for it). Unknown keys, missing fields, non-numbers, NaN/infinite or out-of-range
values (:data:`MAX_FIELD_VALUE`) and unreadable files raise :class:`InputError`.
Units are part of the field names (``_tflops`` = 1e12 FLOP/s, ``_gb_s`` = 1e9 bytes/s,
``_tb_s`` = 1e12 bytes/s, ``_gb`` = 1e9 bytes, ``_us`` = microseconds); ``*_eff`` are the
achieved fractions of the corresponding peak.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

import tomllib

from shardc.errors import InputError
from shardc.validate import MAX_GPUS, MAX_NESTING, check_nesting, check_number

PRESET_DIR = Path(__file__).with_name("hardware")
MAX_FIELD_VALUE = 1e15  # any numeric field, in its own unit: far above any real GPU
_ZERO_OK = ("headroom", "workspace_gb", "a2a_peer_us", "kernel_overhead_us",
            "collective_base_us", "nvlink_hop_us", "net_hop_us")
_FRACTIONS = ("gemm_eff", "attention_eff", "hbm_eff", "nvlink_eff", "nic_eff")
_OVERLAPS = ("tp_comm_overlap", "ep_comm_overlap")  # fractions in [0, 1], optional


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its interconnect; see the preset files for the meaning of each field."""

    name: str
    peak_bf16_tflops: float
    peak_fp8_tflops: float
    hbm_gb: float
    hbm_tb_s: float
    nvlink_gb_s: float
    nvlink_domain: int
    nic_gb_s: float
    gemm_eff: float
    attention_eff: float
    hbm_eff: float
    nvlink_eff: float
    nic_eff: float
    gemm_m_half: float
    gemm_nk_half: float
    hbm_bytes_half: float
    collective_base_us: float
    nvlink_hop_us: float
    net_hop_us: float
    a2a_peer_us: float
    kernel_overhead_us: float
    headroom: float
    workspace_gb: float
    description: str = ""
    # fraction of a branch's tp collectives / ep all-to-alls hidden under its compute
    # (comm/GEMM overlap for tp, two-batch overlap for ep); optional, 0 = serial
    tp_comm_overlap: float = 0.0
    ep_comm_overlap: float = 0.0

    # ---- derived, in SI units ------------------------------------------------------
    def peak_flops(self, fp8: bool = False) -> float:
        """Dense peak FLOP/s (fp8 or bf16)."""
        return (self.peak_fp8_tflops if fp8 else self.peak_bf16_tflops) * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tb_s * 1e12

    @property
    def nvlink_bytes_s(self) -> float:
        """Achieved NVLink bandwidth per GPU per direction, bytes/s."""
        return self.nvlink_gb_s * 1e9 * self.nvlink_eff

    @property
    def nic_bytes_s(self) -> float:
        """Achieved scale-out bandwidth per GPU, bytes/s."""
        return self.nic_gb_s * 1e9 * self.nic_eff

    @property
    def usable_hbm_bytes(self) -> float:
        """HBM a plan may fill: capacity minus headroom fraction minus fixed workspace."""
        return self.hbm_gb * 1e9 * (1.0 - self.headroom) - self.workspace_gb * 1e9

    def scaled(self, **factors: float) -> Hardware:
        """A copy with fields multiplied by the given factors (used by tests/what-ifs)."""
        return replace(self, **{k: getattr(self, k) * v for k, v in factors.items()})


_FIELDS = {f.name: f for f in fields(Hardware)}
_REQUIRED = [f.name for f in fields(Hardware) if f.name not in ("description", *_OVERLAPS)]


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise InputError(f"--hardware {path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise InputError(f"--hardware {path}: not a text TOML file (not UTF-8)") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"--hardware {path}: malformed TOML ({e})") from None
    except RecursionError:
        raise InputError(f"--hardware {path}: malformed TOML (nested more than "
                         f"{MAX_NESTING} levels deep)") from None
    try:
        check_nesting(data, "TOML")
    except ValueError as e:
        raise InputError(f"--hardware {path}: malformed TOML ({e})") from None
    return data


def is_hardware_file(spec: str) -> bool:
    """The ``--hardware`` rule: a file when the value ends in ``.toml`` or contains a path
    separator; anything else is a preset name."""
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return spec.endswith(".toml") or any(sep in spec for sep in seps)


def _resolve(spec: str, seen: tuple[str, ...] = ()) -> dict:
    """Merged raw dict for a preset name or file path, following ``base`` chains."""
    if spec in seen:
        raise InputError(f"--hardware: 'base' chain loops through {spec!r}")
    p = Path(spec)
    if is_hardware_file(spec):
        path, label = p, str(p)
    elif (PRESET_DIR / f"{spec}.toml").exists():
        path, label = PRESET_DIR / f"{spec}.toml", spec
    else:
        raise InputError(f"--hardware {spec!r}: unknown preset (expected one of "
                         f"{', '.join(preset_names())}, or a file: a path ending in .toml or "
                         "containing /)")
    raw = _read_toml(path)
    base = raw.pop("base", None)
    merged: dict = {}
    if base is not None:
        if not isinstance(base, str):
            raise InputError(f"--hardware {label}: 'base' must be a preset name")
        merged = _resolve(base, seen + (spec,))
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise InputError(f"--hardware {label}: unknown field(s) {', '.join(unknown)}")
    merged.update(raw)
    if "name" not in merged:  # a file's stem, made a valid name ("my gpu" -> "my_gpu")
        stem = re.sub(r"[^A-Za-z0-9._+-]", "_", p.stem if is_hardware_file(spec) else spec)
        merged["name"] = stem.lstrip("._+-")[:64] or "custom"
    return merged


def load_hardware(name_or_path: str | Hardware) -> Hardware:
    """A :class:`Hardware` from a preset name (``h100``, ``h200``, ``b200``) or a TOML file."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    raw = _resolve(str(name_or_path))
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise InputError(f"--hardware {name_or_path}: missing field(s) {', '.join(missing)} "
                         "(set base = \"h100\" to start from a preset)")
    kw = {}
    for k, v in raw.items():
        if k in ("name", "description"):
            if not isinstance(v, str):
                raise InputError(f"--hardware {name_or_path}: {k} = {_shown(v)} is not a "
                                 "string")
            if k == "name" and not _NAME_RE.match(v):
                raise InputError(f"--hardware {name_or_path}: name = {_shown(v)}: expected "
                                 "1-64 letters, digits, '.', '_', '-', '+' (starting with a "
                                 "letter or digit)")
            kw[k] = v if k == "name" else " ".join(v.split())
            continue
        what = f"--hardware {name_or_path}: {k}"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(f"{what} = {v!r} is not a number")
        if k == "nvlink_domain":
            kw[k] = check_number(v, what, integer=True, minimum=1, maximum=MAX_GPUS, unit="GPUs")
        elif k in _OVERLAPS:
            kw[k] = check_number(v, what, minimum=0, maximum=1.0,
                                 unit="a fraction of the communication time")
        elif k in _FRACTIONS:
            kw[k] = check_number(v, what, above=0, maximum=1.0, unit="a fraction of peak")
        elif k == "headroom":
            kw[k] = check_number(v, what, minimum=0, maximum=0.99, unit="a fraction of HBM")
        elif k in _ZERO_OK:
            kw[k] = check_number(v, what, minimum=0, maximum=MAX_FIELD_VALUE)
        else:  # peaks, bandwidths, capacities, curve constants: strictly positive
            kw[k] = check_number(v, what, above=0, maximum=MAX_FIELD_VALUE)
    hw = Hardware(**kw)
    usable = hw.hbm_gb * (1.0 - hw.headroom)
    if hw.workspace_gb >= usable:
        raise InputError(f"--hardware {name_or_path}: workspace_gb = {hw.workspace_gb:g}: "
                         f"expected less than hbm_gb x (1 - headroom) = {usable:g} GB")
    return _custom_if_changed(hw, name_or_path)


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
CUSTOM_SUFFIX = "-custom"


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:36] + "...'"


def _custom_if_changed(hw: Hardware, spec: str) -> Hardware:
    """A hardware file whose name is a preset's but whose numbers differ from that preset
    is recorded as ``<name>-custom`` (plan.json, reports): a preset name means the preset's
    numbers."""
    if not is_hardware_file(str(spec)) or hw.name not in preset_names():
        return hw
    preset = load_hardware(hw.name)
    same = all(getattr(hw, f) == getattr(preset, f) for f in _FIELDS if f != "description")
    return hw if same else replace(hw, name=hw.name + CUSTOM_SUFFIX)
