"""Cluster fabrics for projections: what a TOML file says about the network, and the
allreduce time it implies at P GPUs.

Owns: ``Fabric`` (a typed, documented description; `load_fabric` reads it and names every
missing or wrong field), and `Fabric.comm_model(p)` - the α-β model (runtime.calibrate.tune.costmodel)
of one allreduce over p GPUs:
  * p ≤ gpus_per_node: NCCL's ring inside a node, T = α_intra + 2(p−1)/p · n / B_intra, with
    B_intra the bus bandwidth nccl-tests reports on the node;
  * p > gpus_per_node, ``algorithm = "hierarchical"`` (N = p / G nodes): reduce-scatter inside
    the node, an allreduce of each GPU's 1/G shard across the nodes on all NICs at once, an
    all-gather inside the node: T = α_intra + 2·⌈log2 N⌉·α_inter
    + 2(G−1)/G · n / B_intra + 2(N−1)/N · n / B_inter, with B_inter the node's inter-node bus
    bandwidth (all its NICs together, as nccl-tests measures it across nodes). The latency
    term is a tree's (NCCL switches to trees at scale for small messages);
  * ``algorithm = "ring"``: one flat ring at the inter-node bus bandwidth,
    T = 2(p−1)·α_inter + 2(p−1)/p · n / B_inter.
A sharded optimizer (`Fabric.shard_comm`, optim.shard) over groups of g GPUs:
  * g = gpus_per_node < p ('node'): a bucket is reduce-scattered inside the node and its
    shard all-reduced across the nodes, T = α_intra + 2·⌈log2 N⌉·α_inter
    + (G−1)/G · n / B_intra + 2(N−1)/N · n / B_inter (the hierarchical allreduce without its
    intra-node all-gather); the parameters are all-gathered inside the node,
    T = α_intra + (G−1)/G · n / B_intra;
  * g = p ('world', or one node): a reduce-scatter and an all-gather over all p are each
    half the allreduce: the same latency, half the per-byte time.
Never: measures anything; the numbers come from the file and are the user's claims.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from runtime.calibrate.tune.costmodel import CommModel
from runtime.calibrate.tune.simulate import ShardComm

GB = 1e9


class FabricError(ValueError):
    """A fabric file that cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Fabric:
    """A cluster's network, as nccl-tests would describe it (``[fabric]`` of a TOML file)."""

    name: str
    """what this describes, e.g. "DGX A100, 8x HDR InfiniBand" """
    gpus_per_node: int
    """GPUs in one node (NVLink/NVSwitch domain)"""
    intra_bus_bandwidth_GBps: float
    """allreduce bus bandwidth on one full node, GB/s (nccl-tests all_reduce_perf busbw)"""
    inter_bus_bandwidth_GBps: float
    """allreduce bus bandwidth between nodes per node, all NICs together, GB/s"""
    intra_latency_us: float
    """latency of one allreduce inside a node, µs"""
    inter_latency_us: float
    """latency of one hop between nodes, µs"""
    algorithm: str = "hierarchical"
    """'hierarchical' (intra-node reduce-scatter, inter-node allreduce, intra all-gather) |
    'ring' (one flat ring)"""
    source: str = ""
    """where the numbers come from"""

    def comm_model(self, gpus: int) -> CommModel:
        """T(n) for one allreduce of n bytes over ``gpus`` GPUs (module docstring)."""
        if gpus < 1:
            raise FabricError(f"{self.name}: GPU count must be >= 1, got {gpus}")
        G = self.gpus_per_node
        a_in, a_out = self.intra_latency_us * 1e-6, self.inter_latency_us * 1e-6
        b_in, b_out = self.intra_bus_bandwidth_GBps * GB, self.inter_bus_bandwidth_GBps * GB
        if gpus == 1:
            return CommModel.affine(0.0, 0.0, 1)
        if gpus <= G:
            return CommModel.affine(a_in, 2 * (gpus - 1) / gpus / b_in, gpus)
        if gpus % G:
            raise FabricError(f"{self.name}: {gpus} GPUs is not a whole number of "
                              f"{G}-GPU nodes")
        nodes = gpus // G
        if self.algorithm == "ring":
            return CommModel.affine(2 * (gpus - 1) * a_out, 2 * (gpus - 1) / gpus / b_out, gpus)
        alpha = a_in + 2 * math.ceil(math.log2(nodes)) * a_out
        beta = 2 * (G - 1) / G / b_in + 2 * (nodes - 1) / nodes / b_out
        return CommModel.affine(alpha, beta, gpus)


    def shard_comm(self, gpus: int, group: int) -> ShardComm:
        """The sharded step's collectives on ``gpus`` GPUs whose optimizer is shared by
        ``group`` of them (module docstring): ``group`` = gpus_per_node, or ``gpus``."""
        G = self.gpus_per_node
        if group >= gpus:
            return ShardComm.from_allreduce(self.comm_model(gpus), "reduce")
        if group != G or gpus % G:
            raise FabricError(f"{self.name}: a shard group of {group} GPUs out of {gpus}: "
                              f"model a node ({G}) or every GPU")
        nodes = gpus // G
        a_in, a_out = self.intra_latency_us * 1e-6, self.inter_latency_us * 1e-6
        b_in, b_out = self.intra_bus_bandwidth_GBps * GB, self.inter_bus_bandwidth_GBps * GB
        bucket = CommModel.affine(a_in + 2 * math.ceil(math.log2(nodes)) * a_out,
                                  (G - 1) / G / b_in + 2 * (nodes - 1) / nodes / b_out, gpus)
        gather = CommModel.affine(a_in, (G - 1) / G / b_in, G)
        return ShardComm(bucket, gather, self.comm_model(G))


def load_fabric(path: str | Path) -> Fabric:
    path = Path(path)
    if not path.is_file():
        raise FabricError(f"fabric file {path} does not exist (see runtime/calibrate/tune/systems/*.toml "
                          f"for examples)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise FabricError(f"{path}: not valid TOML ({e})") from e
    return from_table(data.get("fabric"), f"{path} [fabric]", Fabric)


def from_table(table, where: str, cls):
    """A dataclass ``cls`` from a TOML table: every field without a default required, types
    checked, unknown keys refused - each error names the key and says what it is for."""
    if not isinstance(table, dict):
        raise FabricError(f"{where}: missing; it needs the keys "
                          f"{', '.join(f.name for f in fields(cls))}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise FabricError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(known)}")
    doc = _field_docs(cls)
    missing = [n for n, f in known.items() if n not in table
               and f.default is f.default_factory is __import__("dataclasses").MISSING]
    if missing:
        raise FabricError(f"{where}: missing field(s): " + "; ".join(
            f"{n} ({doc.get(n, '')})" for n in missing))
    kw = {}
    for name, value in table.items():
        want = known[name].type
        kind = {"int": int, "float": float, "str": str, "bool": bool}.get(str(want), None)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is not None and not isinstance(value, kind):
            raise FabricError(f"{where}: {name} must be {kind.__name__}, got {value!r} "
                              f"({doc.get(name, '')})")
        if kind in (int, float) and value < 0:
            raise FabricError(f"{where}: {name} must be >= 0, got {value}")
        kw[name] = value
    obj = cls(**kw)
    if isinstance(obj, Fabric):
        if obj.algorithm not in ("hierarchical", "ring"):
            raise FabricError(f"{where}: algorithm must be hierarchical | ring, got "
                              f"{obj.algorithm!r}")
        for n in ("gpus_per_node", "intra_bus_bandwidth_GBps", "inter_bus_bandwidth_GBps"):
            if getattr(obj, n) <= 0:
                raise FabricError(f"{where}: {n} must be > 0")
    return obj


def _field_docs(cls) -> dict[str, str]:
    """Field docstrings (the string literal after each field) from the class source."""
    import ast
    import inspect
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    out = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) \
                and isinstance(getattr(b, "value", None), ast.Constant):
            out[a.target.id] = " ".join(str(b.value.value).split())
    return out
