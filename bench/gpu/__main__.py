"""``python -m bench.gpu``: the orchestrator's command line (bench/gpu/orchestrator.py); also
what each stage's child process runs (``--stage NAME``).

Owns: the entry point only. Never: anything the orchestrator does."""
import sys

from bench.gpu.orchestrator import main

sys.exit(main())
