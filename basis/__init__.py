"""basis/: the torch-free room below loaders and runtime - what every other room states the same
way, kept in one place instead of copies: the facts (BERT's shape and FLOPs, the named data
sets, Google BERT's TensorFlow variable names, the dtype names) and the plumbing every
command-line tool needs (its shell, its ``--out`` staging).

Rooms:
  model_shape.py  the shape keys, the named sizes, the parameter count and the FLOP formula
  presets.py      the named data-set builds (MLPerf's flags, the test suite's small set) and
                  the command that builds the set a config asks for
  tf_names.py     Google BERT's TF variables: names, shapes, HF keys, optimizer-state names
  dtypes.py       the dtype names of the config and the rows, and the torch dtype each means
  cli.py          a tool's shell: stop signals -> exit 130, declared failures -> their exit
                  status and one line on stderr
  staging.py      a tool's ``--out``: built in a locked temporary directory, moved into place
                  whole, the leftovers of killed runs removed

Layering (tests/unit/test_layering.py): basis imports the standard library alone - nothing of
the project, no torch, no numpy - and every room (loaders, kernels, runtime, submission,
bench, tests) may import it. Never: anything that needs torch, a device, a data file or the
config.
"""
