"""The trainer: runs under torchrun with no control plane at all if asked.

Importing this package stays torch-free (`megatrain.engine.config` and `megatrain.engine.data` need
only the spec and numpy); the model, checkpoint and train modules import torch themselves.
"""
