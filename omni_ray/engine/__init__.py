"""Engine cores, after vLLM V1: a scheduler decides each step's work, a model runner does it, the core ties them.

Nothing here imports Ray: deployments/ wraps an engine in a Serve replica, tests drive it directly.
"""
