"""The device-time record as markdown tables (``python -m bench.device_time`` prints them;
docs/benchmarks/device_time.md holds them): the validation against the GPU records, the
predictions by mode, part and GPU, the kernels that cost most, 8 GPUs of a node.

Owns: the tables' layout. Never: computes a figure (bench.device_time, bench.device_node).
"""
from __future__ import annotations

from bench.device_model import PARTS

SHORT = {"encoder GEMMs": "enc. GEMMs", "attention": "attention",
         "compiled/elementwise": "elementwise", "optimizer": "optimizer",
         "gradient buffer": "grad buffer", "embeddings and heads": "emb.+heads"}


def validation_table(rows: list[dict]) -> str:
    out = ["| case | GPU | record (key) | tree | measured ms | predicted ms | error | "
           "max form ms | kernels measured / counted | within 15 % |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec = r["record"].split("/")[-1].replace(".json", "")
        key = r["key"].replace("stages.", "").replace(".result.", ": ")
        k = r.get("measured_kernels")
        kernels = f"{k:,.0f} / {r['predicted_kernels']:,.0f}" if k else \
            f"- / {r['predicted_kernels']:,.0f}"
        note = f" ({r['note']})" if r.get("note") else ""
        out.append(f"| {r['case']}{note} | {r['gpu'].upper()} | {rec} ({key}) | {r['tree']} | "
                   f"{r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | "
                   f"**{r['error']:+.1%}** | {r['predicted_max_form_ms']:.2f} | {kernels} | "
                   f"{'met' if r['met'] else '**missed**'} |")
    return "\n".join(out)


def predictions_table(pred: dict, config: str) -> str:
    """Busy ms by mode and GPU at ``config`` ('rows2' or 'throughput'), split by part."""
    head = "| mode | GPU | busy ms | " + " | ".join(SHORT[p] for p in PARTS) + " | kernels |"
    if config == "throughput":
        head += " batch | real tokens/s |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, per_gpu in pred.items():
        for g, p in per_gpu.items():
            if "error" in p:
                out.append(f"| {mode} | {g.upper()} | {p['error']} |" + " |" * (len(PARTS) + 1))
                continue
            c = p[config]
            cells = " | ".join(f"{c['by_part'][x]['ms']:.2f}" for x in PARTS)
            line = f"| {mode} | {g.upper()} | **{c['ms']:.2f}** | {cells} | {c['kernels']:,.0f} |"
            if config == "throughput":
                line += f" {c['local_batch']} | {c['tokens_per_s']:,.0f} |"
            out.append(line)
    return "\n".join(out)


def top_table(pred: dict, mode: str, gpu: str, config: str = "rows2", n: int = 10) -> str:
    c = pred[mode][gpu][config]
    out = ["| part | op | ms | kernels | MB | GFLOP |", "|---|---|---|---|---|---|"]
    for t in c["top"][:n]:
        op = t["op"] if len(t["op"]) < 48 else t["op"][:45] + "..."
        out.append(f"| {t['part']} | `{op}` | {t['ms']:.3f} | {t['kernels']:.0f} | "
                   f"{t['MB']:,.0f} | {t['GFLOP']:,.0f} |")
    return "\n".join(out)


def node_table(node: dict) -> str:
    out = ["| mode | GPU | fabric | one GPU ms | 8 GPUs unsharded: step ms (exposed comm, "
           "optimizer) | 8 GPUs, optim.shard=node: step ms (exposed comm; update + gather) | "
           f"vs NVIDIA's {node['nvidia_step_ms']} ms |", "|---|---|---|---|---|---|---|"]
    for mode, per_gpu in node.items():
        if not isinstance(per_gpu, dict):
            continue
        for g, r in per_gpu.items():
            u, s = r["unsharded"], r["sharded"]
            out.append(f"| {mode} | {g.upper()} | {r['fabric']} | {r['one_gpu_ms']:.2f} | "
                       f"{u['step_ms']:.2f} ({u['exposed_comm_ms']:.2f}, "
                       f"{u['optimizer_ms']:.2f}) | **{s['step_ms']:.2f}** "
                       f"({s['exposed_comm_ms']:.2f}; {s['update_ms']:.2f} + "
                       f"{s['gather_ms']:.2f}) | {s['vs_nvidia']:.2f}x |")
    return "\n".join(out)


def cuts_table(cuts: dict) -> str:
    out = ["| GPU | busy before -> after the buffer's copy (3a22c0e), ms | gradient buffer ms "
           "(GB) before -> after | stored update fp32: ms | stored update bf16: ms | norm in "
           "pass 1: ms |", "|---|---|---|---|---|---|"]
    for g, c in cuts.items():
        b, w = c["gradient_buffer_copy"], c["what_if"]
        out.append(f"| {g.upper()} | {b['before_ms']:.2f} -> **{b['after_ms']:.2f}** | "
                   f"{b['buffer_before_ms']:.2f} ({b['buffer_before_GB']:.2f}) -> "
                   f"{b['buffer_after_ms']:.2f} ({b['buffer_after_GB']:.2f}) | "
                   f"{w['lamb_stored_update_fp32_ms']:+.3f} | "
                   f"{w['lamb_stored_update_bf16_ms']:+.3f} | "
                   f"{w['grad_norm_folded_into_pass1_ms']:+.3f} |")
    return "\n".join(out)


def stored_table(cuts: dict) -> str:
    """``optim.lamb_update = "stored"`` counted with and without (bench.device_cuts)."""
    out = ["| GPU | busy without -> with, ms | optimizer ms (GB) without -> with | kernels "
           "without -> with |", "|---|---|---|---|"]
    for g, c in cuts.items():
        s = c.get("lamb_stored_update")
        if s is None:   # a record from before the option
            continue
        out.append(f"| {g.upper()} | {s['before_ms']:.2f} -> **{s['after_ms']:.2f}** | "
                   f"{s['optimizer_before_ms']:.2f} ({s['optimizer_before_GB']:.2f}) -> "
                   f"{s['optimizer_after_ms']:.2f} ({s['optimizer_after_GB']:.2f}) | "
                   f"{s['kernels_before']:.0f} -> {s['kernels_after']:.0f} |")
    return "\n".join(out)


def tables(rec: dict) -> str:
    parts = []
    if "validation" in rec:
        parts += ["Validation (busy time of a step: the sum of its kernel durations)", "",
                  validation_table(rec["validation"]), ""]
    if "predictions" in rec:
        parts += ["Predicted busy at 2 full rows of 512 (local batch 4), ms", "",
                  predictions_table(rec["predictions"], "rows2"), "",
                  "Predicted busy at the largest batch the records measured, ms", "",
                  predictions_table(rec["predictions"], "throughput"), ""]
    if "cuts" in rec:
        parts += ["The cuts, best mode at 2 full rows (what the model prices them at)", "",
                  cuts_table(rec["cuts"]), "",
                  'optim.lamb_update = "stored", best mode at 2 full rows (counted with and '
                  'without)', "", stored_table(rec["cuts"]), ""]
    if "node8" in rec:
        parts += ["8 GPUs of a node, 2 full rows a GPU (the tuner's projection of the "
                  "model: profile)", "", node_table(rec["node8"]), ""]
    return "\n".join(parts)
