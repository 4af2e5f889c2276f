"""What the tests share, imported as ``tests.support.<module>`` (pytest.ini puts the repository
root on ``sys.path``; tests/dist_scripts/*.py put it there themselves). No test module imports
another test module: what two of them need lives here.

  launch   the venv's launchers (``MPIEXEC``, ``TORCHRUN``, the ``needs_*`` skips), a clean
           environment for the processes a test starts, ``mpiexec``/``run_ranks`` helpers,
           the stop signals at their default disposition, the launcher tests' rank script
           (``WORKER``) and stand-in launcher executables (``bindir``)
  tiny     the one tiny BERT of the suite: its shape, ``tiny_config`` (a loaded config) and
           the overrides of the run_and_time.sh runs; ``optim.backend = "foreach"`` so that
           building a Trainer compiles nothing (tests of the default, compiled pairing ask for
           it explicitly)
  runs     run_and_time.sh runs from a test: start, wait, read metrics.jsonl, and the
           session's uninterrupted 2-rank reference run (a fixture, shared by every test that
           compares against it)
  mllog    MLPerf log helpers: the real compliance checker, the events of a log, a synthetic
           run through the MLPerf logger callback
  data     a synthetic schema-correct data set and batch fingerprints, a data set copy with a
           damaged shard, the eval truth of ``small_dataset``, the sources' directory
  loaders  the balance tests' specs and loaders, a batch's sequences as fingerprints, a
           static-shape loader
  envs     fake launcher environments for ``discover``
  tf_checkpoint  the converter tests' TensorFlow checkpoint (the fixture TF wrote), its config
           and a copy of it to damage
  memory   the peak resident memory of an optimizer step (run in a fresh process)
  capture  what a captured step may touch: the collectives it calls (``Collectives``) and the
           tensors that must live from step to step (``persistent_tensors``)
"""
