"""Signals: the race of ``wait()`` against the stop signals, a group's plan, signal names.

Imports nothing: ``_names`` is read by the leaf modules (results, errors).
"""
