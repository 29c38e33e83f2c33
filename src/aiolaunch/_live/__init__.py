"""The live view of a running group: the control socket, its commands, status, metrics, attach."""
