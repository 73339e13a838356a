"""What a device shows: the CUDA caching allocator, context and workspaces (:class:`DeviceFit`),
and the later micro-step that starts with its gradients allocated.
"""
