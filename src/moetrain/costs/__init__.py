"""Cost formulas shared by the runtime's metrics and the planner: parameters, FLOPs, activation bytes.

Pure functions of the configs, numpy-broadcastable where an argument is a size (seq_len, micro
batch, parallel degrees), and torch-free so the planner scores millions of layouts without torch.
"""
