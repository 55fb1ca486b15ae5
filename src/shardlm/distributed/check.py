"""`shardlm env --check`: what this node looks like to a training run, and the obvious mistakes in its setup.

Run it on a cluster node before launching; paste its output into a bug report. It reports versions
(torch, CUDA, NCCL, Python), the launcher's variables (torchrun, SLURM) and the ranks per node they
imply, the GPUs and how they reach each other (`nvidia-smi topo -m`, `can_device_access_peer`), the
network (netdevs and IB/RoCE/EFA ports from /sys), NCCL's config files and the NCCL/torch/CUDA/gloo
variables set. Then the problems: settings known to hurt when wrong (docs: cluster-env 1.8) and values
that stop the process group from starting (a GLOO_SOCKET_IFNAME naming no interface, a
TORCH_NCCL_ASYNC_ERROR_HANDLING that is no mode), checked against what this node has. A setting whose
hardware is absent is not a problem here (`NCCL_IB_DISABLE=1` on a node without IB is fine). NCCL's own
rules (its list syntax, which config files it reads and how) and the /sys readers come from
shardlm.distributed.nccl, shared with the presets. gloo's rules live here: `start_problems` is also what
`init_distributed` checks before the process group starts, so a run fails with one line instead of gloo's
or torch's traceback.

Absent is a fact to report, never an exception: every probe works on a CPU-only machine. Every probe
is injectable (`run_check(sysfs=, environ=, run=, nccl_conf=, gpus=, versions=, lib_dirs=, ifaddrs=)`) so
the checks are tested on fake /sys trees.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from shardlm.distributed.nccl import (ConfFile, atoi, list_dir, nccl_list_matches, port_active, rdma_devices,
                                      read_file, read_nccl_conf, socket_ifname_ignored)

Runner = Callable[[list[str]], str]  # argv -> stdout; raises OSError/SubprocessError when it cannot

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NTASKS",
              "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
              "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
              "SLURM_CPUS_PER_TASK")
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "CUDA_", "FI_", "GLOO_")
NCCL_BUILTIN_NETS = ("ib", "socket")
LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/lib64", "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu", "/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib64",
            "/opt/aws-ofi-nccl/lib")


@dataclass
class Problem:
    """One obvious mistake: what is wrong (naming the setting and what the node has) and the fix."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}"


@dataclass
class CheckReport:
    sections: dict[str, Any]  # JSON-able facts, one entry per heading
    problems: list[Problem] = field(default_factory=list)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps({"sections": self.sections, "problems": [asdict(p) for p in self.problems]},
                          indent=indent, default=str)

    def format(self) -> str:
        """Human-readable: one heading per section, the problems last."""
        lines = []
        for name, value in self.sections.items():
            lines.append(f"== {name} ==")
            lines += _format_value(value, "  ")
            lines.append("")
        if self.problems:
            lines.append(f"== problems ({len(self.problems)}) ==")
            lines += [f"  - {p}" for p in self.problems]
        else:
            lines.append("no problems found")
        return "\n".join(lines)


def _format_value(value: Any, indent: str) -> list[str]:
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v or isinstance(v, str) and "\n" in v:
                out.append(f"{indent}{k}:")
                out += _format_value(v, indent + "  ")
            else:
                out.append(f"{indent}{k}: {_scalar(v)}")
        return out or [f"{indent}(none)"]
    if isinstance(value, list):
        out = []
        for item in value:
            if not isinstance(item, dict):
                out.append(f"{indent}{_scalar(item)}")
                continue
            blocks = {k: v for k, v in item.items() if isinstance(v, str) and "\n" in v}
            out.append(indent + " ".join(f"{k}={_scalar(v)}" for k, v in item.items() if k not in blocks))
            for text in blocks.values():
                out += _format_value(text, indent + "  | ")
        return out or [f"{indent}(none)"]
    if isinstance(value, str) and "\n" in value:
        return [f"{indent}{line}" for line in value.rstrip("\n").splitlines()]
    return [f"{indent}{_scalar(value)}"]


def _scalar(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (list, dict)):
        return json.dumps(v) if v else "(none)"
    return str(v).lower() if isinstance(v, bool) else str(v)


# --- probes -----------------------------------------------------------------------------------------

def run_subprocess(argv: list[str], timeout: float = 10.0) -> str:
    """Run `argv`, return its stdout; raise OSError/SubprocessError (missing, failed, timed out)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True).stdout


def probe_versions() -> dict[str, Any]:
    """Python, torch, the CUDA torch was built with, and NCCL's version (when torch has CUDA)."""
    out: dict[str, Any] = {"host": socket.gethostname(), "python": platform.python_version(),
                           "platform": platform.platform(), "torch": None, "cuda": None, "nccl": None}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken torch is a fact to report
        out["torch"] = f"absent ({type(e).__name__}: {e})"
        return out
    out["torch"], out["cuda"] = torch.__version__, torch.version.cuda
    if torch.version.cuda is None:
        out["cuda"] = out["nccl"] = "absent (torch built without CUDA)"
        return out
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        out["nccl"] = f"unknown ({type(e).__name__}: {e})"
    return out


def probe_gpus() -> dict[str, Any]:
    """torch.cuda's view: count, names, memory, and which pairs can access each other (P2P)."""
    try:
        import torch
        if not torch.cuda.is_available():
            why = "torch built without CUDA" if torch.version.cuda is None else "torch.cuda.is_available() is False"
            return {"available": False, "count": 0, "devices": [], "note": f"no CUDA GPU ({why})"}
        n = torch.cuda.device_count()
        devices = []
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                            "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count})
        peer = [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
                for i in range(n)]
        return {"available": True, "count": n, "devices": devices, "peer_access": peer}
    except Exception as e:  # noqa: BLE001 - a broken driver is a fact to report
        return {"available": False, "count": 0, "devices": [], "note": f"CUDA error: {type(e).__name__}: {e}"}


def _peer_summary(peer: list[list[bool | None]] | None) -> str | None:
    if not peer:
        return None
    pairs = [v for row in peer for v in row if v is not None]
    if not pairs:
        return "one GPU: no pairs"
    return f"{sum(pairs)} of {len(pairs)} ordered GPU pairs can access each other's memory (P2P)"


def _topology(run: Runner, gpus: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"peer_access": _peer_summary(gpus.get("peer_access"))}
    try:
        text = run(["nvidia-smi", "topo", "-m"])
        out["nvidia_smi"], out["nvlink"], out["topo"] = "ok", bool(re.search(r"\bNV\d+\b", text)), text
    except FileNotFoundError:
        out["nvidia_smi"], out["nvlink"], out["topo"] = "absent (not on PATH)", None, None
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi"], out["nvlink"], out["topo"] = f"failed ({type(e).__name__}: {e})", None, None
    return out


def _netdev_hca(netdev: Path) -> str | None:
    """netdev -> HCA: device/infiniband/<hca>, or device/infiniband_verbs/*/ibdev."""
    hcas = [p.name for p in list_dir(netdev / "device" / "infiniband")]
    hcas += [v for p in list_dir(netdev / "device" / "infiniband_verbs") if (v := read_file(p / "ibdev"))]
    return ",".join(dict.fromkeys(hcas)) or None


def _network(sysfs: Path) -> dict[str, Any]:
    net = sysfs / "class" / "net"
    netdevs = [{"name": d.name, "operstate": read_file(d / "operstate"), "hca": _netdev_hca(d)}
               for d in list_dir(net)]
    rdma = rdma_devices(sysfs)
    return {"netdevs": netdevs if net.is_dir() else f"absent ({net} not found)",
            "rdma": rdma or f"none ({sysfs / 'class' / 'infiniband'} absent or empty)"}


def _active_ports(rdma: list[dict[str, Any]] | str, kinds: tuple[str, ...]) -> list[str]:
    if isinstance(rdma, str):
        return []
    return [f"{d['device']}:{p['port']}" for d in rdma if d["kind"] in kinds for p in d["ports"]
            if port_active(p["state"])]


def _launcher(environ: Mapping[str, str]) -> dict[str, Any]:
    torchrun = {k: environ[k] for k in TORCHRUN_VARS if k in environ}
    torchrun |= {k: environ[k] for k in sorted(environ) if k.startswith("TORCHELASTIC_")}
    slurm = {k: environ[k] for k in SLURM_VARS if k in environ}
    ranks, source = _ranks_per_node(environ)
    launcher = " + ".join(n for n, vs in (("slurm", slurm), ("torchrun", torchrun)) if vs) or "none"
    return {"launcher": launcher, "ranks_per_node": ranks, "ranks_per_node_from": source,
            "torchrun": torchrun or "absent", "slurm": slurm or "absent"}


def _ranks_per_node(environ: Mapping[str, str]) -> tuple[int | None, str | None]:
    """LOCAL_WORLD_SIZE (torchrun), else SLURM's tasks per node (`8` or `8(x2),4`: this job's first)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        m = re.match(r"\s*(\d+)", environ.get(name, ""))
        if m:
            return int(m.group(1)), name
    return None, None


def _conf_section(files: list[ConfFile]) -> list[dict[str, Any]]:
    """The report's nccl_conf section: each file NCCL would read, with its contents or why there are none."""
    def contents(f: ConfFile) -> str:
        if isinstance(f.error, FileNotFoundError):
            return "absent"
        if f.error is not None:
            return f"unreadable ({type(f.error).__name__}: {f.error})"
        return f.text if f.text and f.text.strip() else "(empty)"
    return [{"path": str(f.path), "contents": contents(f)} for f in files]


def _selected_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: environ[k] for k in sorted(environ)
            if k.startswith(ENV_PREFIXES) or re.fullmatch(r"PYTORCH_\w*ALLOC_CONF", k)}


def _plugin_found(plugin: str | None, lib_dirs: list[Path]) -> bool:
    """Is there a net plugin library NCCL could load: NCCL_NET_PLUGIN's (a path, a file name, or
    `libnccl-net-<name>.so`), else any libnccl-net*.so?"""
    if plugin and "/" in plugin:
        return Path(plugin).is_file()
    wanted = {f"libnccl-net-{plugin}.so", plugin} if plugin else None
    files = [f.name for d in lib_dirs for f in list_dir(d)]
    return any(f in wanted if wanted else f.startswith("libnccl-net") and ".so" in f for f in files)


def default_lib_dirs(environ: Mapping[str, str]) -> list[Path]:
    """Where dlopen looks: LD_LIBRARY_PATH, /etc/ld.so.conf.d's directories, the standard lib dirs."""
    dirs = [p for p in environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    for conf in list_dir(Path("/etc/ld.so.conf.d")):
        dirs += [line.strip() for line in (read_file(conf) or "").splitlines() if line.strip().startswith("/")]
    return [Path(d) for d in dict.fromkeys([*dirs, *LIB_DIRS])]


class _IfAddrs(ctypes.Structure):
    """glibc's `struct ifaddrs` (getifaddrs(3)), up to what is read here."""


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.c_void_p)]


def interface_addresses() -> dict[str, list[str]] | None:
    """Each network interface -> its IP address families ("ipv4", "ipv6"; [] for none), read with getifaddrs(3)
    as gloo reads them; None where they cannot be read (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        head = ctypes.POINTER(_IfAddrs)()
        if libc.getifaddrs(ctypes.byref(head)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    kinds = {socket.AF_INET: "ipv4", socket.AF_INET6: "ipv6"}
    out: dict[str, list[str]] = {}
    try:
        entry = head
        while entry:
            families = out.setdefault(entry.contents.name.decode(errors="replace"), [])
            addr = entry.contents.addr  # a sockaddr: sa_family (unsigned short on Linux) comes first
            kind = kinds.get(ctypes.c_ushort.from_address(addr).value) if addr else None
            if kind and kind not in families:
                families.append(kind)
            entry = entry.contents.next
    finally:
        libc.freeifaddrs(head)
    return out


# --- problems ---------------------------------------------------------------------------------------

def _torch_older_than(version: str | None, major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return not m or (int(m.group(1)), int(m.group(2))) < (major, minor)


def _prefix(netdevs: list[str]) -> str:
    """A prefix to suggest: the first interface NCCL's auto-selection would not skip, without its number."""
    usable = [n for n in netdevs if not n.startswith(("lo", "docker", "veth", "ifb"))]
    return re.sub(r"\d+$", "", usable[0]) if usable else "eth"


@dataclass
class _Node:
    """What the checks read: the report's sections, NCCL's effective settings (key -> (value, where
    from): the environment over the config files), the environment, and where plugins may live."""

    sections: dict[str, Any]
    nccl: dict[str, tuple[str, str]]
    environ: Mapping[str, str]
    lib_dirs: list[Path]
    ifaces: dict[str, list[str]] | None  # interface -> its IP address families (None: unknown)

    def setting(self, key: str) -> str | None:
        return self.nccl[key][0] if key in self.nccl else None

    def named(self, key: str) -> str:
        """`KEY=value`, saying which file it came from when not the environment."""
        value, source = self.nccl[key]
        return f"{key}={value}" + ("" if source == "environment" else f" (from {source})")

    def flag(self, key: str) -> bool:
        return atoi(self.setting(key) or "0") != 0


def _space(spec: str) -> str:
    return " (NCCL keeps spaces as part of a name)" if " " in spec else ""


def _socket_ifname(node: _Node) -> Iterator[Problem]:
    netdevs, spec = node.sections["network"]["netdevs"], node.setting("NCCL_SOCKET_IFNAME")
    if spec is None or socket_ifname_ignored(spec) or isinstance(netdevs, str):
        return
    names = [d["name"] for d in netdevs]
    if not nccl_list_matches(spec, names):
        yield Problem(f"{node.named('NCCL_SOCKET_IFNAME')} matches no interface{_space(spec)} (have: "
                      f"{', '.join(names)}): NCCL init fails with `no socket interface found`",
                      f"set it to an interface prefix that exists on every node (e.g. `{_prefix(names)}`), "
                      "or unset it so NCCL picks one")


def _ib_hca(node: _Node) -> Iterator[Problem]:
    rdma, spec = node.sections["network"]["rdma"], node.setting("NCCL_IB_HCA")
    if not spec or isinstance(rdma, str) or node.flag("NCCL_IB_DISABLE"):  # no HCA here: nothing to match
        return
    ports = [f"{d['device']}:{p['port']}" if p else d["device"] for d in rdma for p in d["ports"] or [None]]
    if not nccl_list_matches(spec, ports):
        yield Problem(f"{node.named('NCCL_IB_HCA')} matches no HCA{_space(spec)} (have: {', '.join(ports)}): "
                      "NCCL falls back to TCP sockets",
                      "name HCAs that exist (a prefix such as `mlx5` is enough), or unset it")


def _ib_disable(node: _Node) -> Iterator[Problem]:
    active = _active_ports(node.sections["network"]["rdma"], ("ib", "roce"))
    if node.flag("NCCL_IB_DISABLE") and active:
        yield Problem(f"{node.named('NCCL_IB_DISABLE')} but this node has active InfiniBand/RoCE ports "
                      f"({', '.join(active)})", "unset it: with it NCCL sends over TCP sockets instead")


def _p2p(node: _Node) -> Iterator[Problem]:
    nvlink = node.sections["topology"].get("nvlink")
    peer = any(v for row in node.sections["gpus"].get("peer_access") or [] for v in row)
    level = (node.setting("NCCL_P2P_LEVEL") or "").strip().upper()
    for key, off in (("NCCL_P2P_DISABLE", node.flag("NCCL_P2P_DISABLE")), ("NCCL_P2P_LEVEL", level in ("LOC", "0"))):
        if off and (nvlink or peer):
            yield Problem(f"{node.named(key)} but the GPUs here can reach each other directly "
                          f"({'NVLink' if nvlink else 'CUDA peer access'})",
                          "unset it: with it GPU-to-GPU traffic goes through host memory")


def _max_connections(node: _Node) -> Iterator[Problem]:
    if node.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1":
        yield Problem("CUDA_DEVICE_MAX_CONNECTIONS=1 puts FSDP2's all-gather/reduce-scatter streams on one "
                      "hardware queue, so communication stops overlapping compute", "unset it, or set 16-32")


def _ranks_vs_gpus(node: _Node) -> Iterator[Problem]:
    gpus, launcher = node.sections["gpus"], node.sections["launcher"]
    ranks, source, n = launcher["ranks_per_node"], launcher["ranks_per_node_from"], gpus.get("count")
    one_torchrun = source != "LOCAL_WORLD_SIZE" and ranks == 1  # SLURM: one task per node that runs torchrun
    if gpus.get("available") and ranks is not None and ranks != n and not one_torchrun:
        yield Problem(f"{source}={ranks} ranks on this node but {n} GPUs are visible",
                      f"start one rank per GPU (torchrun --nproc-per-node={n}), or make only the GPUs to use "
                      "visible (CUDA_VISIBLE_DEVICES)")


def _nccl_net(node: _Node) -> Iterator[Problem]:
    net, plugin = node.setting("NCCL_NET"), node.setting("NCCL_NET_PLUGIN")
    if not net or net.strip().lower() in NCCL_BUILTIN_NETS:
        return
    if not _plugin_found(plugin, node.lib_dirs):
        lib = f"libnccl-net-{plugin}.so" if plugin else "libnccl-net*.so"
        yield Problem(f"{node.named('NCCL_NET')} names a network plugin, but no {lib} is on LD_LIBRARY_PATH or "
                      "in the system lib dirs, and with NCCL_NET set NCCL does not fall back to IB/Socket",
                      "install the plugin or add its directory to LD_LIBRARY_PATH, or unset NCCL_NET")


ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # the second: the old name
ASYNC_MODES = "0 no handling, 1 abort and tear down, 2 abort only, 3 tear down without abort"  # ProcessGroupNCCL.hpp


def async_error_handling_problems(environ: Mapping[str, str]) -> Iterator[Problem]:
    """Each of torch's two names whose value is no error-handling mode. torch reads both with std::stoi (leading
    blanks and a sign, then digits; the rest ignored) and fails at ProcessGroupNCCL's start on one without an
    integer; a number outside 0-3 is no mode it knows."""
    for key in ASYNC_ERROR_HANDLING:
        value = environ.get(key)
        m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", value or "")
        if value is None or m and 0 <= int(m.group(1)) <= 3:
            continue
        effect = ("it is no mode torch knows" if m else
                  "on GPUs the NCCL process group fails to start (`Invalid value for environment variable`)")
        yield Problem(f"{key}={value} is not an integer 0-3 ({ASYNC_MODES}): {effect}",
                      f"set {key}=3 (torch's default) or unset it")


def _async_error_handling_mode(node: _Node) -> Iterator[Problem]:
    yield from async_error_handling_problems(node.environ)


def _async_error_handling(node: _Node) -> Iterator[Problem]:
    for key in ASYNC_ERROR_HANDLING:
        if node.environ.get(key, "").strip() == "1":
            yield Problem(f"{key}=1 aborts without a flight-recorder dump, so a hang leaves no trace",
                          f"set {key}=3 (the default) or unset it")
            return


def _alloc_conf(node: _Node) -> Iterator[Problem]:
    new, torch_version = node.environ.get("PYTORCH_ALLOC_CONF", ""), node.sections["versions"].get("torch")
    if ("expandable_segments" in new and "PYTORCH_CUDA_ALLOC_CONF" not in node.environ
            and _torch_older_than(torch_version, 2, 11)):  # torch 2.9.1 ignored the new name (pytorch#183387)
        yield Problem(f"PYTORCH_ALLOC_CONF={new} is set but PYTORCH_CUDA_ALLOC_CONF is not: torch "
                      f"{torch_version} ignores the new name for CUDA memory",
                      f"set PYTORCH_CUDA_ALLOC_CONF={new} as well")


def _conf_file(node: _Node) -> Iterator[Problem]:
    """NCCL_CONF_FILE that NCCL cannot read: it skips it without a word, and reads no ~/.nccl.conf instead."""
    name = node.environ.get("NCCL_CONF_FILE")
    if not name:  # unset or empty: NCCL reads ~/.nccl.conf
        return
    try:
        with open(name, "rb"):
            return
    except IsADirectoryError:
        why = "is a directory"
    except FileNotFoundError:
        why = "does not exist"
    except OSError as e:
        why = f"cannot be read ({e.strerror or type(e).__name__})"
    yield Problem(f"NCCL_CONF_FILE={name} {why}: NCCL skips it without a word (and reads no ~/.nccl.conf "
                  "instead), so none of the settings meant to be in it apply",
                  "point it at a readable file of NAME=value lines, or unset it")


# --- gloo: shardlm's CPU backend, and on GPUs the backend of its host-side and async-checkpoint groups --------

def gloo_ifname_problem(environ: Mapping[str, str], ifaces: dict[str, list[str]] | None) -> Problem | None:
    """A GLOO_SOCKET_IFNAME that gloo cannot bind to; None when it can, when it is unset, or when the
    interfaces are unknown (`ifaces` None).

    As torch reads it (ProcessGroupGloo, gloo's tcp device): ignored when of one character or none; else a
    comma-separated list of exact interface names (no NCCL prefixes, `^` or `=`; a trailing comma is dropped,
    an empty name fails), each of which must have an IPv4 or IPv6 address (`Unable to find address for: X`).
    """
    spec = environ.get("GLOO_SOCKET_IFNAME")
    if spec is None or len(spec) <= 1 or ifaces is None:
        return None
    names = spec.split(",")
    if names[-1] == "":  # torch splits with std::getline: no empty last piece
        names.pop()
    bad = [_gloo_missing(n, ifaces) for n in names if not ifaces.get(n)]
    if not bad:
        return None
    usable = [n for n, families in ifaces.items() if families]
    example = next((n for n in usable if not n.startswith("lo")), "eth0")
    return Problem(f"GLOO_SOCKET_IFNAME={spec}: {'; '.join(bad)} (interfaces with an address here: "
                   f"{', '.join(usable) or 'none'}): gloo fails to start (shardlm's CPU backend, and its host-side "
                   "and async-checkpoint groups on GPUs)",
                   "set it to exact interface names with an address on every node, comma-separated (e.g. "
                   f"`{example}`), or unset it so gloo binds to the address of this host's name")


def _gloo_missing(name: str, ifaces: dict[str, list[str]]) -> str:
    if not name:
        return "an empty name"
    if name in ifaces:
        return f"{name} has no IP address"
    hint = (" (gloo takes exact names: no NCCL `^`/`=` forms or prefixes)" if name.startswith(("^", "="))
            or any(n.startswith(name) for n in ifaces) else " (gloo keeps spaces as part of a name)" if " " in name
            else "")
    return f"no interface {name}{hint}"


def _gloo_socket_ifname(node: _Node) -> Iterator[Problem]:
    if problem := gloo_ifname_problem(node.environ, node.ifaces):
        yield problem


def start_problems(environ: Mapping[str, str], cuda: bool,
                   ifaces: Callable[[], dict[str, list[str]] | None] = interface_addresses) -> list[Problem]:
    """What would stop `init_process_group` with a traceback, checked before it starts: gloo's interface (CPU
    and GPU: gloo runs on both) and, with CUDA, torch's NCCL error-handling mode."""
    gloo = gloo_ifname_problem(environ, ifaces()) if "GLOO_SOCKET_IFNAME" in environ else None
    return [p for p in [gloo] if p] + (list(async_error_handling_problems(environ)) if cuda else [])


CHECKS = (_socket_ifname, _gloo_socket_ifname, _ib_hca, _ib_disable, _p2p, _max_connections, _ranks_vs_gpus,
          _nccl_net, _conf_file, _async_error_handling_mode, _async_error_handling, _alloc_conf)


# --- the check ------------------------------------------------------------------------------------

def run_check(sysfs: Path = Path("/sys"), environ: Mapping[str, str] = os.environ, *,
              run: Runner = run_subprocess, nccl_conf: list[Path] | None = None,
              gpus: Callable[[], dict[str, Any]] = probe_gpus,
              versions: Callable[[], dict[str, Any]] = probe_versions,
              lib_dirs: list[Path] | None = None,
              ifaddrs: Callable[[], dict[str, list[str]] | None] = interface_addresses) -> CheckReport:
    """Probe this node and check its settings (see the module docstring). Never raises for what is absent."""
    environ = dict(environ)
    gpu_facts = gpus()
    conf_files, conf_settings = read_nccl_conf(nccl_conf, environ)
    nccl = {**conf_settings, **{k: (v, "environment") for k, v in environ.items() if k.startswith("NCCL_")}}
    sections = {
        "versions": versions(),
        "launcher": _launcher(environ),
        "gpus": gpu_facts,
        "topology": _topology(run, gpu_facts),
        "network": _network(sysfs),
        "nccl_conf": _conf_section(conf_files),
        "environment": _selected_env(environ) or "(none of NCCL_*, TORCH_NCCL_*, CUDA_*, PYTORCH_*ALLOC_CONF, "
                                                "FI_*, GLOO_* set)",
    }
    node = _Node(sections, nccl, environ, default_lib_dirs(environ) if lib_dirs is None else lib_dirs, ifaddrs())
    return CheckReport(sections, [p for check in CHECKS for p in check(node)])


__all__ = ["CheckReport", "Problem", "async_error_handling_problems", "gloo_ifname_problem", "interface_addresses",
           "probe_gpus", "probe_versions", "run_check", "run_subprocess", "start_problems"]
