"""Tensor parallelism: rank state and collectives, parallel layers' loaders, worker ranks."""
