"""Data preparation and loading for Presto: corpus -> MLPerf BERT HDF5 shards -> batches.

A leaf package: imports torch/numpy/h5py/tokenizers/stdlib and its own modules only.
"""
