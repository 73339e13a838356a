"""The host CPU's truth: real steps measured with the profiler, oneDNN kernel scratch and what this
CPU can run (tiny real probes), torch's native log lines kept quiet.
"""
