"""Named NCCL / torch environment presets for clusters (`env.preset`), applied before the process group starts.

What a preset does: it puts a few environment variables into this process's environment, each with a
one-line reason and the source it came from (the tags of docs/shared cluster-env.md), and reports what it
set and what it left alone. It runs before `init_process_group` because NCCL and torch read these variables
when they create a communicator, and before the first CUDA allocation because the caching allocator reads
its settings (`PYTORCH_ALLOC_CONF`) once, when CUDA is first initialized. So `detect_preset` never
initializes CUDA either: it reads the GPU name from the driver (/proc, nvidia-smi).

What a preset does not do: it never overrides a variable you set, in the environment or (for the variables
NCCL reads) in an nccl.conf file that NCCL would load; an old or new name of the same torch setting counts as
set. It does not set NCCL's "Debugging" variables (NCCL_ALGO, NCCL_PROTO, NCCL_BUFFSIZE, NCCL_P2P_*,
NCCL_NVLS_ENABLE, ...), which NCCL's docs say to leave out of production, unless a primary source's recipe
does, and then the reason names it. It does not guess site knowledge (interface names, HCA lists, the
fabric's service level): the notes say which ones to add with `env.set`. Every preset but `none` also sets
the torch side large runs need (flight recorder with dump on timeout, error handling, expandable segments).

This module is also the one home of what shardlm knows of NCCL's own rules, which `shardlm env --check`
(check.py) uses too: its list syntax (`nccl_list_matches`), its config files (`nccl_conf_paths`,
`read_nccl_conf`), and the /sys readers (`read_file`, `list_dir`, `rdma_devices`).
"""

from __future__ import annotations

import difflib
import os
import pwd
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlm.errors import ConfigError


@dataclass(frozen=True)
class Var:
    name: str
    value: str  # may contain "{output_dir}", filled in by apply_env
    reason: str  # one line: why
    source: str  # source tag(s) as in cluster-env.md, e.g. "[AWS-OFI]"
    unverified: bool = False  # cluster-env.md marks it UNVERIFIED


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str  # one line: which clusters
    vars: tuple[Var, ...]
    checked_against: str  # what the values were checked against
    notes: tuple[str, ...] = ()  # what to add with env.set, what not to set: printed by `shardlm env --preset`


# The torch side every preset but `none` sets. The old flight-recorder name TORCH_NCCL_TRACE_BUFFER_SIZE is
# left out on purpose: torch >= 2.11 (our floor) reads TORCH_FR_BUFFER_SIZE, and setting the old name only
# prints "Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" on every rank (seen on 2.13).
TORCH_VARS = (
    Var("TORCH_FR_BUFFER_SIZE", "20000", "flight recorder: keep each rank's last 20000 collectives, so a hang "
        "can be traced to the rank and op that diverged (torchtitan's value; torch's default 2000)",
        "[TT-cfg] [PT-FR]"),
    Var("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "write the flight recorder out on a timeout or NCCL error (off by "
        "default in older torch builds)", "[PT-PGNCCL] [TT-utils]"),
    Var("TORCH_FR_DUMP_TEMP_FILE", "{output_dir}/comm_traces/rank_", "put the dumps (<prefix><rank>) in the run "
        "folder instead of /tmp; read them with torchfrtrace", "[TT-utils] [PT-FR-tut]"),
    Var("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "on a failed collective tear the process down without "
        "ncclCommAbort (which can hang); 1 writes no flight-recorder dump (pytorch#121055)",
        "[PT-env-doc] [TT-utils]"),
    Var("PYTORCH_ALLOC_CONF", "expandable_segments:True", "less fragmentation in the CUDA caching allocator",
        "[TT-run] [AXO]"),
    Var("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", "the old name as well: torch 2.9.1 ignored the "
        "new one for CUDA (pytorch#183387)", "[NEMO] [pytorch#183387]"),
)

# On a CPU (gloo): NCCL and the CUDA allocator are not there; the flight recorder is (shardlm's watchdog dumps it).
CPU_VARS = tuple(v for v in TORCH_VARS if v.name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"))

# Another name of the same torch setting: set by you, it counts as set (torch reads the first of a pair, so
# ours would silently override yours).
ALIASES = {
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
    "PYTORCH_ALLOC_CONF": ("PYTORCH_CUDA_ALLOC_CONF",),
    "PYTORCH_CUDA_ALLOC_CONF": ("PYTORCH_ALLOC_CONF",),
}

CHECKED = "NCCL 2.29 env docs, torch 2.13"
TCPXO_PROFILES = ("var/lib/tcpxo/lib64/nccl-env-profile.sh",  # A3 Mega / A3 High VMs [GCP-A3M] [GCP-A3H]
                  "usr/local/nvidia/lib64/nccl-env-profile.sh")  # where GKE mounts the plugin [GKE]
MARKER = "SHARDLM_ENV_APPLIED"  # the names apply_env set, so that a second call reports the same

_IB_NOTES = (
    "NCCL's defaults are right here: it finds the HCAs, GPUDirect RDMA, NVLS and PXN itself [NCCL-env]",
    "site-specific, add with env.set if needed: NCCL_SOCKET_IFNAME and NCCL_IB_HCA (CoreWeave: eth0, ibp) [CW]",
    "adaptive routing needs the fabric's AR-enabled service level: env.set NCCL_IB_SL=<it> (Megatron's examples "
    "use 1; that 1 is the AR SL on NVIDIA clusters is UNVERIFIED) [MEG-ex] [NCCL-env]",
    "very large fabrics failing with 'ibv_poll_cq error 12': raise NCCL_IB_TIMEOUT above its default 20 [NCCL-env]",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("h100-ib", "H100/H200 over InfiniBand: DGX H100/SuperPOD, CoreWeave, Azure ND H100 v5 (its image's "
           "/etc/nccl.conf is kept), Lambda (UNVERIFIED: no Lambda source)", TORCH_VARS, CHECKED, _IB_NOTES),
    Preset("h100-efa", "H100 on AWS p5 (EFA through aws-ofi-nccl >= 1.7.2)", (
        Var("FI_PROVIDER", "efa", "pin libfabric to EFA, as torchtitan's and AWS's torchtitan scripts do "
            "(aws-ofi-nccl itself needs it only up to 1.5.0)", "[TT-slurm] [AWS-TT] [AWS-OFI]"),
        Var("FI_EFA_SET_CUDA_SYNC_MEMOPS", "0", "AWS: 'can boost throughput with FSDP' (fewer memory "
            "synchronizations)", "[AWS-TT] [TT-slurm]"),
        Var("NCCL_SOCKET_IFNAME", "^docker,lo,veth", "bootstrap over any interface but docker/loopback/veth: "
            "NCCL's auto-select skips only lo and docker*, and a container veth hung init (nccl#913)",
            "[AWS-TT] [AWS-NT] [nccl#913]"),
        *TORCH_VARS), CHECKED + "; aws-ofi-nccl efa-env-var.md", (
        "FI_EFA_USE_HUGE_PAGE=0 only if DataLoader workers fail to fork with 'Cannot allocate memory' [AWS-OFI]",
        "leave out RDMAV_FORK_SAFE, FI_EFA_FORK_SAFE, NCCL_PROTO, NCCL_MIN_NCHANNELS, NCCL_BUFFSIZE, "
        "NCCL_SOCKET_NTHREADS, NCCL_NSOCKS_PERTHREAD: aws-ofi-nccl: not needed, or harmful, on current versions "
        "[AWS-OFI]",
        "AWS's nccl-tests add NCCL_TUNER_PLUGIN=/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so where the AMI has "
        "it: env.set [AWS-NT]")),
    Preset("h100-gcp", "H100 on Google Cloud A3 Mega (GPUDirect-TCPXO) and A3 High: Google's nccl-env-profile.sh "
           "is read at start; two values of Google's/NVIDIA's are fixed here", (
        Var("NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY", "/dev/aperture_devices", "Google's a3-megagpu-8g script exports "
            "it next to its profile (where the LLCM devices are)", "[GCP-A3M]"),
        Var("NCCL_NVLS_ENABLE", "0", "a Debugging-group variable, set because NVIDIA's JAX-Toolbox measured "
            "a3-megagpu-8g slower (~180 vs ~210 tok/s) without it; turn NVLS on only after benchmarking it",
            "[JAX-1708]"),
        *TORCH_VARS), CHECKED + "; Google's profile is read as installed", (
        "at start: every `export NAME=value` of Google's nccl-env-profile.sh (/" + ", /".join(TCPXO_PROFILES)
        + "), overriding the values above: Google says not to modify them [GCP-A3M]",
        "interface names differ between images: Google's VM script sets NCCL_FASTRAK_CTRL_DEV, NCCL_FASTRAK_IFNAME "
        "and NCCL_SOCKET_IFNAME after the profile: put yours in env.set [GCP-A3M] [GCP-A3H]",
        "LD_LIBRARY_PATH must hold the plugin folder before the process starts: export it in the launcher "
        "[GCP-A3H]")),
    Preset("a100-ib", "A100 over InfiniBand: DGX A100, Azure NDv4 (its image's /etc/nccl.conf is kept), "
           "CoreWeave A100", TORCH_VARS, CHECKED, _IB_NOTES[:3]),
    Preset("roce", "RoCE fabrics (A100/H100), e.g. OCI: GID index, traffic class and IB timeout as OCI sets them", (
        Var("NCCL_IB_GID_INDEX", "3", "OCI's value for every shape (RoCE v2 over IPv4 there); fabric-specific: "
            "check `show_gids` and override with env.set. Unset, NCCL >= 2.21 picks an IPv4 RoCE v2 GID itself",
            "[OCI] [NCCL-env]"),
        Var("NCCL_IB_TC", "41", "OCI's traffic class; fabric-specific: a class your switches do not configure "
            "gets no lossless/priority queue, so ask the fabric admin and override with env.set",
            "[OCI] [NCCL-env]"),
        Var("NCCL_IB_TIMEOUT", "22", "OCI: longer than NCCL's default 20 (4.096 us * 2^22 = 17 s per retry)",
            "[OCI] [NCCL-env]"),
        *TORCH_VARS), CHECKED + "; OCI recommended-nccl-rccl-parameters-by-shape.md", (
        "NCCL_IB_HCA: give the RDMA NICs exactly with env.set, '=' first (=mlx5_0,mlx5_1,...), so mlx5_1 does "
        "not match mlx5_10..19 and the front-end NIC stays out [OCI] [NCCL-env]",
        "OCI's table adds NCCL_IB_QPS_PER_CONNECTION=4 NCCL_IB_SPLIT_DATA_ON_QPS=0 (A100 shapes) and "
        "NCCL_CUMEM_ENABLE=0 NCCL_IGNORE_CPU_AFFINITY=1 NCCL_SOCKET_IFNAME=eth0 (H100, no reason given): "
        "env.set if you follow it [OCI]")),
    Preset("single-node", "one node, GPUs over NVLink/NVSwitch or PCIe, no RDMA NIC", TORCH_VARS, CHECKED, (
        "leave NCCL_P2P_LEVEL and NCCL_P2P_DISABLE unset: they move traffic off NVLink [nccl-tests#228]",
        "'Failed to bind NVLink SHARP (NVLS) Multicast memory' means a broken Fabric Manager: env.set "
        "NCCL_NVLS_ENABLE=0 [NCCL-src]")),
    Preset("cpu", "no GPU (gloo): only the flight recorder, which the watchdog dumps on a hang; NCCL and CUDA "
           "variables mean nothing here", CPU_VARS, CHECKED),
    Preset("none", "sets nothing: the environment as launched (env.set still applies)", (), "-"),
)}


# --- reading /sys and /proc (check.py reads the node through these too) ----------------------------------

def read_file(path: Path) -> str | None:
    """A small text file's stripped contents; None when absent or unreadable (probes must never raise)."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def list_dir(path: Path) -> list[Path]:
    """A folder's entries, sorted; [] when it is absent, not a folder, or unreadable."""
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. PermissionError on a folder we may not enter
        return False


def _link_name(path: Path) -> str | None:
    """The last component of a symlink's target (device/driver -> the driver's name); None when not a link."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def cuda_gpu_name(proc: Path = Path("/proc")) -> str | None:
    """The first NVIDIA GPU's model name, "" for a GPU of unknown model, None for no GPU.

    Read from the driver, not `torch.cuda.get_device_name`, unless CUDA is up already: initializing CUDA
    here would fix the allocator's settings before apply_env sets PYTORCH_ALLOC_CONF.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.get_device_name()
    for info in list_dir(proc / "driver" / "nvidia" / "gpus"):
        for line in (read_file(info / "information") or "").splitlines():
            if line.startswith("Model:"):
                return line.partition(":")[2].strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    import torch as torch_  # no NVIDIA driver files: ask CUDA for a count (this does not set up the allocator)
    return "" if torch_.cuda.is_available() else None


def _is_efa(dev: Path, driver: str | None) -> bool:
    """EFA: named efa_N by the driver, rdmap<bus>s<slot> after rdma-core renames it; driver 'efa', vendor Amazon."""
    return (driver == "efa" or dev.name.startswith(("efa", "rdmap"))
            or read_file(dev / "device" / "vendor") == "0x1d0f")


def port_active(state: str | None) -> bool:
    """A port's sysfs state ("4: ACTIVE") is ACTIVE, the only state NCCL uses a port in (not ACTIVE_DEFER)."""
    return (state or "").endswith("ACTIVE")


def rdma_devices(sysfs: Path = Path("/sys")) -> list[dict[str, Any]]:
    """/sys/class/infiniband: each device with its kind (efa, ib, roce, unknown), its driver, and its ports
    (port, state, phys_state, rate, link_layer: None where unreadable). [] when there is none."""
    devices = []
    for dev in list_dir(sysfs / "class" / "infiniband"):
        driver = _link_name(dev / "device" / "driver")
        ports = [{"port": p.name, "state": read_file(p / "state"), "phys_state": read_file(p / "phys_state"),
                  "rate": read_file(p / "rate"), "link_layer": read_file(p / "link_layer")}
                 for p in list_dir(dev / "ports")]
        layers = {p["link_layer"] for p in ports}
        if _is_efa(dev, driver):
            kind = "efa"
        else:
            kind = "ib" if "InfiniBand" in layers else "roce" if "Ethernet" in layers else "unknown"
        devices.append({"device": dev.name, "kind": kind, "driver": driver, "ports": ports})
    return devices


# --- detection ------------------------------------------------------------------------------------------

def _count(ports: list[tuple[str, str | None, bool]], what: str) -> str:
    active = sum(a for _, _, a in ports)
    return f"{len(ports)} {what} ports " + ("ACTIVE" if active == len(ports) else f"({active} ACTIVE)")


def _gid3(sysfs: Path, ports: list[tuple[str, str | None, bool]]) -> str:
    """What GID index 3 (the roce preset's) is on the first ACTIVE RoCE port: a hint that the preset fits."""
    dev = next((d for d, _, a in ports if a), ports[0][0])
    kind = read_file(sysfs / "class" / "infiniband" / dev / "ports" / "1" / "gid_attrs" / "types" / "3")
    return f"GID 3 on {dev}: {kind or 'none'}"


def detect_preset(sysfs: Path = Path("/sys"), environ: Mapping[str, str] = os.environ, *, root: Path = Path("/"),
                  gpu_name: Callable[[], str | None] = cuda_gpu_name) -> tuple[str, str]:
    """env.preset=auto: (preset name, one-line reason) from what the machine shows without root. Never raises."""
    try:
        gpu = None if environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") else gpu_name()
    except Exception:  # a broken driver must not stop the run: treat it as no GPU
        gpu = None
    if gpu is None:
        return "cpu", "no CUDA GPU"
    gpu = gpu or "GPU model unknown"
    for marker in ("var/lib/tcpxo", "var/lib/tcpx", TCPXO_PROFILES[1]):
        if _exists(root / marker):
            return "h100-gcp", f"/{marker} present (GPUDirect-TCPX/O), {gpu}"
    devices = rdma_devices(sysfs)
    efa = [d["device"] for d in devices if d["kind"] == "efa"]
    if efa:
        return "h100-efa", f"{len(efa)} EFA devices, {gpu}"
    ports = [(d["device"], p["link_layer"], port_active(p["state"])) for d in devices for p in d["ports"]]
    infiniband = [p for p in ports if p[1] == "InfiniBand"]
    if infiniband:
        name = "a100-ib" if re.search(r"A[18]00", gpu) else "h100-ib"
        return name, f"{_count(infiniband, 'InfiniBand')}, {gpu}"
    ethernet = [p for p in ports if p[1] == "Ethernet"]
    if ethernet:
        return "roce", f"{_count(ethernet, 'RoCE (Ethernet link layer)')}, {_gid3(sysfs, ethernet)}, {gpu}"
    return "single-node", f"{gpu}, no RDMA device under {sysfs / 'class' / 'infiniband'}"


def resolve(name: str, sysfs: Path = Path("/sys"), environ: Mapping[str, str] = os.environ, *,
            root: Path = Path("/"), gpu_name: Callable[[], str | None] = cuda_gpu_name) -> tuple[Preset, str]:
    """env.preset (a name or "auto") -> (preset, why it was chosen); an unknown name is a ConfigError."""
    if name == "auto":
        found, why = detect_preset(sysfs, environ, root=root, gpu_name=gpu_name)
        return PRESETS[found], f"auto: {why}"
    if name in PRESETS:
        return PRESETS[name], "set in env.preset"
    close = difflib.get_close_matches(name.lower(), [*PRESETS, "auto"], n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else "use auto or one of " + ", ".join(PRESETS)
    raise ConfigError(f"unknown env.preset '{name}'; {hint} (`shardlm env --list` lists them)")


# --- NCCL's list syntax (NCCL_SOCKET_IFNAME, NCCL_IB_HCA) ---------------------------------------------------

def atoi(s: str) -> int:
    """C's atoi, as NCCL reads a port or a flag: the leading integer, 0 when there is none."""
    m = re.match(r"\s*([+-]?\d+)", s)
    return int(m.group(1)) if m else 0


def _split_port(name: str) -> tuple[str, int]:
    dev, sep, port = name.rpartition(":")
    return (dev, int(port)) if sep and dev and port.isdigit() else (name, -1)


def _parse_nccl_list(spec: str) -> tuple[bool, bool, list[tuple[str, int]]]:
    """(exclude?, exact?, [(prefix, port or -1)]) as NCCL's parseStringList reads a list."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    entries = []
    for item in spec.split(","):
        prefix, sep, port = item.partition(":")
        if prefix:
            entries.append((prefix, atoi(port) if sep else -1))
    return exclude, exact, entries


def nccl_list_matches(spec: str, names: list[str]) -> list[str]:
    """The names NCCL selects with `spec` (`NCCL_SOCKET_IFNAME`, `NCCL_IB_HCA` syntax), in order.

    As NCCL parses it (parseStringList/matchIfList): comma-separated prefixes (`eth` selects `eth0`);
    a leading `^` excludes them instead (`^docker,lo`: everything else), a leading `=` (after any `^`)
    wants exact names; an entry may end in `:port` (`mlx5_0:1`), matched against names given as
    `dev:port`. Spaces are part of a name, as in NCCL (`eth0, ib0` wants an interface named " ib0").
    An empty list selects everything (`^` alone: nothing).
    """
    exclude, exact, entries = _parse_nccl_list(spec)

    def listed(name: str) -> bool:
        dev, port = _split_port(name)
        return not entries or any((dev == p if exact else dev.startswith(p)) and (-1 in (port, q) or port == q)
                                  for p, q in entries)

    return [n for n in names if listed(n) != exclude]


def socket_ifname_ignored(value: str) -> bool:
    """NCCL ignores an NCCL_SOCKET_IFNAME of one character or none and picks an interface itself
    (ncclFindInterfaces: `strlen(env) > 1`)."""
    return len(value) <= 1


def _no_interface(name: str, value: str, sysfs: Path) -> str | None:
    """A warning when the interface list `value` selects no interface under /sys/class/net, so NCCL would find
    none and fail; None when it selects one, when NCCL ignores the value, or when that folder cannot be read."""
    net = sysfs / "class" / "net"
    have = [p.name for p in list_dir(net)]
    if (not have or (name == "NCCL_SOCKET_IFNAME" and socket_ifname_ignored(value))
            or nccl_list_matches(value, have)):
        return None
    exclude, _, entries = _parse_nccl_list(value)
    if exclude:
        return (f"{name}={value}: it excludes every interface under {net} ({', '.join(have)}), and NCCL init fails "
                "when none is left: set the right names with env.set")
    when = "on a missing one" if len(entries) == 1 else "when all are missing"
    return (f"{name}={value}: no interface {', '.join(p for p, _ in entries)} under {net} (NCCL init fails "
            f"{when}): set the right names with env.set")


# --- NCCL's config files ------------------------------------------------------------------------------------

def _home() -> str | None:
    # NVIDIA/nccl src/misc/param.cc userHomeDir(): getpwuid(getuid())->pw_dir, not $HOME; none: no ~/.nccl.conf
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except (KeyError, OSError):
        return None


def nccl_conf_paths(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """NCCL's config files, the one that wins first: $NCCL_CONF_FILE (else ~/.nccl.conf), then /etc/nccl.conf."""
    user = environ.get("NCCL_CONF_FILE")
    if not user and (home := _home()) is not None:
        user = f"{home}/.nccl.conf"
    return ([Path(user)] if user else []) + [Path("/etc/nccl.conf")]


def parse_nccl_conf(text: str) -> dict[str, str]:
    """NCCL's setEnvFile: `NAME=value` lines, split at the first '=' and not trimmed; lines starting with '#'
    and lines without '=' are skipped; the first line of a name wins (NCCL's setenv never overwrites)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, eq, value = line.partition("=")
        if eq and not line.startswith("#"):
            found.setdefault(name, value)
    return found


@dataclass(frozen=True)
class ConfFile:
    path: Path
    text: str | None  # None when it could not be read
    error: OSError | None = None  # why not (FileNotFoundError: absent)


def read_nccl_conf(paths: Sequence[Path] | None = None, environ: Mapping[str, str] = os.environ
                   ) -> tuple[list[ConfFile], dict[str, tuple[str, str]]]:
    """Each config file NCCL would read (`paths`, highest first, default `nccl_conf_paths(environ)`), and the
    settings they give NCCL: NAME -> (value, file), first file wins. Unreadable files give no settings."""
    files, settings = [], {}
    for path in nccl_conf_paths(environ) if paths is None else paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as e:
            files.append(ConfFile(Path(path), None, e))
            continue
        files.append(ConfFile(Path(path), text))
        for name, value in parse_nccl_conf(text).items():
            settings.setdefault(name, (value, str(path)))
    return files, settings


def nccl_conf(paths: Sequence[Path] | None = None,
              environ: Mapping[str, str] = os.environ) -> dict[str, tuple[str, str]]:
    """NAME -> (value, file) as NCCL would load them from its config files (see read_nccl_conf)."""
    return read_nccl_conf(paths, environ)[1]


# --- Google's profile -----------------------------------------------------------------------------------------

_ASSIGN = re.compile(r"(export\s+)?([A-Za-z_]\w*)=(.*)")
_EXPORT = re.compile(r"export\s+([A-Za-z_]\w*)")
_REF = re.compile(r"\$\{([A-Za-z_]\w*)(?::?-([^}]*))?\}|\$([A-Za-z_]\w*)")


def _shell_word(raw: str) -> str:
    try:
        return " ".join(shlex.split(raw, comments=True))
    except ValueError:
        return raw.strip()


def read_profile(path: Path, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The exported `NAME=value` assignments of a shell profile such as Google's nccl-env-profile.sh.

    $VAR, ${VAR} and ${VAR:-x} expand from the profile's earlier assignments, then the environment;
    NCCL_LIB_DIR defaults to the profile's folder, as Google's scripts set it before sourcing. Other shell
    (if, functions) is ignored. Raises OSError when the file cannot be read.
    """
    shell = {"NCCL_LIB_DIR": environ.get("NCCL_LIB_DIR", str(path.parent))}

    def look(ref: re.Match) -> str:
        name = ref[1] or ref[3]
        return shell.get(name, environ.get(name, ref[2] or ""))

    exported: dict[str, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if m := _ASSIGN.fullmatch(line):
            shell[m[2]] = _REF.sub(look, _shell_word(m[3]))
            if m[1]:
                exported[m[2]] = shell[m[2]]
        elif (m := _EXPORT.fullmatch(line)) and m[1] in shell:
            exported[m[1]] = shell[m[1]]
    return exported


def _gcp_vars(root: Path, environ: Mapping[str, str], warnings: list[str]) -> list[Var]:
    """Google's profile as Vars (LD_* left out: the loader reads them only at start), or a warning."""
    paths = [root / p for p in TCPXO_PROFILES]
    for path in paths:
        try:
            profile = read_profile(path, environ)
        except OSError:
            continue
        libdir = str(path.parent)
        if libdir not in environ.get("LD_LIBRARY_PATH", "").split(":"):
            warnings.append(f"LD_LIBRARY_PATH lacks {libdir}, where NCCL finds the TCPXO plugin; the loader reads "
                            f"it only at process start: export LD_LIBRARY_PATH={libdir}:$LD_LIBRARY_PATH in the "
                            "launcher, as Google's scripts do")
        return [Var(k, v, f"Google's profile {path}", "[GCP-A3M]") for k, v in profile.items()
                if not k.startswith("LD_")]
    warnings.append(f"h100-gcp: Google's TCPXO profile is missing ({', '.join(map(str, paths))}), so its NCCL "
                    "settings are not applied: mount the TCPXO plugin folder (A3 Mega VMs: /var/lib/tcpxo/lib64) "
                    "or put the values with env.set")
    return []


# --- applying ---------------------------------------------------------------------------------------------

@dataclass
class EnvReport:
    preset: str
    reason: str
    set: dict[str, str]  # what apply_env put into the environment
    kept: dict[str, tuple[str, str, str]]  # NAME -> (our value, value in force, where: "environment" or a file)
    ignored_extra: dict[str, tuple[str, str]]  # env.set NAME -> (its value, the value in force) when already set
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The startup log: what was set, what was left alone, and the warnings."""
        what = (f"set {len(self.set)} variable{'s' * (len(self.set) != 1)}: "
                + " ".join(f"{k}={v}" for k, v in self.set.items())) if self.set else "set nothing"
        out = [f"env: preset {self.preset} ({self.reason}): {what}"]
        kept = [f"{k}={now} ({where}; " + ("same as the preset" if now == ours else f"preset: {ours}") + ")"
                for k, (ours, now, where) in self.kept.items() if k not in self.ignored_extra]
        if kept:
            out.append("env: left alone (you set them): " + ", ".join(kept))
        for k, (ours, now) in self.ignored_extra.items():
            where = self.kept[k][2] if k in self.kept else "environment"
            place, _, alias = where.partition(", as ")
            place = "the environment" if place == "environment" else place
            out.append(f"env: warning: env.set {k}={ours} has no effect: {place} already has {alias or k}={now}")
        return out + [f"env: warning: {w}" for w in self.warnings]


def launcher_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables torchrun puts into every worker's environment when its own environment lacks them: such a
    value is the launcher's default, not a choice of the user's. torchrun sets
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torch/distributed/elastic/agent/server/local_elastic_agent.py, 2.11
    and 2.13), which turns off the flight-recorder dump the presets ask for (3 dumps; 1 does not)."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"} if "TORCHELASTIC_RUN_ID" in environ else {}


def _in_force(name: str, theirs: Mapping[str, str], conf: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """(value, where) of a setting someone other than apply_env made, or None."""
    if name in theirs:
        return theirs[name], "environment"
    for alias in ALIASES.get(name, ()):
        if alias in theirs:
            return theirs[alias], f"environment, as {alias}"
    if name in conf and not name.startswith(("TORCH_", "PYTORCH_")):  # torch reads those before NCCL loads conf
        return conf[name][0], conf[name][1]
    return None


def _wanted(p: Preset, extra: Mapping[str, str], out_dir: str, root: Path, environ: Mapping[str, str],
            warnings: list[str]) -> dict[str, str]:
    """The preset's values (plus Google's profile for h100-gcp), then env.set's, with {output_dir} filled."""
    found = list(p.vars) + (_gcp_vars(root, environ, warnings) if p.name == "h100-gcp" else [])
    wanted = {v.name: v.value for v in found}
    for name, value in extra.items():
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ConfigError(f"env.set key '{name}' is not an environment variable name; use e.g. "
                              "env.set.NCCL_IB_HCA")
        wanted[name] = str(value)
    return {k: v.replace("{output_dir}", out_dir) for k, v in wanted.items()}


def apply_env(preset: str, extra: Mapping[str, str], output_dir: Path,
              environ: MutableMapping[str, str] = os.environ, conf: Mapping[str, tuple[str, str]] | None = None,
              *, sysfs: Path = Path("/sys"), root: Path = Path("/"),
              gpu_name: Callable[[], str | None] = cuda_gpu_name) -> EnvReport:
    """Resolve `preset` (a name or "auto"), then write its variables and env.set's (`extra`, which override
    the preset's) into `environ` where nobody set them: not in `environ`, not as another name of the same
    torch setting, and, for what NCCL reads, not in an nccl.conf (`conf`, default `nccl_conf()`).

    The names it set are recorded in SHARDLM_ENV_APPLIED: a second call (another Trainer in the same process,
    or a child process) treats them as its own, not the user's, so it reports the same and follows a new
    output_dir or preset (a variable set before and not wanted now is removed). Creates
    <output_dir>/comm_traces/ when a variable it set points there.
    """
    p, reason = resolve(preset, sysfs, environ, root=root, gpu_name=gpu_name)
    warnings: list[str] = []
    out_dir = os.path.abspath(output_dir)
    wanted = _wanted(p, extra, out_dir, root, environ, warnings)
    ours = set(filter(None, environ.get(MARKER, "").split(",")))
    for name in ours - set(wanted):  # set by an earlier call for another preset or env.set
        environ.pop(name, None)
    theirs = {k: v for k, v in environ.items() if k not in ours and k != MARKER}
    for name, value in launcher_defaults(environ).items():  # torchrun's, not the user's
        if theirs.get(name) == value and name in wanted and wanted[name] != value:
            del theirs[name]
            warnings.append(f"{name}={value} is torchrun's default for its workers, not yours: set to {wanted[name]} "
                            f"(keep {value} with env.set.{name}={value})")
    conf = nccl_conf(environ=environ) if conf is None else conf
    report = EnvReport(p.name, reason, {}, {}, {}, warnings)
    for name, value in wanted.items():
        if found := _in_force(name, theirs, conf):
            report.kept[name] = (value, *found)
            if name in extra and found[0] != value:
                report.ignored_extra[name] = (value, found[0])
            continue
        environ[name] = report.set[name] = value
        if name.endswith(("IFNAME", "CTRL_DEV")) and (warning := _no_interface(name, value, sysfs)):
            warnings.append(warning)
    _record(report, environ, out_dir)
    return report


def _record(report: EnvReport, environ: MutableMapping[str, str], out_dir: str) -> None:
    """Remember what was set (for the next call) and make the flight recorder's dump folder if it is ours."""
    names = ",".join(sorted(report.set))
    if names:
        environ[MARKER] = names
    else:
        environ.pop(MARKER, None)
    traces = os.path.join(out_dir, "comm_traces")
    # torch writes there itself on an NCCL timeout (it does not make the folder); the watchdog makes it when it
    # dumps (gloo): no empty folder in a CPU run
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" in report.set and any(v.startswith(traces + os.sep) for v in report.set.values()):
        try:
            os.makedirs(traces, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create {traces} for the flight recorder's dumps ({e.strerror}); make "
                              "train.output_dir writable or set TORCH_FR_DUMP_TEMP_FILE yourself") from None


# --- printing -------------------------------------------------------------------------------------------------

def format_preset(p: Preset) -> str:
    """`shardlm env --preset NAME`: the summary, then one `NAME=value  # reason [source]` line per variable."""
    lines = [f"# {p.name}: {p.summary} (checked against {p.checked_against})"]
    lines += [f"{v.name}={v.value}  # {v.reason} {v.source}" + (" (UNVERIFIED)" if v.unverified else "")
              for v in p.vars] or ["# (no variables)"]
    return "\n".join(lines + [f"# note: {n}" for n in p.notes])


def format_list() -> str:
    """`shardlm env --list`: one line per preset: name, number of variables, summary."""
    return "\n".join(f"{p.name:<12} {len(p.vars):>2} vars  {p.summary}" for p in PRESETS.values())


__all__ = ["ALIASES", "MARKER", "PRESETS", "TORCH_VARS", "ConfFile", "EnvReport", "Preset", "Var", "apply_env",
           "cuda_gpu_name", "detect_preset", "format_list", "format_preset", "list_dir", "nccl_conf",
           "nccl_conf_paths", "nccl_list_matches", "parse_nccl_conf", "port_active", "rdma_devices", "read_file",
           "read_nccl_conf", "read_profile", "resolve"]
