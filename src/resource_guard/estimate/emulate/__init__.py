"""The target's behaviour emulated over CPU fake tensors: CUDA's autocast op policy, the autocast
regions a model opens, and the attention kernel the target would pick.
"""
