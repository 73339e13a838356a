"""The trace: the model, optimizer and batch copied onto fake tensors, live-storage accounting by
category, in-place and composite operators, per-operator recovery, library-specific shims.
"""
