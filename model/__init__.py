"""Model package: configs, ops, layers, whole models and checkpoint I/O."""
