"""Fault timelines: described in ``spec``, applied to a running emulation by ``inject``."""
