"""NCCL / torch environment presets (shardlm.distributed.nccl): what each preset sets, what it leaves to the
user (environment, nccl.conf, another name of the same torch setting), env.set, detection on fake /sys
trees, Google's profile, the printed forms, and the NCCL rules check.py shares (list syntax, config files).
A dict stands in for os.environ; no process group."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardlm.distributed import nccl
from shardlm.distributed.nccl import (MARKER, PRESETS, TORCH_VARS, Preset, Var, apply_env, cuda_gpu_name,
                                      detect_preset, format_list, format_preset, nccl_conf, nccl_conf_paths,
                                      nccl_list_matches, read_nccl_conf, resolve)
from shardlm.errors import ConfigError

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
PROFILE = "var/lib/tcpxo/lib64/nccl-env-profile.sh"
# NCCL's "Debugging" group: only a primary source's recipe may put one into a preset (and the reason says so)
DEBUGGING = {"NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_BUFFSIZE", "NCCL_NTHREADS",
             "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_IB_DISABLE", "NCCL_ALGO", "NCCL_PROTO",
             "NCCL_NET_GDR_LEVEL", "NCCL_NVLS_ENABLE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"}


def _apply(preset: str, tmp_path: Path, environ: dict, extra: dict | None = None, conf: dict | None = None,
           **kw) -> nccl.EnvReport:
    """apply_env on a dict, with no nccl.conf and an empty fake / and /sys unless told otherwise."""
    kw.setdefault("root", tmp_path / "root")
    kw.setdefault("sysfs", tmp_path / "sys")
    return apply_env(preset, extra or {}, tmp_path / "run", environ, {} if conf is None else conf, **kw)


def _ib_tree(sysfs: Path, devices: dict[str, str], state: str = "4: ACTIVE", gid3: str = "") -> Path:
    """A fake /sys/class/infiniband: {device: link layer}, one port each."""
    for dev, layer in devices.items():
        port = sysfs / "class" / "infiniband" / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "link_layer").write_text(layer + "\n")
        (port / "state").write_text(state + "\n")
        if gid3:
            (port / "gid_attrs" / "types").mkdir(parents=True)
            (port / "gid_attrs" / "types" / "3").write_text(gid3 + "\n")
    return sysfs


def _filled(p: Preset, tmp_path: Path) -> dict[str, str]:
    return {v.name: v.value.replace("{output_dir}", str(tmp_path / "run")) for v in p.vars}


# --- applying -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in PRESETS if n != "none"])
def test_each_preset_sets_only_unset_variables_and_reports_both(name, tmp_path):
    environ = {"TORCH_FR_BUFFER_SIZE": "500", "HOME": "/home/me"}
    report = _apply(name, tmp_path, environ)
    want = _filled(PRESETS[name], tmp_path)
    assert report.set == {k: v for k, v in want.items() if k != "TORCH_FR_BUFFER_SIZE"}
    assert report.kept == {"TORCH_FR_BUFFER_SIZE": ("20000", "500", "environment")}
    assert environ["TORCH_FR_BUFFER_SIZE"] == "500" and environ["HOME"] == "/home/me"
    assert {k: environ[k] for k in report.set} == report.set
    assert environ[MARKER] == ",".join(sorted(report.set))
    lines = report.lines()
    n = len(want) - 1
    assert lines[0].startswith(f"env: preset {name} (set in env.preset): set {n} variable{'s' if n != 1 else ''}: ")
    assert f"TORCH_FR_DUMP_TEMP_FILE={tmp_path / 'run' / 'comm_traces' / 'rank_'}" in lines[0]
    assert lines[1] == "env: left alone (you set them): TORCH_FR_BUFFER_SIZE=500 (environment; preset: 20000)"


def test_every_preset_but_none_sets_the_torch_side(tmp_path):
    torch_side = {v.name: v.value for v in TORCH_VARS}
    assert torch_side == {"TORCH_FR_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                          "TORCH_FR_DUMP_TEMP_FILE": "{output_dir}/comm_traces/rank_",
                          "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                          "PYTORCH_ALLOC_CONF": "expandable_segments:True",
                          "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for p in PRESETS.values():
        assert p.name in ("none", "cpu") or set(TORCH_VARS) <= set(p.vars), p.name
    # on a CPU only what matters there: the flight recorder (no NCCL, no CUDA allocator, no torchrun warning)
    assert [v.name for v in PRESETS["cpu"].vars] == ["TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"]
    assert "NCCL and CUDA variables mean nothing here" in PRESETS["cpu"].summary


def test_none_sets_nothing_at_all(tmp_path):
    environ: dict[str, str] = {}
    report = _apply("none", tmp_path, environ)
    assert environ == {} and report.set == {} and report.kept == {}
    assert report.lines() == ["env: preset none (set in env.preset): set nothing"]
    assert not (tmp_path / "run").exists()


def test_env_set_adds_and_overrides_the_preset_but_not_the_environment(tmp_path):
    environ = {"NCCL_DEBUG": "WARN"}
    extra = {"NCCL_IB_TC": "106", "NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_DEBUG": "INFO"}
    report = _apply("roce", tmp_path, environ, extra)
    assert environ["NCCL_IB_TC"] == report.set["NCCL_IB_TC"] == "106"  # the preset's is 41
    assert environ["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1" and environ["NCCL_IB_GID_INDEX"] == "3"
    assert environ["NCCL_DEBUG"] == "WARN" and "NCCL_DEBUG" not in report.set
    assert report.ignored_extra == {"NCCL_DEBUG": ("INFO", "WARN")}
    assert report.lines()[1:] == ["env: warning: env.set NCCL_DEBUG=INFO has no effect: "
                                  "the environment already has NCCL_DEBUG=WARN"]
    with pytest.raises(ConfigError, match="env.set key 'NCCL IB' is not an environment variable name"):
        _apply("roce", tmp_path, {}, {"NCCL IB": "1"})


def test_env_set_applies_with_preset_none(tmp_path):
    environ: dict[str, str] = {}
    assert _apply("none", tmp_path, environ, {"NCCL_IB_HCA": "=mlx5_0"}).set == {"NCCL_IB_HCA": "=mlx5_0"}
    assert environ == {"NCCL_IB_HCA": "=mlx5_0", MARKER: "NCCL_IB_HCA"}


def test_torchruns_default_async_error_handling_is_not_the_users(tmp_path):
    # torchrun gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless its own environment has one:
    # that 1 (no flight-recorder dumps) is the launcher's, so the preset's 3 replaces it, said in one line.
    environ = {"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    report = _apply("h100-ib", tmp_path, environ)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == report.set["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert any("is torchrun's default for its workers" in line for line in report.lines())
    # ... but a user who asks for 1 keeps it, and without torchrun a 1 in the environment is the user's
    environ = {"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    report = _apply("h100-ib", tmp_path, environ, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and not report.ignored_extra
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    report = _apply("h100-ib", tmp_path, environ)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in report.kept
    environ = {"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # not torchrun's default
    _apply("h100-ib", tmp_path, environ)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_another_name_of_the_same_torch_setting_counts_as_set(tmp_path):
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    report = _apply("single-node", tmp_path, environ)
    assert "PYTORCH_ALLOC_CONF" not in environ and "TORCH_FR_BUFFER_SIZE" not in environ
    assert report.kept == {
        "TORCH_FR_BUFFER_SIZE": ("20000", "0", "environment, as TORCH_NCCL_TRACE_BUFFER_SIZE"),
        "PYTORCH_ALLOC_CONF": ("expandable_segments:True", "max_split_size_mb:128",
                               "environment, as PYTORCH_CUDA_ALLOC_CONF"),
        "PYTORCH_CUDA_ALLOC_CONF": ("expandable_segments:True", "max_split_size_mb:128", "environment")}
    assert set(report.set) == {"TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                               "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def test_output_dir_is_filled_absolute_and_comm_traces_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    environ: dict[str, str] = {}
    apply_env("single-node", {}, Path("out"), environ, {}, sysfs=tmp_path / "sys", root=tmp_path / "root")
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "out" / "comm_traces" / "rank_")
    assert (tmp_path / "out" / "comm_traces").is_dir()  # NCCL writes its dumps there and makes no folder
    mine = {"TORCH_FR_DUMP_TEMP_FILE": "/elsewhere/fr_"}  # yours: we make no folder for it
    apply_env("single-node", {}, Path("out2"), mine, {}, sysfs=tmp_path / "sys", root=tmp_path / "root")
    assert mine["TORCH_FR_DUMP_TEMP_FILE"] == "/elsewhere/fr_" and not (tmp_path / "out2").exists()
    cpu: dict[str, str] = {}  # gloo: the watchdog makes the folder when it dumps; none is left empty
    apply_env("cpu", {}, Path("out3"), cpu, {}, sysfs=tmp_path / "sys", root=tmp_path / "root")
    assert cpu["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "out3" / "comm_traces" / "rank_")
    assert not (tmp_path / "out3").exists()


def test_second_call_sets_nothing_and_reports_the_same(tmp_path):
    environ = {"NCCL_IB_TC": "106"}
    first = _apply("roce", tmp_path, environ, {"NCCL_IB_HCA": "=mlx5_0"})
    snapshot = dict(environ)
    second = _apply("roce", tmp_path, environ, {"NCCL_IB_HCA": "=mlx5_0"})
    assert environ == snapshot
    assert second == first and second.lines() == first.lines()
    assert first.kept == {"NCCL_IB_TC": ("41", "106", "environment")} and "NCCL_IB_HCA" in first.set


def test_a_second_run_in_the_same_process_follows_its_own_output_dir_and_preset(tmp_path):
    # Two Trainers in one process: what the first call set is not "the user's" for the second.
    environ = {"NCCL_IB_TC": "106"}
    apply_env("roce", {"NCCL_IB_HCA": "=mlx5_0"}, tmp_path / "a", environ, {},
              sysfs=tmp_path / "sys", root=tmp_path / "root")
    assert environ["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path / "a" / "comm_traces"))
    second = apply_env("cpu", {}, tmp_path / "b", environ, {}, sysfs=tmp_path / "sys", root=tmp_path / "root")
    assert environ["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path / "b" / "comm_traces"))
    assert "TORCH_FR_DUMP_TEMP_FILE" in second.set and not second.kept
    want = _filled(PRESETS["cpu"], tmp_path).keys() | {"NCCL_IB_TC", MARKER}
    assert set(environ) == want, "the roce preset's variables and env.set's stay behind"
    assert environ["NCCL_IB_TC"] == "106"


def test_nccl_conf_reads_the_files_nccl_reads_first_one_wins(tmp_path):
    user, etc = tmp_path / "user.conf", tmp_path / "etc.conf"
    user.write_text("# mine\nNCCL_IB_TIMEOUT=23\n\nnot a setting\n")
    etc.write_text("NCCL_IB_TIMEOUT=20\nNCCL_IB_TC=106\n#NCCL_IB_SL=1\nNCCL_TOPO_FILE=/opt/topo.xml\n")
    assert nccl_conf([user, tmp_path / "missing.conf", tmp_path, etc], {}) == {
        "NCCL_IB_TIMEOUT": ("23", str(user)), "NCCL_IB_TC": ("106", str(etc)),
        "NCCL_TOPO_FILE": ("/opt/topo.xml", str(etc))}
    # default list: $NCCL_CONF_FILE (instead of ~/.nccl.conf), then /etc/nccl.conf
    assert nccl_conf(environ={"NCCL_CONF_FILE": str(user)})["NCCL_IB_TIMEOUT"] == ("23", str(user))


def test_a_variable_in_nccl_conf_is_left_alone_and_reported(tmp_path):
    etc = tmp_path / "nccl.conf"
    etc.write_text("NCCL_IB_TC=106\nTORCH_NCCL_DUMP_ON_TIMEOUT=0\n")
    environ: dict[str, str] = {}
    report = _apply("roce", tmp_path, environ, {"NCCL_IB_TC": "0"}, conf=nccl_conf([etc], {}))
    assert "NCCL_IB_TC" not in environ and environ["NCCL_IB_GID_INDEX"] == "3"
    assert report.kept == {"NCCL_IB_TC": ("0", "106", str(etc))}
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # torch reads it before NCCL loads the file
    assert report.lines()[1] == (f"env: warning: env.set NCCL_IB_TC=0 has no effect: {etc} already has "
                                 "NCCL_IB_TC=106")


def test_nccl_conf_paths_follow_nccl(monkeypatch):
    # NCCL takes ~ from getpwuid(getuid())->pw_dir, not $HOME (NVIDIA/nccl src/misc/param.cc)
    monkeypatch.setattr(nccl, "_home", lambda: "/home/u")
    assert nccl_conf_paths({"HOME": "/home/u"}) == [Path("/home/u/.nccl.conf"), Path("/etc/nccl.conf")]
    assert nccl_conf_paths({"HOME": "/home/u", "NCCL_CONF_FILE": "/x/n.conf"}) == [
        Path("/x/n.conf"), Path("/etc/nccl.conf")]
    assert nccl_conf_paths({"HOME": "/elsewhere"}) == [Path("/home/u/.nccl.conf"), Path("/etc/nccl.conf")]
    assert nccl_conf_paths({"NCCL_CONF_FILE": ""}) == [Path("/home/u/.nccl.conf"), Path("/etc/nccl.conf")]
    monkeypatch.setattr(nccl, "_home", lambda: None)  # no passwd entry: NCCL reads no ~/.nccl.conf
    assert nccl_conf_paths({"HOME": "/home/u"}) == [Path("/etc/nccl.conf")]


def test_read_nccl_conf_reports_each_file(tmp_path):
    user, empty = tmp_path / "user.conf", tmp_path / "empty.conf"
    user.write_text("NCCL_DEBUG=WARN\nNCCL_DEBUG=INFO\n")
    empty.write_text("")
    files, settings = read_nccl_conf([tmp_path / "missing.conf", tmp_path, user, empty], {})
    assert [(f.path, f.text, type(f.error)) for f in files] == [
        (tmp_path / "missing.conf", None, FileNotFoundError), (tmp_path, None, IsADirectoryError),
        (user, "NCCL_DEBUG=WARN\nNCCL_DEBUG=INFO\n", type(None)), (empty, "", type(None))]
    assert settings == {"NCCL_DEBUG": ("WARN", str(user))}


@pytest.mark.parametrize("value,warned", [
    ("eth,ib", False),       # NCCL takes eth0 and is fine without an ib* interface
    ("ib,enp", True), ("=eth", True), ("^eth,lo", True), ("^docker,lo", False),
    ("x", False),            # NCCL ignores a one-character NCCL_SOCKET_IFNAME
])
def test_interface_warning_follows_what_nccl_selects(tmp_path, value, warned):
    sysfs = tmp_path / "sys"
    for name in ("eth0", "lo"):
        (sysfs / "class" / "net" / name).mkdir(parents=True)
    report = _apply("none", tmp_path, {}, {"NCCL_SOCKET_IFNAME": value}, sysfs=sysfs)
    assert bool(report.warnings) == warned, report.warnings
    if warned:
        assert report.warnings[0].startswith(f"NCCL_SOCKET_IFNAME={value}: ")
        assert "NCCL init fails" in report.warnings[0]


def test_unknown_preset_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve("h100ib")
    assert str(e.value) == "unknown env.preset 'h100ib'; did you mean 'h100-ib'? (`shardlm env --list` lists them)"
    with pytest.raises(ConfigError, match=r"'zzz'; use auto or one of h100-ib, h100-efa, .*, none \(`shardlm env"):
        _apply("zzz", tmp_path, {})
    with pytest.raises(ConfigError, match="did you mean 'single-node'"):
        resolve("Single-Node")


# --- NCCL's list syntax ---------------------------------------------------------------------------

IFS = ["eth0", "eth10", "docker0", "lo", "ens5"]
HCAS = ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1", "mlx5_10:1"]


@pytest.mark.parametrize("spec,names,want", [
    ("eth", IFS, ["eth0", "eth10"]),                          # a prefix
    ("eth0", IFS, ["eth0"]),
    ("eth1", IFS, ["eth10"]),                                 # prefix, not exact
    ("=eth1", IFS, []),                                       # exact
    ("=eth0", IFS, ["eth0"]),
    ("eth,ens", IFS, ["eth0", "eth10", "ens5"]),
    ("ib0", ["eth0", "lo"], []),
    ("^docker,lo", IFS, ["eth0", "eth10", "ens5"]),           # exclusion: what remains
    ("^docker,lo", ["docker0", "lo"], []),
    ("^eth", IFS, ["docker0", "lo", "ens5"]),
    ("^=eth1", IFS, IFS),                                     # exact exclusion: eth1 is not a name here
    ("^=eth0", IFS, ["eth10", "docker0", "lo", "ens5"]),
    ("=^eth0", IFS, []),                                      # `^` only counts first: exact name "^eth0"
    ("mlx5_0:1", HCAS, ["mlx5_0:1"]),                         # :port
    ("mlx5:1", HCAS, ["mlx5_0:1", "mlx5_1:1", "mlx5_10:1"]),
    ("mlx5_1", HCAS, ["mlx5_1:1", "mlx5_10:1"]),              # no port: every port
    ("=mlx5_1", HCAS, ["mlx5_1:1"]),
    ("=mlx5_0:2", HCAS, ["mlx5_0:2"]),
    ("mlx5_0:3", HCAS, []),
    ("^mlx5_0:1", HCAS, ["mlx5_0:2", "mlx5_1:1", "mlx5_10:1"]),
    ("^=mlx5_1,mlx5_0:2", HCAS, ["mlx5_0:1", "mlx5_10:1"]),
    ("mlx5_0:1", ["mlx5_0", "mlx5_1"], ["mlx5_0"]),           # a name without port: any port
    ("eth0, ens5", IFS, ["eth0"]),                            # spaces belong to the name, as in NCCL
    (" eth", IFS, []),
    ("eth0,", IFS, ["eth0"]),                                 # empty entries are dropped
    (",,eth0,,", IFS, ["eth0"]),
    (":1,eth0", IFS, ["eth0"]),
    ("", IFS, IFS),                                           # empty list: no restriction
    ("=", IFS, IFS),
    ("^", IFS, []),
    ("eth", [], []),
])
def test_nccl_list_matches(spec, names, want):
    assert nccl_list_matches(spec, names) == want


# --- detection ------------------------------------------------------------------------------------------

def _detect(sysfs: Path, root: Path, gpu: str | None = H100, environ: dict | None = None) -> tuple[str, str]:
    return detect_preset(sysfs, environ or {}, root=root, gpu_name=lambda: gpu)


def test_detect_infiniband_by_gpu_name(tmp_path):
    sysfs = _ib_tree(tmp_path / "sys", {f"mlx5_{i}": "InfiniBand" for i in range(8)})
    assert _detect(sysfs, tmp_path) == ("h100-ib", f"8 InfiniBand ports ACTIVE, {H100}")
    assert _detect(sysfs, tmp_path, A100) == ("a100-ib", f"8 InfiniBand ports ACTIVE, {A100}")
    assert _detect(sysfs, tmp_path, "NVIDIA A800 80GB PCIe")[0] == "a100-ib"
    assert _detect(sysfs, tmp_path, "NVIDIA H200")[0] == "h100-ib"
    preset, why = resolve("auto", sysfs, {}, root=tmp_path, gpu_name=lambda: H100)
    assert preset is PRESETS["h100-ib"] and why == f"auto: 8 InfiniBand ports ACTIVE, {H100}"


def test_detect_counts_ports_that_are_down(tmp_path):
    sysfs = _ib_tree(tmp_path / "sys", {"mlx5_0": "InfiniBand"}, state="1: DOWN")
    assert _detect(sysfs, tmp_path) == ("h100-ib", f"1 InfiniBand ports (0 ACTIVE), {H100}")


def test_detect_ethernet_link_layer_is_roce(tmp_path):
    sysfs = _ib_tree(tmp_path / "sys", {"mlx5_0": "Ethernet", "mlx5_1": "Ethernet"}, gid3="RoCE v2")
    assert _detect(sysfs, tmp_path) == ("roce", f"2 RoCE (Ethernet link layer) ports ACTIVE, GID 3 on mlx5_0: "
                                                f"RoCE v2, {H100}")


def test_detect_efa_by_name_or_vendor(tmp_path):
    assert _detect(_ib_tree(tmp_path / "a", {"efa_0": "Unknown", "efa_1": "Unknown"}), tmp_path) == (
        "h100-efa", f"2 EFA devices, {H100}")
    sysfs = _ib_tree(tmp_path / "b", {"rdmap16s27": "Unknown"})  # rdma-core's rename of efa_0
    (sysfs / "class" / "infiniband" / "rdmap16s27" / "device").mkdir()
    (sysfs / "class" / "infiniband" / "rdmap16s27" / "device" / "vendor").write_text("0x1d0f\n")
    assert _detect(sysfs, tmp_path)[0] == "h100-efa"


def test_detect_gcp_no_gpu_and_single_node(tmp_path):
    ib = _ib_tree(tmp_path / "sys", {"mlx5_0": "InfiniBand"})
    (tmp_path / "root" / "var" / "lib" / "tcpxo").mkdir(parents=True)
    assert _detect(ib, tmp_path / "root") == ("h100-gcp", f"/var/lib/tcpxo present (GPUDirect-TCPX/O), {H100}")
    assert _detect(ib, tmp_path / "root", gpu=None) == ("cpu", "no CUDA GPU")
    assert _detect(tmp_path / "nosys", tmp_path) == (
        "single-node", f"{H100}, no RDMA device under {tmp_path / 'nosys' / 'class' / 'infiniband'}")
    assert _detect(tmp_path / "nosys", tmp_path, gpu="")[0] == "single-node"  # a GPU of unknown model


def test_detect_never_raises(tmp_path):
    def broken() -> str:
        raise RuntimeError("driver/library version mismatch")
    assert detect_preset(tmp_path, {}, root=tmp_path, gpu_name=broken) == ("cpu", "no CUDA GPU")
    called = []
    assert detect_preset(tmp_path, {"CUDA_VISIBLE_DEVICES": ""}, root=tmp_path,
                         gpu_name=lambda: called.append(1) or H100)[0] == "cpu" and not called
    odd = tmp_path / "odd"
    (odd / "class").mkdir(parents=True)
    (odd / "class" / "infiniband").write_text("a file, not a folder")
    dev = _ib_tree(tmp_path / "sys2", {"mlx5_0": "InfiniBand"}) / "class" / "infiniband" / "mlx5_0"
    (dev / "device").mkdir()
    (dev / "device" / "driver").symlink_to(dev / "device" / "driver")  # a loop
    (dev / "ports" / "1" / "link_layer").unlink()
    (dev / "ports" / "1" / "link_layer").mkdir()  # unreadable as a file
    assert _detect(odd, tmp_path)[0] == "single-node"
    assert _detect(tmp_path / "sys2", tmp_path)[0] == "single-node"


def test_gpu_name_comes_from_the_driver_without_cuda(tmp_path):
    info = tmp_path / "driver" / "nvidia" / "gpus" / "0000:18:00.0"
    info.mkdir(parents=True)
    (info / "information").write_text(f"Model: \t\t {H100}\nIRQ:  \t\t 123\n")
    assert cuda_gpu_name(tmp_path) == H100


# --- Google's profile (h100-gcp) ------------------------------------------------------------------------------

def _profile(root: Path) -> Path:
    path = root / PROFILE
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/bash\n# Google's profile (a fake)\n"
                    "export NCCL_CROSS_NIC=0\n"
                    'export NCCL_PROTO="Simple"  # quoted, with a comment\n'
                    "export NCCL_TUNER_CONFIG_PATH=${NCCL_LIB_DIR}/a3plus_tuner_config.textproto\n"
                    "export NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY=/dev/other\n"
                    "export NCCL_SOCKET_IFNAME=enp0s12\n"
                    "LOCAL_ONLY=1\nFLOWS=2\nexport FLOWS\n"
                    "export NCCL_FASTRAK_NUM_FLOWS=${FLOWS:-4}\n"
                    "export LD_LIBRARY_PATH=${NCCL_LIB_DIR}:${LD_LIBRARY_PATH}\n"
                    'if [ -n "$X" ]; then\n  echo hi\nfi\n')
    return path


def test_gcp_reads_googles_profile(tmp_path):
    root, sysfs = tmp_path / "root", tmp_path / "sys"
    libdir = _profile(root).parent
    (sysfs / "class" / "net" / "eth0").mkdir(parents=True)
    environ = {"LD_LIBRARY_PATH": "/usr/lib", "NCCL_CROSS_NIC": "1"}
    report = _apply("h100-gcp", tmp_path, environ, root=root, sysfs=sysfs)
    assert {k: environ.get(k) for k in ("NCCL_PROTO", "NCCL_TUNER_CONFIG_PATH", "NCCL_FASTRAK_NUM_FLOWS", "FLOWS",
                                        "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY", "NCCL_NVLS_ENABLE", "LOCAL_ONLY")} == {
        "NCCL_PROTO": "Simple", "NCCL_TUNER_CONFIG_PATH": f"{libdir}/a3plus_tuner_config.textproto",
        "NCCL_FASTRAK_NUM_FLOWS": "2", "FLOWS": "2",
        "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/other",  # Google's profile wins over the fixed value
        "NCCL_NVLS_ENABLE": "0", "LOCAL_ONLY": None}
    assert environ["LD_LIBRARY_PATH"] == "/usr/lib" and environ["NCCL_CROSS_NIC"] == "1"
    assert report.kept == {"NCCL_CROSS_NIC": ("0", "1", "environment")}
    assert report.warnings == [
        f"LD_LIBRARY_PATH lacks {libdir}, where NCCL finds the TCPXO plugin; the loader reads it only at process "
        f"start: export LD_LIBRARY_PATH={libdir}:$LD_LIBRARY_PATH in the launcher, as Google's scripts do",
        f"NCCL_SOCKET_IFNAME=enp0s12: no interface enp0s12 under {sysfs / 'class' / 'net'} (NCCL init fails on a "
        "missing one): set the right names with env.set"]
    assert report.lines()[-2:] == [f"env: warning: {w}" for w in report.warnings]


def test_gcp_warns_when_the_profile_is_missing(tmp_path):
    environ: dict[str, str] = {}
    report = _apply("h100-gcp", tmp_path, environ)
    assert report.set == _filled(PRESETS["h100-gcp"], tmp_path)
    assert len(report.warnings) == 1 and report.warnings[0].startswith(
        f"h100-gcp: Google's TCPXO profile is missing ({tmp_path / 'root' / PROFILE}, ")
    assert "mount the TCPXO plugin folder" in report.lines()[-1]


# --- what the presets hold, and how they print ----------------------------------------------------------------

def test_every_var_has_a_reason_and_a_source_and_no_unsourced_debugging_var():
    for p in PRESETS.values():
        assert p.summary and p.checked_against and len({v.name for v in p.vars}) == len(p.vars), p.name
        for v in p.vars:
            assert v.reason.strip() and "\n" not in v.reason, (p.name, v.name)
            assert re.fullmatch(r"\[[^\]]+\]( \[[^\]]+\])*", v.source), (p.name, v.name, v.source)
            if v.name in DEBUGGING:  # only where a primary source's recipe sets it, and the reason says so
                assert (p.name, v.name) == ("h100-gcp", "NCCL_NVLS_ENABLE") and "Debugging" in v.reason
    assert not any(v.name in ("NCCL_IB_HCA", "NCCL_TOPO_FILE") or v.name.endswith("IFNAME") and
                   not v.value.startswith("^") for p in PRESETS.values() for v in p.vars)  # site knowledge


def test_format_preset_marks_unverified_lines():
    p = Preset("x", "test clusters", (Var("A", "1", "because", "[NCCL-env]"),
                                      Var("B", "2", "maybe", "[MEG-ex]", unverified=True)), "NCCL 2.29", ("a note",))
    assert format_preset(p) == ("# x: test clusters (checked against NCCL 2.29)\n"
                                "A=1  # because [NCCL-env]\n"
                                "B=2  # maybe [MEG-ex] (UNVERIFIED)\n"
                                "# note: a note")
    text = format_preset(PRESETS["roce"]).splitlines()
    assert text[1].startswith("NCCL_IB_GID_INDEX=3  # OCI's value") and text[1].endswith("[OCI] [NCCL-env]")
    assert format_preset(PRESETS["none"]).splitlines()[1] == "# (no variables)"


def test_format_list_is_one_line_per_preset():
    lines = format_list().splitlines()
    assert [line.split()[0] for line in lines] == ["h100-ib", "h100-efa", "h100-gcp", "a100-ib", "roce",
                                                   "single-node", "cpu", "none"]
    assert lines[4].startswith("roce          9 vars  RoCE") and lines[7].startswith("none          0 vars")
