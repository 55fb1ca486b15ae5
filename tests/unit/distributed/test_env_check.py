"""`shardlm env --check` (shardlm.distributed.check): each obvious mistake flagged on a
fake /sys tree + environment and not flagged where the hardware is absent, the report's JSON, the real
(CPU) machine, and the command's exit code."""

from __future__ import annotations

import functools
import json
import socket
import subprocess
from pathlib import Path

import pytest

from shardlm.cli import Parser
from shardlm.cli import env as env_cmd
from shardlm.distributed import check
from shardlm.distributed.check import CheckReport, Problem, run_check
from shardlm.errors import ConfigError

ACTIVE, DOWN = "4: ACTIVE", "1: DOWN"
TOPO_NVLINK = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-55\nGPU1\tNV18\t X \t0-55\n"


def make_sys(root: Path, netdevs=("eth0", "lo"), rdma: dict | None = None) -> Path:
    """A /sys tree: class/net/<if>/operstate and class/infiniband/<dev>/ports/<p>/{state,rate,link_layer}."""
    for name in netdevs:
        (root / "class" / "net" / name).mkdir(parents=True, exist_ok=True)
        (root / "class" / "net" / name / "operstate").write_text("up\n")
    for dev, ports in (rdma or {}).items():
        for port, (state, layer) in ports.items():
            d = root / "class" / "infiniband" / dev / "ports" / port
            d.mkdir(parents=True, exist_ok=True)
            (d / "state").write_text(state + "\n")
            (d / "phys_state").write_text("5: LinkUp\n")
            (d / "rate").write_text("400 Gb/sec (4X NDR)\n")
            (d / "link_layer").write_text(layer + "\n")
    return root


def no_gpu() -> dict:
    return {"available": False, "count": 0, "devices": [], "note": "no CUDA GPU"}


def gpus(n: int, peer: bool = True):
    def probe() -> dict:
        devices = [{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1} for i in range(n)]
        return {"available": True, "count": n, "devices": devices,
                "peer_access": [[None if i == j else peer for j in range(n)] for i in range(n)]}
    return probe


def no_nvidia_smi(argv):
    raise FileNotFoundError(argv[0])


def checked(tmp_path: Path, environ: dict, *, netdevs=("eth0", "lo"), rdma=None, **kw) -> CheckReport:
    """run_check on a fake node: no GPU, no nvidia-smi, no nccl.conf, no plugin dirs unless given."""
    sysfs = make_sys(tmp_path / "sys", netdevs, rdma)
    kw.setdefault("gpus", no_gpu)
    kw.setdefault("run", no_nvidia_smi)
    kw.setdefault("nccl_conf", [])
    kw.setdefault("lib_dirs", [])
    kw.setdefault("versions", lambda: {"torch": "2.13.0", "cuda": None, "nccl": None})
    kw.setdefault("ifaddrs", lambda: {name: ["ipv4"] for name in netdevs})
    return run_check(sysfs, environ, **kw)


def flagged(report: CheckReport, key: str) -> list[str]:
    return [str(p) for p in report.problems if p.what.startswith(key)]


# --- each mistake, and its absence where the hardware is absent -----------------------------------

def test_socket_ifname_naming_no_interface_is_flagged(tmp_path):
    [line] = flagged(checked(tmp_path, {"NCCL_SOCKET_IFNAME": "ib0"}), "NCCL_SOCKET_IFNAME")
    assert line.startswith("NCCL_SOCKET_IFNAME=ib0 matches no interface (have: eth0, lo)")
    assert "`eth`" in line  # the fix suggests a prefix that exists here
    assert "\n" not in line


@pytest.mark.parametrize("spec", ["eth", "eth0", "^docker,lo", "=eth0", "^=eth1", "x"])
def test_socket_ifname_that_selects_something_is_fine(tmp_path, spec):
    # "x": NCCL ignores a 1-character NCCL_SOCKET_IFNAME (strlen > 1) and picks one itself
    assert checked(tmp_path, {"NCCL_SOCKET_IFNAME": spec}).problems == []


@pytest.mark.parametrize("spec", ["=eth", "^eth,lo", "eth0 ", "^=eth0,lo"])
def test_socket_ifname_that_selects_nothing_is_flagged(tmp_path, spec):
    assert flagged(checked(tmp_path, {"NCCL_SOCKET_IFNAME": spec}), "NCCL_SOCKET_IFNAME")


def test_socket_ifname_from_nccl_conf_and_precedence(tmp_path):
    conf, user = tmp_path / "nccl.conf", tmp_path / "user.conf"
    conf.write_text("# site settings\nNCCL_SOCKET_IFNAME=ib\nNCCL_DEBUG=WARN\n")
    report = checked(tmp_path, {}, nccl_conf=[tmp_path / "absent.conf", conf])
    [line] = flagged(report, "NCCL_SOCKET_IFNAME")
    assert f"NCCL_SOCKET_IFNAME=ib (from {conf})" in line
    files = report.sections["nccl_conf"]
    assert files[0]["contents"] == "absent" and "NCCL_DEBUG=WARN" in files[1]["contents"]
    # the environment wins over the files; an earlier file over a later one
    assert checked(tmp_path / "a", {"NCCL_SOCKET_IFNAME": "eth"}, nccl_conf=[conf]).problems == []
    user.write_text("NCCL_SOCKET_IFNAME=eth\n")
    assert checked(tmp_path / "b", {}, nccl_conf=[user, conf]).problems == []


IB = {"mlx5_0": {"1": (ACTIVE, "InfiniBand")}, "mlx5_1": {"1": (ACTIVE, "InfiniBand")}}


@pytest.mark.parametrize("spec,bad", [("mlx5_9", True), ("mlx5_0:2", True), ("=mlx5", True), ("^mlx5", True),
                                      ("mlx5", False), ("mlx5_0:1", False), ("^mlx5_1", False),
                                      ("=mlx5_0,mlx5_1", False)])
def test_ib_hca_naming_no_hca(tmp_path, spec, bad):
    lines = flagged(checked(tmp_path, {"NCCL_IB_HCA": spec}, rdma=IB), "NCCL_IB_HCA")
    assert bool(lines) == bad
    if bad:
        assert "(have: mlx5_0:1, mlx5_1:1)" in lines[0]


def test_ib_hca_without_any_hca_is_not_a_problem_here(tmp_path):
    assert checked(tmp_path, {"NCCL_IB_HCA": "mlx5"}).problems == []


def test_ib_disable_with_active_ib_or_roce(tmp_path):
    [line] = flagged(checked(tmp_path, {"NCCL_IB_DISABLE": "1"}, rdma=IB), "NCCL_IB_DISABLE")
    assert "mlx5_0:1, mlx5_1:1" in line
    roce = {"mlx5_0": {"1": (ACTIVE, "Ethernet")}}
    assert flagged(checked(tmp_path / "roce", {"NCCL_IB_DISABLE": "1"}, rdma=roce), "NCCL_IB_DISABLE")
    report = checked(tmp_path / "r", {}, rdma=roce)
    assert report.sections["network"]["rdma"][0]["kind"] == "roce"
    assert report.sections["network"]["rdma"][0]["ports"][0]["rate"] == "400 Gb/sec (4X NDR)"


@pytest.mark.parametrize("rdma", [None, {"mlx5_0": {"1": (DOWN, "InfiniBand")}},
                                  {"rdmap16s27": {"1": (ACTIVE, "Unspecified")}}])  # none, down, EFA
def test_ib_disable_without_active_ib_is_fine(tmp_path, rdma):
    assert checked(tmp_path, {"NCCL_IB_DISABLE": "1"}, rdma=rdma).problems == []


def test_ib_disable_0_is_fine(tmp_path):
    assert checked(tmp_path, {"NCCL_IB_DISABLE": "0"}, rdma=IB).problems == []


@pytest.mark.parametrize("env", [{"NCCL_P2P_DISABLE": "1"}, {"NCCL_P2P_LEVEL": "LOC"}, {"NCCL_P2P_LEVEL": "0"}])
def test_p2p_off_where_gpus_reach_each_other(tmp_path, env):
    key = next(iter(env))
    assert flagged(checked(tmp_path, env, gpus=gpus(2)), key)                             # CUDA peer access
    nvlink = checked(tmp_path / "nv", env, run=lambda argv: TOPO_NVLINK)                  # NVLink in topo -m
    assert "NVLink" in flagged(nvlink, key)[0]
    for fine in (checked(tmp_path / "a", env), checked(tmp_path / "b", env, gpus=gpus(1)),
                 checked(tmp_path / "c", env, gpus=gpus(2, peer=False))):
        assert fine.problems == []
    assert checked(tmp_path / "d", {"NCCL_P2P_LEVEL": "NVL"}, gpus=gpus(2)).problems == []


def test_cuda_device_max_connections_1(tmp_path):
    assert flagged(checked(tmp_path, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}), "CUDA_DEVICE_MAX_CONNECTIONS")
    assert checked(tmp_path / "a", {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}).problems == []


@pytest.mark.parametrize("env,n_gpus,bad", [
    ({"LOCAL_WORLD_SIZE": "4"}, 8, True),
    ({"LOCAL_WORLD_SIZE": "8"}, 4, True),
    ({"LOCAL_WORLD_SIZE": "8"}, 8, False),
    ({"LOCAL_WORLD_SIZE": "4"}, 0, False),              # no CUDA here: nothing to compare with
    ({"SLURM_NTASKS_PER_NODE": "4"}, 8, True),
    ({"SLURM_TASKS_PER_NODE": "4(x2)"}, 8, True),
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8, False),
    ({"SLURM_NTASKS_PER_NODE": "1"}, 8, False),         # one torchrun per node
    ({"SLURM_NTASKS_PER_NODE": "1", "LOCAL_WORLD_SIZE": "8"}, 8, False),
    ({"SLURM_NTASKS_PER_NODE": "1", "LOCAL_WORLD_SIZE": "2"}, 8, True),
])
def test_ranks_per_node_vs_visible_gpus(tmp_path, env, n_gpus, bad):
    report = checked(tmp_path, env, gpus=gpus(n_gpus, peer=False) if n_gpus else no_gpu)
    assert bool(report.problems) == bad, report.problems
    if bad:
        assert f"but {n_gpus} GPUs are visible" in str(report.problems[0])


def test_launcher_section(tmp_path):
    env = {"SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2", "LOCAL_WORLD_SIZE": "8", "RANK": "3",
           "TORCHELASTIC_RUN_ID": "abc"}
    launcher = checked(tmp_path, env).sections["launcher"]
    assert launcher["launcher"] == "slurm + torchrun"
    assert (launcher["ranks_per_node"], launcher["ranks_per_node_from"]) == (8, "LOCAL_WORLD_SIZE")
    assert launcher["torchrun"]["TORCHELASTIC_RUN_ID"] == "abc" and launcher["slurm"]["SLURM_NNODES"] == "2"


def test_nccl_net_plugin(tmp_path):
    libs = tmp_path / "libs"
    libs.mkdir()
    env = {"NCCL_NET": "AWS Libfabric"}
    assert flagged(checked(tmp_path / "a", env, lib_dirs=[libs, tmp_path / "absent"]), "NCCL_NET=AWS Libfabric")
    (libs / "libnccl-net.so").write_text("")
    assert checked(tmp_path / "b", env, lib_dirs=[libs]).problems == []
    for builtin in ("IB", "Socket", "socket"):
        assert checked(tmp_path / builtin, {"NCCL_NET": builtin}).problems == []
    env = {"NCCL_NET": "GPUDirectTCPX_v7", "NCCL_NET_PLUGIN": "tcpx"}
    assert "libnccl-net-tcpx.so" in flagged(checked(tmp_path / "c", env, lib_dirs=[libs]), "NCCL_NET")[0]
    (libs / "libnccl-net-tcpx.so").write_text("")
    assert checked(tmp_path / "d", env, lib_dirs=[libs]).problems == []
    assert flagged(checked(tmp_path / "e", {**env, "NCCL_NET_PLUGIN": "none"}, lib_dirs=[libs]), "NCCL_NET")
    by_path = {**env, "NCCL_NET_PLUGIN": str(libs / "libnccl-net-tcpx.so")}
    assert checked(tmp_path / "f", by_path, lib_dirs=[]).problems == []
    assert flagged(checked(tmp_path / "g", {**by_path, "NCCL_NET_PLUGIN": str(libs / "gone.so")}), "NCCL_NET")


def test_async_error_handling_1(tmp_path):
    [line] = flagged(checked(tmp_path, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}), "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert "=3" in line
    assert checked(tmp_path / "a", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}).problems == []


# gloo reads GLOO_SOCKET_IFNAME as exact names, each with an address: "eth0, lo" wants " lo", "eth0,,lo" and
# ",eth0" an empty name; "lo," is "lo"; one character is ignored (all seen with torch 2.13's gloo)
@pytest.mark.parametrize("spec,why", [
    ("bogus0", "no interface bogus0"), ("eth", "no interface eth (gloo takes exact names"),
    ("^lo", "no interface ^lo (gloo takes exact names"), ("=eth0", "no interface =eth0 (gloo takes exact names"),
    ("eth0, lo", "no interface  lo (gloo keeps spaces"), ("eth0,,lo", "an empty name"), (",eth0", "an empty name"),
    ("ifb0", "ifb0 has no IP address"), ("eth0,bogus0", "no interface bogus0")])
def test_gloo_socket_ifname_that_gloo_cannot_bind_is_flagged(tmp_path, spec, why):
    def ifaddrs():
        return {"lo": ["ipv4", "ipv6"], "ifb0": [], "eth0": ["ipv4"]}

    [line] = flagged(checked(tmp_path, {"GLOO_SOCKET_IFNAME": spec}, ifaddrs=ifaddrs), "GLOO_SOCKET_IFNAME")
    assert line.startswith(f"GLOO_SOCKET_IFNAME={spec}: {why}"), line
    assert "(interfaces with an address here: lo, eth0)" in line and "gloo fails to start" in line
    assert "e.g. `eth0`" in line and "unset it" in line and "\n" not in line


@pytest.mark.parametrize("spec", ["eth0", "lo", "eth0,lo", "lo,", "x", ""])
def test_gloo_socket_ifname_that_gloo_binds_is_fine(tmp_path, spec):
    assert checked(tmp_path, {"GLOO_SOCKET_IFNAME": spec}, netdevs=("eth0", "lo")).problems == []


def test_gloo_socket_ifname_not_checked_where_interfaces_are_unknown(tmp_path):
    assert checked(tmp_path, {"GLOO_SOCKET_IFNAME": "bogus0"}, ifaddrs=lambda: None).problems == []


def test_interface_addresses_on_the_real_machine():
    ifaces = check.interface_addresses()
    if ifaces is not None:  # Linux
        assert "ipv4" in ifaces["lo"] or "ipv6" in ifaces["lo"]
        assert set(ifaces) == {name for _, name in socket.if_nameindex()}


@pytest.mark.parametrize("key", ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"])
@pytest.mark.parametrize("value,starts", [("banana", False), ("", False), ("4", True), ("-1", True),
                                          ("99999999999", True)])
def test_async_error_handling_that_is_no_mode(tmp_path, key, value, starts):
    [line] = flagged(checked(tmp_path, {key: value}), key)
    assert line.startswith(f"{key}={value} is not an integer 0-3 (0 no handling, 1 abort and tear down"), line
    assert ("no mode torch knows" in line) == starts and ("fails to start" in line) == (not starts)
    assert f"set {key}=3" in line


@pytest.mark.parametrize("value", ["0", "2", "3", " 3", "+3", "3 "])  # as std::stoi reads them
def test_async_error_handling_modes_are_fine(tmp_path, value):
    assert checked(tmp_path, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}).problems == []


def test_nccl_conf_file_that_nccl_cannot_read(tmp_path):
    folder = tmp_path / "confdir"
    folder.mkdir()
    [line] = flagged(checked(tmp_path / "a", {"NCCL_CONF_FILE": str(folder)}), "NCCL_CONF_FILE")
    assert line.startswith(f"NCCL_CONF_FILE={folder} is a directory: NCCL skips it") and "unset it" in line
    missing = tmp_path / "gone.conf"
    [line] = flagged(checked(tmp_path / "b", {"NCCL_CONF_FILE": str(missing)}), "NCCL_CONF_FILE")
    assert line.startswith(f"NCCL_CONF_FILE={missing} does not exist")
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_DEBUG=WARN\n")
    for fine in (str(conf), ""):
        assert checked(tmp_path / "c", {"NCCL_CONF_FILE": fine}).problems == []


def test_start_problems_what_stops_the_process_group():
    def ifaces():
        return {"lo": ["ipv4"]}

    env = {"GLOO_SOCKET_IFNAME": "bogus0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "banana"}
    assert [p.what.split("=")[0] for p in check.start_problems(env, cuda=True, ifaces=ifaces)] == [
        "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert [p.what.split("=")[0] for p in check.start_problems(env, cuda=False, ifaces=ifaces)] == [
        "GLOO_SOCKET_IFNAME"]  # gloo runs on CPUs and GPUs; ProcessGroupNCCL (which reads the mode) on GPUs only

    def unread():
        raise AssertionError("the interfaces are read only when GLOO_SOCKET_IFNAME is set")

    assert check.start_problems({"GLOO_SOCKET_IFNAME": "lo"}, cuda=True, ifaces=ifaces) == []
    assert check.start_problems({}, cuda=True, ifaces=unread) == []


def test_init_distributed_stops_on_a_bad_gloo_interface_before_the_process_group(monkeypatch):
    import torch.distributed as dist

    from shardlm.distributed.env import init_distributed

    assert not dist.is_initialized()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    with pytest.raises(ConfigError, match=r"^GLOO_SOCKET_IFNAME=bogus0: no interface bogus0"):
        init_distributed("cpu")
    assert not dist.is_initialized()


def test_alloc_conf_new_name_alone(tmp_path):
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    old_torch = {"versions": lambda: {"torch": "2.9.1"}}
    [line] = flagged(checked(tmp_path, env, **old_torch), "PYTORCH_ALLOC_CONF")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line
    both = {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert checked(tmp_path / "a", both, **old_torch).problems == []
    assert checked(tmp_path / "b", env).problems == []  # torch 2.13 reads the new name


def test_clean_environment_has_no_problem(tmp_path):
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_DEBUG=WARN\n")
    env = {"NCCL_SOCKET_IFNAME": "eth", "NCCL_IB_HCA": "mlx5", "CUDA_DEVICE_MAX_CONNECTIONS": "32",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "LOCAL_WORLD_SIZE": "2", "NCCL_NET": "IB",
           "GLOO_SOCKET_IFNAME": "eth0", "NCCL_CONF_FILE": str(conf)}
    report = checked(tmp_path, env, rdma=IB, gpus=gpus(2), run=lambda argv: TOPO_NVLINK)
    assert report.problems == []
    assert report.format().endswith("no problems found")
    assert report.sections["topology"]["nvlink"] is True
    assert report.sections["environment"]["NCCL_IB_HCA"] == "mlx5"
    assert report.sections["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"


# --- the report -----------------------------------------------------------------------------------

def test_json_parses_and_holds_the_problems(tmp_path):
    report = checked(tmp_path, {"NCCL_SOCKET_IFNAME": "ib0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, rdma=IB,
                     gpus=gpus(2), run=lambda argv: TOPO_NVLINK)
    data = json.loads(report.to_json())
    assert [p["what"].split("=")[0] for p in data["problems"]] == ["NCCL_SOCKET_IFNAME", "CUDA_DEVICE_MAX_CONNECTIONS"]
    assert all(p["fix"] for p in data["problems"])
    assert set(data["sections"]) == {"versions", "launcher", "gpus", "topology", "network", "nccl_conf", "environment"}
    assert data["sections"]["topology"]["topo"] == TOPO_NVLINK
    text = report.format()
    assert "== problems (2) ==" in text and "NV18" in text and "no problems found" not in text


def test_problem_str_is_one_line_with_the_fix():
    assert str(Problem("X=1 is wrong", "unset X")) == "X=1 is wrong; unset X"


@pytest.mark.parametrize("error", [FileNotFoundError("nvidia-smi"), subprocess.TimeoutExpired("nvidia-smi", 10),
                                   subprocess.CalledProcessError(9, "nvidia-smi"), PermissionError("denied")])
def test_nvidia_smi_missing_or_failing_is_reported(tmp_path, error):
    def run(argv):
        raise error

    topo = checked(tmp_path, {}, run=run).sections["topology"]
    assert topo["topo"] is None and topo["nvidia_smi"].startswith(("absent", "failed"))


def test_a_node_without_sys_class_net(tmp_path):
    report = run_check(tmp_path / "nothing", {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_DISABLE": "1"}, gpus=no_gpu,
                       run=no_nvidia_smi, nccl_conf=[], lib_dirs=[])
    assert report.problems == []
    assert report.sections["network"]["netdevs"].startswith("absent")
    assert report.sections["network"]["rdma"].startswith("none")


def test_the_real_machine_runs_and_reports_what_is_absent():
    import torch

    report = run_check()
    json.loads(report.to_json())
    text = report.format()
    for heading in ("versions", "launcher", "gpus", "topology", "network", "nccl_conf", "environment"):
        assert f"== {heading} ==" in text
    assert report.sections["versions"]["torch"] == torch.__version__
    if not torch.cuda.is_available():
        gpus_ = report.sections["gpus"]
        assert gpus_["available"] is False and gpus_["count"] == 0 and "no CUDA GPU" in gpus_["note"]


# --- the command ----------------------------------------------------------------------------------

def _env(argv: list[str]):
    p = Parser(prog="shardlm env")
    env_cmd.add_args(p)
    return env_cmd.run(p.parse_args(argv), [])


def test_env_command_exit_codes(tmp_path, monkeypatch, capsys):
    fake = functools.partial(checked, tmp_path / "clean", {"NCCL_SOCKET_IFNAME": "eth"})
    monkeypatch.setattr(check, "run_check", fake)
    assert _env([]) == 0 and capsys.readouterr().out.rstrip().endswith("no problems found")
    assert _env(["--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []
    fake = functools.partial(checked, tmp_path / "bad", {"NCCL_SOCKET_IFNAME": "ib0"})
    monkeypatch.setattr(check, "run_check", fake)
    assert _env(["--check"]) == 1
    assert "NCCL_SOCKET_IFNAME=ib0 matches no interface" in capsys.readouterr().out
    assert _env(["--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["problems"]) == 1


def test_env_command_on_the_real_machine(monkeypatch, capsys):
    for key in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_NET", "CUDA_DEVICE_MAX_CONNECTIONS",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert _env([]) == 1
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in capsys.readouterr().out


@pytest.mark.parametrize("key,value", [("GLOO_SOCKET_IFNAME", "bogus0"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "banana"),
                                       ("NCCL_ASYNC_ERROR_HANDLING", "7"), ("NCCL_CONF_FILE", "/")])
def test_env_command_reports_odd_values_on_the_real_machine(monkeypatch, capsys, key, value):
    for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_NET", "CUDA_DEVICE_MAX_CONNECTIONS", "GLOO_SOCKET_IFNAME",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_CONF_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(key, value)
    assert _env([]) == 1
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith(f"  - {key}=")]
    assert "; " in line  # the problem, then its fix


def test_env_command_argument_errors():
    with pytest.raises(ConfigError, match="--json goes with --check"):
        _env(["--list", "--json"])
    with pytest.raises(ConfigError, match="not allowed with"):
        _env(["--check", "--list"])


def test_env_command_lists_and_prints_the_nccl_presets(capsys):
    from shardlm.distributed.nccl import PRESETS

    assert _env(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)
    name, preset = next((n, p) for n, p in PRESETS.items() if p.vars)
    assert _env(["--preset", name]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# {name}:") and f"{preset.vars[0].name}={preset.vars[0].value}" in out
    assert _env(["--preset", "auto"]) == 0
    assert capsys.readouterr().out.startswith("# auto: ")
    with pytest.raises(ConfigError, match="unknown env.preset"):
        _env(["--preset", "no-such-preset"])
