"""Hang forensics: the watchdog, the stall rule, stack dumps, stragglers and the report."""
