"""Warm start, supervisor side: the zygote's client, the forks it makes, what it preloads.

The zygote process itself runs :mod:`aiolaunch._child._zygote`.
"""
