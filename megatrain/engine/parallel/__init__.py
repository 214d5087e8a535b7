"""Parallelism applied to single-device models: process groups, tensor/sequence, data, pipeline."""
