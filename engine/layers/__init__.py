"""Model building blocks that know about tensor parallelism.

Column-parallel projections need no layer of their own: each rank's fused qkv / gate_up is an
ordinary `Linear` (an `nn.Linear` whose matmul `dispatch.dense_linear` picks) over the rows it
holds, and only the loader knows which rows those are. What needs code is where ranks meet:
the row-parallel projections (one all-reduce), the vocabulary-parallel embedding (one
all-reduce) and the vocabulary-parallel lm_head (a gather to rank 0). With one rank each of
these runs the same torch call a plain layer would.
"""
