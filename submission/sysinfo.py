"""What a machine is, for the MLPerf system description: ``python -m submission.sysinfo``.

Owns: reading this host's CPU (``/proc/cpuinfo``, ``/sys/devices/system/cpu``), memory
(``/proc/meminfo``), storage, accelerators (``nvidia-smi`` when present), OS and software
versions (installed package metadata, never importing torch), and turning those facts plus a
config into the fields ``mlperf_logging.system_desc_checker`` requires.
Never: guesses. A fact this host cannot tell (memory configuration, cooling, interconnects)
is written as "unknown" or "N/A" with the reason, for the submitter to fill in.

run.sub runs ``python -m submission.sysinfo > LOGDIR/sysinfo.json`` on the first node of the
job, so ``package`` describes the compute node, not the login node it runs on.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "numpy", "mpi4py", "mpich", "h5py", "mlperf-logging")
STATUS = {"onprem": "Available on-premise", "cloud": "Available cloud",
          "research": "Research, Development, or Internal (RDI)", "preview": "Preview"}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_facts() -> dict:
    info = _read("/proc/cpuinfo")
    blocks = [dict(re.findall(r"^([^:\n]+?)\s*:\s*(.*)$", b, re.M)) for b in info.split("\n\n")
              if b.strip()]
    first = blocks[0] if blocks else {}
    sockets = len({b.get("physical id", "0") for b in blocks}) or 1
    vcpus = os.cpu_count() or len(blocks) or 1
    cores = int(first.get("cpu cores", 0) or 0) or vcpus // sockets
    mhz = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").strip()
    freq = f"{int(mhz) // 1000} MHz (max)" if mhz.isdigit() else (
        f"{float(first['cpu MHz']):.0f} MHz" if "cpu MHz" in first else "unknown")
    return {"model": first.get("model name", platform.processor() or "unknown"),
            "sockets": sockets, "cores_per_socket": cores, "vcpus": vcpus,
            "frequency": freq, "caches": _caches() or first.get("cache size", "unknown")}


def _caches() -> str:
    out = []
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        level, kind, size = (_read(str(d / f)).strip() for f in ("level", "type", "size"))
        if level and size:
            out.append(f"L{level} {kind.lower().replace('unified', '').strip() or ''} {size}"
                       .replace("  ", " "))
    return ", ".join(out)


def memory_gb() -> float:
    m = re.search(r"^MemTotal:\s+(\d+) kB", _read("/proc/meminfo"), re.M)
    return round(int(m.group(1)) / 2**20, 1) if m else 0.0


def storage_facts(path: Path) -> dict:
    try:
        total = shutil.disk_usage(path).total
        dev = os.stat(path).st_dev
        sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    except OSError:
        return {"type": "unknown", "capacity": "unknown"}
    disk = sysdev if (sysdev / "queue").is_dir() else sysdev.parent
    rot = _read(str(disk / "queue" / "rotational")).strip()
    kind = {"0": "SSD/NVMe (non-rotational)", "1": "rotational or virtual disk"}.get(rot, "unknown")
    return {"type": f"{disk.name}: {kind}" if disk.name else kind,
            "capacity": f"{total / 1e9:.0f} GB"}


def accelerators() -> list[dict]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory": parts[1], "max_clock": parts[2]})
    return gpus


def software() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    os_name = re.search(r'^PRETTY_NAME="?([^"\n]*)', _read("/etc/os-release"), re.M)
    slurm = ""
    if shutil.which("sinfo"):
        try:
            slurm = subprocess.run(["sinfo", "--version"], capture_output=True, text=True,
                                   timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            slurm = ""
    return {"python": platform.python_version(), "executable": sys.executable,
            "packages": versions, "torch_build": torch_build(versions.get("torch", "")),
            "os": os_name.group(1) if os_name else platform.system(),
            "kernel": platform.release(), "slurm": slurm}


def torch_build(version: str) -> str:
    """What torch's local version says it was built for ("2.13.0+cpu": CPU only, a CUDA
    config cannot run; "2.11.0+cu130": CUDA 13.0), without importing it."""
    local = version.partition("+")[2]
    if local == "cpu":
        return "CPU only"
    m = re.fullmatch(r"cu(\d+)(\d)", local)
    if m:
        return f"CUDA {m.group(1)}.{m.group(2)}"
    return f"unknown ({version or 'torch not installed'})"


def collect(path: Path | None = None) -> dict:
    """Every fact of this host (``path``: where the data lives, for the storage fields)."""
    return {"hostname": platform.node(), "cpu": cpu_facts(), "memory_gb": memory_gb(),
            "storage": storage_facts(path or Path.cwd()), "accelerators": accelerators(),
            "software": software()}


def system_description(facts: dict, cfg, org: str, system: str) -> dict:
    """The MLPerf training system-description JSON (every field system_desc_checker wants,
    as strings) from host facts and a config (nodes, ranks, division, status)."""
    cpu, sw, gpus = facts["cpu"], facts["software"], facts["accelerators"]
    pk = sw["packages"]
    per_node = str(cfg.system.ranks_per_node) if gpus and cfg.system.device != "cpu" else "0"
    gpu = gpus[0] if gpus and per_node != "0" else None
    na = "N/A (no accelerators: CPU ranks)" if gpu is None else "unknown"
    stack = ", ".join(f"{k} {v}" for k, v in pk.items() if k != "torch")
    return {
        "submitter": org, "division": cfg.submission.division,
        "status": STATUS.get(cfg.submission.status, cfg.submission.status),
        "system_name": system, "number_of_nodes": str(cfg.system.nodes),
        "host_processors_per_node": str(cpu["sockets"]),
        "host_processor_model_name": cpu["model"],
        "host_processor_core_count": str(cpu["cores_per_socket"]),
        "host_processor_vcpu_count": str(cpu["vcpus"]),
        "host_processor_frequency": cpu["frequency"], "host_processor_caches": cpu["caches"],
        "host_processor_interconnect": "unknown (not readable from the OS)",
        "host_memory_capacity": f"{facts['memory_gb']} GB",
        "host_storage_type": facts["storage"]["type"],
        "host_storage_capacity": facts["storage"]["capacity"],
        "host_networking": "N/A (one node)" if cfg.system.nodes == 1 else "unknown",
        "host_networking_topology": "N/A (one node)" if cfg.system.nodes == 1 else "unknown",
        "host_memory_configuration": "unknown (needs dmidecode on the node)",
        "accelerators_per_node": per_node,
        "accelerator_model_name": gpu["name"] if gpu else "N/A",
        "accelerator_host_interconnect": na, "accelerator_frequency":
            gpu["max_clock"] if gpu else "N/A",
        "accelerator_on-chip_memories": na,
        "accelerator_memory_configuration": na,
        "accelerator_memory_capacity": gpu["memory"] if gpu else "N/A",
        "accelerator_interconnect": na, "accelerator_interconnect_topology": na,
        "cooling": "unknown", "hw_notes": f"described from host {facts['hostname']}",
        "framework": f"PyTorch {pk.get('torch', 'unknown')}, Python {sw['python']}",
        "other_software_stack": stack + (f", {sw['slurm']}" if sw["slurm"] else ""),
        "operating_system": f"{sw['os']} (kernel {sw['kernel']})",
        "sw_notes": "Presto MLPerf-style BERT runtime",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m submission.sysinfo",
        description="Print this host's facts (CPU, memory, storage, accelerators, OS and "
                    "software versions) as JSON on stdout, for the MLPerf system "
                    "description; run.sub keeps them in LOGDIR/sysinfo.json.")
    ap.parse_args(argv)
    json.dump(collect(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
