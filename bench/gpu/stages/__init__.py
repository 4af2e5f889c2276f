"""The stages of ``python -m bench.gpu``, one function each (``stage_<name>(run) -> dict``),
grouped by what they measure; bench/gpu/table.py names each in its row. Each runs in its own
process (``python -m bench.gpu --stage NAME``) and returns a JSON-able dict, which the
orchestrator records whatever a later stage does. What each measures and which goal it is
held to: docs/GPU.md.

Owns: the stage functions and, beside each, the goals its figures are held to (name,
threshold, verdict). Never: the order, budgets or processes of the run (table.py and the
orchestrator).
"""
