"""Distributed execution inside the engine: the tensor-parallel group and how a model splits.

`parallel_state` holds the group a rank talks to (and nothing at all when there is one rank, so
a single-process engine never touches torch.distributed); `sharding` says which heads, MLP
columns and vocabulary rows each rank owns, and refuses a tensor-parallel size that does not
divide the model before any process is spawned.
"""
